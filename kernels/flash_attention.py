"""Flash attention for fastmt: the public op ``attention`` over two Triton tilings, PyTorch's SDPA and an
einops reference.

Layouts
  padded  q (B, H, Tq, D), k/v (B, H, Tk, D), optional int32 (B,) ``q_lengths`` / ``k_lengths``;
          positions past a sequence's length are ignored as keys and give 0 as queries.
  varlen  q (total_q, H, D), k/v (total_k, H, D) packed back to back, int32 (B+1,) ``cu_seqlens_q`` /
          ``cu_seqlens_k`` (cumulative lengths from 0), python-int ``max_seqlen_q`` / ``max_seqlen_k``.

Masking (both layouts, every backend): query i of a sequence with lengths (Lq, Lk) sees key j iff
j < Lk and, when ``causal``, j <= i + (Lk - Lq) (bottom-right aligned, as FlashAttention-2; j <= i for
self-attention). A query row with no visible key gives 0, never NaN.

Triton backend, two tilings of the same algorithm (FlashAttention-2, deterministic backward):
kernels/sequence_attention.py gives each (sequence, head, BLOCK_M rows) a program (the padded layout,
long sequences); kernels/packed_attention.py tiles consecutive rows of the packed stream whatever
segments they hold (packed batches of short segments, where per-sequence tiles would be mostly
empty). ``attention_tiling`` picks one per varlen call; ``FASTMT_ATTN_TILING`` overrides it. Both take
fp16 / bf16 on CUDA (also fp32 under ``TRITON_INTERPRET=1``) and head dims 16/32/64/128; no dropout,
GQA, arbitrary masks or double backward: ``backend="auto"`` serves those with SDPA or the reference.

Host path (one ``kernels._utils.KernelOp`` per tiling): under torch.compile the ``torch.library`` custom
ops (opaque nodes with fake kernels); eagerly a plain ``torch.autograd.Function`` over the same launchers
(the dispatcher's per-call host cost buys nothing there), or the launcher alone when no gradient is needed. The launchers launch
through ``kernels._utils.launch`` (``kernel[grid]``), inside the custom ops too: ``wrap_triton`` there
built a new Autotuner on every call on CUDA.

Layout of this file: reference -> the registration (KernelOp) of both tilings -> checks
and dispatch -> public ``attention`` -> ``FlashAttention`` module.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from torch import nn

from kernels import ATTN_BACKENDS, ATTN_HEAD_DIMS
from kernels._utils import KernelOp, resolve_backend, triton_usable
from kernels.packed_attention import segment_ids, stream_attention_bwd, stream_attention_fwd
from kernels.sequence_attention import lse_shape, sequence_attention_bwd, sequence_attention_fwd

HEAD_DIMS = ATTN_HEAD_DIMS  # head dims both tilings' kernels take


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch + einops): the semantics every backend must match.
# ----------------------------------------------------------------------------------------------
def visibility_mask(
    Tq: int, Tk: int, q_lengths: torch.Tensor, k_lengths: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Boolean (B, 1, Tq, Tk): True where query i may attend to key j (see module docstring)."""
    i = torch.arange(Tq, device=q_lengths.device)[None, :, None]  # (1, Tq, 1)
    j = torch.arange(Tk, device=q_lengths.device)[None, None, :]  # (1, 1, Tk)
    lq = q_lengths.long()[:, None, None]  # (B, 1, 1)
    lk = k_lengths.long()[:, None, None]
    mask = (j < lk) & (i < lq)
    if causal:
        mask = mask & (j <= i + (lk - lq))
    return rearrange(mask, "b i j -> b 1 i j")


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_lengths: torch.Tensor | None = None,
    k_lengths: torch.Tensor | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Padded-layout attention that materialises the (Tq, Tk) scores. Returns (B, H, Tq, D).

    ``upcast=True`` computes in fp32 and casts the result back to ``q.dtype``.
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    if q_lengths is None:
        q_lengths = torch.full((B,), Tq, dtype=torch.int32, device=q.device)
    if k_lengths is None:
        k_lengths = torch.full((B,), Tk, dtype=torch.int32, device=q.device)
    scores = einsum(q, k, "b h i d, b h j d -> b h i j") * scale  # (B, H, Tq, Tk)
    mask = visibility_mask(Tq, Tk, q_lengths, k_lengths, causal)  # (B, 1, Tq, Tk)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(mask, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))  # empty rows -> 0
    out = einsum(probs, v, "b h i j, b h j d -> b h i d")  # (B, H, Tq, D)
    return out.to(dtype)


def pad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """(total, H, D) packed -> (B, H, max_seqlen, D) zero-padded. Static shapes only (compile-friendly)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # (B,)
    pos = torch.arange(max_seqlen, device=x.device)  # (T,)
    valid = pos[None, :] < lengths[:, None]  # (B, T)
    index = (cu_seqlens[:-1].long()[:, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))  # (B, T)
    out = x[index] * valid[:, :, None, None].to(x.dtype)  # (B, T, H, D)
    return rearrange(out, "b t h d -> b h t d")


def unpad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(B, H, T, D) padded -> (total, H, D) packed: a gather by (sequence, position) of every packed
    token, so the output shape is static (no boolean indexing). Tokens past cu_seqlens[-1] give 0."""
    B, T = x.shape[0], x.shape[2]
    t = torch.arange(total, device=x.device)  # (total,) packed token index
    seq = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)  # (total,) first segment ending after t
    inside = seq < B
    seq = seq.clamp(max=B - 1)
    pos = (t - cu_seqlens.long()[seq]).clamp(0, T - 1)  # (total,) position inside its segment
    packed = rearrange(x, "b h t d -> b t h d")[seq, pos]  # (total, H, D)
    return packed * inside[:, None, None].to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Registration: one KernelOp per tiling (custom ops for torch.compile, autograd rule, eager path).
# Both tilings' launchers take (q, k, v, *index tensors, *python args) forward and (dO, q, k, v, out,
# lse, *index tensors, *python args) backward, so one save and one gradient helper serve both.
# ----------------------------------------------------------------------------------------------
def _save(ctx, inputs: tuple, output: tuple) -> None:
    """Save what a backward launcher reads after dO: q, k, v, out, lse and the index tensors (saved), then
    the python arguments (``ctx.args``)."""
    q, k, v, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(a for a in rest if isinstance(a, torch.Tensor)))
    ctx.args = tuple(a for a in rest if not isinstance(a, torch.Tensor))
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)


def _grads(ctx, bwd, d_out: torch.Tensor, _d_lse) -> tuple:
    dq, dk, dv = bwd(d_out, *ctx.saved_tensors, *ctx.args)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)  # nothing for the index tensors and python args


def _fwd_fake_sequence(q, k, v, *_):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q), dtype=torch.float32)


def _fwd_fake_stream(q, k, v, *_):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _bwd_fake(do, q, k, v, *_):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _stream_fwd(q, k, v, cu_q, cu_k, seg_q, seg_k, causal, softmax_scale):
    return stream_attention_fwd(q, k, v, cu_q, cu_k, seg_q, causal, softmax_scale)  # seg_k: for the backward


_BWD_HEAD = "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
# The launches each op declares (``op.shapes``): its GPU tests' grids, which ``bench.aot`` compiles ahead of time.
_BF16, _FP16 = torch.bfloat16, torch.float16
_VARLEN = {"self-ragged": ([37, 1, 256, 129], [37, 1, 256, 129]), "cross-ragged-nokeys": ([50, 300, 7], [64, 0, 513])}
_VARLEN_COVER = [("self-ragged", 64, _BF16, True), ("self-ragged", 16, _FP16, False),  # (lengths, D, dtype, causal)
                 ("cross-ragged-nokeys", 128, _FP16, False), ("cross-ragged-nokeys", 64, _BF16, True)]
_SEQUENCE_SHAPES = {
    "padded": {"B1-T1": (1, 1, 1, 1), "B2-H3-T17": (2, 3, 17, 17), "B4-H4-T128": (4, 4, 128, 128),  # (B, H, Tq, Tk)
               "B2-H3-Tq127-Tk255": (2, 3, 127, 255), "B2-H4-Tq300-Tk77": (2, 4, 300, 77),
               "B1-H2-Tq1023-Tk1024": (1, 2, 1023, 1024)},
    # (shape, D, dtype, causal, ragged): three shapes per head dim, then the long and degenerate ones
    "cover": [(shape, D, dtype, causal, ragged) for D in (16, 32, 64, 128) for shape, dtype, causal, ragged in (
        ("B2-H3-T17", _BF16, True, True), ("B2-H3-Tq127-Tk255", _FP16, False, True),
        ("B2-H4-Tq300-Tk77", _BF16, True, False))] + [
        ("B1-T1", 64, _FP16, True, False), ("B4-H4-T128", 64, _BF16, False, False),
        ("B1-H2-Tq1023-Tk1024", 64, _BF16, True, True), ("B1-H2-Tq1023-Tk1024", 128, _FP16, False, False)],
    "varlen": _VARLEN, "varlen_cover": _VARLEN_COVER}
_STREAM_SHAPES = {
    "varlen": _VARLEN, "varlen_cover": _VARLEN_COVER,
    # (kind, D, dtype) of one packed batch of PACKED_LAYOUT's shape (kernels.packed_attention.packed_layout)
    "packed": [("encoder-self", 64, _BF16), ("decoder-causal", 64, _BF16), ("cross", 64, _BF16),
               ("decoder-causal", 16, _FP16), ("cross", 32, _FP16), ("encoder-self", 128, _FP16)],
    "packed_layout": {"capacity": (2048, 2048), "slots": 176, "max_len": 128, "mean": 15, "p99": 75}}
SEQUENCE_ATTENTION_OP = KernelOp(
    "fastmt::sequence_attention_fwd", sequence_attention_fwd,
    "(Tensor q, Tensor k, Tensor v, Tensor seq_q, Tensor seq_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    "bool causal, float softmax_scale) -> (Tensor, Tensor)", _fwd_fake_sequence,
    bwd=sequence_attention_bwd, bwd_fake=_bwd_fake, save=_save, grads=_grads,
    bwd_schema=_BWD_HEAD + "Tensor seq_q, Tensor seq_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
                           "float softmax_scale) -> (Tensor, Tensor, Tensor)", shapes=_SEQUENCE_SHAPES,
)
STREAM_ATTENTION_OP = KernelOp(
    "fastmt::stream_attention_fwd", _stream_fwd,
    "(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, Tensor seg_q, Tensor seg_k, bool causal, "
    "float softmax_scale) -> (Tensor, Tensor)", _fwd_fake_stream,
    bwd=stream_attention_bwd, bwd_fake=_bwd_fake, save=_save, grads=_grads,
    bwd_schema=_BWD_HEAD + "Tensor cu_q, Tensor cu_k, Tensor seg_q, Tensor seg_k, bool causal, "
                           "float softmax_scale) -> (Tensor, Tensor, Tensor)", shapes=_STREAM_SHAPES,
)


def sequence_attention(q, k, v, seq_q, seq_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                       softmax_scale: float) -> torch.Tensor:
    """Per-sequence-tiled attention on validated inputs (``seq_q`` / ``seq_k``: int32 lengths (B,) padded,
    cu_seqlens (B+1,) varlen). Compiled: the custom op; eager: the autograd.Function, or the launcher
    alone when no gradient is needed."""
    return SEQUENCE_ATTENTION_OP(q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)[0]


def stream_attention(q, k, v, cu_q, cu_k, seg_q, seg_k, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Stream-tiled attention on validated varlen inputs (``seg_*``: ``segment_ids`` of each side), as
    ``sequence_attention`` dispatches."""
    return STREAM_ATTENTION_OP(q, k, v, cu_q, cu_k, seg_q, seg_k, causal, softmax_scale)[0]


# ----------------------------------------------------------------------------------------------
# Public function and module: checks, the backend and tiling rules, ``attention``, ``FlashAttention``
# ----------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, causal, q_lengths, k_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  segment_ids_q=None, segment_ids_k=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"attention: {name}.dtype={t.dtype} is not floating point")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.dim() == 0 or q.shape[-1] == 0:
        raise ValueError(f"attention: head dim must be > 0, got q shape {tuple(q.shape)}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
            raise ValueError("attention: varlen layout needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k")
        if q_lengths is not None or k_lengths is not None:
            raise ValueError("attention: pass either q_lengths/k_lengths (padded) or cu_seqlens (varlen), not both")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                f"attention: varlen q, k, v must be (total, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if k.shape != v.shape or q.shape[1:] != k.shape[1:]:
            raise ValueError(f"attention: shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} do not match")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(f"attention: {name} must be int32 (B+1,), got {cu.dtype} {tuple(cu.shape)}")
            if cu.device != q.device:
                raise ValueError(f"attention: {name} is on {cu.device}, q on {q.device}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"attention: cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences, cu_seqlens_k {cu_seqlens_k.numel() - 1}"
            )
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0:
                raise ValueError(f"attention: {name} must be a python int >= 0, got {m!r}")
        _check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        _check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        _check_segment_ids("segment_ids_q", segment_ids_q, cu_seqlens_q, q)
        _check_segment_ids("segment_ids_k", segment_ids_k, cu_seqlens_k, k)
    else:
        if segment_ids_q is not None or segment_ids_k is not None:
            raise ValueError("attention: segment_ids_q/segment_ids_k belong to the varlen layout (cu_seqlens); "
                             "the padded layout takes q_lengths/k_lengths")
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"attention: padded q, k, v must be (B, H, T, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
            raise ValueError(f"attention: shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} do not match")
        B = q.shape[0]
        for name, lens in (("q_lengths", q_lengths), ("k_lengths", k_lengths)):
            if lens is None:
                continue
            if lens.dtype != torch.int32 or lens.shape != (B,):
                raise ValueError(f"attention: {name} must be int32 ({B},), got {lens.dtype} {tuple(lens.shape)}")
            if lens.device != q.device:
                raise ValueError(f"attention: {name} is on {lens.device}, q on {q.device}")
            T = q.shape[2] if name == "q_lengths" else k.shape[2]
            if _inspectable(lens) and bool(((lens < 0) | (lens > T)).any()):
                raise ValueError(f"attention: {name}={lens.tolist()} must lie in [0, {T}] (T of the padded tensor)")


def _inspectable(index: torch.Tensor) -> bool:
    """Data-dependent checks run eagerly on CPU index tensors only: on CUDA they would cost a host
    sync per call, and under torch.compile a graph break (the kernels clamp lengths to the tensor
    extents, so unchecked lengths cannot read or write out of bounds)."""
    return index.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int, max_seqlen: int) -> None:
    if not _inspectable(cu):
        return
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
        raise ValueError(
            f"attention: {name}={cu.tolist()} must start at 0, be non-decreasing and end at the packed total {total}"
        )
    if int(lengths.max()) > max_seqlen:
        raise ValueError(f"attention: {name} has a sequence of length {int(lengths.max())} > max_seqlen {max_seqlen}")


def _check_segment_ids(name: str, ids: torch.Tensor | None, cu: torch.Tensor, x: torch.Tensor) -> None:
    if ids is None:
        return
    total = x.shape[0]
    fix = f"kernels.packed_attention.segment_ids(cu_seqlens, {total})"
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.shape != (total,):
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"attention: {name} must be int32 ({total},) from {fix}, got {got}")
    if ids.device != x.device:
        raise ValueError(f"attention: {name} is on {ids.device}, q on {x.device}")
    if _inspectable(ids) and _inspectable(cu):
        want = segment_ids(cu, total)
        wrong = (ids != want).nonzero()
        if wrong.numel():
            t = int(wrong[0, 0])
            raise ValueError(f"attention: {name}[{t}]={int(ids[t])} but token {t} lies in segment {int(want[t])} "
                             f"of {cu.tolist()}; compute it with {fix}")


def check_triton_support(q: torch.Tensor) -> None:
    """Raise TypeError (dtype) or ValueError (head dim, then device) when the kernels cannot serve ``q``.
    The dtype comes first, so a CPU tensor of an unsupported dtype reports its dtype on every machine."""
    # fp32 only for CPU tensors under the interpreter (on CUDA tl.dot would round it to tf32)
    dtypes = (torch.float16, torch.bfloat16) + (() if q.is_cuda else (torch.float32,))
    if q.dtype not in dtypes:
        raise TypeError(f"attention: backend='triton' does not support dtype={q.dtype} (supported on CUDA: fp16, "
                        f"bf16; under TRITON_INTERPRET=1 on the CPU also fp32; use backend='auto' or 'sdpa')")
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"attention: backend='triton' does not support head dim D={D} (supported: {HEAD_DIMS}; "
                         f"use backend='auto' or 'sdpa')")
    if not triton_usable(q):
        raise ValueError(f"attention: backend='triton' does not support device={q.device} (Triton needs CUDA "
                         f"tensors, or TRITON_INTERPRET=1 on the CPU)")


def triton_supports(q: torch.Tensor) -> bool:
    """Whether ``check_triton_support`` passes."""
    try:
        check_triton_support(q)
    except (TypeError, ValueError):
        return False
    return True


ATTN_TILINGS = ("auto", "sequence", "stream")
TILING_ENV = "FASTMT_ATTN_TILING"
# "auto" tiles the stream when segments are short on average: the mean slot length max(C_q, C_k) / N
# (static: no host sync, no recompile) is at most this many tokens, about one 64-row tile
STREAM_MEAN_MAX = 64


def attention_tiling(total_q: int, total_k: int, slots: int) -> str:
    """Which Triton tiling serves a varlen call: "stream" (tiles span segments, kernels/packed_attention.py)
    or "sequence" (per-sequence tiles, kernels/sequence_attention.py). ``FASTMT_ATTN_TILING`` in
    {auto, sequence, stream}, read at call time, overrides the "auto" rule (``STREAM_MEAN_MAX``)."""
    tiling = os.environ.get(TILING_ENV, "").strip() or "auto"
    if tiling not in ATTN_TILINGS:
        raise ValueError(f"{TILING_ENV}={tiling!r} is not one of {ATTN_TILINGS}")
    if tiling == "auto":
        return "stream" if max(total_q, total_k) <= STREAM_MEAN_MAX * slots else "sequence"
    return tiling


def _needs_mask(causal, q, k, q_lengths, k_lengths, varlen) -> bool:
    """Whether a mask beyond SDPA's own ``is_causal`` (top-left aligned, square) is needed."""
    if varlen or q_lengths is not None or k_lengths is not None:
        return True
    return causal and q.shape[2] != k.shape[2]


def _auto_backend(q, k, causal, q_lengths, k_lengths, varlen) -> str:
    """The "auto" rule. CPU: PyTorch's SDPA (its fused CPU kernel) where no gradient flows (decoding, validation),
    the reference where one does (training: its backward never meets SDPA's NaN rows of fully masked queries).
    CUDA: our kernel whenever a mask is involved (lengths, varlen, bottom-right causal with Tq != Tk) and it
    supports the dtype/head dim, since SDPA's flash backend refuses masks and its fallbacks materialise them;
    SDPA (flash backend) when no mask is needed, or when our kernel does not support the case."""
    if not q.is_cuda:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return "reference" if grad else "sdpa"
    if _needs_mask(causal, q, k, q_lengths, k_lengths, varlen) and triton_supports(q):
        return "triton"
    return "sdpa"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_lengths: torch.Tensor | None = None,
    k_lengths: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    segment_ids_q: torch.Tensor | None = None,
    segment_ids_k: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Scaled dot-product attention; returns a tensor shaped like ``q``.

    Padded: q (B, H, Tq, D), k/v (B, H, Tk, D), optional int32 (B,) ``q_lengths``/``k_lengths``.
    Varlen: q (total_q, H, D), k/v (total_k, H, D), int32 (N+1,) ``cu_seqlens_q``/``cu_seqlens_k``
    and python-int ``max_seqlen_q``/``max_seqlen_k`` (a static bound is fine). Optional int32
    ``segment_ids_q`` (total_q,) / ``segment_ids_k`` (total_k,): ``kernels.packed_attention.segment_ids(
    cu_seqlens, total)`` computed once per batch and passed to every layer; without them the stream
    kernels compute them on each call (one small device op per side).
    ``backend``: "auto", "triton", "sdpa" or "reference"; ``FASTMT_ATTN_BACKEND`` overrides "auto".
    "auto" on CPU tensors is SDPA without a gradient (decoding, validation) and the reference with one
    (training); on CUDA it is our kernel whenever a mask is involved
    (lengths, varlen, causal with Tq != Tk) and the kernel supports the case (fp16/bf16, head dim
    in 16/32/64/128), else SDPA (its flash backend for unmasked / square-causal attention).
    "triton" raises what ``check_triton_support`` finds.
    Varlen on Triton picks stream tiling (tiles span segments) or per-sequence tiling by
    ``attention_tiling``; ``FASTMT_ATTN_TILING`` = auto | sequence | stream overrides it per call.
    """
    _check_inputs(q, k, v, causal, q_lengths, k_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  segment_ids_q, segment_ids_k)
    varlen = cu_seqlens_q is not None
    backend = resolve_backend(backend, "FASTMT_ATTN_BACKEND", ATTN_BACKENDS)
    if backend == "auto":
        backend = _auto_backend(q, k, causal, q_lengths, k_lengths, varlen)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if backend == "triton":
        check_triton_support(q)
        if not varlen:
            B, _, Tq, _ = q.shape
            Tk = k.shape[2]
            seq_q = q_lengths if q_lengths is not None else torch.full((B,), Tq, dtype=torch.int32, device=q.device)
            seq_k = k_lengths if k_lengths is not None else torch.full((B,), Tk, dtype=torch.int32, device=q.device)
            return sequence_attention(q, k, v, seq_q, seq_k, Tq, Tk, bool(causal), scale)
        total_q, total_k = q.shape[0], k.shape[0]
        if attention_tiling(total_q, total_k, cu_seqlens_q.shape[0] - 1) == "sequence":
            return sequence_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
                                      scale)
        seg_q = segment_ids_q if segment_ids_q is not None else segment_ids(cu_seqlens_q, total_q)
        if segment_ids_k is not None:
            seg_k = segment_ids_k
        elif cu_seqlens_k is cu_seqlens_q and total_k == total_q:  # self-attention: one set of ids
            seg_k = seg_q
        else:
            seg_k = segment_ids(cu_seqlens_k, total_k)
        return stream_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seg_q, seg_k, bool(causal), scale)
    if varlen:
        qp = pad_varlen(q, cu_seqlens_q, max_seqlen_q)  # (B, H, Tq, D)
        kp = pad_varlen(k, cu_seqlens_k, max_seqlen_k)
        vp = pad_varlen(v, cu_seqlens_k, max_seqlen_k)
        q_lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32)
        k_lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        out = attention(qp, kp, vp, causal=causal, softmax_scale=softmax_scale, q_lengths=q_lengths,
                        k_lengths=k_lengths, backend=backend)
        return unpad_varlen(out, cu_seqlens_q, q.shape[0])
    if backend == "sdpa":
        return _sdpa(q, k, v, causal, softmax_scale, q_lengths, k_lengths)
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, q_lengths=q_lengths,
                               k_lengths=k_lengths, upcast=True)


def _sdpa(q, k, v, causal, softmax_scale, q_lengths, k_lengths):
    """PyTorch SDPA with the same semantics (boolean mask when lengths or q!=k causal need one)."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if q_lengths is None and k_lengths is None and (not causal or Tq == Tk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
    ql = q_lengths if q_lengths is not None else torch.full((B,), Tq, dtype=torch.int32, device=q.device)
    kl = k_lengths if k_lengths is not None else torch.full((B,), Tk, dtype=torch.int32, device=q.device)
    mask = visibility_mask(Tq, Tk, ql, kl, causal)  # (B, 1, Tq, Tk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    # rows with no visible key come out NaN from SDPA's softmax: they must be 0
    any_visible = rearrange(mask.any(-1), "b 1 i -> b 1 i 1")
    return torch.where(any_visible, out, torch.zeros((), dtype=out.dtype, device=out.device))


class FlashAttention(nn.Module):
    """``attention`` as a module (no parameters): fixes ``causal``, ``softmax_scale`` and ``backend``.

    ``forward(q, k, v, **layout)`` takes the layout keywords of ``attention`` (``q_lengths``,
    ``k_lengths`` or ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, and
    optionally ``segment_ids_q``, ``segment_ids_k``).
    """

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, backend: str = "auto"):
        super().__init__()
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"FlashAttention: backend={backend!r} is not one of {ATTN_BACKENDS}")
        self.causal, self.softmax_scale, self.backend = causal, softmax_scale, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **layout) -> torch.Tensor:
        return attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, backend=self.backend, **layout)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, backend={self.backend!r}"
