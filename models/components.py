"""One factory per model component, each dispatching by name from one registry.

The model (models/transformer.py), the exporters (train/export/) and the tests build or look up a component
only through these:

- ``norm_for(cfg, dim, activation=None)``: the normalisation module (``NORMS[cfg.norm_kind][cfg.norm]``: ``"layernorm"``
  and ``"rmsnorm"``, each on the fused kernel or PyTorch). Every norm module has the fused kernel's interface,
  ``forward(x, residual=None) -> y`` or ``(y, x + residual)``, applies ``activation`` after the norm (fused into the
  kernel where it can be), and ``plain(s)``: the norm of ``s`` as one PyTorch call (the live decoding step).
- ``activation_for(cfg)``: the FFN activation, a function of one tensor (``ACTIVATIONS[cfg.activation]``).
- ``attention_for(cfg)``: ``attend(q, k, v, q_side, k_side, causal)`` on ``cfg.attn_backend``
  (``ATTENTION[cfg.attn_backend]``).
- ``positions_for(cfg)``: one side's position table as a module, ``forward(pos) -> (..., d_model)`` and ``.weight``
  (``POSITIONS[cfg.positions]``).

Each registry's keys are exactly the choices ModelConfig declares for its field (tests/models/test_components.py
checks it), and a name a registry lacks is a ``ValueError`` naming the field, the value and the choices: a choice
added to the config without an implementation fails there, never silently as another one.

Adding a normalisation (e.g. RMSNorm): a class with this interface (``TorchNorm`` mixed into the PyTorch module
does it) and one entry in ``NORMS``, keyed by the config's value, holding only the backends that compute it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from kernels import ATTN_BACKENDS, attention
from kernels import LayerNorm as FusedLayerNorm
from kernels.layernorm import ACTIVATIONS as FUSED_ACTIVATIONS  # what the kernel fuses after its norm
from kernels.layernorm import RMSNorm as FusedRMSNormKernel

T = TypeVar("T")


def pick(registry: Mapping[str, T], field: str, value: Any) -> T:
    """``registry[value]``, or a ValueError naming ``field``, ``value`` and the registry's names."""
    try:
        return registry[value]
    except (KeyError, TypeError):
        raise ValueError(f"{field}={value!r} is not one of {tuple(registry)}: no implementation is registered for "
                         f"it (models/components.py)") from None


# ----------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------
def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="none")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": _gelu,
                                                                   "gelu_tanh": _gelu_tanh}


def activation_for(cfg) -> Callable[[torch.Tensor], torch.Tensor]:
    """The FFN activation ``cfg.activation`` names."""
    return pick(ACTIVATIONS, "model.activation", cfg.activation)


# ----------------------------------------------------------------------------------------------
# Norms: name -> {backend (model.norm) -> module class}
# ----------------------------------------------------------------------------------------------
class TorchNorm:
    """Mixed into a PyTorch norm module (``class TorchLayerNorm(TorchNorm, nn.LayerNorm)``): the fused kernel's
    interface, ``forward(x, residual=None) -> y`` or ``(y, x + residual)``, the activation after the norm, and
    ``plain``. The parameters keep the PyTorch module's names (state dicts load across backends)."""

    def __init__(self, dim: int, activation: str | None = None):
        super().__init__(dim)
        self.activation = None if activation is None else pick(ACTIVATIONS, "activation", activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        s = x if residual is None else x + residual
        y = super().forward(s)
        if self.activation is not None:
            y = self.activation(y)
        return y if residual is None else (y, s)

    def plain(self, s: torch.Tensor) -> torch.Tensor:
        """The norm of ``s`` (no activation, no residual): one PyTorch call."""
        return super().forward(s)

    @staticmethod
    def plain_exact() -> bool:
        """Whether ``plain`` computes what ``forward`` does on fp32 CPU tensors: always (it is the same call)."""
        return True


class TorchLayerNorm(TorchNorm, nn.LayerNorm):
    """``nn.LayerNorm`` (eps 1e-5) with the fused kernel's interface."""


class FusedActivation:
    """Mixed into a fused norm module (``class FusedNorm(FusedActivation, kernels.LayerNorm)``): an activation the
    kernel has no fused form of (ReLU) runs after it."""

    def __init__(self, dim: int, activation: str | None = None):
        fused = activation in FUSED_ACTIVATIONS
        super().__init__(dim, activation=activation if fused else None)
        self.after = None if fused else pick(ACTIVATIONS, "activation", activation)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = super().forward(x, residual)
        if self.after is None:
            return out
        return self.after(out) if residual is None else (self.after(out[0]), out[1])

    @staticmethod
    def plain_exact() -> bool:
        """On fp32 CPU tensors the module runs its reference, ``plain``'s call, unless ``FASTMT_NORM_BACKEND`` forces
        the Triton kernel (the interpreter)."""
        return os.environ.get("FASTMT_NORM_BACKEND", "").strip() in ("", "auto", "reference")


class FusedNorm(FusedActivation, FusedLayerNorm):
    """``kernels.LayerNorm``: LayerNorm(+residual)(+GELU) in one kernel."""

    def plain(self, s: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(s, (s.shape[-1],), self.weight, self.bias, self.eps)


# the normalisations, each with the backends (model.norm) that compute it: a kind a backend lacks is refused
class TorchRMSNorm(TorchNorm, nn.RMSNorm):
    """``nn.RMSNorm`` (eps 1e-5, as the LayerNorms) with the fused kernel's interface."""

    def __init__(self, dim: int, activation: str | None = None):
        super().__init__(dim, activation)
        self.eps = 1e-5


class FusedRMSNorm(FusedActivation, FusedRMSNormKernel):
    """``kernels.layernorm.RMSNorm``: the LayerNorm kernels with ``IS_RMS_NORM``, no bias (as ``nn.RMSNorm``)."""

    def plain(self, s: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(s, (s.shape[-1],), self.weight, self.eps)


NORMS: dict[str, dict[str, type[nn.Module]]] = {
    "layernorm": {"fused": FusedNorm, "torch": TorchLayerNorm},
    "rmsnorm": {"fused": FusedRMSNorm, "torch": TorchRMSNorm},
}
LAYER_NORMS = tuple(NORMS["layernorm"].values())  # what an exporter reads as a LayerNorm (weight, bias, eps 1e-5)


def norm_kind(cfg) -> str:
    """The normalisation ``cfg`` names (``model.norm_kind``)."""
    return cfg.norm_kind


def norm_class(cfg) -> type[nn.Module]:
    """The module class of ``cfg``'s normalisation on its backend ``cfg.norm``."""
    kind = norm_kind(cfg)
    backends = pick(NORMS, "model.norm_kind", kind)
    if cfg.norm not in backends:
        raise ValueError(f"model.norm={cfg.norm!r} cannot compute norm kind {kind!r}: it runs on "
                         f"{' or '.join(repr(b) for b in backends)}; set model.norm to one of those")
    return backends[cfg.norm]


def norm_for(cfg, dim: int, activation: str | None = None) -> nn.Module:
    """``cfg``'s normalisation over ``dim`` features, then ``activation`` (None: none)."""
    return norm_class(cfg)(dim, activation)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
def attend(q, k, v, q_side, k_side, causal: bool, *, backend: str) -> torch.Tensor:
    """kernels.attention on (B, H, T, D) tensors (padded) or (total, H, D) tensors (varlen); ``q_side``/``k_side``:
    models.layers.Side."""
    if q.dim() == 3:
        return attention(q, k, v, causal=causal, cu_seqlens_q=q_side.cu_seqlens, cu_seqlens_k=k_side.cu_seqlens,
                         max_seqlen_q=q_side.max_len, max_seqlen_k=k_side.max_len, backend=backend,
                         segment_ids_q=q_side.segment_ids, segment_ids_k=k_side.segment_ids)
    return attention(q, k, v, causal=causal, q_lengths=q_side.lengths, k_lengths=k_side.lengths, backend=backend)


# every backend kernels.attention takes (its own dispatch picks the kernel: kernels/flash_attention.py)
ATTENTION: dict[str, Callable[..., torch.Tensor]] = {name: partial(attend, backend=name) for name in ATTN_BACKENDS}


def attention_for(cfg) -> Callable[..., torch.Tensor]:
    """``attend(q, k, v, q_side, k_side, causal)`` on the backend ``cfg.attn_backend`` names."""
    return pick(ATTENTION, "model.attn_backend", cfg.attn_backend)


# ----------------------------------------------------------------------------------------------
# Positions
# ----------------------------------------------------------------------------------------------
def sinusoids(n: int, dim: int) -> torch.Tensor:
    """(n, dim) table: [sin(p w_i), cos(p w_i)] interleaved, w_i = 10000^(-2i/dim)."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]  # (n, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))  # (dim/2,)
    angles = pos * freq  # (n, dim/2)
    return rearrange(torch.stack([angles.sin(), angles.cos()], dim=-1), "n k two -> n (k two)")[:, :dim]


class Sinusoids(nn.Module):
    """The fixed sinusoid table (a buffer outside the state dict): ``forward(pos) -> table[pos]``."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.register_buffer("table", sinusoids(n, dim), persistent=False)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.table[pos]

    @property
    def weight(self) -> torch.Tensor:
        return self.table

    def reset_parameters(self) -> None:
        """Nothing to draw: the table is fixed."""


class LearnedPositions(nn.Embedding):
    """A learned table, initialised N(0, 0.02^2)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


POSITIONS: dict[str, type[nn.Module]] = {"sinusoidal": Sinusoids, "learned": LearnedPositions}


def positions_for(cfg) -> nn.Module:
    """One side's position table (``cfg.max_positions`` x ``cfg.d_model``) of the kind ``cfg.positions`` names."""
    return pick(POSITIONS, "model.positions", cfg.positions)(cfg.max_positions, cfg.d_model)
