"""Optimizers with no-decay groups, and the learning-rate schedules (OneCycle, inverse-sqrt, constant).

Weight decay applies to weight matrices only: biases, norm gains/biases (every parameter with
``ndim < 2``) and embedding tables (``nn.Embedding`` weights, hence a tied output projection too)
go to a group with ``weight_decay=0``.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
from torch import nn

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


def _lion_triton_ok(device: torch.device) -> bool:
    # lion_pytorch.triton calls exit() (code 0) when `import triton` fails: only import it on CUDA,
    # with triton present and not under the CPU interpreter (shared/ENV.md).
    return (
        device.type == "cuda"
        and importlib.util.find_spec("triton") is not None
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    )


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    for g in groups:
        g.pop("names")
        g.pop("group")
    groups = [g for g in groups if g["params"]]
    if cfg.name == "lion":
        try:
            from lion_pytorch import Lion
        except ImportError as e:
            raise ImportError("optim.name='lion' needs lion-pytorch (pip install lion-pytorch) "
                              "or use --optim.name adamw") from e
        return Lion(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                    use_triton=_lion_triton_ok(device))
    fused = device.type == "cuda"  # one multi-tensor kernel per step on CUDA
    # Adam's weight decay is coupled L2 (the baseline uses none); AdamW's is decoupled.
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """A per-optimizer-step scheduler. Call ``.step()`` only after an optimizer step that happened."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (no training batches?)")
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=cfg.lr,
            total_steps=total_steps,
            pct_start=cfg.pct_start,
            anneal_strategy=cfg.anneal,
            div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor,
            three_phase=cfg.three_phase,
            cycle_momentum=False,  # keep the configured betas fixed
        )
    if cfg.schedule == "inverse_sqrt":
        w = cfg.warmup_steps

        def inv_sqrt(step: int) -> float:  # step counts completed optimizer steps, 0-based
            s = step + 1
            return min(s / w, math.sqrt(w / s))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, inv_sqrt)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
