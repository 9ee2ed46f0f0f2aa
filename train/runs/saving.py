"""Writing checkpoints (`train.runs.checkpoint` holds the format, reading and lineage): `atomic_save` (one
``torch.save`` through `data.files.atomic_write`; a failed write is one `CheckpointWriteError` line with its cause
and fix, every earlier file kept), what ``best.pt`` holds (`BEST_KEYS`, `best_record`), and the
`CheckpointManager` that writes ``step-<n>.pt``, keeps the newest K of its own lineage and maintains ``best.pt``,
in the caller's thread or in the background (train/runs/snapshot.py).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from data.files import FileRefusedError, atomic_write, remove_inside
from data.ownership import own_folder
from train.runs.checkpoint import (
    CheckpointWriteError,
    file_lineage_id,
    latest_checkpoint,
    same_lineage,
    step_checkpoints,
    unmarked_are_own,
)
from train.runs.snapshot import BackgroundWriter, StagingPool, snapshot


def _storage_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of tensor storages (each counted once) and raw bytes in a nested state: ~the file size."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(_storage_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_storage_bytes(v, seen) for v in obj)
    return 0


def _mount_point(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


def _write_error(e: BaseException, path: Path, obj: Any) -> CheckpointWriteError | None:
    """Translate a failed checkpoint write into one line with its cause and fix (None: not a write failure).

    On a full disk ``torch.save`` ends with ``RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos`` (closing the zip after the write's ``OSError``, which is then its ``__context__``,
    or alone when it wrote to a file name): the errno is taken from the context, else free space decides.
    """
    stream_failure = isinstance(e, RuntimeError) and ("inline_container" in str(e)
                                                      or "PytorchStreamWriter" in str(e))
    code = e.errno if isinstance(e, OSError) else None
    if stream_failure and isinstance(e.__context__, OSError):
        code = e.__context__.errno
    if code is None and not stream_failure:
        return None
    folder = path.parent
    mount = _mount_point(folder)
    keep = "nothing was overwritten and earlier checkpoints are untouched"
    need = _storage_bytes(obj)
    try:
        free = shutil.disk_usage(mount).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (stream_failure and free is not None and free < need):
        what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"
        room = "unknown space" if free is None else f"{free / 2**20:.0f} MB"
        cause = f"{what}: {room} free on {mount}, the checkpoint needs ~{need / 2**20:.0f} MB"
        if free is not None and free >= need and code == errno.ENOSPC:
            cause += " (the file system may be out of inodes: check df -i)"
        fix = "free some space (old runs' checkpoints, *.prev-* run folders) or set --run.out_dir on a larger disk"
        code = code or errno.ENOSPC
    elif code == errno.EFBIG:  # the process's file-size limit (ulimit -f), not the disk: any folder fails alike
        from data.files import fsize_limit

        cause = (f"the checkpoint (~{need / 2**20:.1f} MB) would pass this process's file-size limit "
                 f"(ulimit -f: {fsize_limit()})")
        fix = "raise the limit (ulimit -f unlimited, or the job's file-size limit) and run again (--resume auto continues from a kept checkpoint)"
    elif code == errno.EROFS:
        cause = f"read-only file system ({mount})"
        fix = "remount it read-write or set --run.out_dir to a writable folder"
    elif code in (errno.EACCES, errno.EPERM):
        cause = f"permission denied: user {os.geteuid()} cannot write in {folder}"
        fix = "fix the folder's permissions or set --run.out_dir to a writable folder"
    else:
        detail = os.strerror(code) if code else " ".join(str(e).split())[:200]
        cause = f"the write failed ({detail})" + (f"; {free / 2**20:.0f} MB free on {mount}" if free else "")
        fix = "check the disk (dmesg) or set --run.out_dir to another disk"
    return CheckpointWriteError(f"cannot write checkpoint {path}: {cause}. Fix: {fix}; {keep}",
                                path=path, cause=cause, code=code)


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` through `data.files.atomic_write` (a ``mkstemp`` file in the same folder, fsync,
    ``os.replace``, folder fsync; a link at ``path`` is refused).

    A failed write (disk full, read-only, ...) raises ``CheckpointWriteError``; the temp file is
    removed and ``path`` keeps its old content.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(obj, f), what="checkpoint")  # temp removed on failure
    except FileRefusedError:
        raise
    except BaseException as e:
        err = _write_error(e, path, obj) if isinstance(e, Exception) else None
        if err is None:
            raise
        raise err from e
    return path


# what best.pt holds: what translate / evaluate / export and --init-from read (train/evaluation/load.py,
# train/runs/plan.py, train/runs/start.py); the optimizer, schedule, RNG and history are in the step checkpoints
BEST_KEYS = ("model", "config", "tokenizer", "position", "data", "lineage", "params", "averaged_from")


def best_record(state: dict[str, Any]) -> dict[str, Any]:
    """The part of a checkpoint ``state`` that ``best.pt`` holds (`BEST_KEYS`), marked ``"kind": "weights"``."""
    return {**{k: state[k] for k in BEST_KEYS if k in state}, "kind": "weights"}


class CheckpointManager:
    """Writes ``step-<n>.pt``, keeps the newest ``keep_last``, and maintains ``best.pt``.

    ``mode="max"`` (BLEU) or ``"min"`` (validation loss) decides what "best" means. ``run_id``: pruning
    deletes only this run's checkpoints (``same_lineage``), never a file of another lineage, one without a
    lineage id (unless the folder's run predates them), a link, or one it cannot read; None prunes every
    readable ``step-*.pt``.

    ``background``: ``save`` waits for the previous write, copies the state into CPU memory (``pin``: page-locked,
    for a CUDA state) and returns; one thread writes the files and prunes (train/runs/snapshot.py). ``wait``
    waits for that write (and raises its error); ``best_state`` is then the best checkpoint's `best_record`,
    in CPU memory. ``blocked`` / ``saves`` / ``max_blocked``: the seconds ``save`` and ``wait`` held the caller.
    """

    def __init__(self, ckpt_dir: str | os.PathLike, keep_last: int, mode: str = "max", run_id: str | None = None,
                 *, background: bool = False, pin: bool = False):
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.mode = mode
        self.run_id = run_id
        self.best_value: float | None = None
        self._best_snap = None  # background: the snapshot holding the best weights, in CPU memory
        self._best_given: dict[str, Any] | None = None
        self._staging = None  # the snapshot whose large tensors the writer is still copying
        self._last_blocked = 0.0
        self._lineage: dict[Path, str | None | bool] = {}  # file -> its run id (read once per file)
        self._checked_dir = False
        self.background = background
        self._writer = BackgroundWriter() if background else None
        self._pool = StagingPool(pin=pin) if background else None
        self._best_storages: set[int] = set()
        self.saves, self.blocked, self.max_blocked = 0, 0.0, 0.0

    @property
    def write_seconds(self) -> float:
        """Seconds the background thread spent writing (0 without ``background``)."""
        return self._writer.seconds if self._writer is not None else 0.0

    def wait(self) -> float:
        """Wait until the background write (if any) is on disk (fsynced, renamed); raises its error. Returns
        the seconds waited (also added to ``blocked``)."""
        if self._writer is None:
            return 0.0
        t0 = time.perf_counter()
        self._staging = None
        try:
            self._writer.wait()
        finally:
            waited = time.perf_counter() - t0
            self.blocked += waited
        return waited

    def is_better(self, value: float | None) -> bool:
        if value is None or value != value:  # None or NaN never wins
            return False
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def save(self, state: dict[str, Any], step: int, metric: float | None = None) -> Path:
        """Write ``step-<step>.pt`` (and ``best.pt`` if ``metric`` is better), then prune to ``keep_last``.

        On ``CheckpointWriteError`` nothing is pruned and ``best_value`` is unchanged; the message
        names the newest checkpoint still on disk. With ``background`` the write happens in the writer
        thread: its error is raised by the next ``save`` or ``wait`` (the run stops there).
        """
        if not self._checked_dir:  # a link or another user's folder planted as checkpoints/: refused, never used
            own_folder(self.dir, "checkpoint folder", "remove it, or give --run.out_dir a folder of yours")
            self._checked_dir = True
        if self.background:
            return self._save_background(state, step, metric)
        path = self.dir / f"step-{step:08d}.pt"
        better = self.is_better(metric)
        self._write(state, path, best_record(state) if better else None)
        if better:
            self.best_value = metric
        return path

    def _save_background(self, state: dict[str, Any], step: int, metric: float | None) -> Path:
        t0 = time.perf_counter()
        try:
            self._writer.wait()  # one write at a time: the previous one first (its error is raised here)
            self._pool.reset(keep=self._best_storages)  # the staging buffers of the written snapshot are free
            snap = snapshot(state, self._pool)  # small tensors copied now, large storages noted
            path = self.dir / f"step-{step:08d}.pt"
            better = self.is_better(metric)
            if better:
                self._best_snap, self._best_given, self.best_value = snap, None, metric

            def job() -> None:
                snap.stage()  # the large storages copied (the loop's wait_staged returns), then the file written
                best = best_record(snap.state) if better else None
                if better:
                    self._best_storages = snap.storage_ids(best)
                self._write(snap.state, path, best)

            self._staging = snap
            self._writer.submit(job)
        finally:
            blocked = time.perf_counter() - t0
            self.saves += 1
            self.blocked += blocked
            self._last_blocked = blocked
            self.max_blocked = max(self.max_blocked, blocked)
        return path

    @property
    def staging(self) -> bool:
        """A snapshot's large tensors are still being copied: the live state must not change yet."""
        return self._staging is not None

    def wait_staged(self) -> float:
        """Wait until the snapshot being taken no longer needs the live tensors (before the next optimizer
        step, before other weights are loaded); the seconds waited count as that save's blocked time."""
        snap, self._staging = self._staging, None
        if snap is None:
            return 0.0
        waited = snap.wait_staged()
        self.blocked += waited
        self._last_blocked += waited
        self.max_blocked = max(self.max_blocked, self._last_blocked)
        return waited

    @property
    def best_state(self) -> dict[str, Any] | None:
        """The best checkpoint's `best_record` in CPU memory (what best.pt holds), when this process saved it
        (or was given it); None otherwise."""
        snap = self._best_snap
        if snap is not None:
            snap.wait_staged()
            return best_record(snap.state) if snap.staged else None
        return self._best_given

    @best_state.setter
    def best_state(self, value: dict[str, Any] | None) -> None:
        self._best_snap, self._best_given = None, value

    def _write(self, state: dict[str, Any], path: Path, best: dict[str, Any] | None) -> None:
        """Write ``path`` (and ``best.pt`` from ``best``), then prune; the writer thread's job in background."""
        try:
            atomic_save(state, path)
            if best is not None:
                self._write_best(best)
        except CheckpointWriteError as e:
            newest = latest_checkpoint(self.dir)
            raise CheckpointWriteError(f"{e}; newest checkpoint on disk: {newest or 'none yet'}",
                                       path=e.path, cause=e.cause, code=e.errno) from e.__cause__
        self._lineage[path] = self.run_id
        for old in self._own_checkpoints()[: -self.keep_last]:
            remove_inside(self.dir, old)
            self._lineage.pop(old, None)

    def own_checkpoints(self) -> list[Path]:
        """This run's ``step-*.pt`` files, oldest first (other lineages' and unreadable files left out); a
        background write in progress is waited for first."""
        self.wait()
        return self._own_checkpoints()

    def _own_checkpoints(self) -> list[Path]:
        files = step_checkpoints(self.dir)
        for p in files:
            if p not in self._lineage:
                self._lineage[p] = file_lineage_id(p)
        unmarked = self.run_id is None or unmarked_are_own(self.dir)
        return [p for p in files if not p.is_symlink() and same_lineage(self._lineage[p], self.run_id, unmarked)]

    def _write_best(self, best: dict[str, Any]) -> None:
        """``best.pt`` from ``best`` (a `best_record`): its own file, written atomically; a link at ``best.pt``
        is replaced (the file it pointed to untouched)."""
        path = self.dir / "best.pt"
        if path.is_symlink():
            remove_inside(self.dir, path)
        atomic_save(best, path)
