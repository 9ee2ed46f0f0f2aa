"""Fused LayerNorm(+residual)(+GELU) for fastmt (forward + backward), with an einops reference.

    s = x + residual            (when a residual is given; returned for the pre-LN residual stream)
    y = act(LayerNorm(s) * weight + bias),  act in {None, "gelu" (exact erf), "gelu_tanh"}

Statistics in fp32 whatever the input dtype (fp32 / bf16 / fp16).

(Kernel layers: the Triton forward/backward kernels, launchers and the custom op are added by
the kernels work; until then every call is served by the reference.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels._utils import resolve_backend

NORM_BACKENDS = ("auto", "triton", "reference")
ACTIVATIONS = (None, "gelu", "gelu_tanh")


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    activation: str | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, s) with s = x + residual (or x). ``upcast=True`` computes in fp32."""
    dtype = x.dtype
    s = x + residual if residual is not None else x
    h = s.float() if upcast else s
    w = weight.to(h.dtype)
    b = bias.to(h.dtype) if bias is not None else None
    y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y.to(dtype), s


# ----------------------------------------------------------------------------------------------
# Public function and module
# ----------------------------------------------------------------------------------------------
def _check_inputs(x, weight, bias, residual, activation):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"layer_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"layer_norm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"layer_norm: weight shape {tuple(weight.shape)} != ({N},) (last dim of x {tuple(x.shape)})")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"layer_norm: bias shape {tuple(bias.shape)} != ({N},)")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"layer_norm: residual dtype {residual.dtype} != x dtype {x.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"layer_norm: {name} is on {t.device}, x on {x.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"layer_norm: activation={activation!r} is not one of {ACTIVATIONS}")


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    activation: str | None = None,
    return_residual: bool = False,
    backend: str = "auto",
):
    """``act(LayerNorm(x + residual))`` over the last dimension; x (..., N), weight/bias (N,).

    Returns y shaped like x, or ``(y, s)`` with ``s = x + residual`` when ``return_residual``.
    ``backend``: "auto" (Triton on CUDA, the reference otherwise), "triton" or "reference";
    ``FASTMT_NORM_BACKEND`` overrides "auto".
    """
    _check_inputs(x, weight, bias, residual, activation)
    backend = resolve_backend(backend, "FASTMT_NORM_BACKEND", NORM_BACKENDS)
    if backend == "triton":
        raise NotImplementedError("layer_norm: the Triton backend is not built yet")
    y, s = layer_norm_reference(x, weight, bias, residual, eps=eps, activation=activation, upcast=True)
    return (y, s) if return_residual else y


class LayerNorm(nn.Module):
    """LayerNorm(+residual)(+GELU) module; ``forward(x, residual=None)`` returns y, or (y, x + residual)."""

    def __init__(self, dim: int, eps: float = 1e-5, activation: str | None = None, bias: bool = True,
                 backend: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNorm: activation={activation!r} is not one of {ACTIVATIONS}")
        self.dim, self.eps, self.activation, self.backend = dim, eps, activation, backend
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, residual, eps=self.eps, activation=self.activation,
                          return_residual=residual is not None, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, activation={self.activation}, backend={self.backend!r}"
