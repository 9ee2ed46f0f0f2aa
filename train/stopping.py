"""When the Trainer's loop stops: the stop reasons checked after each step (``run.max_steps``, the wall budget,
a stop signal, ``stop_after``), the agreement of every DDP rank on them, and the one announcement of a signal.

``Stopping`` is a mixin of ``train.loop.Trainer`` (it reads the Trainer's config, clock, distributed info and the
signal its ``fit`` recorded); the loop itself stays in train/loop.py.
"""

from __future__ import annotations

import torch

from train.distributed import all_reduce_max


class Stopping:
    """The loop's stop decisions (see the module docstring)."""

    def _stop_reason(self, steps_this_call: int, stop_after: int | None) -> str | None:
        run = self.cfg.run
        if run.max_steps is not None and self.step >= run.max_steps:
            return "max_steps"
        wall, signalled = self._agreed_stop(at_epoch_end=False)
        if wall:
            return "wall_budget"
        if signalled or (stop_after is not None and steps_this_call >= stop_after):
            self._signalled()
            return "interrupted"
        return None

    def _agreed_stop(self, *, at_epoch_end: bool) -> tuple[bool, bool]:
        """(wall budget spent, stop signal received): this process's view, or under DDP every rank's combined,
        so that all ranks stop at the same step (a rank stepping on alone would wait forever in its next
        all-reduce). Ranks combine them at logging steps and epoch ends only: one small all-reduce there."""
        run = self.cfg.run
        wall = run.max_wall_seconds is not None and self.clock.wall() >= run.max_wall_seconds
        signalled = self._stop_signal is not None
        if self.dist.world_size == 1:
            return wall, signalled
        if not at_epoch_end and self.step % run.log_every:
            return False, False
        flags = torch.tensor([wall, signalled], dtype=torch.float32, device=self.device)
        all_reduce_max(flags)
        wall, signalled = (bool(x) for x in flags.tolist())
        if signalled and self._stop_signal is None:
            self._stop_signal = "a signal to another rank"
        return wall, signalled

    def _signalled(self) -> str | None:
        """The stop signal received, if any; announced once, from the loop."""
        name = self._stop_signal
        if name is not None and not self._stop_announced:
            self._stop_announced = True
            self.log(self._stop_message(name))
        return name

    @staticmethod
    def _stop_message(name: str) -> str:
        return f"\n{name}: stopping after this step with a checkpoint" + (
            " (Ctrl-C again to abort)" if name == "SIGINT" else "")
