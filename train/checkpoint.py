"""Atomic checkpoints (temp file + ``os.replace``), keep-last-K + best, and RNG state capture.

A checkpoint is one ``torch.save`` dict written by the Trainer:
``model`` (the un-compiled, un-wrapped module's state), ``optimizer``, ``scheduler``, ``scaler``,
``rng`` (python, numpy, torch, cuda), ``position`` (epoch, batch index, optimizer step), ``config``
(``Config.to_dict()``), ``tokenizer`` (model file path + cache key), ``metrics`` (the epoch's line).
Files are ``<run>/checkpoints/step-<step>.pt`` plus ``best.pt``; a reader never sees a partial file.
"""

from __future__ import annotations

import os
import random
import re
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


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temp file in the same folder, fsync, then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
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
        path = atomic_save(state, self.dir / f"step-{step:08d}.pt")
        if self.is_better(metric):
            self.best_value = metric
            best_tmp = self.dir / f".best.pt.tmp-{os.getpid()}"
            try:  # a hard link costs nothing; os.replace keeps best.pt atomic
                if best_tmp.exists():
                    best_tmp.unlink()
                os.link(path, best_tmp)
                os.replace(best_tmp, self.dir / "best.pt")
            except OSError:
                atomic_save(state, self.dir / "best.pt")
        for old in step_checkpoints(self.dir)[: -self.keep_last]:
            old.unlink()
        return path
