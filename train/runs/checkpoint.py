"""Checkpoints: the format, reading (data, never code), lineage, RNG state capture and averaging. Writing them
(`atomic_save`, `CheckpointManager`: keep-last-K + best) is `train.runs.saving`.

A checkpoint is one ``torch.save`` dict written by the Trainer:
``model`` (the un-compiled, un-wrapped module's state), ``optimizer``, ``scheduler``, ``scaler``,
``rng`` (python, numpy, torch, cuda), ``position`` (epoch, batch index, optimizer step), ``config``
(``Config.to_dict()``), ``tokenizer`` (model file path + cache key), ``metrics`` (the epoch's line),
``lineage`` (``run_id`` of the run that wrote it, ``parent``: the run and step that run branched from).
Files are ``<run>/checkpoints/step-<step>.pt`` (the whole resumable state) plus ``best.pt``, which holds only
what inference needs (`BEST_KEYS`: the weights, config, tokenizer, position, data record, lineage; ``"kind":
"weights"``); a reader never sees a partial file. The Trainer's manager writes in the background
(``background=True``, train/runs/snapshot.py): ``save`` copies the state to CPU memory and returns, one thread
writes it; the best weights stay in memory as ``best_state``.
A failed write (disk full, read-only) raises ``CheckpointWriteError`` in one line and keeps every
earlier file; ``latest_loadable_checkpoint`` skips (and reports, renaming nothing) a newest file that does
not load, and considers only the run's own lineage, as keep-last pruning does.

Loading is data, never code: every read is ``torch.load(weights_only=True)``. What fastmt writes needs no
allowlist (RNG states are stored as tensors, ints and lists); `LEGACY_GLOBALS`, the one allowlist, admits
the numpy array of the RNG state that checkpoints written before this change hold. A file that asks for
any other Python object is refused in one line naming it and the type (``CheckpointUnsafeError``).
A checkpoint carrying no lineage id is another run's file (never pruned, never resumed by ``auto``) unless
its folder's marker says the run predates lineage ids (`unmarked_are_own`).
"""

from __future__ import annotations

import errno
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.files import (
    CHECKPOINT_MAX,
    BadFileError,
    FileRefusedError,
    ReadRefusedError,
    cause_of,
    check_stored_zip,
    fd_path,
    open_read,
)
from train.errors import UserError

_STEP_RE = re.compile(r"^step-(\d+)\.pt$")


# The one allowlist of globals a checkpoint may name: numpy's array, as the RNG state of checkpoints written
# before RNG states were stored as plain lists (fastmt <= 4f69878). (object, name) pairs: numpy 1 and 2 name
# the reconstructor differently. An object-dtype array would still need globals outside this list.
LEGACY_GLOBALS = [
    (np._core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    np.ndarray, np.dtype, type(np.dtype(np.uint32)),
]


# errors of reading a file that say nothing about its content: the run stops with the cause (never falls back)
NOT_CONTENT = {errno.EACCES, errno.EPERM, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ESTALE,
               errno.ETIMEDOUT, errno.ENOLINK, errno.EREMOTEIO}


def rng_state() -> dict[str, Any]:
    """The RNG states as plain data (a ``weights_only`` load reads them without any allowlist)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),  # (version, tuple of 625 ints, None)
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    if isinstance(npy, dict):
        npy = (npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written (disk full, read-only, no permission, I/O error).

    The message is one line naming the file, the cause and the fix; ``path`` is the checkpoint,
    ``cause`` the short cause. The temp file is gone and no existing file was changed.
    """

    def __init__(self, message: str, *, path: Path, cause: str, code: int | None = None):
        super().__init__(message)
        self.path, self.cause, self.errno = path, cause, code


class CheckpointReadError(UserError, RuntimeError):
    """A checkpoint the user named does not load, or none of a run's checkpoints loads."""


class CheckpointUnsafeError(CheckpointReadError):
    """A checkpoint that asks for a Python object fastmt never writes (it would run code when unpickled)."""


class CheckpointIOError(UserError, OSError):
    """A checkpoint could not be read for a reason that is not its content (permission denied, I/O error,
    out of memory): the run stops with the cause instead of falling back to an older checkpoint."""


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """A checkpoint the user named does not exist."""


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint does not fit this run (another tokenizer, other data, another model)."""


def lineage_id(ckpt: dict[str, Any]) -> str | None:
    """The run id of the run that wrote ``ckpt``; None for checkpoints written before lineages existed."""
    lineage = ckpt.get("lineage") or {}
    return lineage.get("run_id") if isinstance(lineage, dict) else None


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is written in place (a replaced file is another inode: the open fd keeps the old).
    Not ``st_ctime``: it changes too when the file is merely replaced at its name (its link count drops)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def hash_open_file(f, digest) -> tuple[int, ...]:
    """Feed ``digest`` every byte of the open file ``f`` (1 MiB blocks, from its start; left at its start) and return
    the file's `file_identity` from before the read: the caller compares it after using ``f`` (unchanged: the bytes it
    used are the bytes hashed)."""
    from data.files import MIB

    before = file_identity(os.fstat(f.fileno()))
    f.seek(0)
    for block in iter(lambda: f.read(MIB), b""):
        digest.update(block)
    f.seek(0)
    return before


def _torch_load(path: Path, map_location, mmap: bool = False, inside: str | os.PathLike | None = None,
                digest=None) -> Any:
    """``torch.load(weights_only=True)`` with the one allowlist (`LEGACY_GLOBALS`), of the file the one reader
    opened (`data.files.open_read`: a regular file of at most `data.files.CHECKPOINT_MAX` bytes, no link below
    ``inside``) after its records were checked stored, not compressed, and no larger than the file together
    (`data.files.check_stored_zip`: nothing inflates). A file that names any other global raises
    ``CheckpointUnsafeError`` naming the file and the type; an ``OSError`` or an allocation failure (not the
    file's content) raises ``CheckpointIOError``; anything else propagates. ``digest`` (a ``hashlib`` object): fed
    the bytes of the very file loaded, through the same descriptor (`hash_open_file`); a file written in place
    while it was read raises ``CheckpointIOError`` (a file replaced at ``path`` meanwhile does not matter: the
    descriptor keeps the one loaded)."""
    import pickle

    try:
        with open_read(path, "checkpoint", limit=CHECKPOINT_MAX, inside=inside) as f:
            check_stored_zip(f, path, "checkpoint")
            before = hash_open_file(f, digest) if digest is not None else None
            with torch.serialization.safe_globals(LEGACY_GLOBALS):  # mmap opens by name: the checked fd's
                ckpt = torch.load(fd_path(f) if mmap else f, map_location=map_location, weights_only=True,
                                  mmap=mmap)
            if before is not None and file_identity(os.fstat(f.fileno())) != before:
                raise CheckpointIOError(f"checkpoint {path} was written to while it was read (another process "
                                        f"writes it in place?): its hash would not name what was loaded; nothing was "
                                        f"changed. Run again once it is written")
            return ckpt
    except ReadRefusedError as e:  # the OS refused the read (permission, I/O): not the file's content
        if e.errno not in NOT_CONTENT:
            raise
        raise CheckpointIOError(f"cannot read checkpoint {path}: {cause_of(e, path)}; nothing was changed. Fix "
                                f"the cause and run again") from e
    except (FileRefusedError, CheckpointIOError):
        raise
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found is None:  # not a pickle that names code: damaged or not a checkpoint (the caller says so)
            why = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", " ".join(str(e).split()))
            raise RuntimeError(f"not a torch checkpoint ({why.group(1) if why else 'unpickling failed'})") from None
        raise CheckpointUnsafeError(
            f"checkpoint {path} asks for the Python object {found.group(1)}, which no fastmt checkpoint holds: "
            f"loading it could run code (a file made or changed by someone else?); it was not loaded. Use a "
            f"checkpoint fastmt wrote") from None
    except OSError as e:
        if e.errno not in NOT_CONTENT:  # e.g. EINVAL seeking past the end of a truncated file: its content
            raise
        raise CheckpointIOError(f"cannot read checkpoint {path}: {cause_of(e, path)}; nothing was changed. "
                                f"Fix the cause and run again") from e
    except MemoryError as e:
        raise CheckpointIOError(f"cannot read checkpoint {path}: out of memory; nothing was changed") from e
    except RuntimeError as e:
        if "can't allocate memory" in str(e) or "DefaultCPUAllocator" in str(e):
            raise CheckpointIOError(f"cannot read checkpoint {path}: out of memory ({' '.join(str(e).split())[:120]})"
                                    f"; nothing was changed") from e
        raise


def file_lineage_id(path: str | os.PathLike) -> str | None | bool:
    """``lineage_id`` of the checkpoint file at ``path``, read without loading its tensors (memory-mapped,
    ``weights_only``; no link followed: a file of its folder); False when the file cannot be read (or asks for
    code: never unpickled)."""
    try:
        ckpt = _torch_load(Path(path), "cpu", mmap=True, inside=Path(path).parent)
    except Exception:  # noqa: BLE001 - unreadable: the caller leaves the file alone
        return False
    return lineage_id(ckpt) if isinstance(ckpt, dict) else False


def same_lineage(ckpt_run_id: str | None | bool, run_id: str | None, unmarked: bool = False) -> bool:
    """A checkpoint belongs to run ``run_id`` when it carries that id; one with no id at all only when
    ``unmarked`` (its folder's records show the run predates lineage ids: `unmarked_are_own`). ``run_id``
    None: every readable file."""
    if ckpt_run_id is False:
        return False
    return run_id is None or ckpt_run_id == run_id or (ckpt_run_id is None and unmarked)


def unmarked_are_own(ckpt_dir: str | os.PathLike) -> bool:
    """Do checkpoints without a lineage id in ``ckpt_dir`` belong to its run? Only in a run folder an earlier
    fastmt made: no marker (run.json), or one written when such a folder was adopted."""
    from train.runs.folder import read_marker

    marker = read_marker(Path(ckpt_dir).parent)
    return marker is None or bool(marker.get("adopted"))


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", *,
                    inside: str | os.PathLike | None = None, digest=None) -> dict[str, Any]:
    """The checkpoint at ``path`` as data (``weights_only``: see the module docstring). ``inside``: the folder it
    was found in (a run's ``checkpoints/``): no link below it is followed; None: a path the user named. Raises
    ``FileNotFoundError``, ``CheckpointUnsafeError`` (it asks for code), ``CheckpointIOError`` (the OS could
    not read it: not its content), or ``RuntimeError`` (truncated, refused, not a fastmt checkpoint)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = _torch_load(path, map_location, inside=inside, digest=digest)
    except (CheckpointUnsafeError, CheckpointIOError):
        raise
    except FileRefusedError as e:  # a link, FIFO, device or an oversized file: one line (content: below)
        if not isinstance(e, BadFileError):
            raise RuntimeError(f"cannot read checkpoint {str(path)!r}: {' '.join(str(e).split())}") from e
        raise RuntimeError(f"cannot read checkpoint {str(path)!r} (truncated or not a fastmt checkpoint): {e}") from e
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist") from None
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the likely cause
        raise RuntimeError(f"cannot read checkpoint {str(path)!r} (truncated or not a fastmt checkpoint): {e}") from e
    if not isinstance(ckpt, dict):
        raise RuntimeError(f"{str(path)!r} is not a fastmt training checkpoint: it holds a {type(ckpt).__name__}")
    missing = {"model", "config", "position"} - set(ckpt)
    if missing:
        raise RuntimeError(f"{str(path)!r} is not a fastmt training checkpoint: missing keys {sorted(missing)}")
    problem = record_problem(ckpt)
    if problem:  # checked once, here: a damaged or forged record is a checkpoint that does not load
        raise RuntimeError(f"{str(path)!r} is not a fastmt training checkpoint: {problem}")
    return ckpt


COUNT_MAX = 10**12  # bound of the counts a checkpoint records (epochs, batches, steps): far past any real run


def _shown(value: Any) -> str:
    return " ".join(repr(value).split())[:80]


def _count_problem(where: str, value: Any, *, low: int = 0) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= COUNT_MAX:
        return f"its {where} {_shown(value)} is not a count ({low} to {COUNT_MAX:,})"
    return None


def record_problem(ckpt: dict[str, Any]) -> str | None:
    """Why the records of a loaded checkpoint (everything but the tensors) are not what fastmt writes, naming the
    field (None: they are). What plans a resume, reports it and appends to its metrics is checked here once, so
    no later reader meets a missing key or a wrong type: ``position`` (epoch, batch_index, step: counts; its
    optional total_steps, world_size, best_value and clock), ``config``, ``history`` (the epoch records: a list of
    objects with counts ``epoch`` and ``step``), ``lineage`` and ``tokenizer`` (objects)."""
    pos = ckpt["position"]
    if not isinstance(ckpt["config"], dict):
        return f"its config is a {type(ckpt['config']).__name__}, not a record of settings"
    if not isinstance(pos, dict):
        return f"its position {_shown(pos)} is not a record of epochs, batches and steps"
    for k in ("epoch", "batch_index", "step"):
        if k not in pos:
            return f"its position lacks position.{k} (it holds {', '.join(map(str, list(pos)[:8]))})"
        problem = _count_problem(f"position.{k}", pos[k])
        if problem:
            return problem
    for k, low in (("total_steps", 0), ("world_size", 1)):
        problem = _count_problem(f"position.{k}", pos[k], low=low) if pos.get(k) is not None else None
        if problem:
            return problem
    best = pos.get("best_value")
    if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
        return f"its position.best_value {_shown(best)} is not a number"
    clock = pos.get("clock")
    if clock is not None:
        if not isinstance(clock, dict):
            return f"its position.clock {_shown(clock)} is not a record"
        offset = clock.get("offset", 0.0)
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not 0 <= offset < float("inf"):
            return f"its position.clock.offset {_shown(offset)} is not a number of seconds"
        problem = _count_problem("position.clock.evals_since_best", clock.get("evals_since_best", 0))
        if problem:
            return problem
    history = ckpt.get("history", [])
    if not isinstance(history, list):
        return f"its history {_shown(history)} is not a list of epoch records"
    for i, rec in enumerate(history):
        if not isinstance(rec, dict):
            return f"its history[{i}] {_shown(rec)} is not an epoch record"
        for k in ("epoch", "step"):
            problem = _count_problem(f"history[{i}].{k}", rec.get(k))
            if problem:
                return problem
    for k in ("lineage", "tokenizer", "data"):
        if ckpt.get(k) is not None and not isinstance(ckpt[k], dict):
            return f"its {k} {_shown(ckpt[k])} is not a record"
    lineage = ckpt.get("lineage") or {}
    if lineage.get("run_id") is not None and not isinstance(lineage["run_id"], str):
        return f"its lineage.run_id {_shown(lineage['run_id'])} is not a run id"
    if lineage.get("parent") is not None and not isinstance(lineage["parent"], dict):
        return f"its lineage.parent {_shown(lineage['parent'])} is not a record"
    return None


def read_checkpoint(path: str | os.PathLike, what: str = "--resume") -> dict[str, Any]:
    """``load_checkpoint`` of a path the user named, failing in one line (``UserError``) when it is missing
    or is not a readable fastmt checkpoint."""
    path = Path(path)
    if path.is_dir() or (not path.exists() and not path.is_symlink()):
        what_is = "is a folder, not a checkpoint file" if path.is_dir() else "does not exist"
        raise CheckpointNotFoundError(f"{what} {path}: checkpoint {str(path)!r} {what_is} (checkpoints are "
                                      f"runs/<name>/checkpoints/step-<N>.pt and best.pt)")
    try:
        return load_checkpoint(path)
    except (CheckpointUnsafeError, CheckpointIOError):
        raise
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{what} {path}: {e}") from None
    except RuntimeError as e:
        raise CheckpointReadError(f"{what} {path}: " + " ".join(str(e).split())[:400]) from e


def step_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """``step-*.pt`` files in ``ckpt_dir`` sorted by step (oldest first)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    ckpts = step_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def latest_loadable_checkpoint(ckpt_dir: str | os.PathLike, log: Callable[[str], Any] = print,
                               map_location: str | torch.device = "cpu", *, run_id: str | None = None,
                               ) -> tuple[Path | None, dict | None]:
    """The newest step checkpoint of run ``run_id`` that loads, as ``(path, checkpoint)``; ``(None, None)``
    if the folder has none at all. Nothing is renamed, moved or deleted.

    A newer one whose content does not load (truncated, not a fastmt checkpoint) is reported in one line
    (path, size, cause) and the one before it is tried; it stays where it is (pruning never deletes a file it
    cannot read). A file that asks for code (``CheckpointUnsafeError``) or that the OS cannot read (permission
    denied, I/O error, out of memory: ``CheckpointIOError``) stops the search with that cause: falling back
    would silently resume from an older point. Checkpoints of another lineage (and, unless the folder's run
    predates lineage ids, files with none) are skipped, listed in one line. If checkpoints exist but none of
    this run loads, ``CheckpointReadError``, every time: resuming from nothing would silently restart the run.
    """
    d = Path(ckpt_dir)
    ckpts = step_checkpoints(d)
    unmarked = unmarked_are_own(d)
    bad, foreign = [], []
    found: tuple[Path | None, dict | None] = (None, None)
    for path in reversed(ckpts):
        try:
            ckpt = load_checkpoint(path, map_location, inside=d)
        except (RuntimeError, FileNotFoundError) as e:
            if isinstance(e, CheckpointUnsafeError):
                raise
            size = path.lstat().st_size
            log(f"checkpoint {path} ({size:,} bytes) does not load, skipped and left in place: "
                + " ".join(str(e).split())[:300])
            bad.append(path)
            continue
        if same_lineage(lineage_id(ckpt), run_id, unmarked):
            found = (path, ckpt)
            break
        foreign.append((path, lineage_id(ckpt)))
    if foreign:
        log(f"--resume auto: {len(foreign)} checkpoint(s) in {d} belong to another run (this run is {run_id}), "
            f"skipped and left in place: " + ", ".join(f"{p.name} (run id {rid})" for p, rid in foreign[:6])
            + (", ..." if len(foreign) > 6 else ""))
    if found[0] is not None:
        return found
    earlier = sorted(d.glob("step-*.pt.unreadable")) if d.is_dir() else []  # set aside by an earlier fastmt
    if bad or foreign or earlier:
        every = [*bad, *earlier, *(p for p, _ in foreign)]
        names = ", ".join(p.name for p in every[:6]) + (", ..." if len(every) > 6 else "")
        raise CheckpointReadError(
            f"--resume auto: none of the {len(every)} checkpoint(s) in {d} loads as this run's ({names}); nothing "
            f"was changed. Resume from "
            f"a checkpoint you trust with --resume PATH, or start a new run (without --resume: it gets its own folder)"
        )
    return None, None


def check_tokenizer(ckpt: dict[str, Any], tok, path) -> None:
    ref = ckpt.get("tokenizer") or {}
    if ref.get("key") != tok.key:
        raise CheckpointMismatchError(
            f"tokenizer mismatch: checkpoint {path} was trained with tokenizer key {ref.get('key')!r} "
            f"({ref.get('model_file')}), but the current data settings give key {tok.key!r} ({tok.model_file}). "
            f"Resume with the same data files and data.* settings as the checkpoint's run (its config is stored "
            f"in the checkpoint), or start a new run with a different --run.name"
        )


def average_checkpoints(paths: list[Path], map_location: str | torch.device = "cpu",
                        loaded: dict[Path, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The newest of ``paths`` with its model weights replaced by the mean over all of them (checkpoint
    averaging, as translation systems do over their last epochs). Float tensors are averaged in fp32 and
    cast back; integer buffers are taken from the newest. ``loaded``: checkpoints already in memory."""
    if not paths:
        raise ValueError("average_checkpoints: no checkpoints given")
    loaded = loaded or {}
    load = lambda p: loaded[p] if p in loaded else load_checkpoint(p, map_location)  # noqa: E731
    newest = load(paths[-1])
    total = {k: v.detach().float().clone() for k, v in newest["model"].items() if v.is_floating_point()}
    for path in paths[:-1]:
        model = load(path)["model"]
        if set(model) != set(newest["model"]):
            raise ValueError(f"average_checkpoints: {path} holds other parameters than {paths[-1]}")
        for k in total:
            total[k] += model[k].float()
    newest["model"] = {k: (total[k] / len(paths)).to(v.dtype) if k in total else v
                       for k, v in newest["model"].items()}
    newest["averaged_from"] = [str(p) for p in paths]
    return newest


def average_last_epochs(ckpt_dir: str | os.PathLike, k: int, log: Callable[[str], Any] = print, *,
                        run_id: str | None = None) -> dict | None:
    """``average_checkpoints`` of the newest ``k`` end-of-epoch checkpoints of run ``run_id`` in ``ckpt_dir``
    (mid-epoch ones, from interruptions, and other lineages' are left out; each file is read once); None,
    said in one line, when fewer are kept."""
    ends: dict[Path, dict[str, Any]] = {}
    unmarked = run_id is None or unmarked_are_own(ckpt_dir)
    for p in reversed(step_checkpoints(ckpt_dir)):
        ckpt = load_checkpoint(p, inside=ckpt_dir)
        if ckpt["position"]["batch_index"] == 0 and same_lineage(lineage_id(ckpt), run_id, unmarked):
            ends[p] = ckpt
            if len(ends) == k:
                return average_checkpoints(sorted(ends), loaded=ends)
    log(f"checkpoint averaging: {len(ends)} epoch checkpoints kept in {ckpt_dir}, {k} asked; skipped")
    return None
