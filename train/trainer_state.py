"""The Trainer's state: its position in the run, the checkpoint's dict (`state_dict`) and its restore
(`_load_state`), the run's provenance record, the epoch's batch and step counts and the progress bar.

``TrainerState`` is a mixin of ``train.loop.Trainer`` (it reads and sets the Trainer's model, optimizer,
schedule, counters and clocks); the loop itself stays in train/loop.py.
"""

from __future__ import annotations

import math
from typing import Any

from train import ema
from train.errors import UserError
from train.runs.checkpoint import rng_state, set_rng_state
from train.runs.metrics import write_provenance
from train.runs.resume import apply_hyperparameters, replan_scheduler, saved_total_steps
from train.runs.start import data_record
from train.step import EpochStats


class TrainerState:
    """What a checkpoint holds of the Trainer and how it comes back (see the module docstring)."""

    def _micro_batches_in_epoch(self, epoch: int) -> int:
        n = self.data.num_batches("train", epoch=epoch, rank=self.dist.rank, world_size=self.dist.world_size)
        if n == 0:
            raise UserError("the training split has no batches: check --data-files and data.valid_size/test_size")
        cap = self.cfg.run.max_batches_per_epoch
        return n if cap is None else min(n, cap)

    def _steps_in_epoch(self, epoch: int) -> int:
        return math.ceil(self._micro_batches_in_epoch(epoch) / self.cfg.optim.accum_steps)

    def position(self) -> dict[str, int]:
        """Where the run stands: the epoch in progress or next (0-based), its batches done, the steps taken."""
        return {"epoch": self.epoch, "batch_index": self.batch_index, "step": self.step}

    def state_dict(self) -> dict[str, Any]:
        tok = self.data.tokenizer
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
            "position": {"epoch": self.epoch, "batch_index": self.batch_index, "step": self.step,
                         "total_steps": self.total_steps, "world_size": self.dist.world_size, "counters": self.counters.state_dict(),
                         "epoch_stats": self.stats.state_dict(), "best_value": self.ckpts.best_value,
                         "clock": self.clock.state_dict(self.clock.wall()), "split": self.split.state_dict()},
            "config": self.cfg.record(),
            "tokenizer": {"model_file": tok.model_file, "key": tok.key, "model_bytes": tok.model_bytes()},
            "data": data_record(getattr(self.data, "split_record", None)),  # what a resume checks it reads again
            "lineage": {"run_id": self.run_id, "parent": self.parent},
            "params": self.params,
            "history": self.history,
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
        }

    def _load_state(self, ckpt: dict[str, Any]) -> tuple[float | None, dict | None]:
        """Restore a checkpoint's state; the optimizer takes this config's hyper-parameters, and the schedule
        is re-planned from the current step when its settings or the run's length changed. Returns
        ``(best_value, schedule)``: the schedule's new plan, or None when the saved one was kept."""
        self.model.load_state_dict(ckpt["model"])  # copies into the flat buffers' views
        self.ema = ema.from_checkpoint(ckpt, self.model, self.cfg.optim.ema_decay)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        apply_hyperparameters(self.optimizer, self.model, self.cfg.optim)
        self.scaler.load_state_dict(ckpt["scaler"])
        pos = ckpt["position"]
        self.epoch, self.batch_index, self.step = pos["epoch"], pos["batch_index"], pos["step"]
        n = self.data.num_batches("train", epoch=self.epoch, rank=self.dist.rank, world_size=self.dist.world_size)
        if self.batch_index > n:  # (counts and types: checked when the file was read, train/runs/checkpoint.py)
            raise ValueError(f"its position.batch_index {self.batch_index:,} is past the {n:,} batches of epoch "
                             f"{self.epoch + 1} of this data")
        self.counters.load_state_dict(pos.get("counters", {}))
        self.stats = EpochStats.from_state(pos.get("epoch_stats", {}), self.device)
        if "clock" in pos:
            self.clock.load_state_dict(pos["clock"])
        self.split.load_state_dict(pos.get("split", {}))
        self.history = list(ckpt.get("history", []))
        ranks = ckpt.get("rank_rng") or []  # a DDP run's: each rank's own (the rank count is checked to match)
        self._pending_rng = ranks[self.dist.rank] if len(ranks) == self.dist.world_size else ckpt["rng"]
        now = rng_state()  # the saved state is applied at the first step: tried here, so a bad one fails now
        set_rng_state(self._pending_rng)
        set_rng_state(now)
        schedule = None
        if self._replan:
            self.scheduler = replan_scheduler(self.optimizer, self.cfg.optim, self.total_steps, self.step)
            schedule = {"total_steps": self.total_steps, "previous_total_steps": saved_total_steps(ckpt),
                        "lr": self.scheduler.get_last_lr()[0], "from_step": self.step}
        else:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        return pos.get("best_value"), schedule

    def _write_provenance(self) -> None:
        if not self.is_main:
            return
        extra = {"params": self.params, "device": str(self.device), "world_size": self.dist.world_size,
                 "peak_flops": self.peak_flops, "peak_dtype": self.peak_dtype, "peak_note": self.peak_note,
                 "compiled": self.compiled, "step_graph": self.step_plan.reason, "compile_caches": self.compile_caches,
                 "total_steps": self.total_steps,
                 "steps_per_epoch": self.steps_per_epoch, "tokenizer": self.data.tokenizer.model_file,
                 "run_id": self.run_id, "parent": self.parent}
        write_provenance(self.run_dir, self.cfg.to_dict(), getattr(self.data, "split_record", None), extra,
                         step=self.step, log=self.log)

    def _note(self, msg: str) -> None:
        """A line said while an epoch's progress bar may be on screen (above the bar, not through it)."""
        bar = getattr(self, "_bar", None)
        if bar is not None and self.log is print:
            bar.write(msg)
        else:
            self.log(msg)

    def _progress(self, epoch: int, n_micro: int):
        """A progress bar over the steps this epoch will really take (``run.max_steps`` included)."""
        if not (self.is_main and self.cfg.run.progress):
            return None
        from tqdm import tqdm

        accum = self.cfg.optim.accum_steps
        done, total = self.batch_index // accum, math.ceil(n_micro / accum)
        if self.cfg.run.max_steps is not None:
            total = min(total, done + max(self.cfg.run.max_steps - self.step, 0))
        return tqdm(total=total, initial=done, desc=f"epoch {epoch + 1}/{self.cfg.run.epochs}", dynamic_ncols=True,
                    leave=False)
