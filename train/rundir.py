"""One run folder, one writer: run-name checks, the run lock, moving an earlier run aside, and resume hygiene.

A run lives in ``<out_dir>/<name>/``. The Trainer (rank 0) uses these pieces in this order:
``validate_run_name`` -> ``RunLock(run_dir)`` held for the whole run -> a fresh start moves an earlier
run aside (``move_aside_previous_run``), a resume checks ``run_finished`` and then cuts ``metrics.jsonl``
back to the checkpoint (``cut_metrics``) -> ``remove_stale_temp_files`` -> train -> ``done_record`` is
logged last -> the lock is released.

The lock is ``fcntl.flock`` on ``<run_dir>/.lock``: the kernel drops it when the holder exits, however
it exits (kill -9 included), so a lock file left behind never blocks. Local file systems only: flock
over NFS depends on the client. POSIX only (``fcntl``); nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"
MAX_NAME_LEN = 200
# temp files of atomic writes (train.checkpoint.atomic_save, cut_metrics): ".<file name>.tmp-<pid>"
_TEMP_RE = re.compile(r"^\..+\.tmp-\d+$")
_GOOD_NAME = "a plain folder name such as 'en-it-tiny' or 'wmt14_s18.v2'"


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _one_line(text: Any, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------
# run names
# ----------------------------------------------------------------------------------------------
def validate_run_name(name: str) -> str:
    """Return ``name`` if it is one plain folder name; else a ``ValueError`` saying what is wrong.

    ``.``/``..``/``a/b`` would put the run folder (and the move-aside of an earlier run) somewhere
    other than ``<out_dir>/<name>`` — ``--run.name .`` used to move the whole ``runs/`` folder aside.
    """
    if not isinstance(name, str):
        raise ValueError(f"run.name={name!r} must be a string: use {_GOOD_NAME}")
    problem = None
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
    elif len(name) > MAX_NAME_LEN:
        problem = f"it is {len(name)} characters long (at most {MAX_NAME_LEN})"
    if problem:
        raise ValueError(f"--run.name {name!r} cannot be used: {problem}. Use {_GOOD_NAME}")
    return name


# ----------------------------------------------------------------------------------------------
# the run lock
# ----------------------------------------------------------------------------------------------
class RunLockedError(RuntimeError):
    """Another live process holds the run folder's lock."""


def _same_file(fd: int, path: Path) -> bool:
    """True when ``fd`` is still the file at ``path`` (not removed or replaced since it was opened)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_holder(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, 65536, 0).decode("utf-8", "replace")
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    return info if isinstance(info, dict) else {"raw": raw.strip()}


def _command_line(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return _one_line(raw.replace(b"\0", b" ").decode("utf-8", "replace"), 200) or None


_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) shares the parent's lock: close its copy, so the lock
    dies with the parent, and mark its RunLocks unheld, so the child never removes the parent's file."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/.lock``, held for a run's life.

    ``acquire()`` creates the folder if needed and fails at once with ``RunLockedError`` naming the
    holder (PID, host, start time, command line) when another open of the file holds it — another
    process, or this one through a second ``RunLock``. The file holds the holder's PID, host, start
    time and argv as JSON; ``release()`` removes it. Use as a context manager or acquire/release.
    Forked children do not keep it (their copy is closed at fork), so it ends with this process.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already locked by this RunLock")
        for _ in range(10):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
                os.close(fd)
                if holder is None:
                    raise
                raise RunLockedError(self._busy_message(holder)) from None
            # the holder before us may have removed (released) the file between our open and flock:
            # then we hold a lock on a file nobody else will open, so start over on the current one
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise RunLockedError(f"{self.path} kept being replaced while locking it; is something deleting it?")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": _command_line(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD.add(self)
        return self

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order, so a waiter never keeps a stale file)."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a dropped holder (e.g. a Trainer never fit) frees the name
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down os/pathlib
            pass

    def _busy_message(self, holder: dict[str, Any]) -> str:
        pid, host = holder.get("pid"), holder.get("host")
        if pid is None:
            who = "another process (it has not written its PID yet" + (
                f"; the file reads {holder['raw']!r})" if holder.get("raw") else ")")
            kill = "stop that process"
        else:
            local = host in (None, socket.gethostname())
            cmd = (_command_line(pid) if local else None) or holder.get("argv") or "command line unknown"
            this = " (this process)" if local and pid == os.getpid() else ""
            who = f"PID {pid}{this} on {host or 'this host'}, started {holder.get('started', '?')}: {cmd}"
            kill = f"stop it (kill {pid})" + ("" if local else f" on {host}")
        return (f"run folder {self.run_dir} is in use by {who}. Wait for that run to finish, {kill}, "
                f"or start this one under another --run.name")


# ----------------------------------------------------------------------------------------------
# fresh start: an earlier run of the same name is moved aside, never mixed in or overwritten
# ----------------------------------------------------------------------------------------------
def move_aside_previous_run(run_dir: str | os.PathLike, log: Callable[[str], Any] = print, *,
                            lock: RunLock) -> Path | None:
    """Rename a non-empty ``run_dir`` to ``<name>.prev-<UTC time>`` and return the new path (None: nothing there).

    Only under ``lock``, this process's held ``RunLock`` of ``run_dir``: so no live run can be
    writing in the folder (a second run never moves a live run's folder). The held lock file moves
    with the folder; the lock is taken again on a new ``<run_dir>/.lock`` and the moved copy removed.
    If another process takes the name in between, ``RunLockedError`` (the earlier run is safe in
    the ``.prev-`` folder either way).
    """
    run_dir = Path(run_dir)
    if not lock.held or lock.run_dir.resolve() != run_dir.resolve() or not _same_file(lock._fd, lock.path):
        raise RuntimeError(f"move_aside_previous_run({run_dir}) needs this process to hold RunLock({run_dir}): "
                           "a folder is only moved by the run that holds its lock")
    if not any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        return None
    stamp = _utc_stamp()
    target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}")
    n = 1
    while target.exists():
        target, n = run_dir.with_name(f"{run_dir.name}.prev-{stamp}-{n}"), n + 1
    run_dir.rename(target)
    log(f"{run_dir} held an earlier run: moved to {target} (to continue a run instead, pass --resume auto)")
    moved_fd, lock._fd = lock._fd, None
    _HELD.discard(lock)
    try:
        lock.acquire()
    finally:
        (target / LOCK_NAME).unlink(missing_ok=True)
        os.close(moved_fd)
    return target


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
        p.unlink()
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


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    if not path.is_file():
        return None
    where = ""
    if not callable(keep):
        epoch, step = (keep["epoch"], keep["step"]) if isinstance(keep, Mapping) else keep
        where = f" (epoch {epoch}, step {step})"
        keep = keep_through(epoch, step)
    kept: list[bytes] = []
    cut: list[bytes] = []
    unreadable: list[int] = []
    for lineno, raw in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        if not raw.strip():
            kept.append(line)
            continue
        rec = _parse_record(raw)
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
    with open(side, "xb") as f:
        f.writelines(cut)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
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
    if not path.is_file():
        return None
    final: dict[str, Any] | None = None
    for raw in path.read_bytes().splitlines():
        rec = _parse_record(raw) if raw.strip() else None
        if rec is None:
            continue
        kind = rec.get("kind", "epoch")
        if kind == "epoch":
            final = None
        elif kind == "done" or (kind == "test" and (final is None or final.get("kind") != "done")):
            final = rec
    return final


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[str], Any]):
    """While active, the first Ctrl-C (SIGINT) or SIGTERM calls ``request_stop(name)`` instead of killing the
    run, so the loop can stop at a step boundary with a checkpoint; a second Ctrl-C interrupts at once.
    The previous handlers are restored on exit. Only the main thread can install handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        request_stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
