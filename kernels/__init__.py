"""fastmt's Triton kernels, each with a plain-PyTorch reference beside it.

Public API (imported lazily: ``import kernels`` loads neither torch nor triton):

- ``attention(q, k, v, ...)``: flash attention, padded ``(B, H, T, D)`` with per-sequence
  lengths or packed varlen ``(total, H, D)`` with ``cu_seqlens``; causal or not; self or cross.
- ``layer_norm(x, weight, bias, residual=..., activation=...)``: fused
  ``act(LayerNorm(x + residual))``, optionally returning the sum for the residual stream.
- ``LayerNorm``: the ``nn.Module`` form of ``layer_norm``.
- ``lion_step(param, grad, exp_avg, *, lr, beta1, beta2, weight_decay, found_inf=None)``: one fused,
  in-place Lion update of a flat fp32 buffer; ``Lion``: the ``torch.optim.Optimizer`` around it.
- ``warm_compile(step)``: during a run's setup, compile (in worker processes, in the background) every kernel
  of ours one forward + backward launches; a no-op without CUDA (kernels/tuning.py).

Every public function takes ``backend=`` (one of the tuples below); the environment variables
``FASTMT_ATTN_BACKEND`` / ``FASTMT_NORM_BACKEND`` / ``FASTMT_LION_BACKEND`` override "auto" for
benchmarks and ablations, ``FASTMT_ATTN_TILING`` picks attention's Triton tiling and
``FASTMT_AUTOTUNE=0`` launches every autotuned kernel untimed with its first config; by default a key that
kernels/pinned.py pins for this GPU launches its pinned config untimed and other keys autotune once, and
``FASTMT_AUTOTUNE=full`` autotunes every key (``kernels._utils.launch``).
Files and their common layout: docs/ARCHITECTURE.md.
"""

from importlib import import_module

# The backend names each public op accepts (the one definition; configs and CLIs import these).
ATTN_BACKENDS = ("auto", "triton", "sdpa", "reference")
NORM_BACKENDS = ("auto", "triton", "reference")
LION_BACKENDS = ("auto", "triton", "reference")
ATTN_HEAD_DIMS = (16, 32, 64, 128)  # head dims the Triton attention kernels take (both tilings)

_EXPORTS = {
    "attention": "kernels.flash_attention",
    "attention_reference": "kernels.flash_attention",
    "FlashAttention": "kernels.flash_attention",
    "triton_supports": "kernels.flash_attention",
    "layer_norm": "kernels.layernorm",
    "layer_norm_reference": "kernels.layernorm",
    "LayerNorm": "kernels.layernorm",
    "lion_step": "kernels.lion",
    "lion_step_reference": "kernels.lion",
    "Lion": "kernels.lion",
    "warm_compile": "kernels.tuning",
}

__all__ = sorted(_EXPORTS) + ["ATTN_BACKENDS", "ATTN_HEAD_DIMS", "LION_BACKENDS", "NORM_BACKENDS"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
