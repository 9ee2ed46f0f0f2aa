"""One run folder, one writer, one lineage: run names, the run marker, the run lock, and resume hygiene.

A run lives in ``<out_dir>/<name>/`` and is marked by ``run.json`` (``fastmt_run``, ``run_id``, ``parent``:
the run and step it branched from). fastmt writes into, prunes or renames only folders that carry the
marker (or that an earlier fastmt wrote: ``folder_state``); anything else under a run name is refused
(``RunFolderError``). The Trainer (rank 0) uses these pieces in this order:
``validate_run_name`` -> a fresh run claims a new folder (``claim_run_folder``: ``<name>``, else
``<name>-2``, ...; created only after every setting was checked) and holds its ``RunLock``; a resume locks
the existing run folder, checks ``run_finished`` and cuts ``metrics.jsonl`` back to the checkpoint
(``cut_metrics``) -> ``remove_stale_temp_files`` -> train -> ``done_record`` is logged last -> the lock
is released (a new folder that never got a checkpoint is removed: ``discard_unused_run_folder``).

The lock (``RunLock``, train/runs/lock.py) is ``fcntl.flock`` on ``<run_dir>/.lock``, dropped by the kernel
however its holder exits. POSIX only; nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from data.files import (
    RECORD_MAX,
    BadFileError,
    FileRefusedError,
    atomic_write,
    open_nofollow,
    parse_json,
    read_bytes,
    read_json,
    read_json_lines,
    remove_inside,
)
from data.ownership import swap_problem
from train.errors import UserError
from train.runs.lock import LOCK_NAME, RunLock, RunLockedError

PROVENANCE_MAX = 64 * 2**20  # provenance.json: the config, the environment and the data split record
MARKER_NAME = "run.json"  # the run marker: only folders holding it (or an earlier fastmt's runs) are written
MAX_NAME_LEN = 200  # bytes of UTF-8 (a file name holds 255; the name-2, ... of a taken name need a few more)
# temp files of atomic writes (data.files.atomic_write): ".<file name>.tmp-<pid>-<random>" (".tmp-<pid>": older)
_TEMP_RE = re.compile(r"^\..+\.tmp-\d+(-[0-9a-z_]+)?$")
_GOOD_NAME = "a plain folder name such as 'en-it-tiny' or 'wmt14_s18.v2'"


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


# ----------------------------------------------------------------------------------------------
# run names
# ----------------------------------------------------------------------------------------------
def validate_run_name(name: str) -> str:
    """Return ``name`` if it is one plain folder name; else a ``ValueError`` saying what is wrong.

    ``.``/``..``/``a/b`` would put the run folder (and the move-aside of an earlier run) somewhere
    other than ``<out_dir>/<name>`` — ``--run.name .`` used to move the whole ``runs/`` folder aside.
    """
    if not isinstance(name, str):
        raise ValueError(f"run.name={_shown(name)} must be a string: use {_GOOD_NAME}")
    problem = None
    size = len(name.encode("utf-8", "surrogatepass"))
    if not name:
        problem = "it is empty"
    elif set(name) == {"."}:
        problem = "it is only dots, which names the output folder itself or its parent"
    elif "/" in name or "\\" in name:
        problem = "it contains a path separator ('/' or '\\'); the run folder is always <out_dir>/<name>"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "it contains a control character (NUL, newline, tab, ...)"
    elif name.startswith("-"):
        problem = "it starts with '-', which command-line tools read as an option"
    elif name != name.strip():
        problem = "it starts or ends with whitespace"
    elif size > MAX_NAME_LEN:  # the file system counts bytes (255 a name), not characters
        problem = f"it is {size:,} bytes long in UTF-8 (at most {MAX_NAME_LEN})"
    if problem:
        raise ValueError(f"--run.name {_shown(name)} cannot be used: {problem}. Use {_GOOD_NAME}")
    return name


def _shown(value: Any, limit: int = 300) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 100 MB name is never echoed whole)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= 4 * limit else repr(value[: 4 * limit])
    return text if len(text) <= limit else text[: limit - 5] + "...'" + f" ({len(value):,} characters)" * isinstance(value, str)


# ----------------------------------------------------------------------------------------------
# run identity: the marker, what a folder is, claiming a new folder, discarding an unused one
# ----------------------------------------------------------------------------------------------
class RunFolderError(UserError):
    """A run name points at a folder fastmt did not make (or cannot read as a run); nothing was changed."""


def new_run_id() -> str:
    """A fresh run id: the UTC time and 6 random hex digits (sortable, unique in practice)."""
    return f"{_utc_stamp()}-{secrets.token_hex(3)}"


def read_record(run_dir: str | os.PathLike, name: str, what: str, limit: int = RECORD_MAX) -> Any:
    """The JSON record ``<run_dir>/<name>`` through the one reader (`data.files.read_json`: a regular file of at most
    ``limit`` bytes, no link followed inside the run folder); ``OSError`` / ``ValueError`` when it cannot be had."""
    return read_json(Path(run_dir) / name, what, limit=limit, inside=run_dir)


def read_marker(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run marker ``<run_dir>/run.json`` if it is one fastmt wrote (a regular file, not a link), else None."""
    try:
        marker = read_record(run_dir, MARKER_NAME, "run marker")
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("fastmt_run") != 1 or not isinstance(marker.get("run_id"), str):
        return None
    return marker


def _damaged_marker(run_dir: Path) -> str | None:
    """Why ``<run_dir>/run.json`` is there but no marker fastmt wrote (None: missing or fine)."""
    path = run_dir / MARKER_NAME
    if not path.exists() and not path.is_symlink():
        return None
    if read_marker(run_dir) is not None:
        return None
    if path.is_symlink():
        return "it is a symbolic link"
    try:
        text = read_bytes(path, "run marker", limit=RECORD_MAX, inside=run_dir)
    except FileRefusedError as e:
        return " ".join(str(e).split())[:200]
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    if not text.strip():
        return "empty"
    try:
        parse_json(text.decode("utf-8"), path)
    except (BadFileError, UnicodeDecodeError):
        return "not JSON"
    return "not a fastmt run marker"


def write_marker(run_dir: str | os.PathLike, run_id: str, *, parent: dict[str, Any] | None = None,
                 adopted: bool = False, made_folder: bool = True) -> dict[str, Any]:
    """Write ``<run_dir>/run.json`` (atomically): the run id, its name, creation time, parent lineage, and
    whether fastmt made the folder (an empty folder a user made is used, and never removed)."""
    run_dir = Path(run_dir)
    marker = {"fastmt_run": 1, "run_id": run_id, "name": run_dir.name,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parent": parent,
              "made_folder": made_folder}
    if adopted:
        marker["adopted"] = "a run folder of an earlier fastmt (no run.json): marked when it was resumed"
    write_text_atomic(run_dir / MARKER_NAME, json.dumps(marker, indent=1) + "\n")
    return marker


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never a part (`data.files.atomic_write`; a link at
    ``path`` is refused)."""
    atomic_write(path, text, what="run record")


def _legacy_run(run_dir: Path) -> bool:
    """A run folder written by fastmt before run markers existed: its ``provenance.json`` is fastmt's."""
    try:
        prov = read_record(run_dir, "provenance.json", "provenance record", PROVENANCE_MAX)
    except FileRefusedError as e:
        if isinstance(e, BadFileError):  # not JSON: not an earlier fastmt's record
            return False
        raise RunFolderError(f"{' '.join(str(e).split())}: fastmt cannot tell whether {run_dir} is a run of an "
                             f"earlier fastmt and changes nothing in it. Fix: remove that file, or choose another "
                             f"--run.name") from None
    except (OSError, ValueError):
        return False
    return isinstance(prov, dict) and {"config", "git_sha", "torch"} <= set(prov) and (
        (run_dir / "metrics.jsonl").is_file() or (run_dir / "checkpoints").is_dir())


def folder_state(path: str | os.PathLike) -> str:
    """What ``path`` is: "missing"; "empty" (nothing in it, or only a run lock file); "run" (a fastmt run:
    it holds ``run.json``, or is a run folder of an earlier fastmt); "other" (anything else). A fastmt run
    folder whose ``run.json`` is damaged (empty, not JSON, a link) raises ``RunFolderError``. A link to a
    folder is judged by that folder (fastmt never renames a run folder, so a link is safe to follow)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return "missing"
    if not path.is_dir():  # a file, or a dangling link
        return "other"
    if read_marker(path) is not None:
        return "run"
    if _legacy_run(path):  # a fastmt run's files: its run.json must be missing (an earlier fastmt), not damaged
        why = _damaged_marker(path)
        if why is not None:  # adopting it would silently rewrite run.json with a new id
            raise RunFolderError(f"the run marker {path / MARKER_NAME} is damaged ({why}): fastmt cannot tell which "
                                 f"run {path} holds and changes nothing in it. Fix: restore run.json from a copy, or "
                                 f"continue from one of its checkpoints with --resume PATH under another --run.name")
        return "run"
    # only a lock (and the temp file of a marker being written): a claim in progress, whose lock decides
    if all(p.name == LOCK_NAME or _TEMP_RE.match(p.name) for p in path.iterdir()):
        return "empty"
    return "other"


def not_a_run_message(path: Path) -> str:
    if not path.is_dir():
        what = "a file" if path.exists() else "a dangling link"
    else:
        what = "a folder that holds files but no fastmt run marker (run.json)"
    return (f"{path} is {what}: fastmt only writes into, renames or prunes folders it made. "
            f"Choose another --run.name, or another --run.out_dir")


def check_usable(path: Path) -> str:
    """``folder_state(path)``, refusing (``RunFolderError``) a path that is neither missing, empty nor a run."""
    state = folder_state(path)
    if state == "other":
        raise RunFolderError(not_a_run_message(path))
    here = path.parent  # --run.out_dir (or the folder it will be made in): another user must not be able to swap
    while not here.exists() and here != here.parent:  # a run folder in it (the folder itself is checked when it
        here = here.parent                             # is locked: a fresh run may go to <name>-2)
    problem = swap_problem(here, "a folder the run folder is in")
    if problem:
        raise FileRefusedError(f"run folder {path}: {problem}: fastmt writes a run only where nobody else can change "
                               f"it. Fix: give --run.out_dir a folder of yours that only you may write")
    return state


# what a continued run reads, cuts, rewrites or appends to in its folder: each must be the real thing, never a link
_RUN_RECORDS = (MARKER_NAME, "config.json", "metrics.jsonl", "curves.png", "provenance.json")
_RUN_FOLDERS = ("checkpoints", "tensorboard")
_CHECKPOINT_RE = re.compile(r"^(step-\d+\.pt|best\.pt|step-\d+\.pt\.unreadable)$")


def _kind(st: os.stat_result) -> str:
    return ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a regular file" if stat.S_ISREG(st.st_mode)
            else "a device or socket")


def run_files_problem(run_dir: str | os.PathLike) -> str | None:
    """Why the run folder ``run_dir`` cannot be continued in place without reading, cutting or writing through
    something planted there (None: it can): the folder itself, ``checkpoints/``, ``tensorboard/``, every
    checkpoint file (``step-*.pt``, ``best.pt``) and the records (run.json, config.json, metrics.jsonl, provenance
    and curves) must each be what it seems (``lstat``: a real folder or regular file, never a link), and
    ``metrics.jsonl``, appended to in place, must have no other hard link. Nothing is read or followed."""
    run_dir = Path(run_dir)

    def wrong(path: Path, want: str) -> str | None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"{path} cannot be examined ({e.strerror or e})"
        ok = stat.S_ISDIR(st.st_mode) if want == "a folder" else stat.S_ISREG(st.st_mode)
        if not ok:
            to = f" (to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode) else ""
            return f"{path} is {_kind(st)}{to}, not {want}"
        if path.name == "metrics.jsonl" and st.st_nlink > 1:
            return f"{path} has {st.st_nlink - 1} other hard link(s), and a run appends to it in place"
        return None

    if run_dir.is_symlink():
        return (f"the run folder {run_dir} is a symbolic link (to {os.readlink(run_dir)}); continue it by its real "
                f"path (--run.out_dir {run_dir.resolve().parent} --run.name {run_dir.resolve().name})")
    checks = [(run_dir / name, "a regular file") for name in _RUN_RECORDS]
    checks += [(run_dir / name, "a folder") for name in _RUN_FOLDERS]
    for path, want in checks:
        problem = wrong(path, want)
        if problem:
            return problem
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        for path in sorted(ckpts.iterdir()):
            problem = wrong(path, "a regular file") if _CHECKPOINT_RE.match(path.name) else None
            if problem:
                return problem
    for path in sorted(run_dir.glob("provenance-resume-step*.json")):
        problem = wrong(path, "a regular file")
        if problem:
            return problem
    return None


def check_run_files(run_dir: str | os.PathLike) -> None:
    """``run_files_problem`` as a refusal (`RunFolderError`, one line naming the path and the fix), made before a
    run continued in place reads a checkpoint or a record of its folder, and before it cuts or writes anything."""
    problem = run_files_problem(run_dir)
    if problem:
        raise RunFolderError(f"cannot continue the run in {run_dir}: {problem}. fastmt reads, cuts and writes a run "
                             f"only through its own files, never through a link or a file someone else may have "
                             f"planted; nothing was read or changed. Fix: put the real file or folder in its place "
                             f"(or remove it), or start a new run under another --run.name")


def free_run_name(out_dir: str | os.PathLike, name: str) -> str:
    """``name`` if ``<out_dir>/<name>`` does not exist (or is empty), else the first free ``name-2``,
    ``name-3``, ... (what a fresh run under ``name`` will be called)."""
    out = Path(out_dir)
    if folder_state(out / name) in ("missing", "empty"):
        return name
    k = 2
    while (out / f"{name}-{k}").exists() or (out / f"{name}-{k}").is_symlink():
        k += 1
    return f"{name}-{k}"


def claim_run_folder(out_dir: str | os.PathLike, name: str, run_id: str, *,
                     parent: dict[str, Any] | None = None) -> tuple[Path, RunLock]:
    """Make a new run folder for a fresh run and hold its lock; returns ``(run_dir, lock)``.

    ``<out_dir>/<name>`` when it does not exist (or is empty); when it holds another run, the first free
    of ``<name>-2``, ``<name>-3``, ...; when it holds anything else, ``RunFolderError``.
    Folders are created with ``mkdir`` (never reused), so two runs starting at once get two folders.
    The marker ``run.json`` (run id, parent lineage) is written under the lock.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--run.out_dir {out} is a file, not a folder: choose a folder for the runs")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunFolderError(f"cannot create the output folder --run.out_dir {out}: {e.strerror or e}; choose a "
                             f"writable folder") from e
    k = 1
    while True:
        cand = out / (name if k == 1 else f"{name}-{k}")
        try:
            validate_run_name(cand.name)
        except ValueError as e:  # the name is taken and name-k is too long: a message, not a traceback
            raise RunFolderError(f"{out / name} is taken and the next free name cannot be used ({e}); "
                                 f"choose another --run.name") from None
        made = True
        try:
            cand.mkdir()
        except OSError as e:
            made = False
            if not isinstance(e, FileExistsError):
                raise RunFolderError(f"cannot create the run folder {cand}: {e.strerror or e}; choose a writable "
                                     f"--run.out_dir") from e
            state = folder_state(cand)
            if k == 1 and state == "other":
                raise RunFolderError(not_a_run_message(cand)) from None
            if not (k == 1 and state == "empty"):
                k += 1
                continue
        lock = RunLock(cand)
        try:
            lock.acquire()
        except RunLockedError:  # another run took this folder between our mkdir (or its) and the lock
            k += 1
            continue
        if folder_state(cand) != "empty":  # something arrived before the lock: not ours to use
            lock.release()
            k += 1
            continue
        write_marker(cand, run_id, parent=parent, made_folder=made)
        return cand, lock


# the files a run writes; an unused new run folder holding only these is removed when its run fails
_RUN_FILES = (MARKER_NAME, "config.json", "metrics.jsonl", "curves.png", LOCK_NAME)


def discard_unused_run_folder(run_dir: str | os.PathLike, log: Callable[[str], Any] = print) -> bool:
    """Remove a run folder this process created when no checkpoint was written into it (a run that failed
    or stopped before its first checkpoint): its marker, config, provenance, metrics and TensorBoard files.
    Anything else in it (a checkpoint, a file someone put there) keeps the folder; an empty folder a user
    made (``made_folder`` false in the marker) is emptied of fastmt's files but kept. Returns True if the
    files were removed."""
    run_dir = Path(run_dir)
    marker = read_marker(run_dir)
    if marker is None:
        return False
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(not _TEMP_RE.match(p.name) for p in ckpts.iterdir()):
        return False
    ours = set(_RUN_FILES)
    for p in run_dir.iterdir():
        if not (p.name in ours or p.name.startswith("provenance") and p.suffix == ".json"
                or p.name in ("tensorboard", "checkpoints") and p.is_dir() and not p.is_symlink()
                or _TEMP_RE.match(p.name)):
            return False
    for p in run_dir.iterdir():
        if p.name != LOCK_NAME:
            remove_inside(run_dir, p)  # a link is removed itself; tensorboard/ and checkpoints/ are real folders
    remove_inside(run_dir, run_dir / LOCK_NAME)
    if marker.get("made_folder", True) and not run_dir.is_symlink():
        run_dir.rmdir()
        log(f"removed the run folder {run_dir}: the run ended before writing a checkpoint")
    return True




# ----------------------------------------------------------------------------------------------
# resume hygiene
# ----------------------------------------------------------------------------------------------
def remove_stale_temp_files(directory: str | os.PathLike, log: Callable[[str], Any] = print) -> list[Path]:
    """Delete ``.<file>.tmp-<pid>`` files (interrupted atomic saves) in ``directory``; return what was removed.

    Call it under the run lock at start, before anything saves: then no temp file there is live.
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    stale = sorted(p for p in d.iterdir() if _TEMP_RE.match(p.name) and (p.is_file() or p.is_symlink()))
    sizes = []
    for p in stale:
        sizes.append(p.lstat().st_size)
        remove_inside(d, p)
    if stale:
        log(f"removed {len(stale)} temp file(s) left by interrupted saves in {d}: "
            + ", ".join(f"{p.name} ({s / 2**20:.1f} MB)" for p, s in zip(stale, sizes)))
    return stale


def keep_through(epoch: int, step: int) -> Callable[[dict[str, Any]], bool]:
    """The metrics records a resume from a checkpoint at (completed ``epoch``, optimizer ``step``) keeps.

    Cut: ``test``/``done`` records (the resumed run writes its own), records with ``step`` > ``step``,
    records with ``epoch`` > ``epoch`` (1-based ``epoch`` records count completed epochs, as does the
    checkpoint's ``position["epoch"]``). Anything else is kept.
    """
    def keep(rec: dict[str, Any]) -> bool:
        if rec.get("kind") in ("test", "done"):
            return False
        s, e = rec.get("step"), rec.get("epoch")
        if isinstance(s, (int, float)) and not isinstance(s, bool) and s > step:
            return False
        return not (isinstance(e, (int, float)) and not isinstance(e, bool) and e > epoch)

    return keep


def cut_metrics(metrics_path: str | os.PathLike, *,
                keep: Callable[[dict[str, Any]], bool] | tuple[int, int] | Mapping[str, Any],
                log: Callable[[str], Any] = print) -> Path | None:
    """Cut ``metrics.jsonl`` back to a checkpoint; the cut lines go to ``metrics.cut-<UTC>.jsonl`` beside it.

    ``keep``: a predicate on each record, or the checkpoint's position — ``(epoch, step)`` or its
    ``position`` dict — which means ``keep_through(epoch, step)``. Lines that are not a JSON object
    (a torn last line from a kill mid-write, bytes that are not UTF-8) are cut too. Every cut line is
    kept verbatim in the side file (a newline added where a torn one had none), written and synced
    before ``metrics_path`` is atomically replaced, so a crash in between duplicates, never loses.
    Returns the side file, or None when nothing was cut (the file is then left untouched).
    TensorBoard events are not cut: scalars past the checkpoint show twice in TensorBoard.
    """
    path = Path(metrics_path)
    if not path.exists() and not path.is_symlink():
        return None
    where = ""
    if not callable(keep):
        epoch, step = (keep["epoch"], keep["step"]) if isinstance(keep, Mapping) else keep
        where = f" (epoch {epoch}, step {step})"
        keep = keep_through(epoch, step)
    kept: list[bytes] = []
    cut: list[bytes] = []
    unreadable: list[int] = []
    # through the one reader before anything is written: a link (say to a file of another user's), a FIFO or an
    # oversized file is refused here, never copied into the side file
    for lineno, (raw, rec) in enumerate(read_json_lines(path, "metrics file", inside=path.parent), 1):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        if not raw.strip():
            kept.append(line)
            continue
        rec = rec if isinstance(rec, dict) else None
        if rec is None:
            unreadable.append(lineno)
            cut.append(line)
        elif keep(rec):
            kept.append(line)
        else:
            cut.append(line)
    if not cut:
        return None
    base = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    stamp = _utc_stamp()
    side = path.with_name(f"{base}.cut-{stamp}.jsonl")
    n = 1
    while side.exists():
        side, n = path.with_name(f"{base}.cut-{stamp}-{n}.jsonl"), n + 1
    fd = open_nofollow(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, "metrics side file")
    with os.fdopen(fd, "wb") as f:
        f.writelines(cut)
        f.flush()
        os.fsync(f.fileno())
    atomic_write(path, b"".join(kept), what="metrics file")
    bad = ""
    if unreadable:
        shown = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        bad = f", {len(unreadable)} unreadable line(s) (torn or not JSON objects; line {shown})"
    log(f"resume: cut {path} back to the checkpoint{where}: {len(cut) - len(unreadable)} record(s) past it{bad} "
        f"moved to {side}; {len(kept)} line(s) kept")
    return side


# ----------------------------------------------------------------------------------------------
# the end of a run
# ----------------------------------------------------------------------------------------------
def done_record(*, epoch: int, step: int, stop_reason: str, **extra: Any) -> dict[str, Any]:
    """The last ``metrics.jsonl`` record of a run that ended normally (not interrupted, not failed).

    ``{"kind": "done", "time": <UTC ISO>, "epoch": <completed epochs>, "step": <optimizer steps>,
    "stop_reason": "done" | "max_steps", ...extra}``; ``extra`` may hold e.g. the test scores.
    Logged after the final checkpoint and the "test" record, so its presence means the run finished.
    """
    return {"kind": "done", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "epoch": epoch,
            "step": step, "stop_reason": stop_reason, **extra}


def run_finished(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The record that ended ``<run_dir>/metrics.jsonl`` if the run finished, else None.

    Finished: a ``done`` record (or, for runs logged before it existed, a ``test`` record) with no
    ``epoch`` record after it. Unreadable lines are ignored. Check this before ``cut_metrics``,
    which removes those records.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file() and not path.is_symlink():
        return None
    final: dict[str, Any] | None = None
    for _, rec in read_json_lines(path, "metrics file", inside=run_dir):
        if not isinstance(rec, dict):
            continue
        kind = rec.get("kind", "epoch")
        if kind == "epoch":
            final = None
        elif kind == "done" or (kind == "test" and (final is None or final.get("kind") != "done")):
            final = rec
    return final
