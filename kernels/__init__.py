"""fastmt's Triton kernels, each with a plain-PyTorch (einops) reference beside it.

Public API (imported lazily: ``import kernels`` loads neither torch nor triton):

- ``attention(q, k, v, ...)``: flash attention, padded ``(B, H, T, D)`` with per-sequence
  lengths or packed varlen ``(total, H, D)`` with ``cu_seqlens``; causal or not; self or cross.
- ``layer_norm(x, weight, bias, residual=..., activation=...)``: fused
  ``act(LayerNorm(x + residual))``, optionally returning the sum for the residual stream.
- ``LayerNorm``: the ``nn.Module`` form of ``layer_norm``.

Every public function takes ``backend=`` ("auto", "triton", "sdpa" for attention, "reference");
the environment variables ``FASTMT_ATTN_BACKEND`` / ``FASTMT_NORM_BACKEND`` override "auto"
for benchmarks and ablations.
"""

from importlib import import_module

_EXPORTS = {
    "attention": "kernels.flash_attention",
    "attention_reference": "kernels.flash_attention",
    "FlashAttention": "kernels.flash_attention",
    "triton_supports": "kernels.flash_attention",
    "layer_norm": "kernels.layernorm",
    "layer_norm_reference": "kernels.layernorm",
    "LayerNorm": "kernels.layernorm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
