"""Optimizers over flat parameter groups, and the learning-rate schedules (OneCycle, inverse-sqrt, constant).

Weight decay applies to weight matrices only: biases, norm gains/biases (every parameter with
``ndim < 2``) and embedding tables (``nn.Embedding`` weights, hence a tied output projection too)
go to a group with ``weight_decay=0``.

Flat groups (``FlatParams``): each group's parameters become views into one contiguous buffer, and the
optimizer sees one tensor per group. After backward one multi-tensor copy gathers the gradients into a
flat gradient buffer; clipping, the non-finite check and the update are then a fixed number of ops per
group whatever the parameter count (the H100 profile showed one Lion launch per parameter, 155 a step).
The non-finite guard never syncs: the optimizers read a ``found_inf`` flag on the device and skip the
update there (torch's fused AdamW/Adam natively, ``kernels.lion.Lion`` likewise).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_

import torch
from torch import nn

from models.components import pick
from train.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ``decay`` (>= 2-D weights of non-embedding modules) and ``no_decay`` (the rest).

    Shared parameters (parameter sharing, tied embeddings) appear once: ``named_parameters``
    de-duplicates by identity.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    decay_names, no_decay_names = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in embedding_params:
            no_decay.append(p)
            no_decay_names.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names, "group": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names, "group": "no_decay"},
    ]


class FlatParams:
    """The model's parameters, group by group, as views into one contiguous buffer per group.

    ``flat[i]`` is group i's buffer (what the optimizer steps), ``flat[i].grad`` its gradient buffer,
    filled by ``gather_grads()`` from the parameters' own ``.grad`` (one ``_foreach_copy_`` per group).
    The parameters stay ``nn.Parameter`` objects of the model (state dicts, DDP, compile see no change);
    only their storage moves. Build it before wrapping the model (DDP, compile).
    """

    def __init__(self, groups: list[dict]):
        self.params: list[list[nn.Parameter]] = []
        self.flat: list[torch.Tensor] = []
        self._grad_views: list[list[torch.Tensor]] = []
        for g in groups:
            params = g["params"]
            kinds = {(p.dtype, p.device) for p in params}
            if len(kinds) != 1:
                raise ValueError(f"FlatParams: group {g.get('group', '?')!r} mixes dtypes/devices {sorted(map(str, kinds))}; "
                                 f"keep the model in one dtype (autocast does the low precision)")
            dtype, device = kinds.pop()
            flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            grad = torch.zeros_like(flat)
            views, offset = [], 0
            for p in params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = flat[offset:offset + n].view_as(p)
                views.append(grad[offset:offset + n].view_as(p))
                offset += n
            flat.grad = grad
            self.params.append(list(params))
            self.flat.append(flat)
            self._grad_views.append(views)

    @torch.no_grad()
    def gather_grads(self) -> None:
        """Copy every parameter's ``.grad`` into its group's flat gradient (zeros where a parameter got none).

        One ``_foreach_copy_`` per group; the per-parameter work (reading ``.grad``) is a C-level ``map``, so
        the step runs no Python bytecode per parameter (tests/train/test_step.py pins it)."""
        for params, views in zip(self.params, self._grad_views):
            grads = list(map(_GRAD, params))
            # an unused parameter this step (a host-side check: no sync; rare). Not ``None in grads``: that
            # compares every tensor with None through Tensor.__eq__ (~40 us each, 7 ms at 155 tensors)
            if any(map(is_, grads, repeat(None))):
                used = [(g, v) for g, v in zip(grads, views) if g is not None]
                for g, v in zip(grads, views):
                    if g is None:
                        v.zero_()
                grads, views = [g for g, _ in used], [v for _, v in used]
            if grads:
                torch._foreach_copy_(views, grads)

    def grads(self) -> list[torch.Tensor]:
        return [f.grad for f in self.flat]

    def zero_grad(self) -> None:
        """Drop the parameters' gradients (the next backward hands autograd's own tensors over, no zeroing
        kernel; the flat buffers stay). A C-level loop, as in ``gather_grads``."""
        for params in self.params:
            deque(map(setattr, params, repeat("grad"), repeat(None)), maxlen=0)


_GRAD = attrgetter("grad")


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device
                    ) -> tuple[torch.optim.Optimizer, FlatParams]:
    """The optimizer over flat groups (decay, no_decay) of ``model``'s parameters, and the ``FlatParams``.

    Every optimizer honours ``optimizer.found_inf`` (a 0-d device tensor: nonzero skips the update on the
    device) and ``GradScaler``'s sync-free path (``_step_supports_amp_scaling``).
    """
    groups = [g for g in param_groups(model, cfg.weight_decay) if g["params"]]
    flat = FlatParams(groups)
    opt_groups = [{"params": [f], "weight_decay": g["weight_decay"]} for f, g in zip(flat.flat, groups)]
    return pick(OPTIMIZERS, "optim.name", cfg.name)(opt_groups, cfg), flat


def _lion(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    from kernels.lion import Lion

    return Lion(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def _torch_adam(cls: type[torch.optim.Optimizer]) -> Callable[[list[dict], OptimConfig], torch.optim.Optimizer]:
    """torch's fused ``cls``: one multi-tensor kernel per step (CUDA and CPU) that reads found_inf on the device."""
    return lambda groups, cfg: cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                   fused=True)


# optim.name -> the optimizer over flat groups. Adam's weight decay is coupled L2 (the baseline uses none); AdamW's
# is decoupled.
OPTIMIZERS: dict[str, Callable[[list[dict], OptimConfig], torch.optim.Optimizer]] = {
    "lion": _lion, "adamw": _torch_adam(torch.optim.AdamW), "adam": _torch_adam(torch.optim.Adam)}


def onecycle_pct_start(cfg: OptimConfig, total_steps: int) -> float:
    """``cfg.pct_start``, widened where a short run would leave OneCycle a warm-up or anneal phase of
    zero steps (torch divides by the phase length: ZeroDivisionError at, e.g., 5 steps and 20 %)."""
    # phase ends: pct * total - 1 (warm-up), [2 * pct * total - 2 (three-phase)], total - 1; each >= 1 step long
    lo = 2.0 / total_steps
    hi = 0.5 if cfg.three_phase else (total_steps - 1.0) / total_steps
    return min(max(cfg.pct_start, lo), hi)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """A per-optimizer-step scheduler (``SCHEDULES[cfg.schedule]``), stepped after every optimizer step (skipped
    steps included: the non-finite guard decides on the device, and a rare skipped step changes the schedule by one
    step), never past ``total_steps``. A schedule name without an entry is a ValueError naming the choices."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (no training batches?)")
    return pick(SCHEDULES, "optim.schedule", cfg.schedule)(optimizer, cfg, total_steps)


def _constant(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _onecycle(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """OneCycle (it extrapolates to a negative lr past ``total_steps``, then raises). A run of fewer than 3 steps
    (4 for three-phase) gets a constant lr: OneCycle has no room to cycle."""
    if total_steps < (4 if cfg.three_phase else 3):
        return _constant(optimizer, cfg, total_steps)
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=cfg.lr,
        total_steps=total_steps,
        pct_start=onecycle_pct_start(cfg, total_steps),
        anneal_strategy=cfg.anneal,
        div_factor=cfg.div_factor,
        final_div_factor=cfg.final_div_factor,
        three_phase=cfg.three_phase,
        cycle_momentum=False,  # keep the configured betas fixed
    )


def _inverse_sqrt(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up over ``warmup_steps``, then lr * sqrt(warmup / step)."""
    w = cfg.warmup_steps

    def inv_sqrt(step: int) -> float:  # step counts completed optimizer steps, 0-based
        s = step + 1
        return min(s / w, math.sqrt(w / s))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, inv_sqrt)


def _cosine(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up over ``warmup_steps`` (at most ``total_steps``) to lr, then half a cosine over the rest of the
    plan: step s (0-based) after the warm-up w has lr * (1 + cos(pi * (s + 1 - w) / (total - w + 1))) / 2, so no
    step, first or last, runs at lr 0."""
    w = min(cfg.warmup_steps, total_steps)

    def cosine(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1.0 + math.cos(math.pi * (step + 1 - w) / (total_steps - w + 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)


# optim.schedule -> (optimizer, cfg, total_steps) -> the scheduler
SCHEDULES = {"onecycle": _onecycle, "inverse_sqrt": _inverse_sqrt, "cosine": _cosine, "constant": _constant}
