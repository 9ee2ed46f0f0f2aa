"""The training loop: ``Trainer(cfg).fit()``, and ``Trainer.train_step(batch)`` for the benchmark ladder.

One optimizer step (``train_step``), in order:
  1. count the real target tokens of the micro-batches on the host (CPU tensors: no device sync);
  2. per micro-batch: non-blocking copy to the device, forward under the autocast context built once
     in ``__init__``, summed label-smoothed cross-entropy / total target tokens of the step (so k
     micro-batches give the gradient of one big batch), ``scaler.scale(loss).backward()``; DDP
     all-reduces only on the last micro-batch (``no_sync`` before). Under DDP each rank normalises
     by its own token count and DDP averages, i.e. a mean of per-rank token means (an all-reduce of
     the counts would cost a sync per step; the token-bucket batches make the counts near-equal);
  3. fp16: ``scaler.unscale_``; clip the global grad norm (after unscale);
  4. non-finite guard, then ``optimizer.step()``; the scheduler steps only if the optimizer did;
  5. ``zero_grad(set_to_none=True)``.

Host syncs (the only places the CPU waits for the device):
  - fp16: ``GradScaler.step`` reads its inf flag, and we read the scale (one per step, inherent);
  - bf16/fp32 with ``run.nonfinite_guard``: one bool per step (turn the guard off for benchmarks: a
    NaN is then caught at the next log read-back and the run stops);
  - the running loss, every ``run.log_every`` steps, and once at the end of an epoch;
  - evaluation (validation loss, beam search) and checkpointing, once per epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.checkpoint import CheckpointManager, latest_checkpoint, load_checkpoint, rng_state, set_rng_state
from train.config import Config
from train.distributed import DistInfo, barrier, init_distributed
from train.loss import SummedCrossEntropy
from train.metrics import MetricsLogger, plot_curves, provenance
from train.optim import build_optimizer, build_scheduler

H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM dense bf16 tensor-core peak (FLOP/s), the MFU denominator


class NonFiniteLossError(RuntimeError):
    pass


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
        run = cfg.run
        if self.device.type == "cpu" and run.cpu_threads is not None:
            torch.set_num_threads(run.cpu_threads)
        if self.device.type == "cuda" and run.precision != "fp32":
            # fp32 matmuls left outside autocast may use TF32; the fp32 baseline keeps full precision
            torch.set_float32_matmul_precision("high")

        if run.precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU has no bf16; use --run.precision fp16")

        resume_path = self._resolve_resume(cfg, resume)
        ckpt = load_checkpoint(resume_path) if resume_path is not None else None

        torch.manual_seed(run.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        if data is None:
            from data import build_data

            data = build_data(cfg.data, log=self.log)
        self.data = data
        tok = data.tokenizer
        if ckpt is not None:
            _check_tokenizer(ckpt, tok, resume_path)
        # the tokenizer decides the vocabulary: the model config follows it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size,
                                                                 pad_id=tok.pad_id))
        self.cfg = cfg

        from models import Transformer, count_params

        self.model = Transformer(cfg.model).to(self.device)  # the un-compiled module: checkpoints hold this
        self.params = count_params(self.model)
        self.loss_module = SummedCrossEntropy(self.model, tok.pad_id, cfg.optim.label_smoothing)
        self.ddp = None
        step_module: nn.Module = self.loss_module
        if self.dist.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = step_module = DDP(self.loss_module, device_ids=ids)
        self.compiled = run.compile if run.compile is not None else self.device.type == "cuda"
        if self.compiled:
            step_module = torch.compile(step_module, backend=run.compile_backend,
                                        mode=None if run.compile_mode == "default" else run.compile_mode,
                                        dynamic=run.compile_dynamic)
        self.step_module = step_module

        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
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
        self.step = 0  # optimizer steps taken (skipped steps excluded)
        self.skipped_steps = 0  # steps skipped for a non-finite loss or by the fp16 scaler
        self.nonfinite_in_row = 0
        self._epoch_acc = self._new_epoch_acc()
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.history: list[dict[str, Any]] = []

        self.run_dir = Path(run.out_dir) / run.name
        if ckpt is None and self.is_main:
            _move_aside_previous_run(self.run_dir, self.log)
        self.ckpts = CheckpointManager(self.run_dir / "checkpoints", run.keep_last,
                                       mode="max" if run.best_metric == "bleu" else "min")
        self.metrics = MetricsLogger(self.run_dir, tensorboard=run.tensorboard, enabled=self.is_main)
        self._pending_rng = None
        self._stop_requested = False
        if ckpt is not None:
            _warn_config_changes(ckpt["config"], cfg.to_dict(), self.log)
            self._load_state(ckpt)
            self.log(f"resumed from {resume_path}: epoch {self.epoch}, batch {self.batch_index}, step {self.step}")

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------
    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step over one Batch or a sequence of micro-batches (gradient accumulation).

        Returns the step's mean label-smoothed loss per real target token as a 0-d device tensor
        (no host sync here unless fp16 or the non-finite guard needs one, see the module docstring).
        """
        if not isinstance(batches, Sequence):
            batches = [batches]
        n_tgt = sum(b.num_target_tokens for b in batches)  # python ints from the collate: no sync
        self.model.train()
        total = torch.zeros((), device=self.device)
        try:
            for i, cpu_batch in enumerate(batches):
                b = cpu_batch.to(self.device, non_blocking=True)  # pinned memory -> async H2D copy
                self.shapes_seen.add((b.src.shape[0], b.src.shape[1], b.tgt_in.shape[1]))
                last = i == len(batches) - 1
                sync = self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
                with sync:
                    with self.autocast:
                        loss_sum = self.step_module(b.tgt_out, **b.model_inputs(static_max_len=self.compiled))
                    loss = loss_sum / n_tgt
                    self.scaler.scale(loss).backward()
                total += loss.detach()
        except torch.OutOfMemoryError as e:
            raise torch.OutOfMemoryError(
                f"out of memory with data.max_tokens={self.cfg.data.max_tokens} (batching={self.cfg.data.batching}, "
                f"batch_size={self.cfg.data.batch_size}): use a smaller token budget, e.g. --data.max_tokens "
                f"{self.cfg.data.max_tokens // 2}, with --optim.accum_steps {2 * self.cfg.optim.accum_steps} to keep "
                f"the effective batch, or --model.checkpointing true"
            ) from e

        self.scaler.unscale_(self.optimizer)  # no-op unless fp16; clipping must see unscaled grads
        grad_norm = None
        if self.cfg.optim.grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip, foreach=True)

        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()  # host sync (fp16 only)
            self.scaler.step(self.optimizer)  # skips the step when grads hold inf/NaN
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # the scale drops only after a skipped step
        elif self.cfg.run.nonfinite_guard:
            finite = torch.isfinite(total)
            if grad_norm is not None:
                finite &= torch.isfinite(grad_norm)
            stepped = bool(finite)  # host sync: one bool per step (run.nonfinite_guard)
            if stepped:
                self.optimizer.step()
        else:
            self.optimizer.step()
            stepped = True

        if stepped:
            self.step += 1
            # only after a real optimizer step (seeds: skipped with the scaler), and not past the plan:
            # OneCycle extrapolates (a negative lr) and then raises beyond total_steps
            if self.step < self.total_steps:
                self.scheduler.step()
            self.nonfinite_in_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._last_grad_norm = grad_norm
        return total

    # ------------------------------------------------------------------------------------------
    # the epoch loop
    # ------------------------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train for ``run.epochs`` (or ``run.max_steps``); evaluate and checkpoint every epoch.

        ``stop_after``: interrupt after this many optimizer steps *in this call*, writing a checkpoint
        (a preemption drill: the run resumes exactly from it). Returns a summary dict.
        """
        previous_handler = self._install_sigint()
        try:
            return self._fit(stop_after)
        finally:
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)

    def _fit(self, stop_after: int | None) -> dict[str, Any]:
        run, accum = self.cfg.run, self.cfg.optim.accum_steps
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
            if self._pending_rng is not None:  # after iter(): creating the iterator draws from the torch RNG
                set_rng_state(self._pending_rng)
                self._pending_rng = None
            acc = self._epoch_acc
            acc["t0"] = time.perf_counter()
            bar = self._progress(epoch, n_micro, accum)
            t_last_log, tok_last_log = time.perf_counter(), acc["real_tokens"]
            group: list = []
            for batch in it:
                if self.batch_index + len(group) >= n_micro:  # run.max_batches_per_epoch reached
                    break
                group.append(batch)
                if len(group) < accum and self.batch_index + len(group) < n_micro:
                    continue
                n_tgt = sum(b.num_target_tokens for b in group)
                loss = self.train_step(group)
                self.batch_index += len(group)
                steps_this_call += 1
                acc["loss_sum"] += loss.detach().double() * n_tgt  # device-side: no sync
                acc["last_loss"] = loss.detach()
                acc["tgt_tokens"] += n_tgt
                acc["real_tokens"] += sum(b.num_real_tokens for b in group)
                acc["padded_tokens"] += sum(b.num_padded_tokens for b in group)
                acc["src_tokens"] += sum(b.num_real_tokens for b in group) - n_tgt
                acc["micro_batches"] += len(group)
                acc["sentences"] += sum(len(b) for b in group)
                group = []

                if self.step % run.log_every == 0 or self.nonfinite_in_row:
                    now = time.perf_counter()
                    loss_value = float(loss)  # host sync: every log_every steps
                    lr = self.scheduler.get_last_lr()[0]
                    tps = (acc["real_tokens"] - tok_last_log) / max(now - t_last_log, 1e-9)
                    t_last_log, tok_last_log = now, acc["real_tokens"]
                    pad = 1 - acc["real_tokens"] / max(acc["padded_tokens"], 1)
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}",
                                        pad=f"{100 * pad:.1f}%")
                    self.metrics.scalars({"loss": loss_value, "lr": lr, "tokens_per_second": tps,
                                          "padding_fraction": pad}, self.step, prefix="train/")
                    if not math.isfinite(loss_value) and not self.cfg.run.nonfinite_guard and not self.scaler.is_enabled():
                        stop_reason = "nonfinite"
                if bar is not None:
                    bar.update(1)
                if self.nonfinite_in_row >= run.max_nonfinite:
                    stop_reason = "nonfinite"
                if run.max_steps is not None and self.step >= run.max_steps:
                    stop_reason = stop_reason or "max_steps"
                if (stop_after is not None and steps_this_call >= stop_after) or self._stop_requested:
                    stop_reason = stop_reason or "interrupted"
                if stop_reason is not None:
                    break
            if bar is not None:
                bar.close()
            del it, loader

            unguarded_nonfinite = (stop_reason == "nonfinite" and not self.cfg.run.nonfinite_guard
                                   and not self.scaler.is_enabled())
            if unguarded_nonfinite:
                # without the per-step guard the bad steps were applied: saving now would make
                # `--resume auto` continue from corrupted weights
                last_good = latest_checkpoint(self.run_dir / "checkpoints")
                raise NonFiniteLossError(
                    f"non-finite loss read at step {self.step} with run.nonfinite_guard off, so non-finite steps "
                    f"were not skipped and the weights may be corrupted; nothing was saved. Resume from the last "
                    f"good checkpoint ({last_good or 'none yet'}) with --run.nonfinite_guard true, or lower --optim.lr"
                )
            if self.batch_index >= n_micro:
                path = self._end_epoch(epoch)
            else:
                path = self._save(metric=None)  # mid-epoch: the position lets a resume continue exactly
            if stop_reason is not None:
                if stop_reason == "nonfinite":
                    raise NonFiniteLossError(
                        f"{self.nonfinite_in_row} non-finite losses in a row (limit run.max_nonfinite="
                        f"{run.max_nonfinite}) at step {self.step}; state saved to {path}. Lower --optim.lr, "
                        f"keep --optim.grad_clip, or use --run.precision bf16/fp32"
                    )
                self.log(f"stopped ({stop_reason}) in epoch {epoch + 1}, after batch {self.batch_index}/{n_micro}, "
                         f"step {self.step}; checkpoint {path}")
        summary: dict[str, Any] = {"steps": self.step, "skipped_steps": self.skipped_steps,
                                   "epochs_done": self.epoch, "wall_seconds": time.perf_counter() - t_fit,
                                   "stop_reason": stop_reason or "done"}
        if stop_reason in (None, "max_steps") and self.is_main:
            if run.test_at_end:
                summary["test"] = self._final_test()
            if run.plot and self.metrics.path.exists():
                png = plot_curves(self.metrics.path, self.run_dir / "curves.png")
                if png:
                    self.log(f"curves: {png}")
        barrier()
        self.metrics.close()
        return summary

    def _install_sigint(self):
        """First Ctrl-C: finish the current step, checkpoint, return (``--resume auto`` continues exactly).
        A second Ctrl-C interrupts at once."""
        self._stop_requested = False
        if threading.current_thread() is not threading.main_thread():
            return None

        def request_stop(signum, frame):
            self._stop_requested = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.log("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort)")

        return signal.signal(signal.SIGINT, request_stop)

    # ------------------------------------------------------------------------------------------
    # end of epoch: evaluation, metrics line, checkpoint
    # ------------------------------------------------------------------------------------------
    def _end_epoch(self, epoch: int) -> Path | None:
        run, acc = self.cfg.run, self._epoch_acc
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds = acc["seconds"] + (time.perf_counter() - acc["t0"])
        world = self.dist.world_size
        record: dict[str, Any] = {
            "kind": "epoch",
            "epoch": epoch + 1,  # 1-based in the records, as people count epochs
            "step": self.step,
            # host sync: once per epoch
            "train_loss": float(acc["loss_sum"]) / max(acc["tgt_tokens"], 1),
            "train_loss_last_batch": float(acc["last_loss"]) if acc["last_loss"] is not None else None,
            "lr": self.scheduler.get_last_lr()[0],
            "epoch_seconds": train_seconds,
            # real (non-pad) src+tgt tokens/s over all ranks (every rank runs the same number of batches)
            "tokens_per_second": acc["real_tokens"] * world / max(train_seconds, 1e-9),
            "tgt_tokens_per_second": acc["tgt_tokens"] * world / max(train_seconds, 1e-9),
            "padding_fraction": 1 - acc["real_tokens"] / max(acc["padded_tokens"], 1),
            "skipped_steps": self.skipped_steps,
            "micro_batches": acc["micro_batches"],
            "distinct_shapes": len(self.shapes_seen),
        }
        record["mfu"] = self._mfu(acc, record["tgt_tokens_per_second"])
        record["compiled_graphs"] = _compiled_graphs() if self.compiled else None
        if self.device.type == "cuda":
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            record["peak_memory_gb"] = None
            record["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux

        metric = None
        if self.is_main:
            t0 = time.perf_counter()
            record["valid_loss"] = self._split_loss("valid")
            scores = self._scores("valid")
            record["bleu"], record["chrf"] = scores["bleu"], scores["chrf"]
            record["eval_sentences"] = scores["sentences"]
            record["eval_seconds"] = time.perf_counter() - t0
            metric = record["bleu"] if run.best_metric == "bleu" else record["valid_loss"]
            self.log(
                f"epoch {epoch + 1}/{run.epochs}: train_loss {record['train_loss']:.4f} "
                f"(last batch {record['train_loss_last_batch']:.4f}) valid_loss {record['valid_loss']:.4f} "
                f"BLEU {record['bleu']:.2f} chrF {record['chrf']:.2f} | {train_seconds:.1f} s, "
                f"{record['tokens_per_second']:,.0f} tok/s, pad {100 * record['padding_fraction']:.1f}%"
                + (f", MFU {100 * record['mfu']:.1f}%" if record["mfu"] is not None else "")
            )
            for src, ref, hyp in scores["samples"][: run.num_samples]:
                self.log(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
            self.metrics.log(record)
            self.metrics.scalars({k: v for k, v in record.items() if k not in ("kind", "epoch")}, epoch + 1,
                                 prefix="epoch/")
        self.history.append(record)
        self.epoch, self.batch_index = epoch + 1, 0
        self._epoch_acc = self._new_epoch_acc()
        return self._save(metric=metric)

    def _final_test(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        test_loss = self._split_loss("test")
        scores = self._scores("test")
        rec = {"kind": "test", "epoch": self.epoch, "test_loss": test_loss, "test_bleu": scores["bleu"],
               "test_chrf": scores["chrf"], "test_sentences": scores["sentences"],
               "eval_seconds": time.perf_counter() - t0}
        self.log(f"test: loss {test_loss:.4f} BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} "
                 f"({scores['sentences']} sentences, beam {self.cfg.run.eval_beam_size})")
        self.metrics.log(rec)
        return rec

    def _split_loss(self, split: str) -> float | None:
        from train.evaluate import split_loss

        if len(self.data.splits[split]) == 0:
            return None
        return split_loss(self.model, self.data, split, self.device, self.autocast)

    def _scores(self, split: str) -> dict[str, Any]:
        from train.evaluate import bleu_chrf

        run = self.cfg.run
        if len(self.data.splits[split]) == 0:
            return {"bleu": None, "chrf": None, "sentences": 0, "samples": []}
        return bleu_chrf(self.model, self.data, split, self.device, max_sentences=run.eval_max_sentences,
                         beam_size=run.eval_beam_size, batch_size=run.eval_batch_size,
                         max_len_ratio=run.eval_max_len_a, max_len_extra=run.eval_max_len_b,
                         autocast=self.autocast)

    def _mfu(self, acc, tgt_tps: float) -> float | None:
        peak = self.cfg.run.peak_flops
        if peak is None:
            peak = H100_BF16_DENSE_FLOPS if self.device.type == "cuda" else None
        if peak is None or acc["sentences"] == 0:
            return None
        from models import flops_per_token

        # FLOPs at the epoch's mean real lengths (src incl. EOS, tgt incl. BOS)
        src_len = acc["src_tokens"] / acc["sentences"]
        tgt_len = acc["tgt_tokens"] / acc["sentences"]
        return flops_per_token(self.cfg.model, src_len, tgt_len) * tgt_tps / (peak * self.dist.world_size)

    # ------------------------------------------------------------------------------------------
    # state, checkpoints, provenance
    # ------------------------------------------------------------------------------------------
    def _new_epoch_acc(self) -> dict[str, Any]:
        return {"loss_sum": torch.zeros((), dtype=torch.float64, device=self.device), "last_loss": None,
                "tgt_tokens": 0, "src_tokens": 0, "real_tokens": 0, "padded_tokens": 0, "micro_batches": 0,
                "sentences": 0,
                "seconds": 0.0, "t0": time.perf_counter()}

    def _micro_batches_in_epoch(self, epoch: int) -> int:
        n = self.data.num_batches("train", epoch=epoch, rank=self.dist.rank, world_size=self.dist.world_size)
        if n == 0:
            raise ValueError("the training split has no batches: check --data-files and data.valid_size/test_size")
        cap = self.cfg.run.max_batches_per_epoch
        return n if cap is None else min(n, cap)

    def _steps_in_epoch(self, epoch: int) -> int:
        return math.ceil(self._micro_batches_in_epoch(epoch) / self.cfg.optim.accum_steps)

    def state_dict(self) -> dict[str, Any]:
        acc = self._epoch_acc
        epoch_acc = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in acc.items() if k != "t0"}
        epoch_acc["seconds"] = acc["seconds"] + (time.perf_counter() - acc["t0"])
        tok = self.data.tokenizer
        try:
            spm_bytes = Path(tok.model_file).read_bytes()
        except OSError:
            spm_bytes = None
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state(),
            "position": {"epoch": self.epoch, "batch_index": self.batch_index, "step": self.step,
                         "skipped_steps": self.skipped_steps, "nonfinite_in_row": self.nonfinite_in_row,
                         "epoch_acc": epoch_acc, "best_value": self.ckpts.best_value},
            "config": self.cfg.to_dict(),
            "tokenizer": {"model_file": tok.model_file, "key": tok.key, "model_bytes": spm_bytes},
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
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        pos = ckpt["position"]
        self.epoch, self.batch_index, self.step = pos["epoch"], pos["batch_index"], pos["step"]
        self.skipped_steps, self.nonfinite_in_row = pos["skipped_steps"], pos["nonfinite_in_row"]
        self.ckpts.best_value = pos.get("best_value")
        acc = self._new_epoch_acc()
        for k, v in pos["epoch_acc"].items():
            acc[k] = v.to(self.device) if isinstance(v, torch.Tensor) else v
        acc["t0"] = time.perf_counter()
        self._epoch_acc = acc
        self.history = list(ckpt.get("history", []))
        self._pending_rng = ckpt["rng"]  # restored at the start of fit(), after the loader is built

    def _save(self, metric: float | None) -> Path | None:
        if not self.is_main:
            barrier()
            return None
        path = self.ckpts.save(self.state_dict(), self.step, metric)
        barrier()
        return path

    def _resolve_resume(self, cfg: Config, resume) -> Path | None:
        if resume is None:
            return None
        if str(resume) == "auto":
            found = latest_checkpoint(Path(cfg.run.out_dir) / cfg.run.name / "checkpoints")
            if found is None:
                (print if self.is_main else _quiet)(
                    f"--resume auto: no checkpoint under {Path(cfg.run.out_dir) / cfg.run.name / 'checkpoints'}; "
                    "starting fresh")
            return found
        return Path(resume)

    def _write_provenance(self) -> None:
        if not self.is_main:
            return
        extra = {"params": self.params, "device": str(self.device), "world_size": self.dist.world_size,
                 "compiled": self.compiled, "total_steps": self.total_steps,
                 "steps_per_epoch": self.steps_per_epoch, "tokenizer": self.data.tokenizer.model_file}
        rec = provenance(self.cfg.to_dict(), getattr(self.data, "split_record", None), extra)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = "provenance.json" if self.step == 0 else f"provenance-resume-step{self.step}.json"
        (self.run_dir / name).write_text(json.dumps(rec, indent=2, default=str))
        self.log(f"provenance ({self.run_dir / name}): git {rec['git_sha']}, torch {rec['torch']}, "
                 f"triton {rec['triton']}, cuda {rec['cuda']}, gpu {rec['gpu']}, device {self.device}, "
                 f"world {self.dist.world_size}, params {self.params}, compile {self.compiled}, "
                 f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps planned")
        self.log("config: " + json.dumps(self.cfg.to_dict(), default=str))

    def _progress(self, epoch: int, n_micro: int, accum: int):
        if not (self.is_main and self.cfg.run.progress):
            return None
        from tqdm import tqdm

        return tqdm(total=math.ceil(n_micro / accum), initial=self.batch_index // accum,
                    desc=f"epoch {epoch + 1}/{self.cfg.run.epochs}", dynamic_ncols=True, leave=False)


def _move_aside_previous_run(run_dir: Path, log) -> None:
    """A fresh start never mixes with (or overwrites) an earlier run of the same name: its folder is
    renamed ``<name>.prev-<UTC time>`` first, so nothing is lost."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}")
    n = 1
    while target.exists():
        target, n = run_dir.with_name(f"{run_dir.name}.prev-{stamp}-{n}"), n + 1
    run_dir.rename(target)
    log(f"{run_dir} held an earlier run: moved to {target} (to continue a run instead, pass --resume auto)")


def _check_tokenizer(ckpt: dict[str, Any], tok, path) -> None:
    ref = ckpt.get("tokenizer") or {}
    if ref.get("key") != tok.key:
        raise ValueError(
            f"tokenizer mismatch: checkpoint {path} was trained with tokenizer key {ref.get('key')!r} "
            f"({ref.get('model_file')}), but the current data settings give key {tok.key!r} ({tok.model_file}). "
            f"Resume with the same data files and data.* settings as the checkpoint's run (its config is stored "
            f"in the checkpoint), or start a new run with a different --run.name"
        )


def _warn_config_changes(saved: dict[str, Any], now: dict[str, Any], log) -> None:
    """Resuming with different settings is allowed (e.g. a new eval beam) but never silent."""
    changed = {f"{sec}.{k}": (v, now.get(sec, {}).get(k)) for sec, fields in saved.items()
               for k, v in fields.items() if json.dumps(v, default=str) != json.dumps(now.get(sec, {}).get(k), default=str)}
    if changed:
        log("resume: config differs from the checkpoint's (saved -> now): "
            + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))


def _compiled_graphs() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a diagnostics counter, never fatal
        return None
