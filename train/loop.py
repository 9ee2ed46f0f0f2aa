"""The Trainer: wires data, model, optimizer, compile, step, evaluation, checkpoints and records.

``Trainer(cfg).fit()`` trains for ``run.epochs`` (or ``run.max_steps`` / ``run.max_wall_seconds``),
evaluating every ``eval.every`` epochs; ``Trainer.train_step(batches)`` is one optimizer step (the
benchmark ladder calls it). The step itself lives in train/step.py, the objective (wall seconds to each
BLEU threshold, early stopping) in train/objective.py, compilation in train/compile.py.

Host syncs (the only places the CPU waits for the device):
  - logging steps (every ``run.log_every`` optimizer steps): the loss and the skipped-step counters;
  - epoch ends: the epoch's loss sums, evaluation (validation loss, decoding) and the checkpoint.
A training step syncs nowhere else: the non-finite guard and fp16's GradScaler decide on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.checkpoint import (
    CheckpointManager,
    atomic_save,
    average_last_epochs,
    check_tokenizer,
    latest_checkpoint,
    latest_loadable_checkpoint,
    load_checkpoint,
    rng_state,
    set_rng_state,
    warn_config_changes,
)
from train.compile import compile_for_training, compiled_graphs, configure_caches
from train.config import Config
from train.distributed import DistInfo, barrier, init_distributed
from train.loss import SummedCrossEntropy
from train.metrics import MetricsLogger, plot_curves, write_provenance
from train.objective import BleuClock
from train.optim import build_optimizer, build_scheduler
from train.rundir import (
    RunLock,
    cut_metrics,
    done_record,
    move_aside_previous_run,
    remove_stale_temp_files,
    run_finished,
    stop_on_signals,
)
from train.step import EpochStats, StepCounters, forward_backward, optimizer_step, out_of_memory_advice


class NonFiniteLossError(RuntimeError):
    pass


class RunFinishedError(RuntimeError):
    """``--resume auto`` on a run that already ended: nothing to continue (the message says how it ended)."""


def _amp_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def _quiet(*_args, **_kwargs):
    pass


class Trainer:
    """Builds everything from a ``Config``: data, model, optimizer, schedule, scaler, logging, checkpoints.

    ``data`` may be passed in (a built ``DataBundle``) to share one across Trainers (benchmarks, tests).
    ``resume``: a checkpoint path, or "auto" for the newest checkpoint of this run (none: fresh start).
    """

    def __init__(self, cfg: Config, *, data=None, resume: str | os.PathLike | None = None, log=print):
        self.dist: DistInfo = init_distributed(cfg.run.device)
        self.device = self.dist.device
        self.is_main = self.dist.is_main
        self.log = log if self.is_main else _quiet
        _configure_backend(cfg, self.device)
        self.run_dir = Path(cfg.run.out_dir) / cfg.run.name
        # one writer per run folder, held from here until fit() ends (or close()); rank 0 only
        self.lock = RunLock(self.run_dir).acquire() if self.is_main else None
        try:
            self._build(cfg, data, resume)
        except BaseException:
            self.close()
            raise
        barrier()

    def close(self) -> None:
        """Release the run folder (fit() does this when it returns)."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self, cfg: Config, data, resume) -> None:
        run = cfg.run
        resume_path, ckpt = self._resolve_resume(resume)

        torch.manual_seed(run.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        if data is None:
            from data import build_data

            data = build_data(cfg.data, log=self.log)
        self.data = data
        tok = data.tokenizer
        if ckpt is not None:
            check_tokenizer(ckpt, tok, resume_path)
        # the tokenizer decides the vocabulary: the model config follows it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                                                 pad_id=tok.pad_id))
        self.cfg = cfg

        from models import Transformer, count_params

        self.model = Transformer(cfg.model).to(self.device)  # the un-compiled module: checkpoints hold this
        self.params = count_params(self.model)
        self.loss_module = SummedCrossEntropy(self.model, tok.pad_id, cfg.optim.label_smoothing)
        # flat parameter groups first: DDP and compile must see the parameters' final storage
        self.optimizer, self.flat = build_optimizer(self.model, cfg.optim, self.device)
        self.ddp = None
        step_module: nn.Module = self.loss_module
        if self.dist.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = step_module = DDP(self.loss_module, device_ids=ids)
        from models.flops import run_peak

        # MFU's denominator: the peak of this run's own compute dtype (bf16, fp16, tf32 or fp32)
        self.peak_flops, self.peak_dtype, self.peak_note = run_peak(self.device, run.precision,
                                                                    override=run.peak_flops)
        self.compiled = run.compile if run.compile is not None else self.device.type == "cuda"
        self.compile_caches = {}
        if self.compiled:
            self.compile_caches = configure_caches(run.cache_dir)
            step_module = compile_for_training(step_module, self.loss_module, scope=run.compile_scope,
                                               backend=run.compile_backend, mode=run.compile_mode,
                                               dynamic=run.compile_dynamic)
        self.step_module = step_module

        self.steps_per_epoch = self._steps_in_epoch(0)
        # token buckets are re-cut every epoch, so batch counts differ a little: plan each epoch
        planned = sum(self._steps_in_epoch(e) for e in range(run.epochs))
        self.total_steps = min(planned, run.max_steps) if run.max_steps is not None else planned
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.amp_dtype = _amp_dtype(run.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=run.precision == "fp16")
        # autocast is built once and re-entered every step
        self.autocast = torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                       enabled=self.amp_dtype is not None)

        # position and counters (all saved in checkpoints)
        self.epoch = 0  # current epoch (0-based)
        self.batch_index = 0  # micro-batches of this epoch already consumed
        self.step = 0  # optimizer steps taken (a step the guard skipped on the device counts too)
        self.counters = StepCounters(self.device)
        self.stats = EpochStats.new(self.device)
        self.clock = BleuClock(cfg.eval.bleu_thresholds, cfg.eval.patience)
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.history: list[dict[str, Any]] = []
        self._last_grad_norm = None
        self.first_step_seconds: float | None = None  # this process's first step: compile + CUDA-graph capture

        if self.is_main:
            if ckpt is None:
                move_aside_previous_run(self.run_dir, self.log, lock=self.lock)
            elif resume_path.parent.resolve() == (self.run_dir / "checkpoints").resolve():
                cut_metrics(self.run_dir / "metrics.jsonl", keep=ckpt["position"], log=self.log)
            remove_stale_temp_files(self.run_dir / "checkpoints", self.log)
            remove_stale_temp_files(self.run_dir, self.log)
        if cfg.eval.average_last > run.keep_last:
            raise ValueError(f"eval.average_last={cfg.eval.average_last} needs run.keep_last >= it (got "
                             f"{run.keep_last}): pass --run.keep_last {cfg.eval.average_last}")
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", run.keep_last,
                                       mode="max" if cfg.eval.best_metric == "bleu" else "min")
        self.metrics = MetricsLogger(self.run_dir, tensorboard=run.tensorboard, enabled=self.is_main)
        self._pending_rng = None
        self._stop_signal: str | None = None
        if ckpt is not None:
            warn_config_changes(ckpt["config"], cfg.to_dict(), self.log)
            self._load_state(ckpt)
            self.log(f"resumed from {resume_path}: epoch {self.epoch}, batch {self.batch_index}, step {self.step}")

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------
    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step over one Batch or a sequence of micro-batches (gradient accumulation).

        Returns the step's mean label-smoothed loss per real target token as a 0-d device tensor. No host
        sync: a non-finite loss or gradient skips the update on the device (``skipped_steps`` counts it).
        """
        if not isinstance(batches, Sequence):
            batches = [batches]
        self.model.train()
        t_first = time.perf_counter() if self.first_step_seconds is None else None
        try:
            loss = forward_backward(self.step_module, batches, device=self.device, autocast=self.autocast,
                                    scaler=self.scaler, ddp=self.ddp, on_batch=self._see_shape)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(out_of_memory_advice(self.cfg)) from e
        self._last_grad_norm = optimizer_step(self.optimizer, self.flat, self.scheduler, self.scaler, self.counters,
                                              loss, grad_clip=self.cfg.optim.grad_clip,
                                              guard=self.cfg.run.nonfinite_guard,
                                              step_scheduler=self.step + 1 < self.total_steps)
        self.step += 1
        if t_first is not None:  # once per process: a sync to time compilation and capture honestly
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_seconds = time.perf_counter() - t_first
        return loss

    def _see_shape(self, b) -> None:
        self.shapes_seen.add((b.src.shape[0], b.src.shape[1], b.tgt_in.shape[1]))

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped (non-finite); reading it syncs the host."""
        return int(self.counters.skipped)

    # ------------------------------------------------------------------------------------------
    # the epoch loop
    # ------------------------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train for ``run.epochs`` (or ``run.max_steps`` / ``run.max_wall_seconds``); evaluate and checkpoint.

        ``stop_after``: interrupt after this many optimizer steps *in this call*, writing a checkpoint
        (a preemption drill: the run resumes exactly from it). Returns a summary dict.
        """
        self._stop_signal = None

        def request_stop(name: str) -> None:
            self._stop_signal = name
            self.log(f"\n{name}: stopping after this step with a checkpoint"
                     + (" (Ctrl-C again to abort)" if name == "SIGINT" else ""))

        try:
            with stop_on_signals(request_stop):
                return self._fit(stop_after)
        finally:
            self.close()

    def _fit(self, stop_after: int | None) -> dict[str, Any]:
        run = self.cfg.run
        self._write_provenance()
        t_fit = time.perf_counter()
        steps_this_call = 0
        stop_reason = None
        while self.epoch < run.epochs and stop_reason is None:
            epoch = self.epoch
            n_micro = self._micro_batches_in_epoch(epoch)
            loader = self.data.loader("train", epoch=epoch, rank=self.dist.rank,
                                      world_size=self.dist.world_size, start_batch=self.batch_index)
            it = iter(loader)
            if self._pending_rng is not None:  # dropout's RNG as saved (the loader has its own generator)
                set_rng_state(self._pending_rng)
                self._pending_rng = None
            self.stats.t0 = time.perf_counter()
            bar = self._progress(epoch, n_micro)
            t_log, tok_log = time.perf_counter(), self.stats.real_tokens
            group: list = []
            for batch in it:
                if self.batch_index + len(group) >= n_micro:  # run.max_batches_per_epoch reached
                    break
                group.append(batch)
                if len(group) < self.cfg.optim.accum_steps and self.batch_index + len(group) < n_micro:
                    continue
                loss = self.train_step(group)
                self.batch_index += len(group)
                steps_this_call += 1
                self.stats.add(loss, group)
                group = []
                if self.step % run.log_every == 0:
                    stop_reason = self._log_step(loss, bar, t_log, tok_log)
                    t_log, tok_log = time.perf_counter(), self.stats.real_tokens
                if bar is not None:
                    bar.update(1)
                if stop_reason is None:
                    stop_reason = self._stop_reason(steps_this_call, stop_after)
                if stop_reason is not None:
                    break
            if bar is not None:
                bar.close()
            del it, loader
            if stop_reason == "nonfinite_unguarded":
                # without the guard the bad steps were applied: saving now would make `--resume auto`
                # continue from corrupted weights
                raise NonFiniteLossError(
                    f"non-finite loss read at step {self.step} with run.nonfinite_guard off, so non-finite steps "
                    f"were not skipped and the weights may be corrupted; nothing was saved. Resume from the last "
                    f"good checkpoint ({latest_checkpoint(self.run_dir / 'checkpoints') or 'none yet'}) with "
                    f"--run.nonfinite_guard true, or lower --optim.lr"
                )
            epoch_done = self.batch_index >= n_micro
            if epoch_done or stop_reason == "wall_budget":
                path = self._end_epoch(epoch, partial=not epoch_done)
                if stop_reason is None and self.clock.should_stop():
                    stop_reason = "early_stop"
                    self.log(f"early stop: no new best BLEU in {self.cfg.eval.patience} evaluations "
                             f"(best {self.clock.best:.2f})")
            else:
                path = self._save(metric=None)  # mid-epoch: the position lets a resume continue exactly
            if stop_reason == "nonfinite":
                raise NonFiniteLossError(
                    f"{int(self.counters.nonfinite_in_row)} non-finite losses in a row (limit run.max_nonfinite="
                    f"{run.max_nonfinite}) at step {self.step}; they were skipped and the state saved to {path}. "
                    f"Lower --optim.lr, keep --optim.grad_clip, or use --run.precision bf16/fp32"
                )
            if stop_reason is not None:
                self.log(f"stopped ({stop_reason}) in epoch {epoch + 1}, after batch {self.batch_index}/{n_micro}, "
                         f"step {self.step}; checkpoint {path}")
        summary: dict[str, Any] = {"steps": self.step, "skipped_steps": self.skipped_steps,
                                   "epochs_done": self.epoch, "wall_seconds": time.perf_counter() - t_fit,
                                   "run_wall_seconds": self.clock.wall(), "stop_reason": stop_reason or "done",
                                   "best_bleu": self.clock.best, "time_to_bleu": self.clock.reached,
                                   # CUDA-graph decoding that fell back to eager (the records say when and why)
                                   "decode_fallbacks": sum(r.get("decode_fallbacks") or 0 for r in self.history)}
        if stop_reason in (None, "max_steps", "wall_budget", "early_stop") and self.is_main:
            if self.cfg.eval.average_last:
                self._average_last(self.cfg.eval.average_last)
            if self.cfg.eval.test_at_end:
                summary["test"] = self._final_test()
                summary["decode_fallbacks"] += summary["test"]["decode_fallbacks"] or 0
            for line in self.clock.summary_lines():
                self.log(line)
            test = summary.get("test") or {}
            self.metrics.log(done_record(epoch=self.epoch, step=self.step, stop_reason=stop_reason or "done",
                                         wall_seconds=self.clock.wall(), best_bleu=self.clock.best,
                                         time_to_bleu=self.clock.reached, test_bleu=test.get("test_bleu")))
            if run.plot and self.metrics.path.exists():
                png = plot_curves(self.metrics.path, self.run_dir / "curves.png")
                if png:
                    self.log(f"curves: {png}")
        barrier()
        self.metrics.close()
        return summary

    def _log_step(self, loss: torch.Tensor, bar, t_log: float, tok_log: int) -> str | None:
        """A logging step: read the loss and the counters (the host sync of the loop), report, decide."""
        now = time.perf_counter()
        loss_value = float(loss)  # host sync: every log_every steps
        in_row = float(self.counters.nonfinite_in_row)
        lr = self.scheduler.get_last_lr()[0]
        tps = (self.stats.real_tokens - tok_log) / max(now - t_log, 1e-9)
        pad = 1 - self.stats.real_tokens / max(self.stats.padded_tokens, 1)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", pad=f"{100 * pad:.1f}%")
        self.metrics.scalars({"loss": loss_value, "lr": lr, "tokens_per_second": tps, "padding_fraction": pad,
                              "skipped_steps": float(self.counters.skipped)}, self.step, prefix="train/")
        guarded = self.cfg.run.nonfinite_guard or self.scaler.is_enabled()
        if not math.isfinite(loss_value) and not guarded:
            return "nonfinite_unguarded"
        if in_row >= self.cfg.run.max_nonfinite:
            return "nonfinite"
        return None

    def _stop_reason(self, steps_this_call: int, stop_after: int | None) -> str | None:
        run = self.cfg.run
        if run.max_steps is not None and self.step >= run.max_steps:
            return "max_steps"
        if run.max_wall_seconds is not None and self.clock.wall() >= run.max_wall_seconds:
            return "wall_budget"
        if self._stop_signal is not None or (stop_after is not None and steps_this_call >= stop_after):
            return "interrupted"
        return None

    # ------------------------------------------------------------------------------------------
    # end of epoch: evaluation, metrics line, checkpoint
    # ------------------------------------------------------------------------------------------
    def _end_epoch(self, epoch: int, partial: bool = False) -> Path | None:
        run, ev, st = self.cfg.run, self.cfg.eval, self.stats
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds = st.elapsed()
        world = self.dist.world_size
        record: dict[str, Any] = {
            "kind": "epoch",
            "epoch": epoch + 1,  # 1-based in the records, as people count epochs
            "step": self.step,
            # host sync: once per epoch
            "train_loss": float(st.loss_sum) / max(st.tgt_tokens, 1),
            "train_loss_last_batch": float(st.last_loss) if st.last_loss is not None else None,
            "lr": self.scheduler.get_last_lr()[0],
            "epoch_seconds": train_seconds,
            # real (non-pad) src+tgt tokens/s over all ranks (every rank runs the same number of batches)
            "tokens_per_second": st.real_tokens * world / max(train_seconds, 1e-9),
            "tgt_tokens_per_second": st.tgt_tokens * world / max(train_seconds, 1e-9),
            "padding_fraction": 1 - st.real_tokens / max(st.padded_tokens, 1),
            "skipped_steps": self.skipped_steps,
            "micro_batches": st.micro_batches,
            "distinct_shapes": len(self.shapes_seen),
        }
        if partial:
            record["partial_epoch"] = True
        record["mfu"] = self._mfu(st, record["tgt_tokens_per_second"])
        record["peak_dtype"] = self.peak_dtype
        record["compiled_graphs"] = compiled_graphs() if self.compiled else None
        record["first_step_seconds"] = self.first_step_seconds
        if self.device.type == "cuda":
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            record["peak_memory_gb"] = None
            record["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux

        metric = None
        evaluate = (epoch + 1) % ev.every == 0 or epoch + 1 == run.epochs or partial
        if self.is_main and evaluate:
            metric = self._evaluate(epoch, record)
        record["wall_seconds"] = self.clock.wall()  # the run's clock, since process start (+ earlier processes)
        if self.is_main:
            self.metrics.log(record)
            self.metrics.scalars({k: v for k, v in record.items() if k not in ("kind", "epoch")}, epoch + 1,
                                 prefix="epoch/")
        self.history.append(record)
        if not partial:
            self.epoch, self.batch_index = epoch + 1, 0
            self.stats = EpochStats.new(self.device)
        return self._save(metric=metric)

    def _evaluate(self, epoch: int, record: dict[str, Any]) -> float | None:
        """Validation loss and BLEU into ``record``; updates the BLEU clock; returns the best-metric value."""
        ev = self.cfg.eval
        r = self._eval_split("valid", ev.decode, loss=ev.valid_loss)
        from train.evaluate import DECODE_RECORD_KEYS

        record.update(valid_loss=r["loss"], bleu=r["bleu"], chrf=r["chrf"], eval_sentences=r["sentences"],
                      eval_seconds=r["seconds"], **{k: r.get(k) for k in DECODE_RECORD_KEYS})
        wall = self.clock.wall()
        for t in self.clock.update(record["bleu"], epoch + 1, wall):
            self.log(f"BLEU {t:g} reached at {wall:.1f} s (epoch {epoch + 1})")
        self.log(
            f"epoch {epoch + 1}/{self.cfg.run.epochs}: train_loss {record['train_loss']:.4f} "
            f"(last batch {_fmt(record['train_loss_last_batch'], '.4f')}) valid_loss {_fmt(record['valid_loss'], '.4f')} "
            f"BLEU {_fmt(record['bleu'], '.2f')} chrF {_fmt(record['chrf'], '.2f')} | {record['epoch_seconds']:.1f} s, "
            f"{record['tokens_per_second']:,.0f} tok/s, pad {100 * record['padding_fraction']:.1f}%, "
            f"eval {record['eval_seconds']:.1f} s, wall {wall:.1f} s"
            + (f", MFU {100 * record['mfu']:.1f}%" if record["mfu"] is not None else "")
        )
        for src, ref, hyp in r["samples"][: ev.num_samples]:
            self.log(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
        return record["bleu"] if ev.best_metric == "bleu" else record["valid_loss"]

    def _final_test(self) -> dict[str, Any]:
        """Test loss and beam-search BLEU with best.pt's weights (the checkpoint translate uses)."""
        best = self.ckpts.dir / "best.pt"
        source = "last"
        if best.is_file():
            state = load_checkpoint(best, map_location=self.device)
            self.model.load_state_dict(state["model"])
            source = f"best.pt (epoch {state['position']['epoch']})"
        r = self._eval_split("test", "beam")
        rec = {"kind": "test", "epoch": self.epoch, "weights": source, "test_loss": r["loss"],
               "test_bleu": r["bleu"], "test_chrf": r["chrf"], "test_sentences": r["sentences"],
               "eval_seconds": r["seconds"], "wall_seconds": self.clock.wall(),
               "decode_fallbacks": r.get("decode_fallbacks"), "decode_eager_reason": r.get("decode_eager_reason")}
        self.log(f"test ({source}): loss {_fmt(r['loss'], '.4f')} BLEU {_fmt(r['bleu'], '.2f')} "
                 f"chrF {_fmt(r['chrf'], '.2f')} ({r['sentences']} sentences, beam {self.cfg.eval.beam_size})")
        self.metrics.log(rec)
        return rec

    def _average_last(self, k: int) -> None:
        """The average of the last ``k`` epoch checkpoints becomes best.pt if its validation BLEU beats the
        best single checkpoint's (that one is kept as best-single.pt)."""
        state = average_last_epochs(self.ckpts.dir, k, self.log)
        if state is None:
            return
        self.model.load_state_dict(state["model"])
        r = self._eval_split("valid", "beam", loss=False)
        better = r["bleu"] is not None and self.ckpts.is_better(r["bleu"])
        self.log(f"average of the last {k} epoch checkpoints: valid BLEU {_fmt(r['bleu'], '.2f')} (best single "
                 f"{_fmt(self.ckpts.best_value, '.2f')}){': kept as best.pt' if better else ''}")
        self.metrics.log({"kind": "average", "checkpoints": [Path(p).name for p in state["averaged_from"]],
                          "bleu": r["bleu"], "best_single_bleu": self.ckpts.best_value, "wall_seconds": self.clock.wall()})
        if better:
            if (self.ckpts.dir / "best.pt").exists():
                os.replace(self.ckpts.dir / "best.pt", self.ckpts.dir / "best-single.pt")
            atomic_save(state, self.ckpts.dir / "best.pt")
            self.ckpts.best_value = r["bleu"]

    def _eval_split(self, split: str, decode: str, loss: bool = True) -> dict[str, Any]:
        from train.evaluate import evaluate_split

        return evaluate_split(self.model, self.data, split, self.device, self.cfg.eval, autocast=self.autocast,
                              decode=decode, loss=loss)

    def _mfu(self, st: EpochStats, tgt_tps: float) -> float | None:
        """Model FLOPs utilisation against the peak of the run's dtype; None where no peak exists (CPU)."""
        if self.peak_flops is None or st.sentences == 0:
            return None
        from models.flops import flops_per_token, mfu

        # FLOPs at the epoch's mean real lengths (src incl. EOS, tgt incl. BOS)
        src_len, tgt_len = st.src_tokens / st.sentences, st.tgt_tokens / st.sentences
        return mfu(flops_per_token(self.cfg.model, src_len, tgt_len) * tgt_tps,
                   self.peak_flops * self.dist.world_size)

    # ------------------------------------------------------------------------------------------
    # state, checkpoints, provenance
    # ------------------------------------------------------------------------------------------
    def _micro_batches_in_epoch(self, epoch: int) -> int:
        n = self.data.num_batches("train", epoch=epoch, rank=self.dist.rank, world_size=self.dist.world_size)
        if n == 0:
            raise ValueError("the training split has no batches: check --data-files and data.valid_size/test_size")
        cap = self.cfg.run.max_batches_per_epoch
        return n if cap is None else min(n, cap)

    def _steps_in_epoch(self, epoch: int) -> int:
        return math.ceil(self._micro_batches_in_epoch(epoch) / self.cfg.optim.accum_steps)

    def state_dict(self) -> dict[str, Any]:
        tok = self.data.tokenizer
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
            "position": {"epoch": self.epoch, "batch_index": self.batch_index, "step": self.step,
                         "counters": self.counters.state_dict(), "epoch_stats": self.stats.state_dict(),
                         "best_value": self.ckpts.best_value, "clock": self.clock.state_dict(self.clock.wall())},
            "config": self.cfg.to_dict(),
            "tokenizer": {"model_file": tok.model_file, "key": tok.key, "model_bytes": tok.model_bytes()},
            "params": self.params,
            "history": self.history,
        }

    def _load_state(self, ckpt: dict[str, Any]) -> None:
        planned = ckpt["scheduler"].get("total_steps")
        if planned is not None and planned != self.total_steps:
            raise ValueError(
                f"the checkpoint's OneCycle schedule spans {planned} steps but this config plans {self.total_steps}: "
                f"resume with the run's --epochs/--max-steps/data settings (the checkpoint holds its config)"
            )
        self.model.load_state_dict(ckpt["model"])  # copies into the flat buffers' views
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        pos = ckpt["position"]
        self.epoch, self.batch_index, self.step = pos["epoch"], pos["batch_index"], pos["step"]
        self.counters.load_state_dict(pos.get("counters", {}))
        self.ckpts.best_value = pos.get("best_value")
        self.stats = EpochStats.from_state(pos.get("epoch_stats", {}), self.device)
        if "clock" in pos:
            self.clock.load_state_dict(pos["clock"])
        self.history = list(ckpt.get("history", []))
        self._pending_rng = ckpt["rng"]  # restored at the start of fit(), after the loader is built

    def _save(self, metric: float | None) -> Path | None:
        if not self.is_main:
            barrier()
            return None
        path = self.ckpts.save(self.state_dict(), self.step, metric)
        barrier()
        return path

    def _resolve_resume(self, resume) -> tuple[Path | None, dict[str, Any] | None]:
        """(path, checkpoint) to continue from, or (None, None) for a fresh start. "auto": the newest
        checkpoint of this run that loads (a corrupt newer one is reported and set aside)."""
        if resume is None:
            return None, None
        if str(resume) != "auto":
            return Path(resume), load_checkpoint(resume)
        finished = run_finished(self.run_dir)
        if finished is not None:
            raise RunFinishedError(
                f"--resume auto: run {self.run_dir} already finished ({finished.get('stop_reason', 'done')} at "
                f"step {finished.get('step')}, epoch {finished.get('epoch')}"
                + (f", test BLEU {finished['test_bleu']:.2f}" if finished.get("test_bleu") is not None else "")
                + "): nothing to continue. Train longer with a new --run.name, or translate with its best.pt")
        path, ckpt = latest_loadable_checkpoint(self.run_dir / "checkpoints", self.log)
        if path is None:
            self.log(f"--resume auto: no checkpoint under {self.run_dir / 'checkpoints'}; starting fresh")
        return path, ckpt

    def _write_provenance(self) -> None:
        if not self.is_main:
            return
        extra = {"params": self.params, "device": str(self.device), "world_size": self.dist.world_size,
                 "peak_flops": self.peak_flops, "peak_dtype": self.peak_dtype, "peak_note": self.peak_note,
                 "compiled": self.compiled, "compile_caches": self.compile_caches, "total_steps": self.total_steps,
                 "steps_per_epoch": self.steps_per_epoch, "tokenizer": self.data.tokenizer.model_file}
        write_provenance(self.run_dir, self.cfg.to_dict(), getattr(self.data, "split_record", None), extra,
                         step=self.step, log=self.log)

    def _progress(self, epoch: int, n_micro: int):
        if not (self.is_main and self.cfg.run.progress):
            return None
        from tqdm import tqdm

        accum = self.cfg.optim.accum_steps
        return tqdm(total=math.ceil(n_micro / accum), initial=self.batch_index // accum,
                    desc=f"epoch {epoch + 1}/{self.cfg.run.epochs}", dynamic_ncols=True, leave=False)


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _configure_backend(cfg: Config, device: torch.device) -> None:
    run = cfg.run
    if device.type == "cpu" and run.cpu_threads is not None:
        torch.set_num_threads(run.cpu_threads)
    if device.type == "cuda" and run.precision != "fp32":
        # fp32 matmuls left outside autocast may use TF32; the fp32 baseline keeps full precision
        torch.set_float32_matmul_precision("high")
    if run.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU has no bf16; use --run.precision fp16")
