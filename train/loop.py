"""The Trainer: wires data, model, optimizer, compile, step, evaluation, checkpoints and records.

``Trainer(cfg).fit()`` trains for ``run.epochs`` (or ``run.max_steps`` / ``run.max_wall_seconds``),
evaluating every ``eval.every`` epochs; ``Trainer.train_step(batches)`` is one optimizer step (the
benchmark ladder calls it). The step itself lives in train/step.py, the epoch and run ends in
train/epoch_end.py, the state a checkpoint holds in train/trainer_state.py, the stop decisions in
train/stopping.py, the objective (wall seconds to each BLEU threshold, early stopping) in
train/objective.py, compilation in train/compile.py.

Setup order: the config's own cross-field checks (train/config.py) -> decide the run folder and what it continues
(train/runs/plan.py; reads only), and what it continues from: its checkpoint's tokenizer, data source and rank count
(train/runs/start.py), what changed and whether it may (train/runs/resume.py) -> build data, model, optimizer and
schedule once each (the schedule re-planned from the checkpoint's step or built to load the saved one: decided
before it is built) and check what can fail (data, model vs data: train/preflight.py) -> load the checkpoint's
state -> only then claim or lock the run folder and write into it.

Host syncs (the only places the CPU waits for the device):
  - logging steps (every ``run.log_every`` optimizer steps): the loss and the skipped-step counters;
  - epoch ends: the epoch's loss sums, the weights' finiteness, evaluation and the checkpoint.
A training step syncs nowhere else: the non-finite guard and fp16's GradScaler decide on the device.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train import cpu_threads, ema
from train.bounds import machine_capped
from train.compile import compile_for_training, compiles, configure_caches
from train.config import Config, check_consistency
from train.distributed import DistInfo, barrier, init_distributed
from train.epoch_end import EpochEnd, NonFiniteLossError
from train.errors import UserError
from train.graph_step import NormalisedLoss, StepGraph, plan_step_graph
from train.loss import SummedCrossEntropy
from train.objective import BleuClock, WallSplit, process_seconds
from train.optim import build_optimizer, build_scheduler
from train.preflight import build_data_checked, check_model_fits_data, tokenizer_of
from train.runs.checkpoint import (
    CheckpointMismatchError,
    check_tokenizer,
    set_rng_state,
)
from train.runs.folder import discard_unused_run_folder
from train.runs.plan import RunFinishedError
from train.runs.report import longer_flag, next_commands, where_stopped
from train.runs.resume import (
    schedule_replanned,
)
from train.runs.saving import CheckpointManager
from train.runs.signals import stop_on_signals
from train.runs.start import RunSetup, check_same_data
from train.step import EpochStats, StepCounters, forward_backward, optimizer_step, out_of_memory_advice
from train.stopping import Stopping
from train.trainer_state import TrainerState

__all__ = ["Trainer", "NonFiniteLossError", "RunFinishedError"]


def _amp_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def _quiet(*_args, **_kwargs):
    pass


class Trainer(RunSetup, EpochEnd, TrainerState, Stopping):
    """Builds everything from a ``Config``: data, model, optimizer, schedule, scaler, logging, checkpoints.

    ``data`` may be passed in (a built ``DataBundle``) to share one across Trainers (benchmarks, tests).
    ``resume``: a checkpoint path, or "auto" for the newest checkpoint of this run (none: fresh start);
    ``init_from``: a checkpoint whose weights (and tokenizer) start a new run with a fresh optimizer.
    ``run_dir`` is the run's folder (for a fresh run under a taken name: ``<name>-2``, ...).
    """

    def __init__(self, cfg: Config, *, data=None, resume: str | os.PathLike | None = None,
                 init_from: str | os.PathLike | None = None, log=print):
        self.lock, self._created, self.metrics = None, False, None
        self._device_warmup: threading.Thread | None = None
        self.run_dir = Path(cfg.run.out_dir) / cfg.run.name
        self.log = log
        try:
            self.dist: DistInfo = init_distributed(cfg.run.device)
            self.device = self.dist.device
            self.is_main = self.dist.is_main
            self.log = log if self.is_main else _quiet
            self._device_warmup = _warm_device(self.device)  # CUDA's context made while the data is built
            _configure_backend(cfg, self.device)
            self.threads = _thread_adapter(cfg, self.device, self._note)
            if self.threads is not None:  # the count for building too: the window since this run's imports
                self.threads.poll()
            self._build(cfg, data, resume, init_from)
        except BaseException:
            self.close()
            raise
        barrier()

    def close(self) -> None:
        """Release the run folder (fit() does this when it returns). A checkpoint write still in progress is
        finished first (its failure, when nothing else reported it, said in one line). A folder this Trainer
        created that holds no checkpoint (the run failed or never trained) is removed."""
        if getattr(self, "threads", None) is not None:  # this run's adapter: off, and the count it started with
            self.threads.restore()
        ckpts = getattr(self, "ckpts", None)
        if ckpts is not None:
            try:
                ckpts.wait()
            except Exception as e:  # noqa: BLE001 - the run already ended with its own error or summary
                self.log(f"the last checkpoint write failed: {' '.join(str(e).split())[:300]}")
        if self.metrics is not None:
            self.metrics.close()
        try:
            if self._created:  # while the lock is held: no other run may take the folder as it goes
                self._created = False
                discard_unused_run_folder(self.run_dir, self.log)
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # setup: everything that can fail first, then the run folder
    # ------------------------------------------------------------------------------------------
    def _build(self, cfg: Config, data, resume, init_from) -> None:
        run = cfg.run
        try:  # the config's own cross-field checks (one place), again for a config changed in place after it was made
            check_consistency(cfg)
        except ValueError as e:
            raise UserError(str(e)) from None
        plan = self._plan(cfg, resume, init_from)
        self.lock = plan.lock
        ckpt = plan.ckpt
        if ckpt is not None and not plan.weights_only and ckpt.get("kind") == "weights":
            raise CheckpointMismatchError(
                f"--resume {plan.ckpt_path}: it holds only the weights (a best.pt: no optimizer, schedule or data "
                f"position), so the run cannot continue exactly from it; nothing was changed. Resume with --resume auto "
                f"(the newest step-*.pt), or start a new run from these weights: --init-from {plan.ckpt_path}")
        cfg, own_tokenizer = self._continued_config(cfg, plan)  # train/runs/start.py: from what the run recorded
        changes = self._check_changes(cfg, plan)

        torch.manual_seed(run.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        if data is None:
            tokenizer = tokenizer_of(ckpt, plan.ckpt_path) if own_tokenizer else None
            data = build_data_checked(cfg, log=self.log, tokenizer=tokenizer)
        self.data = data
        tok = data.tokenizer
        if ckpt is not None:
            check_tokenizer(ckpt, tok, plan.ckpt_path)
            if not plan.weights_only:
                check_same_data(ckpt, getattr(data, "split_record", None), plan.ckpt_path)
        # the tokenizer decides the vocabulary: the model config follows it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                                                 pad_id=tok.pad_id))
        check_model_fits_data(cfg, data)
        self.cfg = cfg

        from models import Transformer, count_params
        from train.evaluation.load import check_model_config, check_model_memory

        # the model is built on the meta device first (shapes only), as for inference: its size against this
        # device's memory, and a checkpoint's tensors against its config, before anything is allocated
        check_model_memory(cfg.model, self.device, training=True, where="this run's model config")
        if ckpt is not None and isinstance(ckpt.get("model"), dict):
            check_model_config(cfg.model, ckpt["model"], plan.ckpt_path)
        if self._device_warmup is not None:
            self._device_warmup.join()
        self.model = Transformer(cfg.model).to(self.device)  # the un-compiled module: checkpoints hold this
        self.params = count_params(self.model)
        self.loss_module = SummedCrossEntropy(self.model, tok.pad_id, cfg.optim.label_smoothing)
        # flat parameter groups first: DDP and compile must see the parameters' final storage
        self.optimizer, self.flat = build_optimizer(self.model, cfg.optim, self.device)
        self.ema = None  # optim.ema_decay's weight average (train/ema.py), started at the first step
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
        self.compiled = compiles(run, self.device.type)
        self.compile_caches = {}
        self.mega_cache = None
        # the whole step as one CUDA graph where it applies (train/graph_step.py); its reason is recorded
        self.step_plan = plan_step_graph(cfg, self.device.type, distributed=self.dist.distributed)
        self.step_graph: StepGraph | None = None  # built at the first step, after any checkpoint's state loaded
        if self.step_plan.on:
            step_module = NormalisedLoss(step_module)
        if self.compiled:
            self.compile_caches = configure_caches(run.cache_dir)
            from train.compile_cache import mega_cache

            # Inductor's mega-cache (train/compile_cache.py): last run's artifacts into the caches before compiling
            self.mega_cache = mega_cache(cfg, self.device, log=self.log)
            self.mega_cache.load()
            self.compile_caches.update(mega=str(self.mega_cache.path), mega_state=self.mega_cache.state)
            # compiled regions run inside the step's own graph: no CUDA-graph trees within it
            mode = "default" if self.step_plan.capture else run.compile_mode
            step_module = compile_for_training(step_module, self.loss_module, scope=run.compile_scope,
                                               backend=run.compile_backend, mode=mode,
                                               dynamic=run.compile_dynamic)
        self.step_module = step_module

        self.steps_per_epoch = self._steps_in_epoch(0)
        # token buckets are re-cut every epoch, so batch counts differ a little: plan each epoch
        planned = sum(self._steps_in_epoch(e) for e in range(run.epochs))
        self.total_steps = min(planned, run.max_steps) if run.max_steps is not None else planned
        # the schedule, built once: planned afresh from the checkpoint's step when its settings or the run's
        # length changed (_load_state), else built here (a resume then loads the saved schedule's state into it)
        self._replan = schedule_replanned(ckpt, changes, self.total_steps, weights_only=plan.weights_only)
        self.scheduler = None if self._replan else build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.amp_dtype = _amp_dtype(run.precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=run.precision == "fp16")
        # autocast is built once and re-entered every step
        self.autocast = torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                                       enabled=self.amp_dtype is not None)
        # our Triton kernels at this run's batch shape compiled in worker processes during the rest of setup
        # (kernels.warm_compile; CUDA only): the first step loads them from Triton's cache (waited for there)
        self.kernel_warm = self._warm_kernels() if self.device.type == "cuda" else None

        # position and counters (all saved in checkpoints)
        self.epoch = 0  # current epoch (0-based)
        self.batch_index = 0  # micro-batches of this epoch already consumed
        self.step = 0  # optimizer steps taken (a step the guard skipped on the device counts too)
        self.counters = StepCounters(self.device)
        self.stats = EpochStats.new(self.device)
        self.clock = BleuClock(cfg.eval.bleu_thresholds, cfg.eval.patience)
        self.split = WallSplit()  # setup / compile / eval / checkpoint seconds of the run
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.history: list[dict[str, Any]] = []
        self.first_step_seconds: float | None = None  # this process's first step: compile + CUDA-graph capture
        self._pending_rng = None
        self._stop_signal: str | None = None
        self._stop_announced = False
        self.run_id, self.parent = plan.run_id, plan.parent
        best_value, schedule = None, None
        if ckpt is not None and plan.weights_only:
            self.model.load_state_dict(ckpt["model"])  # weights only: fresh optimizer, schedule and position
        elif ckpt is not None:
            try:  # a state that does not load (a damaged or forged checkpoint): one line, before any write
                best_value, schedule = self._load_state(ckpt)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
                if isinstance(e, UserError):
                    raise
                raise CheckpointMismatchError(
                    f"resuming from {plan.ckpt_path}: its training state does not load ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}): a damaged or forged checkpoint; nothing was changed. Resume "
                    f"from another checkpoint, or start a new run from its weights: --init-from {plan.ckpt_path}"
                ) from None
        if self.is_main:
            self._open_run_folder(plan, changes, schedule)
        # written in the background (train/runs/snapshot.py): the loop pays for a copy to (pinned) CPU memory
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", run.keep_last,
                                       mode="max" if cfg.eval.best_metric == "bleu" else "min", run_id=self.run_id,
                                       background=True, pin=self.device.type == "cuda")
        self.ckpts.best_value = best_value

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
        if not self.model.training:  # (a walk over every module: only after an evaluation)
            self.model.train()
        t_first = time.perf_counter() if self.first_step_seconds is None else None
        if self.kernel_warm is not None:  # the pool's kernels in Triton's cache before their first launch
            warm, self.kernel_warm = self.kernel_warm.wait(), None
            if warm["kernels"]:
                self.log(f"kernels: {warm['kernels']} compiled in a pool during setup ({warm['failed']} failed: they "
                         f"compile at their launch), {warm['seconds']:.1f} s")
        if self.step_plan.on:
            loss = self._graph_step(batches)
        else:
            loss = self._eager_step(batches)
        self.ema = ema.after_step(self.ema, self.model, self.cfg.optim.ema_decay)
        self.step += 1
        if t_first is not None:  # once per process: a sync to time compilation and capture honestly
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_seconds = time.perf_counter() - t_first
            if self.compiled:
                if self.mega_cache is not None and self.is_main:  # what this step compiled, for the next process
                    self.mega_cache.save()
                self.split.add("compile", time.perf_counter() - t_first)
        return loss

    def _warm_kernels(self):
        """``kernels.warm_compile`` of one forward and backward of the first training batch (compiled regions run
        eagerly, gradients through ``autograd.grad``: no parameter's ``.grad`` is touched). A failure costs nothing
        but the warm start: the kernels then compile at their first launch, as without it."""
        import kernels
        from models.decoding import eager_compiled_regions

        try:
            loader = self.data.loader("train", epoch=0, rank=self.dist.rank, world_size=self.dist.world_size,
                                      start_batch=0)
            b = next(iter(loader)).to(self.device)
            params = [p for p in self.model.parameters() if p.requires_grad]

            def step():
                with eager_compiled_regions(), self.autocast:
                    loss = self.loss_module(b.tgt_out, **b.model_inputs(static_max_len=True))
                torch.autograd.grad(loss.float(), params, allow_unused=True)

            return kernels.warm_compile(step)
        except Exception as e:  # noqa: BLE001 - only the warm start is lost
            self.log(f"kernels: no warm compile ({type(e).__name__}: {' '.join(str(e).split())[:200]}); they compile "
                     f"at their first launch")
            return None

    def _graph_step(self, batches) -> torch.Tensor:
        """The static-buffer step (train/graph_step.py): one replay per step on CUDA after its capture."""
        if self.step_graph is None:
            run = self.cfg.run
            update = dict(backend=run.compile_backend, dynamic=False) if self.compiled else None
            self.step_graph = StepGraph(self.step_module, self.optimizer, self.flat, self.counters,
                                        name=self.cfg.optim.name, device=self.device, autocast=self.autocast,
                                        grad_clip=self.cfg.optim.grad_clip, guard=run.nonfinite_guard,
                                        capture=self.step_plan.capture, compile_update=update)
        for batch in batches:
            self._see_shape(batch)
        if self.ckpts.staging:  # a checkpoint still copying the weights and moments: this step's update changes them
            self.checkpoint_waited(self.ckpts.wait_staged())
        try:
            loss = self.step_graph(list(batches))
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(out_of_memory_advice(self.cfg)) from e
        if self.step + 1 < self.total_steps:
            self.scheduler.step()
        return loss

    def _eager_step(self, batches) -> torch.Tensor:
        try:
            loss = forward_backward(self.step_module, batches, device=self.device, autocast=self.autocast,
                                    scaler=self.scaler, ddp=self.ddp, on_batch=self._see_shape)
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(out_of_memory_advice(self.cfg)) from e
        if self.ckpts.staging:  # a checkpoint still copying the weights and moments: they change next
            self.checkpoint_waited(self.ckpts.wait_staged())
        optimizer_step(self.optimizer, self.flat, self.scheduler, self.scaler, self.counters, loss,
                       grad_clip=self.cfg.optim.grad_clip, guard=self.cfg.run.nonfinite_guard,
                       step_scheduler=self.step + 1 < self.total_steps)
        return loss

    def compile_seconds(self) -> float:
        """This process's compilation seconds: every graph dynamo compiled (forward and backward, recompiles for
        new shapes included: torch's own count), else the first step, plus the mega-cache's load and saves."""
        from train.compile import compile_seconds

        mega = self.mega_cache
        own = compile_seconds()
        return (own if own is not None else self.first_step_seconds or 0.0) + (
            mega.load_seconds + mega.save_seconds if mega is not None else 0.0)

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
        (a preemption drill: the run resumes exactly from it). Returns a summary dict (train/runs/report.py
        prints it for people).
        """
        self._stop_signal, self._stop_announced = None, False

        def request_stop(name: str) -> None:  # a signal handler
            if self._stop_signal is not None:  # already stopping (e.g. SIGTERM to the group, then again)
                return
            self._stop_signal = name
            # say it now, but not through print on a real stdout: a print the signal interrupted would be
            # re-entered ("reentrant call" RuntimeError); os.write bypasses the buffer. A custom log (or a
            # captured stdout) gets the line from the loop (`_signalled`), or here if stdout has no file.
            if self.log is print:
                self._stop_announced = True
                try:
                    os.write(sys.stdout.fileno(), self._stop_message(name).encode() + b"\n")
                except (OSError, ValueError, AttributeError):  # captured or closed stdout
                    print(self._stop_message(name))

        if self.threads is not None:  # the decoding loops poll it too, while this run trains (close() removes it)
            cpu_threads.install(self.threads)
        try:
            with stop_on_signals(request_stop):
                return self._fit(stop_after)
        finally:
            self.close()

    def _fit(self, stop_after: int | None) -> dict[str, Any]:
        run = self.cfg.run
        loaded = self.mega_cache.load_seconds if self.mega_cache is not None else 0.0
        self.split.add("setup", process_seconds() - loaded)  # this process, from its start to here
        self.split.add("compile", loaded)  # (the mega-cache's load: compilation's, not setup's)
        self._write_provenance()
        steps_this_call = 0
        stop_reason, path = None, None
        while self.epoch < run.epochs and stop_reason is None:
            epoch = self.epoch
            n_micro = self._micro_batches_in_epoch(epoch)
            loader = self.data.loader("train", epoch=epoch, rank=self.dist.rank,
                                      world_size=self.dist.world_size, start_batch=min(self.batch_index, n_micro))
            it = iter(loader)
            if self._pending_rng is not None:  # dropout's RNG as saved (the loader has its own generator)
                set_rng_state(self._pending_rng)
                self._pending_rng = None
            self.stats.t0 = time.perf_counter()
            bar = self._bar = self._progress(epoch, n_micro)
            t_log, tok_log = time.perf_counter(), self.stats.real_tokens
            group: list = []
            for batch in it if self.batch_index < n_micro else ():
                if self.batch_index + len(group) >= n_micro:  # run.max_batches_per_epoch reached
                    break
                group.append(batch)
                if len(group) < self.cfg.optim.accum_steps and self.batch_index + len(group) < n_micro:
                    continue
                host0 = time.thread_time()  # the training thread's CPU time: what the host pays for a step
                loss = self.train_step(group)
                self.stats.host_seconds += time.thread_time() - host0
                self.stats.steps += 1
                self.batch_index += len(group)
                steps_this_call += 1
                self.stats.add(loss, group)
                group = []
                if self.threads is not None:
                    self.threads.poll()
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
            self._bar = None
            del it, loader
            if stop_reason == "nonfinite_unguarded":
                # without the guard the bad steps were applied: saving now would make `--resume auto`
                # continue from corrupted weights
                raise NonFiniteLossError(
                    f"non-finite loss read at step {self.step} with run.nonfinite_guard off, so non-finite steps "
                    f"were not skipped and the weights may be corrupted; nothing was saved. "
                    + self._resume_hint(self.newest_finite_checkpoint() if self.is_main else None)
                    + " and --run.nonfinite_guard true")
            epoch_done = self.batch_index >= n_micro
            before = self.ckpts.own_checkpoints()[-1:] if self.is_main and stop_reason == "nonfinite" else []
            if epoch_done or stop_reason == "wall_budget":
                path = self.end_epoch(epoch, partial=not epoch_done)
                if stop_reason is None and self.clock.should_stop():
                    stop_reason = "early_stop"
                    self.log(f"early stop: no new best BLEU in {self.cfg.eval.patience} evaluations "
                             f"(best {self.clock.best:.2f})")
                if stop_reason is None and self._agreed_stop(at_epoch_end=True)[1]:  # the epoch's checkpoint is
                    self._signalled()                                                  # the stop
                    stop_reason = "interrupted"
            else:
                path = self.save(metric=None)  # mid-epoch: the position lets a resume continue exactly
            if stop_reason == "nonfinite":
                raise NonFiniteLossError(
                    f"{int(self.counters.nonfinite_in_row)} non-finite losses in a row (limit run.max_nonfinite="
                    f"{run.max_nonfinite}) at step {self.step}; they were skipped, and the weights (finite) saved "
                    f"to {path}" + (f"; the checkpoint before these steps is {before[0]}" if before else "")
                    + ". Lower --optim.lr, keep --optim.grad_clip, or use --run.precision bf16/fp32")
            if stop_reason == "interrupted":  # a stop signal: the checkpoint on disk before the process ends
                self.wait_for_checkpoints()
            if stop_reason is not None:
                self.log(f"stopped ({stop_reason}) {where_stopped(self.position())}; checkpoint {path}")
        return self._summary(stop_reason, path)

    def _summary(self, stop_reason: str | None, path: Path | None) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "run_dir": str(self.run_dir), "run_id": self.run_id, "stop_reason": stop_reason or "done",
            "signal": self._stop_signal, "steps": self.step, "skipped_steps": self.skipped_steps,
            "position": self.position(),  # one truth for the stop line, this summary and the resume line
            "epochs_done": self.epoch, "checkpoint": str(path) if path else None, "best_bleu": self.clock.best,
            "best_bleu_at": self.clock.best_at, "time_to_bleu": self.clock.reached, "test": None, "curves": None,
            # CUDA-graph decoding that fell back to eager (the epoch records say when and why)
            "decode_fallbacks": sum(r.get("decode_fallbacks") or 0 for r in self.history)}
        finished = stop_reason in (None, "max_steps", "wall_budget", "early_stop")
        if finished and self.is_main:
            self.finish(stop_reason, summary)  # (waits for the last checkpoint's write after the final test)
        self.wait_for_checkpoints()
        summary.update(self.checkpoint_summary())
        if self.mega_cache is not None and self.is_main:  # anything compiled after the first step too
            self.mega_cache.save()
        summary["compile_s"] = self.compile_seconds() if self.compiled else None
        summary["compile_cache"] = self.mega_cache.state if self.mega_cache is not None else None
        wall = self.clock.wall()
        summary.setdefault("wall_seconds", wall)
        summary.setdefault("time_split", self.split.split(wall))
        summary["time_to_bleu_lines"] = self.clock.summary_lines()
        summary["cpu_threads"] = self.threads.summary() if self.threads is not None else None
        if self.is_main:
            reason = summary["stop_reason"]
            summary["commands"] = next_commands(self.run_dir, stop_reason=reason,
                                                longer=longer_flag(reason, self.cfg, self.step),
                                                world_size=self.dist.world_size)
        barrier()
        return summary

    def _log_step(self, loss: torch.Tensor, bar, t_log: float, tok_log: int) -> str | None:
        """A logging step: read the loss and the counters (the host sync of the loop), report, decide."""
        now = time.perf_counter()
        c = self.counters  # one host sync every log_every steps: the loss and the device-side counters together
        loss_value, in_row, skipped = torch.stack([loss.detach().float().reshape(()), c.nonfinite_in_row,
                                                   c.skipped]).tolist()
        lr = self.scheduler.get_last_lr()[0]
        tps = (self.stats.real_tokens - tok_log) / max(now - t_log, 1e-9)
        pad = 1 - self.stats.real_tokens / max(self.stats.padded_tokens, 1)
        if bar is not None:
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", pad=f"{100 * pad:.1f}%")
        if self.metrics is not None:
            self.metrics.scalars({"loss": loss_value, "lr": lr, "tokens_per_second": tps, "padding_fraction": pad,
                                  "skipped_steps": skipped}, self.step, prefix="train/")
        guarded = self.cfg.run.nonfinite_guard or self.scaler.is_enabled()
        if not math.isfinite(loss_value) and not guarded:
            return "nonfinite_unguarded"
        if in_row >= self.cfg.run.max_nonfinite:
            return "nonfinite"
        return None


def _warm_device(device: torch.device) -> threading.Thread | None:
    """On CUDA, a thread that makes the device's context (the driver's start, the first allocation) while the
    main thread builds the data; None elsewhere. An error there is left to the main thread's first CUDA call,
    which meets and reports the same one."""
    if device.type != "cuda":
        return None

    def warm() -> None:
        try:
            torch.cuda.init()
            torch.empty(1, device=device)
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - reported by the main thread's own first use
            pass

    thread = threading.Thread(target=warm, name="fastmt-cuda-init", daemon=True)
    thread.start()
    return thread


def _thread_adapter(cfg: Config, device: torch.device, log) -> cpu_threads.ThreadAdapter | None:
    """The CPU run's thread adapter (train/cpu_threads.py; `fit` installs it for the decoding loops too); None on a GPU,
    with ``run.cpu_adapt false``, on one core, or where /proc cannot be read."""
    if device.type != "cpu" or not cfg.run.cpu_adapt or torch.get_num_threads() < 2:
        return None
    adapter = cpu_threads.ThreadAdapter(torch.get_num_threads(), log=log, since=cpu_threads.AT_IMPORT)
    return adapter if adapter.works else None


def _configure_backend(cfg: Config, device: torch.device) -> None:
    run = cfg.run
    if device.type == "cpu" and run.cpu_threads is not None:  # never more threads than this machine's cores
        torch.set_num_threads(machine_capped("run.cpu_threads", run.cpu_threads, print))
    if device.type == "cuda" and run.precision != "fp32":
        # fp32 matmuls left outside autocast may use TF32; the fp32 baseline keeps full precision
        torch.set_float32_matmul_precision("high")
    if run.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("run.precision='bf16' but this GPU has no bf16: use --run.precision fp16 (or fp32)")
