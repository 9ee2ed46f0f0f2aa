"""The one place that counts parameters and FLOPs (for MFU).

``count_params(model)``: ``unique`` = distinct parameter tensors (a tied embedding or a shared block
counted once); ``applied`` = parameters as executed: each shared block counted once per application
in its stack's schedule (the tied embedding still counts once: tying is not an application).

``flops_per_token(cfg, src_len, tgt_len)``: model FLOPs of one training step (forward + backward =
3 x forward) for one sentence pair with ``src_len`` source and ``tgt_len`` target tokens, divided by
``tgt_len``. Counted: every matmul (2 FLOPs per multiply-add) -- projections, FFN, the output
projection over the vocabulary, and attention's QK^T and PV over the *visible* score entries only
(S^2 encoder self, T(T+1)/2 causal decoder self, T*S cross). Not counted: norms, activations,
softmax, embeddings lookups, the loss, and the recomputation of activation checkpointing (MFU
convention: model FLOPs, not hardware FLOPs). Cross-attention K/V are counted once per applied
decoder layer, as the training forward computes them. Use the batch's mean real lengths; the
quadratic terms then slightly under-count a batch with spread lengths.

``run_peak(device, precision)`` / ``peak_flops(device, dtype)``: the peak FLOP/s of the dtype the
matmuls run in (fp32, tf32, bf16, fp16) -- NVIDIA's datasheet (dense) for the GPUs in ``PEAK_TABLE``,
else a matmul measured once per process and dtype; None on CPU, with the reason.
``mfu(model_flops_per_second, peak)``: their ratio, NaN without a peak -- never a number against
another dtype's peak.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from models.config import ModelConfig


def count_params(model: nn.Module) -> dict[str, int]:
    from models.layers import Stack

    unique = sum(p.numel() for p in model.parameters())  # .parameters() yields a shared tensor once
    applied = unique
    for stack in (m for m in model.modules() if isinstance(m, Stack)):
        sizes = [sum(p.numel() for p in block.parameters()) for block in stack.blocks]
        applied += sum(sizes[i] for i in stack.schedule) - sum(sizes)
    return {"unique": unique, "applied": applied}


def forward_flops(cfg: ModelConfig, src_len: float, tgt_len: float) -> dict[str, float]:
    """Forward matmul FLOPs for one sentence pair, by part (see the module docstring)."""
    d, f, V, S, T = cfg.d_model, cfg.d_ff, cfg.vocab_size, float(src_len), float(tgt_len)
    ffn = 2 * 2 * d * f  # W1 and W2, per token
    enc_layer = S * (2 * 4 * d * d + ffn) + 2 * 2 * S * S * d  # QKV + out proj, FFN; QK^T + PV
    dec_layer = (
        T * (2 * 4 * d * d + 2 * 2 * d * d + ffn)  # self QKV + out, cross Q + out, FFN
        + S * 2 * 2 * d * d  # cross K/V of the encoder output
        + 2 * 2 * d * T * (T + 1) / 2  # causal self-attention, visible entries
        + 2 * 2 * d * T * S  # cross-attention
    )
    return {
        "encoder": cfg.enc_layers * enc_layer,
        "decoder": cfg.dec_layers * dec_layer,
        "output": 2 * T * d * V,
    }


def flops_per_token(cfg: ModelConfig, src_len: float, tgt_len: float) -> float:
    """Training (fwd + bwd) model FLOPs per real target token; MFU = this * tokens/s / peak FLOP/s."""
    if src_len <= 0 or tgt_len <= 0:
        raise ValueError(f"flops_per_token: src_len={src_len} and tgt_len={tgt_len} must be > 0")
    return 3.0 * sum(forward_flops(cfg, src_len, tgt_len).values()) / float(tgt_len)


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU
# ----------------------------------------------------------------------------------------------
# MFU = model FLOP/s / the peak of the dtype the matmuls ran in. A run's precision decides it:
# bf16/fp16 autocast -> that dtype's tensor-core peak; fp32 -> the TF32 tensor-core peak when TF32
# matmuls are enabled (torch.get_float32_matmul_precision() != "highest"), else the fp32 (CUDA-core) peak.
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16")


def _dense(sparse_tflops: float) -> float:
    """NVIDIA's datasheets quote tensor-core rates with 2:4 sparsity; dense is half of that."""
    return sparse_tflops / 2 * 1e12


# Dense peak FLOP/s per compute dtype, from NVIDIA's product datasheets (boost clocks). Tensor-core
# figures there carry an asterisk "with sparsity" and are halved by ``_dense``; fp32 is the non-tensor
# rate, quoted dense.
#   H100 SXM5 (H100 datasheet):   FP32 67 TF;  TF32 989*, BF16 1,979*, FP16 1,979* TF
#   H100 PCIe (same datasheet):   FP32 51;     TF32 756*, BF16 1,513*, FP16 1,513*
#   H100 NVL  (same datasheet):   FP32 60;     TF32 835*, BF16 1,671*, FP16 1,671*
#   H200 SXM  (H200 datasheet):   FP32 67;     TF32 989*, BF16 1,979*, FP16 1,979*
#   H200 NVL  (same datasheet):   FP32 60;     TF32 835*, BF16 1,671*, FP16 1,671*
#   A100 SXM4 / PCIe, 40 and 80 GB (A100 datasheet): FP32 19.5; TF32 312*, BF16 624*, FP16 624*
# Entries: (label, regex searched in the lower-cased torch.cuda.get_device_name, peaks); first match
# wins, so the specific forms (PCIe, NVL) come before the SXM default.
PEAK_TABLE: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H100 NVL", r"h100.*nvl", {"fp32": 60e12, "tf32": _dense(835), "bf16": _dense(1671), "fp16": _dense(1671)}),
    ("H100 PCIe", r"h100.*pcie", {"fp32": 51e12, "tf32": _dense(756), "bf16": _dense(1513), "fp16": _dense(1513)}),
    ("H100 SXM", r"h100", {"fp32": 67e12, "tf32": _dense(989), "bf16": _dense(1979), "fp16": _dense(1979)}),
    ("H200 NVL", r"h200.*nvl", {"fp32": 60e12, "tf32": _dense(835), "bf16": _dense(1671), "fp16": _dense(1671)}),
    ("H200 SXM", r"h200", {"fp32": 67e12, "tf32": _dense(989), "bf16": _dense(1979), "fp16": _dense(1979)}),
    ("A100", r"a100", {"fp32": 19.5e12, "tf32": _dense(312), "bf16": _dense(624), "fp16": _dense(624)}),
)

_TORCH_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_MEASURED: dict[tuple[str, str], float] = {}  # (device name, dtype) -> FLOP/s measured in this process


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may run on TF32 tensor cores now (torch's global matmul precision)."""
    return torch.get_float32_matmul_precision() != "highest"


def peak_dtype(precision: str, *, tf32: bool = False) -> str:
    """The dtype a run's matmuls execute in: "bf16"/"fp16" autocast -> itself; "fp32" -> "tf32" when
    TF32 matmuls are enabled, else "fp32"."""
    if precision in ("bf16", "fp16"):
        return precision
    if precision == "fp32":
        return "tf32" if tf32 else "fp32"
    raise ValueError(f"precision={precision!r}: expected one of 'fp32', 'bf16', 'fp16'")


def table_peak(device_name: str, dtype: str, table=PEAK_TABLE) -> tuple[float | None, str]:
    """(dense peak FLOP/s or None, reason) for ``dtype`` on the device called ``device_name``."""
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {PEAK_DTYPES}")
    for label, pattern, peaks in table:
        if re.search(pattern, device_name.lower()):
            if peaks.get(dtype):
                return float(peaks[dtype]), f"{label} datasheet, dense {dtype}"
            return None, f"{label}: no {dtype} entry in the peak table"
    return None, f"{device_name!r} is not in the peak table"


def resolve_peak(device_name: str, dtype: str, *, table=PEAK_TABLE,
                 measure: Callable[[], float] | None = None) -> tuple[float | None, str]:
    """The table's peak, else ``measure()`` (FLOP/s) -- called once per (device name, dtype) per process."""
    value, why = table_peak(device_name, dtype, table)
    if value is not None or measure is None:
        return value, why
    key = (device_name, dtype)
    if key not in _MEASURED:
        _MEASURED[key] = float(measure())
    return _MEASURED[key], f"measured in this run: {dtype} matmul ({why})"


def matmul_flops(device, dtype: torch.dtype, *, tf32: bool = False, n: int | None = None,
                 timer: Callable[[Callable[[], object]], float] | None = None) -> float:
    """FLOP/s of a random (n x n) @ (n x n) product in ``dtype`` (n: 8192 on CUDA, enough for the tensor
    cores' rate; 256 elsewhere). Random data: a product of zeros runs faster on Hopper. ``tf32``: fp32
    inputs with TF32 allowed for this measurement only. ``timer(fn)``: milliseconds per call (default
    the median of ``torch.utils.benchmark``'s blocked autorange)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 256)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        ms = _matmul_ms(n, dtype, device, timer or _median_ms)
    finally:
        torch.set_float32_matmul_precision(before)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3)


def _matmul_ms(n: int, dtype: torch.dtype, device: torch.device, timer) -> float:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return timer(lambda: a @ b)


def _median_ms(fn: Callable[[], object]) -> float:
    from torch.utils.benchmark import Timer

    fn()  # first call: allocation, library initialisation
    return Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2).median * 1e3


def measure_peak(device, dtype: str) -> float:
    """FLOP/s of a large random matrix product in ``dtype`` (fp32, tf32, bf16, fp16) on ``device``."""
    return matmul_flops(device, getattr(torch, _TORCH_DTYPES[dtype]), tf32=dtype == "tf32")


def peak_flops(device, dtype: str, *, table=PEAK_TABLE) -> tuple[float | None, str]:
    """(peak FLOP/s of ``dtype`` on ``device`` or None, reason).

    CUDA: the datasheet table (dense), else a matmul measured once per run and dtype. Other devices
    have no meaningful peak (a CPU's matmul rate depends on the library, threads and load): None.
    """
    device = torch.device(device)
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {PEAK_DTYPES}")
    if device.type != "cuda":
        return None, f"no MFU on {device.type}: no meaningful {dtype} peak"
    name = torch.cuda.get_device_name(device)
    return resolve_peak(name, dtype, table=table, measure=lambda: measure_peak(device, dtype))


def run_peak(device, precision: str, *, override: float | None = None,
             table=PEAK_TABLE) -> tuple[float | None, str, str]:
    """(peak FLOP/s or None, peak dtype, reason) for a run of ``precision`` on ``device``, with TF32
    read from torch's setting now (call it after the run has set its matmul precision).
    ``override``: a user-given peak (``run.peak_flops``), taken as the peak of that dtype."""
    device = torch.device(device)
    dtype = peak_dtype(precision, tf32=device.type == "cuda" and tf32_enabled())
    if override is not None:
        return float(override), dtype, "given peak (run.peak_flops)"
    value, why = peak_flops(device, dtype, table=table)
    return value, dtype, why


def mfu(model_flops_per_second: float, peak: float | None) -> float:
    """Model FLOPs utilisation: model FLOP/s / peak FLOP/s of the same dtype; NaN without a peak."""
    if peak is None or not peak > 0:
        return float("nan")
    return model_flops_per_second / peak
