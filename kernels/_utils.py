"""Helpers shared by the kernel files: backend choice, interpreter detection, poisoned outputs."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "sdpa", "reference")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: a CUDA tensor, or any tensor under the interpreter."""
    return t.is_cuda or interpreting()


def resolve_backend(backend: str, env_var: str, allowed: tuple[str, ...]) -> str:
    """Validate ``backend``; "auto" is replaced by ``env_var``'s value when that is set."""
    if backend not in allowed:
        raise ValueError(f"backend={backend!r} is not one of {allowed}")
    if backend == "auto":
        override = os.environ.get(env_var, "").strip()
        if override:
            if override not in allowed:
                raise ValueError(f"{env_var}={override!r} is not one of {allowed}")
            return override
    return backend


def poison_enabled() -> bool:
    """``FASTMT_POISON=1``: kernel outputs start as NaN, so an element no program writes fails tests."""
    return os.environ.get("FASTMT_POISON", "0") not in ("", "0")


def empty(*shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, NaN-filled under ``FASTMT_POISON=1`` (integer outputs are filled with -1)."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    if poison_enabled():
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(*t.shape, dtype=dtype or t.dtype, device=t.device)
