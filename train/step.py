"""One optimizer step, without a host sync: ``forward_backward`` then ``optimizer_step``.

``forward_backward``: per micro-batch a non-blocking copy to the device, the (compiled) loss module under
autocast, the summed cross-entropy divided by the real target tokens of the whole step (k micro-batches
give the gradient of one big batch), ``scaler.scale(loss).backward()``; DDP all-reduces on the last
micro-batch only. Under DDP each rank normalises by its own token count and DDP averages (an all-reduce
of the counts would cost a sync per step; packed and token-bucket batches make the counts near-equal).

``optimizer_step``: gather the gradients into the flat buffers (one multi-tensor copy per group), unscale
(fp16), clip by the global norm, decide "finite?" on the device (loss and gradient norm), let the
optimizer skip on the device through ``found_inf`` (fp16: also the GradScaler's flag from ``unscale_``),
update the scaler, step the schedule, drop the gradients. The skipped-step counters live on the device and are read at logging steps only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from train.optim import FlatParams


@dataclass
class StepCounters:
    """Device-side counters of the training steps (read with a sync only at logging and epoch ends)."""

    device: torch.device
    skipped: torch.Tensor = field(init=False)  # steps whose update was skipped (non-finite), in total
    nonfinite_in_row: torch.Tensor = field(init=False)  # non-finite steps since the last finite one

    def __post_init__(self):
        self.skipped = torch.zeros((), dtype=torch.float32, device=self.device)
        self.nonfinite_in_row = torch.zeros((), dtype=torch.float32, device=self.device)

    def record(self, found_inf: torch.Tensor) -> None:
        self.skipped += found_inf
        self.nonfinite_in_row.add_(found_inf).mul_(found_inf)  # +1 on a skip, back to 0 on a finite step

    def state_dict(self) -> dict[str, float]:
        return {"skipped": float(self.skipped), "nonfinite_in_row": float(self.nonfinite_in_row)}  # host sync

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.skipped.fill_(state.get("skipped", 0.0))
        self.nonfinite_in_row.fill_(state.get("nonfinite_in_row", 0.0))


def forward_backward(step_module, batches, *, device: torch.device, autocast, scaler, ddp=None,
                     on_batch=None) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches; returns the step's mean loss per real
    target token as a 0-d device tensor (no sync). ``on_batch(device_batch)``: a host-side hook."""
    n_tgt = sum(b.num_target_tokens for b in batches)  # python ints from the collate: no sync
    if device.type == "cuda":  # a new iteration for CUDA-graph trees (compiled regions run many times per step)
        torch.compiler.cudagraph_mark_step_begin()
    total = None  # one micro-batch (the usual step): its loss, no accumulator ops
    for i, cpu_batch in enumerate(batches):
        b = cpu_batch.to(device, non_blocking=True)  # pinned memory -> async H2D copy
        if on_batch is not None:
            on_batch(b)
        last = i == len(batches) - 1
        sync = ddp.no_sync() if (ddp is not None and not last) else contextlib.nullcontext()
        with sync:
            with autocast:
                loss_sum = step_module(b.tgt_out, **b.model_inputs(static_max_len=True))
            loss = loss_sum / max(n_tgt, 1)
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total if total is not None else torch.zeros((), device=device)


def optimizer_step(optimizer, flat: FlatParams, scheduler, scaler, counters: StepCounters, loss: torch.Tensor, *,
                   grad_clip: float | None, guard: bool, step_scheduler: bool = True) -> torch.Tensor | None:
    """Apply one update from the gradients held by the parameters; returns the global grad norm (device)."""
    flat.gather_grads()
    scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see unscaled grads
    grads = flat.grads()
    grad_norm = None
    if grad_clip is not None or guard:
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # one norm kernel per step
    if grad_clip is not None:
        coef = (grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    found_inf = None
    if scaler.is_enabled():  # unscale_ above recorded the scaler's inf/NaN check, on the device
        found_inf = _scaler_found_inf(scaler, optimizer, loss)
    if guard:
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
        found_inf = bad if found_inf is None else torch.maximum(found_inf, bad)
    if found_inf is not None:
        optimizer.found_inf = found_inf  # fused AdamW/Adam and kernels.Lion skip the update on the device
    try:
        optimizer.step()
    finally:
        if found_inf is not None:
            del optimizer.found_inf
    if scaler.is_enabled():
        scaler.update()  # backs the scale off after a skipped step, grows it after enough good ones
    if found_inf is not None:
        counters.record(found_inf)
    if step_scheduler:
        scheduler.step()
    flat.zero_grad()
    return grad_norm


def out_of_memory_advice(cfg) -> str:
    """The message of a training step that ran out of memory: a smaller token budget with more accumulation
    (the same effective batch), or activation checkpointing, which CUDA-graph modes cannot run
    (``train.config.Config`` refuses the pair): with those the advice also names a mode without graphs."""
    from train.config import uses_cuda_graphs

    d, accum = cfg.data, cfg.optim.accum_steps
    msg = (f"out of memory with data.max_tokens={d.max_tokens} (batching={d.batching}, batch_size={d.batch_size}): "
           f"use a smaller token budget, e.g. --data.max_tokens {max(d.max_tokens // 2, 1)}, with --optim.accum_steps "
           f"{2 * accum} to keep the effective batch")
    if cfg.model.checkpointing:
        return msg
    if cfg.run.compile is not False and uses_cuda_graphs(cfg.run):
        return (msg + f", or --model.checkpointing true --run.compile_mode default (activation checkpointing cannot "
                f"run under CUDA graphs, run.compile_mode={cfg.run.compile_mode!r}: pytorch#154306)")
    return msg + ", or --model.checkpointing true"


def _scaler_found_inf(scaler, optimizer, loss: torch.Tensor) -> torch.Tensor:
    """The GradScaler's inf/NaN flag from ``unscale_``, as a 0-d device float (per-device flags summed;
    no sync). Read here rather than through ``scaler.step``, which syncs for optimizers without AMP hooks."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    flags = list(state["found_inf_per_device"].values()) if state else []
    if not flags:
        return (~torch.isfinite(loss)).float()
    return (sum(f.to(loss.device, non_blocking=True) for f in flags) > 0).float()


@dataclass
class EpochStats:
    """What one epoch accumulates; the loss sums stay on the device until the epoch ends."""

    loss_sum: torch.Tensor  # float64 sum of (step loss x its target tokens)
    last_loss: torch.Tensor | None = None  # the last step's loss (device)
    tgt_tokens: int = 0
    src_tokens: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    micro_batches: int = 0
    sentences: int = 0
    seconds: float = 0.0  # training seconds before the current stretch (resume)
    steps: int = 0  # optimizer steps this epoch
    host_seconds: float = 0.0  # CPU time of the training thread inside those steps (the host's cost of a step)
    t0: float = 0.0  # perf_counter at the start of the current stretch

    @classmethod
    def new(cls, device: torch.device) -> EpochStats:
        return cls(loss_sum=torch.zeros((), dtype=torch.float64, device=device), t0=time.perf_counter())

    def add(self, loss: torch.Tensor, batches: Sequence) -> None:
        n_tgt = sum(b.num_target_tokens for b in batches)
        self.loss_sum += loss.detach().double() * n_tgt  # device-side: no sync
        self.last_loss = loss.detach()
        self.tgt_tokens += n_tgt
        real = sum(b.num_real_tokens for b in batches)
        self.real_tokens += real
        self.src_tokens += real - n_tgt
        self.padded_tokens += sum(b.num_padded_tokens for b in batches)
        self.micro_batches += len(batches)
        self.sentences += sum(len(b) for b in batches)

    def elapsed(self) -> float:
        return self.seconds + (time.perf_counter() - self.t0)

    def state_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("t0", "last_loss")}
        d["loss_sum"] = self.loss_sum.detach().cpu()
        d["seconds"] = self.elapsed()
        return d

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> EpochStats:
        s = cls.new(device)
        for k, v in state.items():
            if k in ("t0", "last_loss") or not hasattr(s, k):
                continue
            setattr(s, k, v.to(device) if isinstance(v, torch.Tensor) else v)
        s.t0 = time.perf_counter()
        return s
