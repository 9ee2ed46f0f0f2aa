"""Atomic checkpoints (temp file + ``os.replace``), keep-last-K + best, and RNG state capture.

A checkpoint is one ``torch.save`` dict written by the Trainer:
``model`` (the un-compiled, un-wrapped module's state), ``optimizer``, ``scheduler``, ``scaler``,
``rng`` (python, numpy, torch, cuda), ``position`` (epoch, batch index, optimizer step), ``config``
(``Config.to_dict()``), ``tokenizer`` (model file path + cache key), ``metrics`` (the epoch's line).
Files are ``<run>/checkpoints/step-<step>.pt`` plus ``best.pt``; a reader never sees a partial file.
A failed write (disk full, read-only) raises ``CheckpointWriteError`` in one line and keeps every
earlier file; ``latest_loadable_checkpoint`` skips (and reports) a newest file that does not load.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_RE = re.compile(r"^step-(\d+)\.pt$")


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, no permission, I/O error).

    The message is one line naming the file, the cause and the fix; ``path`` is the checkpoint,
    ``cause`` the short cause. The temp file is gone and no existing file was changed.
    """

    def __init__(self, message: str, *, path: Path, cause: str, code: int | None = None):
        super().__init__(message)
        self.path, self.cause, self.errno = path, cause, code


class CheckpointReadError(RuntimeError):
    """None of a run's checkpoints loads."""


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
    """``torch.save`` to a temp file in the same folder, fsync, then ``os.replace`` onto ``path``.

    A failed write (disk full, read-only, ...) raises ``CheckpointWriteError``; the temp file is
    removed and ``path`` keeps its old content.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. the folder turned read-only: report the write error, not this
        err = _write_error(e, path, obj) if isinstance(e, Exception) else None
        if err is None:
            raise
        raise err from e
    return path


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        # Our own files (they hold numpy RNG state and plain dicts), so full unpickling is intended.
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # noqa: BLE001 - re-raised with the path and the likely cause
        raise RuntimeError(f"cannot read checkpoint {str(path)!r} (truncated or not a fastmt checkpoint): {e}") from e
    missing = {"model", "config", "position"} - set(ckpt)
    if missing:
        raise RuntimeError(f"{str(path)!r} is not a fastmt training checkpoint: missing keys {sorted(missing)}")
    return ckpt


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
                               map_location: str | torch.device = "cpu") -> tuple[Path | None, dict | None]:
    """The newest step checkpoint that loads, as ``(path, checkpoint)``; ``(None, None)`` if there is none.

    A newer one that does not load (truncated, not a fastmt checkpoint) is reported in one line (path,
    size, error) and renamed ``<name>.unreadable`` — kept for inspection, out of keep-last pruning and
    of later ``--resume auto`` — and the one before it is tried. If checkpoints exist but none loads,
    ``CheckpointReadError``: resuming from nothing would silently restart the run.
    """
    ckpts = step_checkpoints(ckpt_dir)
    bad = []
    for path in reversed(ckpts):
        try:
            return path, load_checkpoint(path, map_location)
        except (RuntimeError, OSError) as e:
            size = path.stat().st_size if path.exists() else 0
            aside = path.with_name(path.name + ".unreadable")
            try:
                path.rename(aside)
            except OSError:
                aside = path
            log(f"checkpoint {path} ({size:,} bytes) does not load, skipped (now {aside.name}): "
                + " ".join(str(e).split())[:300])
            bad.append(aside)
    if bad:
        raise CheckpointReadError(
            f"none of the {len(bad)} checkpoint(s) in {ckpt_dir} loads ({', '.join(p.name for p in bad)}); "
            f"to start this run over, run without --resume (the folder is moved aside, nothing is deleted)"
        )
    return None, None


class CheckpointManager:
    """Writes ``step-<n>.pt``, keeps the newest ``keep_last``, and maintains ``best.pt``.

    ``mode="max"`` (BLEU) or ``"min"`` (validation loss) decides what "best" means.
    """

    def __init__(self, ckpt_dir: str | os.PathLike, keep_last: int, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"mode={mode!r} must be 'max' or 'min'")
        self.dir = Path(ckpt_dir)
        self.keep_last = keep_last
        self.mode = mode
        self.best_value: float | None = None

    def is_better(self, value: float | None) -> bool:
        if value is None or value != value:  # None or NaN never wins
            return False
        if self.best_value is None:
            return True
        return value > self.best_value if self.mode == "max" else value < self.best_value

    def save(self, state: dict[str, Any], step: int, metric: float | None = None) -> Path:
        """Write ``step-<step>.pt`` (and ``best.pt`` if ``metric`` is better), then prune to ``keep_last``.

        On ``CheckpointWriteError`` nothing is pruned and ``best_value`` is unchanged; the message
        names the newest checkpoint still on disk.
        """
        try:
            path = atomic_save(state, self.dir / f"step-{step:08d}.pt")
            if self.is_better(metric):
                self._write_best(path, state)
                self.best_value = metric
        except CheckpointWriteError as e:
            newest = latest_checkpoint(self.dir)
            raise CheckpointWriteError(f"{e}; newest checkpoint on disk: {newest or 'none yet'}",
                                       path=e.path, cause=e.cause, code=e.errno) from e.__cause__
        for old in step_checkpoints(self.dir)[: -self.keep_last]:
            old.unlink()
        return path

    def _write_best(self, path: Path, state: dict[str, Any]) -> None:
        best_tmp = self.dir / f".best.pt.tmp-{os.getpid()}"
        try:  # a hard link costs nothing; os.replace keeps best.pt atomic
            best_tmp.unlink(missing_ok=True)
            os.link(path, best_tmp)
            os.replace(best_tmp, self.dir / "best.pt")
        except OSError:  # no hard links here (some network/FUSE file systems): write a copy
            best_tmp.unlink(missing_ok=True)
            atomic_save(state, self.dir / "best.pt")


def check_tokenizer(ckpt: dict[str, Any], tok, path) -> None:
    ref = ckpt.get("tokenizer") or {}
    if ref.get("key") != tok.key:
        raise ValueError(
            f"tokenizer mismatch: checkpoint {path} was trained with tokenizer key {ref.get('key')!r} "
            f"({ref.get('model_file')}), but the current data settings give key {tok.key!r} ({tok.model_file}). "
            f"Resume with the same data files and data.* settings as the checkpoint's run (its config is stored "
            f"in the checkpoint), or start a new run with a different --run.name"
        )


def warn_config_changes(saved: dict[str, Any], now: dict[str, Any], log) -> None:
    """Resuming with different settings is allowed (e.g. a new eval beam) but never silent."""
    changed = {f"{sec}.{k}": (v, now.get(sec, {}).get(k)) for sec, fields in saved.items()
               for k, v in fields.items() if json.dumps(v, default=str) != json.dumps(now.get(sec, {}).get(k), default=str)}
    if changed:
        log("resume: config differs from the checkpoint's (saved -> now): "
            + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))


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


def average_last_epochs(ckpt_dir: str | os.PathLike, k: int, log: Callable[[str], Any] = print) -> dict | None:
    """``average_checkpoints`` of the newest ``k`` end-of-epoch checkpoints in ``ckpt_dir`` (mid-epoch ones, from
    interruptions, are left out; each file is read once); None, said in one line, when fewer are kept."""
    ends: dict[Path, dict[str, Any]] = {}
    for p in reversed(step_checkpoints(ckpt_dir)):
        ckpt = load_checkpoint(p)
        if ckpt["position"]["batch_index"] == 0:
            ends[p] = ckpt
            if len(ends) == k:
                return average_checkpoints(sorted(ends), loaded=ends)
    log(f"checkpoint averaging: {len(ends)} epoch checkpoints kept in {ckpt_dir}, {k} asked; skipped")
    return None
