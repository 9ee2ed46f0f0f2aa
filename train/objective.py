"""The objective fastmt optimises: wall seconds from process start to each validation BLEU threshold.

``process_seconds()`` counts from the moment the OS started this process (imports, data, compilation and
evaluation included), not from the first step. ``BleuClock`` records, per run, the first wall time each
threshold of ``eval.bleu_thresholds`` was reached and decides early stopping (``eval.patience``). A resumed
run adds the wall time its earlier processes had spent (``offset``), so the clock is the run's, not the
process's.

``wall_seconds`` has this one meaning everywhere (metrics.jsonl records, the summary, provenance): seconds
since the run's first process started, summed over the processes of a resumed run (the time a process
lost after its last checkpoint, e.g. to kill -9, is not counted). ``WallSplit`` divides it into setup,
compile, train, eval and checkpoints.
"""

from __future__ import annotations

import os
import time
from typing import Any

_IMPORT_TIME = time.time()


def _process_start_time() -> float:
    """Epoch seconds at which the OS started this process (Linux /proc), else this module's import time."""
    from data.files import MIB, read_text

    try:
        fields = read_text("/proc/self/stat", "process status", limit=MIB).rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5): starttime, clock ticks after boot
        stat = read_text("/proc/stat", "kernel statistics", limit=16 * MIB).splitlines()
        btime = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):  # (the reader's refusals are ValueErrors)
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
        self.best_at: dict[str, float] | None = None  # {"epoch", "seconds"} of the best BLEU
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
            self.best_at = {"epoch": epoch, "seconds": wall}
        else:
            self.evals_since_best += 1
        return new

    def should_stop(self) -> bool:
        return self.patience is not None and self.evals_since_best >= self.patience

    def summary_lines(self) -> list[str]:
        """One line per threshold reached ("time to BLEU 20: 81.2 s (epoch 3, BLEU 20.41)"), or one line
        saying none was."""
        lines = [f"time to BLEU {k}: {r['seconds']:.1f} s (epoch {r['epoch']}, BLEU {r['bleu']:.2f})"
                 for k, r in self.reached.items() if r]
        if not lines and self.reached:
            best = "no validation BLEU yet" if self.best is None else f"best {self.best:.2f}"
            lines = [f"time to BLEU: none of {', '.join(self.reached)} reached ({best})"]
        return lines

    def state_dict(self, wall: float) -> dict[str, Any]:
        return {"offset": wall, "reached": self.reached, "best": self.best, "best_at": self.best_at,
                "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = float(state.get("offset", 0.0))
        for k, v in state.get("reached", {}).items():
            if k in self.reached:
                self.reached[k] = v
        self.best = state.get("best")
        self.best_at = state.get("best_at")
        self.evals_since_best = int(state.get("evals_since_best", 0))


class WallSplit:
    """Where a run's wall seconds went, summed over its processes (saved in checkpoints):

    - ``setup``: each process's start up to its first training step (imports, data, model, resume);
    - ``compile``: each process's first training step when the model is compiled (compilation and CUDA-graph
      capture dominate it); 0 for eager runs, whose first step counts as training;
    - ``eval``: validation, checkpoint averaging and the final test (decoding included);
    - ``checkpoints``: writing checkpoints;
    - ``train``: the rest of the run's wall seconds (training steps, data loading, records).
    """

    PARTS = ("setup", "compile", "eval", "checkpoints")

    def __init__(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def split(self, wall: float) -> dict[str, float]:
        """``{setup, compile, train, eval, checkpoints}`` seconds summing to ``wall`` (the run's wall seconds)."""
        s = dict(self.seconds)
        train = max(wall - sum(s.values()), 0.0)
        return {"setup": s["setup"], "compile": s["compile"], "train": train, "eval": s["eval"],
                "checkpoints": s["checkpoints"]}

    def state_dict(self) -> dict[str, float]:
        return dict(self.seconds)

    def load_state_dict(self, state: dict[str, float]) -> None:
        for k in self.PARTS:
            self.seconds[k] = float(state.get(k, 0.0))
