"""Kernel benchmarks: our Triton attention and fused LayerNorm against what PyTorch offers.

    python -m bench.kernels [--smoke] [--only attention|layernorm] [--out DIR] [--budget-s S]

Providers (one row per case x provider x mode in ``kernels-<gpu>.csv``):
  attention   ours            kernels.attention(..., backend="triton"), padded (B, H, T, D) + lengths
              ours-varlen     the same kernel on packed (total, H, D) + cu_seqlens (what training feeds)
              torch-varlen    torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention-2 varlen)
              sdpa            F.scaled_dot_product_attention, PyTorch's own backend choice
              sdpa-flash / sdpa-efficient / sdpa-cudnn / sdpa-math   one backend forced through
                              torch.nn.attention.sdpa_kernel; a backend that refuses the case
                              (flash with a mask, say) is recorded as "unsupported", not a crash
              reference       kernels.attention_reference, eager einops, same dtype (upcast=False)
              reference-compile  torch.compile of that reference (dynamic=None: automatic dynamic
                              shapes after the second length, as in training; it keeps compile
                              time inside one device call)
  layernorm   ours            kernels.layer_norm(x, w, b, residual, activation="gelu",
                              return_residual=True, backend="triton") -> (y, s)
              eager           s = x + r; y = F.gelu(F.layer_norm(s)): three kernels
              compile         torch.compile(kernels.layer_norm_reference, dynamic=False): one static
                              graph per shape, the best inductor does (fp32 statistics, like ours)
Modes: fwd (the training forward, autograd recording), bwd (``backward(retain_graph=True)`` on a
graph built once), fwd+bwd. Backward gets random upstream gradients for every output, so the
LayerNorm backward includes the gradient that arrives at the residual stream ``s``.

Shapes
  train-ragged  H=8, D=64, T in 32..512, B*T = 32768 padded tokens, per-sequence lengths drawn
                uniformly in [min_fill*T, T] (one sequence of length T); SDPA gets a boolean
                padding mask ((B,1,1,T) keys only, (B,1,T,T) with causal), built outside the timing.
  train-dense   the same shapes with every sequence full: no mask (fused providers only).
  long          T in 1k..8k, D in {64, 128}, B*T = 16384 tokens, H*D = 2048, causal or not --
                FlashAttention-2's benchmark grid, to compare with its published numbers.
  ln            rows x width, bf16: width 512 at 16k and 64k rows, widths 1k..8k at 32k rows.
Counting (bench.harness): attention TFLOP/s on real positions, causal halved, bwd = 2.5x and
fwd+bwd = 3.5x fwd (FA2's convention); LayerNorm GB/s over the minimal bytes moved. Each rate is
also given as % of the ceiling measured at the start of the same run (bf16 matmul, copy).
``rel_err`` = ||out - ref|| / ||ref|| of the forward output against the fp32 reference on one
slice (first sequence, first two heads; all rows for LayerNorm): a fast wrong kernel shows up.

Robustness: each provider's errors (OOM, unsupported, not implemented, compile failures) become
rows with a status; on CUDA the cases run in a worker process, and a crash that poisons the CUDA
context (an illegal address in a kernel under development) costs that provider's case, not the
run: the parent restarts a worker for what is left. ``--budget-s`` stops starting new work when
the budget is spent (the rest is recorded as skipped; cases run in priority order: LayerNorm at
width 512, padded train batches, long hd 64, full train batches, long hd 128, other widths), and
SIGTERM (``timeout``) still writes outputs. Timing defaults: 10 ms warm-up, 50 ms of repetitions
(hundreds of samples for the sub-millisecond cases, at least 10 for the slowest).

``--smoke`` (automatic without CUDA): tiny shapes in seconds, written to ``--out`` or a fresh
temporary directory, never to bench/results. Our Triton provider is skipped on CPU unless
``--cpu-triton`` (the interpreter is slow); torch.compile uses the aot_eager backend on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from bench import harness as H

ATTN_GROUPS = ("train-ragged", "train-dense", "long")
SDPA_PROVIDERS = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")
RAGGED_PROVIDERS = ("ours", "ours-varlen", "torch-varlen", *SDPA_PROVIDERS, "reference", "reference-compile")
DENSE_PROVIDERS = ("ours", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
LONG_PROVIDERS = ("ours", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
LN_PROVIDERS = ("ours", "eager", "compile")
TRITON_PROVIDERS = ("ours", "ours-varlen")
LN_EPS = 1e-5
FA2_FWD_BWD_TFLOPS = (215.0, 296.0)  # issue 3's target: FlashAttention-2's published fwd+bwd, hd 64
MASKED_SPEEDUP_TARGET = 1.5  # ours vs the best SDPA backend that accepts a padding mask
LN_TARGET_GBPS = 2000.0  # LayerNorm+GELU fwd+bwd, width 512, bf16
CHECK_HEADS = 2  # heads compared against the fp32 reference
CRASHES_BEFORE_EXCLUDING = 2  # a provider that kills its worker this often is left out afterwards
WORKER_GRACE_S = 45.0  # how long past --budget-s a worker may finish the provider in flight
FAULT_ENV = "FASTMT_BENCH_FAULT"  # test hook: a worker exits abruptly when it starts this provider

COLUMNS = (
    "timestamp", "bench", "case", "group", "provider", "mode", "status",
    "dtype", "B", "H", "Tq", "Tk", "D", "causal", "masked", "fill", "tokens", "rows", "width",
    "ms", "ms_p20", "ms_p80", "flops", "bytes", "tflops", "gbps", "pct_peak", "peak_mem_mb", "rel_err",
    "error", "note", "peak_tflops", "peak_gbps", *H.PROVENANCE_COLUMNS,
)


class Unsupported(RuntimeError):
    """A provider that cannot run this case by design (recorded as status 'unsupported')."""


class Terminated(BaseException):
    """SIGTERM (e.g. from ``timeout``): stop measuring, still write what was measured."""


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    bench: str  # "attention" | "layernorm"
    group: str  # "train-ragged" | "train-dense" | "long" | "ln"
    providers: tuple[str, ...]
    B: int = 0  # attention: sequences
    H: int = 0  # heads
    T: int = 0  # padded (maximum) length; self-attention, so Tq = Tk = T
    D: int = 0  # head dim
    causal: bool = False
    rows: int = 0  # layernorm: rows (tokens)
    width: int = 0  # layernorm: normalised width
    seed: int = 0

    @property
    def id(self) -> str:
        if self.bench == "layernorm":
            return f"ln-R{self.rows}-N{self.width}"
        return f"{self.group}-T{self.T}-hd{self.D}-{'causal' if self.causal else 'full'}"

    @property
    def ragged(self) -> bool:
        return self.group == "train-ragged"


def build_cases(*, smoke: bool, only: str | None) -> list[Case]:
    """All cases in priority order: the targets first, so a spent budget drops the least useful."""
    def attn(group, T, D, causal, B, Hh, providers):
        return Case("attention", group, providers, B=B, H=Hh, T=T, D=D, causal=causal, seed=T * 7 + D + causal)

    def ln(rows, width):
        return Case("layernorm", "ln", LN_PROVIDERS, rows=rows, width=width, seed=rows + width)

    if smoke:
        cases = [  # one case per group, every provider: the paths, not the numbers
            ln(64, 32),
            attn("train-ragged", 16, 16, True, 3, 2, RAGGED_PROVIDERS),
            attn("train-dense", 16, 16, False, 2, 2, DENSE_PROVIDERS),
            attn("long", 32, 64, True, 1, 2, LONG_PROVIDERS),
        ]
    else:
        train_tokens, train_heads, train_hd = 32768, 8, 64
        train_T = (512, 256, 128, 64, 32)
        long_tokens, long_hidden, long_T = 16384, 2048, (1024, 2048, 4096, 8192)
        cases = [ln(16384, 512), ln(65536, 512)]
        cases += [attn("train-ragged", T, train_hd, c, train_tokens // T, train_heads, RAGGED_PROVIDERS)
                  for c in (False, True) for T in train_T]
        cases += [attn("long", T, 64, c, long_tokens // T, long_hidden // 64, LONG_PROVIDERS)
                  for c in (False, True) for T in long_T]
        cases += [attn("train-dense", T, train_hd, c, train_tokens // T, train_heads, DENSE_PROVIDERS)
                  for c in (False, True) for T in train_T]
        cases += [attn("long", T, 128, c, long_tokens // T, long_hidden // 128, LONG_PROVIDERS)
                  for c in (False, True) for T in long_T]
        cases += [ln(32768, w) for w in (1024, 2048, 4096, 8192)]
    if only:
        cases = [c for c in cases if c.bench == only]
    return cases


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
@dataclass
class AttnInputs:
    q: torch.Tensor  # (B, H, T, D) leaf, requires grad
    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]  # real length of every sequence (all T when dense)
    lengths_t: torch.Tensor | None  # int32 (B,) on the device; None when dense
    sdpa_mask: torch.Tensor | None  # bool, True = attend; None when dense
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (total, H, D) leaves
    cu_seqlens: torch.Tensor | None = None  # int32 (B+1,)
    ref: torch.Tensor | None = None  # fp32 reference output, (1, CHECK_HEADS, L0, D)


@dataclass
class LNInputs:
    x: torch.Tensor  # (rows, width) leaves, requires grad
    r: torch.Tensor
    w: torch.Tensor  # (width,)
    b: torch.Tensor
    ref: torch.Tensor | None = None  # fp32 reference y


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _leaf(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    """Random N(0, scale^2) leaf drawn on ``device`` (never zeros: they hide bugs and time faster)."""
    x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return x.mul_(scale).to(dtype).requires_grad_()


def ragged_lengths(B: int, T: int, min_fill: float, gen: torch.Generator) -> list[int]:
    """Per-sequence lengths uniform in [ceil(min_fill * T), T], the first one exactly T."""
    low = max(1, math.ceil(min_fill * T))
    lengths = torch.randint(low, T + 1, (B,), generator=gen)
    lengths[0] = T
    return [int(v) for v in lengths]


def make_attention_inputs(case: Case, dtype: torch.dtype, device: torch.device, min_fill: float) -> AttnInputs:
    gen = _generator(case.seed, device)
    shape = (case.B, case.H, case.T, case.D)
    q, k, v = (_leaf(shape, dtype, device, gen) for _ in range(3))
    if not case.ragged:
        return AttnInputs(q, k, v, [case.T] * case.B, None, None)
    lengths = ragged_lengths(case.B, case.T, min_fill, _generator(case.seed))
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    j = torch.arange(case.T, device=device)
    keys = j[None, :] < lengths_t[:, None].long()  # (B, Tk)
    if case.causal:
        mask = keys[:, None, :] & (j[None, :, None] >= j[None, None, :])  # (B, Tq, Tk)
        mask = rearrange(mask, "b i j -> b 1 i j")
    else:
        mask = rearrange(keys, "b j -> b 1 1 j")
    inputs = AttnInputs(q, k, v, lengths, lengths_t, mask)
    if any(p in case.providers for p in ("ours-varlen", "torch-varlen")):
        cu = torch.zeros(case.B + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths_t, 0)
        valid = j[None, :] < lengths_t[:, None].long()  # (B, T)
        packed = [rearrange(t.detach(), "b h t d -> b t h d")[valid].contiguous().requires_grad_()
                  for t in (q, k, v)]  # (total, H, D)
        inputs.packed, inputs.cu_seqlens = tuple(packed), cu
    return inputs


def make_ln_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> LNInputs:
    gen = _generator(case.seed, device)
    x = _leaf((case.rows, case.width), dtype, device, gen)
    r = _leaf((case.rows, case.width), dtype, device, gen)
    w = _leaf((case.width,), dtype, device, gen, scale=0.1).detach().add_(1).requires_grad_()
    b = _leaf((case.width,), dtype, device, gen, scale=0.1)
    return LNInputs(x, r, w, b)


def attention_reference_slice(case: Case, d: AttnInputs) -> torch.Tensor:
    """fp32 reference output of the first sequence, first CHECK_HEADS heads: (1, h, L0, D)."""
    from kernels import attention_reference

    L0, h = d.lengths[0], min(CHECK_HEADS, case.H)
    q, k, v = (t.detach()[:1, :h, :L0].float() for t in (d.q, d.k, d.v))
    with torch.no_grad():
        return attention_reference(q, k, v, causal=case.causal, upcast=True)


def ln_reference(d: LNInputs) -> torch.Tensor:
    from kernels import layer_norm_reference

    with torch.no_grad():
        y, _ = layer_norm_reference(d.x.detach().float(), d.w.detach().float(), d.b.detach().float(),
                                    d.r.detach().float(), eps=LN_EPS, activation="gelu")
    return y


# ----------------------------------------------------------------------------------------------
# Providers: each returns a Prepared (a forward closure and the leaves it differentiates)
# ----------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    fn: Callable[[], Any]  # the forward; returns a tensor or a tuple of tensors
    leaves: tuple[torch.Tensor, ...]  # inputs whose .grad is reset between repetitions
    layout: str = "padded"  # "padded" (B, H, T, D) | "packed" (total, H, D) | "rows"
    note: str = ""


_COMPILED: dict[tuple[str, str], Callable] = {}


def _compiled(name: str, fn: Callable, backend: str, dynamic: bool | None) -> Callable:
    """One torch.compile wrapper per (function, backend) for the whole run (its cache persists)."""
    key = (name, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=dynamic)
    return _COMPILED[key]


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }[name]


def prepare_attention(name: str, case: Case, d: AttnInputs, opts: argparse.Namespace) -> Prepared:
    qkv = (d.q, d.k, d.v)
    if name in ("ours", "ours-varlen"):
        import kernels

        if name == "ours":
            kw: dict[str, Any] = {}
            if d.lengths_t is not None:
                kw = {"q_lengths": d.lengths_t, "k_lengths": d.lengths_t}
            return Prepared(lambda: kernels.attention(*qkv, causal=case.causal, backend="triton", **kw), qkv)
        qp, kp, vp = d.packed
        kw = {"cu_seqlens_q": d.cu_seqlens, "cu_seqlens_k": d.cu_seqlens,
              "max_seqlen_q": max(d.lengths), "max_seqlen_k": max(d.lengths)}
        return Prepared(lambda: kernels.attention(qp, kp, vp, causal=case.causal, backend="triton", **kw),
                        d.packed, "packed")
    if name == "torch-varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:
            raise Unsupported(f"torch.nn.attention.varlen is not in torch {torch.__version__}") from e
        params = inspect.signature(varlen_attn).parameters
        kw = {}
        if case.causal:  # the keyword changed between releases: is_causal (2.10), window_size (later)
            if "is_causal" in params:
                kw["is_causal"] = True
            elif "window_size" in params:
                kw["window_size"] = (-1, 0)
            else:
                raise Unsupported("varlen_attn takes neither is_causal nor window_size")
        qp, kp, vp = d.packed
        T = max(d.lengths)
        return Prepared(lambda: varlen_attn(qp, kp, vp, d.cu_seqlens, d.cu_seqlens, T, T, **kw), d.packed, "packed")
    if name in SDPA_PROVIDERS:
        mask = d.sdpa_mask
        is_causal = case.causal and mask is None
        backends = None if name == "sdpa" else [_sdpa_backend(name)]

        def sdpa():
            with _sdpa_kernel(backends) if backends else contextlib.nullcontext():
                return F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=is_causal)

        note = "" if mask is None else f"bool mask {tuple(mask.shape)}"
        return Prepared(sdpa, qkv, note=note)
    if name in ("reference", "reference-compile"):
        from kernels import attention_reference

        fn = attention_reference
        note = "upcast=False"
        if name == "reference-compile":
            fn = _compiled("attention_reference", attention_reference, opts.compile_backend, None)
            note += f", torch.compile(backend={opts.compile_backend}, dynamic=None)"
        kw = {"q_lengths": d.lengths_t, "k_lengths": d.lengths_t} if d.lengths_t is not None else {}
        return Prepared(lambda: fn(*qkv, causal=case.causal, upcast=False, **kw), qkv, note=note)
    raise ValueError(f"unknown attention provider {name!r}")


def _sdpa_kernel(backends):
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


def _ln_eager(x, w, b, r):
    s = x + r
    return F.gelu(F.layer_norm(s, (s.shape[-1],), w, b, LN_EPS)), s


def prepare_layernorm(name: str, case: Case, d: LNInputs, opts: argparse.Namespace) -> Prepared:
    leaves = (d.x, d.r, d.w, d.b)
    if name == "ours":
        import kernels

        return Prepared(lambda: kernels.layer_norm(d.x, d.w, d.b, d.r, eps=LN_EPS, activation="gelu",
                                                   return_residual=True, backend="triton"), leaves, "rows")
    if name == "eager":
        return Prepared(lambda: _ln_eager(d.x, d.w, d.b, d.r), leaves, "rows", "add + F.layer_norm + F.gelu")
    if name == "compile":
        from kernels import layer_norm_reference

        fn = _compiled("layer_norm_reference", layer_norm_reference, opts.compile_backend, False)
        return Prepared(lambda: fn(d.x, d.w, d.b, d.r, eps=LN_EPS, activation="gelu"), leaves, "rows",
                        f"torch.compile(layer_norm_reference, backend={opts.compile_backend}, dynamic=False)")
    raise ValueError(f"unknown layernorm provider {name!r}")


# ----------------------------------------------------------------------------------------------
# Running one case
# ----------------------------------------------------------------------------------------------
def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _pick(out, keep: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    outs = _as_tuple(out)
    return tuple(outs[i] for i in keep)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def _forward_slice(out: torch.Tensor, layout: str, case: Case, d: AttnInputs) -> torch.Tensor:
    L0, h = d.lengths[0], min(CHECK_HEADS, case.H)
    if layout == "packed":
        return rearrange(out[:L0, :h], "t h d -> 1 h t d")
    return out[:1, :h, :L0]


def classify(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower():
        return "oom"
    if isinstance(exc, NotImplementedError):
        return "not-implemented"
    if isinstance(exc, Unsupported) or "No available kernel" in text or "No viable backend" in text:
        return "unsupported"
    return "error"


def _message(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    reasons = []
    for w in caught:  # SDPA explains a refusal in warnings: keep the first few
        text = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if text and text not in reasons:
            reasons.append(text)
    if reasons:
        msg += " | " + " | ".join(reasons[:3])
    return msg[:400]


def cuda_context_broken(device: torch.device) -> bool:
    """After an error: does the CUDA context still work? (An illegal address poisons it for good.)"""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return False
    except Exception:  # noqa: BLE001 - any failure means the context is gone
        return True


@dataclass
class Context:
    """What every row shares: device, options, provenance and the ceilings of this run."""

    device: torch.device
    dtype: torch.dtype
    opts: argparse.Namespace
    prov: dict[str, Any]
    peaks: H.Peaks
    deadline: float | None  # time.time() after which no new provider starts
    emit: Callable[[dict[str, Any]], None]  # receives events {"ev": "start"|"row"|"end", ...}
    in_worker: bool = False
    skip: set[tuple[str, str]] = field(default_factory=set)  # (case id, provider) not to run


def case_columns(case: Case, dtype: torch.dtype, d: AttnInputs | None) -> dict[str, Any]:
    cols: dict[str, Any] = {"bench": case.bench, "case": case.id, "group": case.group,
                            "dtype": str(dtype).removeprefix("torch.")}
    if case.bench == "attention":
        cols.update(B=case.B, H=case.H, Tq=case.T, Tk=case.T, D=case.D, causal=case.causal, masked=case.ragged)
        if d is not None:
            real = sum(L * L for L in d.lengths)
            cols.update(fill=real / (case.B * case.T * case.T), tokens=sum(d.lengths))
    else:
        cols.update(rows=case.rows, width=case.width, tokens=case.rows)
    return cols


def work(case: Case, mode: str, d: AttnInputs | None, dtype: torch.dtype) -> dict[str, float]:
    if case.bench == "attention":
        lengths = d.lengths if d is not None else [case.T] * case.B
        return {"flops": H.attention_flops(lengths, lengths, case.H, case.D, causal=case.causal, mode=mode)}
    elem = torch.empty((), dtype=dtype).element_size()
    return {"bytes": H.layer_norm_bytes(case.rows, case.width, mode=mode, elem_bytes=elem)}


def make_row(ctx: Context, base: dict[str, Any], provider: str, mode: str, status: str, **values) -> dict[str, Any]:
    row = {"timestamp": ctx.prov.get("timestamp"), **base, "provider": provider, "mode": mode, "status": status,
           **values, **ctx.peaks.as_row()}
    row.update({k: ctx.prov.get(k, "") for k in H.PROVENANCE_COLUMNS})
    return row


def run_provider(ctx: Context, case: Case, name: str, inputs, base: dict[str, Any]) -> None:
    """Time one provider in every mode; emits one row per mode, whatever happens."""
    opts, device = ctx.opts, ctx.device
    modes = opts.modes
    rows_done: set[str] = set()

    def emit(mode, status, **values):
        ctx.emit({"ev": "row", "row": make_row(ctx, base, name, mode, status, **values)})
        rows_done.add(mode)

    if device.type != "cuda" and name in TRITON_PROVIDERS and not opts.cpu_triton:
        for mode in modes:
            emit(mode, "skipped", error="Triton needs a CUDA device (--cpu-triton runs it through the interpreter)")
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # each distinct warning once: SDPA explains its refusals
        try:
            prep = (prepare_attention if case.bench == "attention" else prepare_layernorm)(name, case, inputs, opts)
            outs = _as_tuple(prep.fn())  # first call: compile / autotune, untimed
            if case.bench == "attention":
                if inputs.ref is None:
                    inputs.ref = attention_reference_slice(case, inputs)
                err = rel_err(_forward_slice(outs[0], prep.layout, case, inputs), inputs.ref)
            else:
                if inputs.ref is None:
                    inputs.ref = ln_reference(inputs)
                err = rel_err(outs[0], inputs.ref)
            # random upstream gradients for every differentiable output (y and s for LayerNorm)
            keep = tuple(i for i, o in enumerate(outs) if o.requires_grad)
            douts = tuple(torch.randn_like(outs[i]) for i in keep)
            del outs
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            status, msg = classify(e), _message(e, caught)
            if status == "error":
                traceback.print_exc()
            for mode in modes:
                emit(mode, status, error=msg)
            _after_error(ctx, case, name)
            return
        for mode in modes:
            caught.clear()
            try:
                if mode == "fwd":
                    fn = prep.fn
                elif mode == "bwd":
                    graph_outs = _pick(prep.fn(), keep)

                    def fn(outs=graph_outs):
                        torch.autograd.backward(outs, douts, retain_graph=True)
                else:
                    def fn():
                        torch.autograd.backward(_pick(prep.fn(), keep), douts)
                t = H.bench(fn, device=device, warmup_ms=opts.warmup_ms, rep_ms=opts.rep_ms, grad_to_none=prep.leaves)
                mem = H.peak_memory_mb(fn, device, prep.leaves)
                counted = work(case, mode, inputs, ctx.dtype)
                if "flops" in counted:
                    rate = {"tflops": H.tflops(counted["flops"], t.ms)}
                    rate["pct_peak"] = 100 * rate["tflops"] / ctx.peaks.matmul_tflops
                else:
                    rate = {"gbps": H.gbps(counted["bytes"], t.ms)}
                    rate["pct_peak"] = 100 * rate["gbps"] / ctx.peaks.copy_gbps
                emit(mode, "ok", ms=t.ms, ms_p20=t.p20, ms_p80=t.p80, peak_mem_mb=mem, rel_err=err,
                     note=prep.note, **counted, **rate)
            except Exception as e:  # noqa: BLE001
                status = classify(e)
                if status == "error":
                    traceback.print_exc()
                emit(mode, status, error=_message(e, caught), note=prep.note)
                _after_error(ctx, case, name)
            finally:
                fn = graph_outs = None  # noqa: F841 - drop the graph before the next mode
                for leaf in prep.leaves:
                    leaf.grad = None


def _after_error(ctx: Context, case: Case, name: str) -> None:
    """Free memory after an error; in a worker, exit if the CUDA context is gone (the parent restarts)."""
    gc.collect()
    if ctx.device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    if cuda_context_broken(ctx.device):
        ctx.emit({"ev": "fatal", "case": case.id, "provider": name})
        if ctx.in_worker:
            os._exit(3)
        raise RuntimeError(f"CUDA context lost while running {name} on {case.id}; use --isolate process")


def run_cases(ctx: Context, cases: Sequence[Case]) -> None:
    for case in cases:
        todo = [p for p in case.providers if p in ctx.opts.providers and (case.id, p) not in ctx.skip]
        if not todo:
            continue
        if ctx.deadline is not None and time.time() > ctx.deadline:
            return
        try:
            if case.bench == "attention":
                inputs = make_attention_inputs(case, ctx.dtype, ctx.device, ctx.opts.min_fill)
            else:
                inputs = make_ln_inputs(case, ctx.dtype, ctx.device)
        except Exception as e:  # noqa: BLE001 - e.g. OOM while building inputs
            base = case_columns(case, ctx.dtype, None)
            for p in todo:
                ctx.emit({"ev": "start", "case": case.id, "provider": p})
                for mode in ctx.opts.modes:
                    ctx.emit({"ev": "row", "row": make_row(ctx, base, p, mode, classify(e), error=_message(e))})
                ctx.emit({"ev": "end", "case": case.id, "provider": p})
            _after_error(ctx, case, "inputs")
            continue
        base = case_columns(case, ctx.dtype, inputs if case.bench == "attention" else None)
        for p in todo:
            if ctx.deadline is not None and time.time() > ctx.deadline:
                return
            ctx.emit({"ev": "start", "case": case.id, "provider": p})
            if ctx.in_worker and os.environ.get(FAULT_ENV) == p:
                os._exit(7)  # fault injection for the isolation test
            run_provider(ctx, case, p, inputs, base)
            ctx.emit({"ev": "end", "case": case.id, "provider": p})
        del inputs
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Isolation: cases run in a worker process; the parent restarts one after a crash
# ----------------------------------------------------------------------------------------------
def _progress(ev: dict[str, Any]) -> None:
    if ev.get("ev") != "row":
        return
    r = ev["row"]
    rate = (f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else f"{r['gbps']:7.0f} GB/s") if r["status"] == "ok" else ""
    ms = f"{r['ms']:9.4f} ms" if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:90]}"
    print(f"  {r['case']:<30} {r['provider']:<18} {r['mode']:<8} {ms} {rate}", flush=True)


def run_in_process(ctx: Context, cases: Sequence[Case], sink: list[dict[str, Any]]) -> None:
    """Run ``cases`` here, appending rows to ``sink`` as they come (so an interruption keeps them)."""
    def emit(ev):
        _progress(ev)
        if ev.get("ev") == "row":
            sink.append(ev["row"])

    ctx.emit = emit
    run_cases(ctx, cases)


def run_isolated(ctx: Context, cases: Sequence[Case], sink: list[dict[str, Any]]) -> None:
    """Run ``cases`` in worker processes (``--worker SPEC``), restarting one after a crash.

    A worker appends events to a file: ``start`` / ``row``... / ``end`` per provider. When it dies,
    the provider in flight keeps the modes it finished and gets 'crash' rows for the others; a
    provider that crashes CRASHES_BEFORE_EXCLUDING times is left out for the rest of the run.
    Rows reach ``sink`` after each worker, and also when SIGTERM interrupts the wait.
    """
    workdir = Path(tempfile.mkdtemp(prefix="fastmt-bench-worker-"))
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    crashes: dict[str, int] = {}
    excluded: set[tuple[str, str]] = set()
    by_id = {c.id: c for c in cases}
    try:
        for attempt in range(1, 2 * len(cases) + 3):
            pending = [(c.id, p) for c in cases for p in c.providers
                       if p in ctx.opts.providers and (c.id, p) not in rows and (c.id, p) not in excluded]
            if not pending or (ctx.deadline is not None and time.time() > ctx.deadline):
                break
            events = workdir / f"events{attempt}.jsonl"
            spec = workdir / f"spec{attempt}.json"
            spec.write_text(json.dumps({
                "opts": vars(ctx.opts), "prov": ctx.prov, "peaks": asdict(ctx.peaks), "deadline": ctx.deadline,
                "skip": sorted(set(rows) | excluded), "events": str(events),
            }))
            # Same process group as this one: `timeout` signals reach the worker too, and nothing
            # outlives the device call.
            proc = subprocess.Popen([sys.executable, "-m", "bench.kernels", "--worker", str(spec)], cwd=H.REPO_ROOT)
            rc = None
            try:
                grace = WORKER_GRACE_S  # a provider that starts just before the deadline may still compile
                rc = proc.wait(timeout=None if ctx.deadline is None else max(30.0, ctx.deadline - time.time() + grace))
            except subprocess.TimeoutExpired:
                print(f"bench.kernels: worker {proc.pid} overran the budget; killing it", flush=True)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                running, partial = _collect_events(events, rows)
            if rc == 0:
                break
            if running is not None:  # the provider in flight died with its worker
                provider = running[1]
                crashes[provider] = crashes.get(provider, 0) + 1
                why = (f"worker exited with code {proc.returncode} while this ran (CUDA context lost or killed); "
                       "see the log")
                base = case_columns(by_id[running[0]], ctx.dtype, None)
                finished = {r["mode"] for r in partial}
                rows[running] = partial + [make_row(ctx, base, provider, m, "crash", error=why)
                                           for m in ctx.opts.modes if m not in finished]
                if crashes[provider] >= CRASHES_BEFORE_EXCLUDING:
                    excluded |= {(c.id, provider) for c in cases
                                 if provider in c.providers and (c.id, provider) not in rows}
                    print(f"bench.kernels: {provider} crashed {crashes[provider]} times; left out from here on",
                          flush=True)
            if rc is None:
                break  # killed at the deadline
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        sink.extend(r for pair_rows in rows.values() for r in pair_rows)
        for case_id, provider in sorted(excluded - set(rows)):
            base = case_columns(by_id[case_id], ctx.dtype, None)
            sink.extend(make_row(ctx, base, provider, m, "skipped",
                                 error=f"left out after {CRASHES_BEFORE_EXCLUDING} worker crashes")
                        for m in ctx.opts.modes)


def _collect_events(path: Path, rows: dict[tuple[str, str], list[dict[str, Any]]]):
    """Move finished providers' rows from a worker's event file into ``rows``.

    Returns ``(pair in flight, its rows so far)``, or ``(None, [])`` when the worker ended cleanly.
    """
    if not path.exists():
        return None, []
    running, partial = None, []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if ev["ev"] == "start":
            running, partial = (ev["case"], ev["provider"]), []
        elif ev["ev"] == "row" and running is not None:
            partial.append(ev["row"])
        elif ev["ev"] == "end":
            rows[(ev["case"], ev["provider"])] = partial
            running, partial = None, []
    return running, partial


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    opts = argparse.Namespace(**spec["opts"])
    device, dtype = _device_and_dtype(opts)
    _configure_torch(opts)
    events = open(spec["events"], "a", buffering=1)  # line-buffered: a crash loses at most one line

    def emit(ev):
        _progress(ev)
        events.write(json.dumps(ev, default=str) + "\n")
        events.flush()

    ctx = Context(device, dtype, opts, spec["prov"], H.Peaks(**spec["peaks"]), spec["deadline"], emit,
                  in_worker=True, skip={tuple(p) for p in spec["skip"]})
    run_cases(ctx, build_cases(smoke=opts.smoke, only=opts.only))
    events.close()
    return 0


# ----------------------------------------------------------------------------------------------
# Reports: markdown, plot, console summary
# ----------------------------------------------------------------------------------------------
_SHORT = {"unsupported": "n/a", "not-implemented": "not impl.", "oom": "OOM", "error": "error",
          "crash": "crash", "skipped": "skip"}


def _ok(r) -> bool:
    return r.get("status") == "ok"


def _val(r, key) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def pivot(rows, bench: str, mode: str, metric: str, providers: Sequence[str]) -> tuple[list[dict], list[str]]:
    """Rows = cases (in run order), columns = providers; cells 'rate (pct%)' or a short status."""
    sel = [r for r in rows if r["bench"] == bench and r["mode"] == mode]
    cases = list(dict.fromkeys(r["case"] for r in sel))
    present = [p for p in providers if any(r["provider"] == p for r in sel)]
    table = []
    for c in cases:
        line: dict[str, Any] = {"case": c}
        for r in sel:
            if r["case"] != c:
                continue
            if _ok(r):
                line[r["provider"]] = f"{H.fmt(_val(r, metric))} ({_val(r, 'pct_peak'):.0f}%)"
                if _val(r, "rel_err") > 2e-2:
                    line[r["provider"]] += " WRONG?"
            else:
                line[r["provider"]] = _SHORT.get(r["status"], r["status"])
        table.append(line)
    return table, present


def _met(ok: bool, value: float) -> str:
    return "-" if math.isnan(value) else ("yes" if ok else "no")


def summary_tables(rows) -> list[tuple[str, list[dict], list[str]]]:
    """The three target comparisons as (title, rows, columns)."""
    def get(case, provider, mode="fwd+bwd"):
        for r in rows:
            if r["case"] == case and r["provider"] == provider and r["mode"] == mode and _ok(r):
                return r
        return None

    out = []
    lo, hi = FA2_FWD_BWD_TFLOPS
    fa2 = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("group") == "long" and r.get("D") == 64):
        ours, flash = get(case, "ours"), get(case, "sdpa-flash")
        t_ours = _val(ours, "tflops") if ours else float("nan")
        t_flash = _val(flash, "tflops") if flash else float("nan")
        fa2.append({"case": case, "ours": t_ours, "sdpa-flash": t_flash, "ours/flash": t_ours / t_flash,
                    "target": f">= {lo:.0f}", "met": _met(t_ours >= lo, t_ours)})
    out.append((f"attention fwd+bwd TFLOP/s, hd 64, long (target: FlashAttention-2's published {lo:.0f}-{hi:.0f})",
                fa2, ["case", "ours", "sdpa-flash", "ours/flash", "target", "met"]))
    masked = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("group") == "train-ragged"):
        best_ours = max((get(case, p) for p in ("ours", "ours-varlen") if get(case, p)),
                        key=lambda r: _val(r, "tflops"), default=None)
        best_sdpa = max((get(case, p) for p in SDPA_PROVIDERS if get(case, p)),
                        key=lambda r: _val(r, "tflops"), default=None)
        tv = get(case, "torch-varlen")
        speed = (_val(best_ours, "tflops") / _val(best_sdpa, "tflops")) if best_ours and best_sdpa else float("nan")
        masked.append({
            "case": case, "ours": _val(best_ours, "tflops") if best_ours else float("nan"),
            "ours via": best_ours["provider"] if best_ours else "-",
            "best sdpa": _val(best_sdpa, "tflops") if best_sdpa else float("nan"),
            "sdpa via": best_sdpa["provider"] if best_sdpa else "-",
            "torch-varlen": _val(tv, "tflops") if tv else float("nan"),
            "speedup": speed, "met": _met(speed >= MASKED_SPEEDUP_TARGET, speed),
        })
    out.append((f"padded train batches, fwd+bwd TFLOP/s on real tokens: ours vs best SDPA with a padding mask "
                f"(target >= {MASKED_SPEEDUP_TARGET}x)", masked,
                ["case", "ours", "ours via", "best sdpa", "sdpa via", "torch-varlen", "speedup", "met"]))
    ln = []
    for case in dict.fromkeys(r["case"] for r in rows if r.get("bench") == "layernorm" and r.get("width") == 512):
        ours, comp, eager = get(case, "ours"), get(case, "compile"), get(case, "eager")
        g = _val(ours, "gbps") if ours else float("nan")
        ratio = _val(comp, "ms") / _val(ours, "ms") if ours and comp else float("nan")
        ln.append({"case": case, "ours GB/s": g, "compile GB/s": _val(comp, "gbps") if comp else float("nan"),
                   "eager GB/s": _val(eager, "gbps") if eager else float("nan"), "ours vs compile": ratio,
                   "met": _met(g >= LN_TARGET_GBPS and ratio > 1, g)})
    out.append((f"LayerNorm+residual+GELU fwd+bwd, width 512 (target >= {LN_TARGET_GBPS:,.0f} GB/s and faster "
                f"than torch.compile)", ln, ["case", "ours GB/s", "compile GB/s", "eager GB/s", "ours vs compile", "met"]))
    return out


def write_markdown(path: Path, rows, prov, peaks: H.Peaks, opts) -> None:
    attn_providers = list(dict.fromkeys(RAGGED_PROVIDERS + DENSE_PROVIDERS + LONG_PROVIDERS))
    parts = [
        f"# Kernel benchmarks: {prov.get('gpu')}",
        "",
        H.provenance_markdown(prov, peaks),
        "",
        "Written by `python -m bench.kernels` (see its docstring). Times are "
        + ("`triton.testing.do_bench` medians (L2 flushed before each repetition, " if prov.get("gpu_slug") != "cpu"
           else "wall-clock medians of a CPU smoke run (")
        + f"warm-up {opts.warmup_ms:g} ms, {opts.rep_ms:g} ms of repetitions); cells are rate "
        "(% of the ceiling measured above). Attention TFLOP/s count real (unmasked) positions only, causal "
        "halved, bwd = 2.5x and fwd+bwd = 3.5x the forward (FlashAttention-2's convention): padding a "
        "provider computes is never counted. LayerNorm GB/s count the minimal bytes (inputs read once, "
        "outputs written once). 'WRONG?' marks a forward more than 2e-2 (relative) from the fp32 "
        "reference. Full rows, p20/p80 and peak memory: the CSV beside this file.",
        "",
        "## Targets",
    ]
    for title, table, cols in summary_tables(rows):
        parts += ["", f"**{title}**", "", H.markdown_table(table, cols) if table else "(no rows)"]
    for mode in opts.modes:
        table, present = pivot(rows, "attention", mode, "tflops", attn_providers)
        if table:
            parts += ["", f"## Attention {mode}: TFLOP/s", "", H.markdown_table(table, ["case", *present])]
    for mode in opts.modes:
        table, present = pivot(rows, "layernorm", mode, "gbps", LN_PROVIDERS)
        if table:
            parts += ["", f"## LayerNorm+residual+GELU {mode}: GB/s", "", H.markdown_table(table, ["case", *present])]
    problems = [r for r in rows if not _ok(r) and r["status"] != "skipped"]
    if problems:
        parts += ["", "## Rows that did not run", "",
                  H.markdown_table(problems, ["case", "provider", "mode", "status", "error"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def write_plot(path: Path, rows, prov, peaks: H.Peaks) -> Path:
    sel = [r for r in rows if r["mode"] == "fwd+bwd" and _ok(r)]
    fig, axes = H.new_figure(2, 3)

    def attn_series(pred, suffix_causal: bool):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in sel:
            if r["bench"] == "attention" and pred(r):
                label = r["provider"] + (" (causal)" if suffix_causal and r["causal"] else "")
                series.setdefault(label, []).append((r["Tq"], _val(r, "tflops")))
        return series

    panels = [
        (lambda r: r["group"] == "train-ragged" and not r["causal"], False, "padded batches, padding mask, full"),
        (lambda r: r["group"] == "train-ragged" and r["causal"], False, "padded batches, padding mask, causal"),
        (lambda r: r["group"] == "train-dense", True, "full batches (no mask)"),
        (lambda r: r["group"] == "long" and r["D"] == 64, True, "long, head dim 64"),
        (lambda r: r["group"] == "long" and r["D"] == 128, True, "long, head dim 128"),
    ]
    for ax, (pred, suffix, title) in zip(axes.flat, panels):
        series = attn_series(pred, suffix)
        if "dim 64" in title and series:
            ax.axhspan(*FA2_FWD_BWD_TFLOPS, color="tab:green", alpha=0.12, label="FA2 published (target)")
        H.line_panel(ax, series, title=f"attention fwd+bwd: {title}", xlabel="sequence length T",
                     ylabel="TFLOP/s (real positions)")
    ln_rows = [r for r in sel if r["bench"] == "layernorm"]
    cats = list(dict.fromkeys(f"{r['width']}x{r['rows'] // 1024}k" if r["rows"] >= 1024 else f"{r['width']}x{r['rows']}"
                              for r in ln_rows))
    groups = {p: [float("nan")] * len(cats) for p in LN_PROVIDERS}
    for r in ln_rows:
        cat = f"{r['width']}x{r['rows'] // 1024}k" if r["rows"] >= 1024 else f"{r['width']}x{r['rows']}"
        groups[r["provider"]][cats.index(cat)] = _val(r, "gbps")
    ax = axes.flat[5]
    H.bar_panel(ax, cats, groups, title="LayerNorm+residual+GELU fwd+bwd", xlabel="width x rows", ylabel="GB/s")
    ax.axhline(peaks.copy_gbps, color="gray", linestyle="--", linewidth=1)
    ax.text(0, peaks.copy_gbps, " copy ceiling", va="bottom", fontsize=7, color="gray")
    sha = str(prov.get("git_sha", ""))[:10]
    return H.save_figure(fig, path, suptitle=f"fastmt kernels on {prov.get('gpu')} (torch {prov.get('torch')}, "
                                             f"triton {prov.get('triton')}, git {sha})")


def print_summary(rows, prov, peaks: H.Peaks, paths: Sequence[Path]) -> None:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print()
    print(f"== bench.kernels summary: {prov.get('gpu')}, torch {prov.get('torch')}, triton {prov.get('triton')}, "
          f"git {str(prov.get('git_sha'))[:10]} ==")
    print(f"ceilings this run: copy {peaks.copy_gbps:,.0f} GB/s, {peaks.dtype} matmul {peaks.matmul_tflops:,.1f} TFLOP/s")
    for title, table, cols in summary_tables(rows):
        print(f"\n{title}")
        print(H.text_table(table, cols) if table else "(no rows)")
    print("\nrows by status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    bad = sorted({(r["provider"], r["status"], r.get("error", "")[:100]) for r in rows
                  if r["status"] in ("error", "crash", "oom", "not-implemented")})
    for provider, status, err in bad[:8]:
        print(f"  {provider}: {status}: {err}")
    for p in paths:
        print(f"wrote {p}")


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def _device_and_dtype(opts) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, getattr(torch, opts.dtype)


def _configure_torch(opts) -> None:
    import torch._dynamo

    # Recompiles past the limit fall back to eager *silently*: raise it so "compile" stays compiled.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in seconds (automatic without CUDA)")
    p.add_argument("--only", choices=("attention", "layernorm"), help="one benchmark")
    p.add_argument("--out", type=Path, help="output folder (default bench/results; a temp dir with --smoke)")
    p.add_argument("--providers", help="comma-separated subset of providers")
    p.add_argument("--modes", default=",".join(H.MODES), help="comma-separated subset of fwd,bwd,fwd+bwd")
    p.add_argument("--budget-s", type=float, help="start no new work after this many seconds (rest: skipped)")
    p.add_argument("--warmup-ms", type=float, help="do_bench warm-up (default 10; smoke 1)")
    p.add_argument("--rep-ms", type=float, help="do_bench repetition time (default 50; smoke 5)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="input dtype")
    p.add_argument("--min-fill", type=float, default=0.5,
                   help="ragged lengths are uniform in [min_fill*T, T] (default 0.5)")
    p.add_argument("--compile-backend", help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--isolate", choices=("auto", "process", "none"), default="auto",
                   help="run cases in a worker process (auto: on CUDA)")
    p.add_argument("--cpu-triton", action="store_true", help="run our Triton providers on CPU (interpreter)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.worker:
        return opts
    cuda = torch.cuda.is_available()
    if opts.cpu_triton and not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    if not cuda and not opts.smoke:
        print("bench.kernels: no CUDA device: running the --smoke configuration", flush=True)
        opts.smoke = True
    opts.warmup_ms = opts.warmup_ms if opts.warmup_ms is not None else (1.0 if opts.smoke else 10.0)
    opts.rep_ms = opts.rep_ms if opts.rep_ms is not None else (5.0 if opts.smoke else 50.0)
    opts.compile_backend = opts.compile_backend or ("inductor" if cuda else "aot_eager")
    opts.modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    bad = [m for m in opts.modes if m not in H.MODES]
    if bad or not opts.modes:
        p.error(f"--modes: {bad or opts.modes} not in {H.MODES}")
    known = list(dict.fromkeys(RAGGED_PROVIDERS + DENSE_PROVIDERS + LONG_PROVIDERS + LN_PROVIDERS))
    opts.providers = [s.strip() for s in opts.providers.split(",")] if opts.providers else known
    bad = [s for s in opts.providers if s not in known]
    if bad:
        p.error(f"--providers: unknown {bad}; choose from {known}")
    if not 0 < opts.min_fill <= 1:
        p.error(f"--min-fill must be in (0, 1], got {opts.min_fill}")
    if opts.out is None:
        opts.out = Path(tempfile.mkdtemp(prefix="fastmt-bench-smoke-")) if opts.smoke else H.RESULTS_DIR
    opts.out = str(opts.out)
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        return worker_main(opts.worker)
    t_start = time.time()
    device, dtype = _device_and_dtype(opts)
    _configure_torch(opts)

    def on_term(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    prov = H.provenance(device)
    print(f"bench.kernels: {prov['gpu']} | torch {prov['torch']} | triton {prov['triton']} | CUDA {prov['cuda'] or '-'} "
          f"| git {prov['git_sha'][:10]}{' (dirty)' if prov['git_dirty'] == 'yes' else ''} | out {opts.out}", flush=True)
    peak_kw = {"warmup_ms": opts.warmup_ms, "rep_ms": opts.rep_ms}
    if opts.smoke:
        peak_kw.update(copy_bytes=4 * 2**20, matmul_n=128)
    peaks = H.measure_peaks(device, dtype=dtype, **peak_kw)
    print(f"ceilings: copy {peaks.copy_gbps:,.0f} GB/s, {peaks.dtype} matmul {peaks.matmul_tflops:,.1f} TFLOP/s", flush=True)
    deadline = t_start + opts.budget_s if opts.budget_s else None
    cases = build_cases(smoke=opts.smoke, only=opts.only)
    ctx = Context(device, dtype, opts, prov, peaks, deadline, emit=lambda ev: None)
    isolate = opts.isolate == "process" or (opts.isolate == "auto" and device.type == "cuda")
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        (run_isolated if isolate else run_in_process)(ctx, cases, rows)
    except (Terminated, KeyboardInterrupt):
        interrupted = True
        print("bench.kernels: interrupted; writing what was measured", flush=True)
    except Exception:  # noqa: BLE001 - e.g. a lost CUDA context with --isolate none: keep the rows
        interrupted = True
        traceback.print_exc()
        print("bench.kernels: aborted; writing what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = _fill_skipped(ctx, cases, rows, interrupted)
    out = Path(opts.out)
    slug = prov["gpu_slug"]
    paths = [H.append_csv(H.result_path(out, "kernels", slug, "csv"), rows, COLUMNS)]
    md = H.result_path(out, "kernels", slug, "md")
    write_markdown(md, rows, prov, peaks, opts)
    paths.append(md)
    if not opts.no_plot:
        try:
            paths.append(write_plot(H.result_path(out, "kernels", slug, "png"), rows, prov, peaks))
        except Exception:  # noqa: BLE001 - a plot must not cost the numbers
            traceback.print_exc()
    print_summary(rows, prov, peaks, paths)
    print(f"bench.kernels: {time.time() - t_start:.0f} s", flush=True)
    return 130 if interrupted else 0


def _fill_skipped(ctx: Context, cases: Sequence[Case], rows: list[dict[str, Any]], interrupted: bool) -> list[dict]:
    """Record every (case, provider, mode) that never ran, so the CSV shows what is missing and why."""
    have = {(r["case"], r["provider"], r["mode"]) for r in rows}
    if interrupted:
        why = "interrupted or aborted (see the log)"
    elif ctx.deadline is not None and time.time() > ctx.deadline:
        why = f"time budget (--budget-s {ctx.opts.budget_s:g}) spent"
    else:
        why = "not run: the worker stopped early (see the log)"
    out = list(rows)
    for c in cases:
        base = case_columns(c, ctx.dtype, None)
        for p in c.providers:
            if p not in ctx.opts.providers:
                continue
            for m in ctx.opts.modes:
                if (c.id, p, m) not in have:
                    out.append(make_row(ctx, base, p, m, "skipped", error=why))
    return out


if __name__ == "__main__":
    sys.exit(main())
