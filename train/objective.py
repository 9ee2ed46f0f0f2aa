"""The objective fastmt optimises: wall seconds from process start to each validation BLEU threshold.

``process_seconds()`` counts from the moment the OS started this process (imports, data, compilation and
evaluation included), not from the first step. ``BleuClock`` records, per run, the first wall time each
threshold of ``eval.bleu_thresholds`` was reached and decides early stopping (``eval.patience``). A resumed
run adds the wall time its earlier processes had spent (``offset``), so the clock is the run's, not the
process's.
"""

from __future__ import annotations

import os
import time
from typing import Any

_IMPORT_TIME = time.time()


def _process_start_time() -> float:
    """Epoch seconds at which the OS started this process (Linux /proc), else this module's import time."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime, clock ticks after boot
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORT_TIME


_PROCESS_START = min(_process_start_time(), _IMPORT_TIME)


def process_seconds() -> float:
    """Wall seconds since this process started."""
    return time.time() - _PROCESS_START


def threshold_key(t: float) -> str:
    return f"{t:g}"


class BleuClock:
    """First wall time each BLEU threshold was reached, the best BLEU so far, and early stopping."""

    def __init__(self, thresholds: tuple[float, ...], patience: int | None, offset: float = 0.0):
        self.thresholds = tuple(thresholds)
        self.patience = patience
        self.offset = offset  # wall seconds spent by earlier processes of this run (resume)
        self.reached: dict[str, dict[str, float] | None] = {threshold_key(t): None for t in self.thresholds}
        self.best: float | None = None
        self.evals_since_best = 0

    def wall(self) -> float:
        """The run's wall seconds: earlier processes' time plus this process's."""
        return self.offset + process_seconds()

    def update(self, bleu: float | None, epoch: int, wall: float) -> list[float]:
        """Record one validation BLEU; returns the thresholds reached for the first time."""
        if bleu is None or bleu != bleu:
            return []
        new = []
        for t in self.thresholds:
            k = threshold_key(t)
            if bleu >= t and self.reached[k] is None:
                self.reached[k] = {"seconds": wall, "epoch": epoch, "bleu": bleu}
                new.append(t)
        if self.best is None or bleu > self.best:
            self.best, self.evals_since_best = bleu, 0
        else:
            self.evals_since_best += 1
        return new

    def should_stop(self) -> bool:
        return self.patience is not None and self.evals_since_best >= self.patience

    def summary_lines(self) -> list[str]:
        lines = []
        for k, r in self.reached.items():
            lines.append(f"time to BLEU {k}: " + (f"{r['seconds']:.1f} s (epoch {r['epoch']}, BLEU {r['bleu']:.2f})"
                                                  if r else "not reached"))
        return lines

    def state_dict(self, wall: float) -> dict[str, Any]:
        return {"offset": wall, "reached": self.reached, "best": self.best, "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = float(state.get("offset", 0.0))
        for k, v in state.get("reached", {}).items():
            if k in self.reached:
                self.reached[k] = v
        self.best = state.get("best")
        self.evals_since_best = int(state.get("evals_since_best", 0))
