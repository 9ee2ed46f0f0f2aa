"""Flash attention for fastmt (forward + backward), with an einops reference beside it.

Layouts
  padded  q (B, H, Tq, D), k/v (B, H, Tk, D), optional per-sequence ``q_lengths`` / ``k_lengths``
          (int32 (B,)); positions past a sequence's length are ignored as keys and give 0 as queries.
  varlen  q (total_q, H, D), k/v (total_k, H, D) packed back to back, with ``cu_seqlens_q`` /
          ``cu_seqlens_k`` (int32 (B+1,), cumulative lengths starting at 0) and ``max_seqlen_q`` /
          ``max_seqlen_k`` (python ints).

Masking semantics (both layouts, every backend)
  query i of a sequence with lengths (Lq, Lk) sees key j iff j < Lk and, when ``causal``,
  j <= i + (Lk - Lq)  (bottom-right aligned, as FlashAttention-2; equals j <= i for self-attention).
  A query row with no visible key gives 0 (never NaN).

Triton kernels (FlashAttention-2 algorithm)
  * forward: one program per (BLOCK_M query rows, head, sequence); online softmax in base 2
    (the softmax scale is folded with log2(e)), fp32 accumulators, logsumexp saved in fp32
    (natural log; +inf for rows with no visible key, so the backward gives them exactly 0).
  * backward, deterministic (no atomics): ``delta = rowsum(dO * O)`` preprocess; one kernel
    for dK/dV per key block iterating over query blocks; one kernel for dQ per query block
    iterating over key blocks.
  * both layouts go through the same kernels (``VARLEN`` constexpr: sequence b starts at
    ``cu_seqlens[b]`` instead of at batch stride b); any strides with a unit last stride.
  * key/query blocks that no query of the block can see (causal, past a length) are skipped,
    so padding costs no compute; only blocks on a mask boundary evaluate the mask.
  * dtypes: fp16 / bf16 on CUDA (``tl.dot`` on tensor cores, wgmma on sm_90a, fp32 accumulate);
    under ``TRITON_INTERPRET=1`` also fp32, and every tile is upcast to fp32 after loading (the
    interpreter's bf16 arithmetic is wrong). Head dims 16, 32, 64, 128; any softmax scale.
  * Not supported by the kernels: fp32 on CUDA, other head dims, dropout, ALiBi / arbitrary masks,
    k/v with a different number of heads than q (GQA), double backward. ``backend="auto"``
    serves those with SDPA or the reference instead.
  * Lengths are clamped to the tensors' extents inside the kernels, so bad lengths cannot read
    out of bounds; the public function checks them eagerly when they live on the CPU.

Two tilings of the varlen layout (``attention_tiling``)
  * "sequence": the kernels above, one program per (sequence, head, BLOCK_M rows); padded layouts and
    long sequences.
  * "stream": ``kernels.packed_attention``, one program per BLOCK_M consecutive rows of the packed
    stream, whatever segments they hold (packed batches of short segments, where per-sequence tiles
    would be mostly empty).
  "auto" picks "stream" when the mean slot length max(total_q, total_k) / N is at most
  ``STREAM_MEAN_MAX`` (static: no host sync). ``FASTMT_ATTN_TILING`` = auto | sequence | stream,
  read at each call, overrides the rule (benchmarks time both kernels with it).

Host path: eagerly, ``attention`` calls a plain ``torch.autograd.Function`` (or the launcher alone when
no gradient is needed); under torch.compile it calls the ``torch.library`` custom ops (opaque, with fake
kernels). After an autotuner has chosen a config for a key, launches reuse it without re-entering the
autotuner (``packed_attention.launch``); ``FASTMT_AUTOTUNE=0`` takes each kernel's first fitting
config without timing any.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from einops import einsum, rearrange
from torch import nn

from kernels._utils import empty, interpreting, resolve_backend, triton_usable
from kernels.packed_attention import _pow2, launch, segment_ids, stream_attention

ATTN_BACKENDS = ("auto", "triton", "sdpa", "reference")
HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634


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
# Triton kernels
# ----------------------------------------------------------------------------------------------
LOG2E_C = tl.constexpr(LOG2E)  # log2(e) as a compile-time constant inside the kernels


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> Configs; one tiny config when interpreting."""
    if interpreting():  # the interpreter fails on >1 config and is slow per program: small blocks
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu]


# H100 (sm_90a) shapes. Forward: 128 query rows x 64 keys is FA2's hd-64 sweet spot; 64-row blocks
# serve short sequences (T <= 128, our training buckets) where 128-row blocks would be mostly padding.
FWD_CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]
# dK/dV: few query rows per step, many keys per program (8 warps: with 4, BLOCK_N 128 spills at
# hd 64 on sm_90a per ptxas); dQ: the transpose.
BWD_KV_CONFIGS = [(32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)]
BWD_Q_CONFIGS = [(128, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]


def _prune(configs, named_args, **kwargs):
    """Drop configs whose tiles are larger than the (bucketed) sequence or overflow shared memory."""
    seq, head_dim = named_args["SEQ_BUCKET"], kwargs["HEAD_DIM"]
    kept = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= max(seq, 64) and c.kwargs["BLOCK_N"] <= max(seq, 32)
        and not (head_dim == 128 and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= 128 * 128 and c.num_stages > 2)
    ]
    return kept or configs[-1:]


def _autotune(configs):
    # key: head dim, causality and a power-of-two bucket of the longest sequence (a plain int that
    # the kernel ignores), so ragged batches do not retune for every new maximum length.
    return triton.autotune(
        configs=_configs(configs),
        key=["HEAD_DIM", "CAUSAL", "VARLEN", "SEQ_BUCKET"],
        prune_configs_by=None if interpreting() else {"early_config_prune": _prune},
    )


@triton.jit
def _seq_bounds(SEQ_ptr, b, EXTENT, VARLEN: tl.constexpr):
    """(start row, length, rows this program may store) of sequence ``b``.

    VARLEN: SEQ_ptr is cu_seqlens (B+1,), EXTENT the packed total; the sequence owns rows
    [start, start + length). Padded: SEQ_ptr is lengths (B,), EXTENT the padded T; every row < T
    is stored (rows past the length as 0). Lengths are clamped to EXTENT.
    """
    if VARLEN:
        start = tl.minimum(tl.load(SEQ_ptr + b), EXTENT)
        end = tl.minimum(tl.load(SEQ_ptr + b + 1), EXTENT)
        length = tl.maximum(end - start, 0)
        rows = length
    else:
        start = b * 0
        length = tl.maximum(tl.minimum(tl.load(SEQ_ptr + b), EXTENT), 0)
        rows = length * 0 + EXTENT
    return start, length, rows


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,  # running (BLOCK_M, D) numerator, row sums, row maxima (log2 units); q tile
    K_base, V_base,  # pointers to row 0 of this sequence/head in K and V
    stride_kt, stride_vt,  # row strides of K and V
    offs_m, offs_n, offs_d,  # query row indices (in the sequence), key offsets, head-dim offsets
    Lk, diag,  # key length; causal diagonal offset Lk - Lq
    lo, hi,  # key range [lo, hi), multiples of BLOCK_N from lo
    qk_scale,  # softmax_scale * log2(e)
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,)
        k_ptrs = K_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
        v_ptrs = V_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < Lk, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < Lk, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            visible = cols[None, :] < Lk
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible so far keeps m = -inf; subtract 0 instead (exp2(-inf) = 0, no NaN)
        if MASKED:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_ranges(m0, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks for query rows [m0, m0 + BLOCK_M): unmasked [0, full_hi), masked [full_hi, hi)."""
    diag = Lk - Lq
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Lk, m0 + BLOCK_M + diag), 0)  # last key any row of the block sees
        full_hi = tl.maximum(tl.minimum(Lk, m0 + 1 + diag), 0) // BLOCK_N * BLOCK_N  # seen by every row
    else:
        hi = Lk
        full_hi = Lk // BLOCK_N * BLOCK_N
    hi = tl.where(m0 < Lq, hi, 0)  # padded layout: blocks past Lq only write zeros
    full_hi = tl.where(m0 < Lq, full_hi, 0)
    return diag, full_hi, hi


@_autotune(FWD_CONFIGS)
@triton.jit
def _attn_fwd_kernel(
    Q_ptr,  # (B, H, Tq, D) padded or (total_q, H, D) varlen; unit last stride
    K_ptr,  # (B, H, Tk, D) or (total_k, H, D)
    V_ptr,  # like K
    O_ptr,  # like Q (written)
    LSE_ptr,  # (B, H, Tq) or (H, total_q) fp32, natural log; +inf where no key is visible (written)
    SEQ_Q_ptr,  # int32 lengths (B,) padded, or cu_seqlens_q (B+1,) varlen
    SEQ_K_ptr,  # int32 lengths (B,) or cu_seqlens_k (B+1,)
    stride_qb, stride_qh, stride_qt,  # Q strides: batch (0 varlen), head, row
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh,  # LSE strides: batch (0 varlen), head; rows contiguous
    EXTENT_Q, EXTENT_K,  # padded T, or packed total rows
    qk_scale,  # softmax_scale * log2(e)
    SEQ_BUCKET,  # power-of-two bucket of max_seqlen_q (autotune key only)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, q_rows = _seq_bounds(SEQ_Q_ptr, b, EXTENT_Q, VARLEN)
    k_start, Lk, _k_rows = _seq_bounds(SEQ_K_ptr, b, EXTENT_K, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_rows:  # varlen: this block lies past the sequence
        return
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    Q_base = Q_ptr + b64 * stride_qb + h64 * stride_qh + q_start.to(tl.int64) * stride_qt
    K_base = K_ptr + b64 * stride_kb + h64 * stride_kh + k_start.to(tl.int64) * stride_kt
    V_base = V_ptr + b64 * stride_vb + h64 * stride_vh + k_start.to(tl.int64) * stride_vt
    O_base = O_ptr + b64 * stride_ob + h64 * stride_oh + q_start.to(tl.int64) * stride_ot
    LSE_base = LSE_ptr + b64 * stride_lb + h64 * stride_lh + q_start.to(tl.int64)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                mask=offs_m[:, None] < Lq, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    diag, full_hi, hi = _key_ranges(m0, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, stride_kt, stride_vt,
                                    offs_m, offs_n, offs_d, Lk, diag, 0, full_hi, qk_scale,
                                    BLOCK_N, False, CAUSAL, FP32_DOT)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K_base, V_base, stride_kt, stride_vt,
                                    offs_m, offs_n, offs_d, Lk, diag, full_hi, hi, qk_scale,
                                    BLOCK_N, True, CAUSAL, FP32_DOT)

    valid = (offs_m < Lq) & (l_i > 0.0)  # rows past Lq and rows with no visible key give 0
    l_safe = tl.where(valid, l_i, 1.0)
    out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(valid, (m_i + tl.math.log2(l_safe)) / LOG2E_C, float("inf"))
    store = offs_m < q_rows
    tl.store(O_base + offs_m[:, None].to(tl.int64) * stride_ot + offs_d[None, :],
             out.to(O_ptr.dtype.element_ty), mask=store[:, None])
    tl.store(LSE_base + offs_m, lse, mask=store)


@triton.jit
def _attn_bwd_preprocess_kernel(
    O_ptr,  # forward output, (B, H, Tq, D) or (total_q, H, D)
    DO_ptr,  # its gradient, same shape, any strides with a unit last one
    DELTA_ptr,  # (B, H, Tq) or (H, total_q) fp32: rowsum(dO * O) (written)
    SEQ_Q_ptr,  # int32 lengths (B,) or cu_seqlens_q (B+1,)
    stride_ob, stride_oh, stride_ot,
    stride_dob, stride_doh, stride_dot,
    stride_lb, stride_lh,  # DELTA strides (as LSE)
    EXTENT_Q,
    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, q_rows = _seq_bounds(SEQ_Q_ptr, b, EXTENT_Q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_rows:
        return
    b64, h64, s64 = b.to(tl.int64), h.to(tl.int64), q_start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    valid = offs_m[:, None] < Lq
    o = tl.load(O_ptr + b64 * stride_ob + h64 * stride_oh + (s64 + rows) * stride_ot + offs_d[None, :],
                mask=valid, other=0.0).to(tl.float32)
    do = tl.load(DO_ptr + b64 * stride_dob + h64 * stride_doh + (s64 + rows) * stride_dot + offs_d[None, :],
                 mask=valid, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA_ptr + b64 * stride_lb + h64 * stride_lh + s64 + offs_m, delta, mask=offs_m < q_rows)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v,  # (BLOCK_N, D) fp32 accumulators; this program's K and V tiles
    Q_base, DO_base, LSE_base, DELTA_base,  # row 0 of this sequence/head
    stride_qt, stride_dot,  # row strides
    offs_n, offs_m0, offs_d,  # key indices (in the sequence), query-row offsets, head-dim offsets
    Lq, Lk, diag, lo, hi, qk_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m0  # (BLOCK_M,)
        q_ptrs = Q_base + rows[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
        do_ptrs = DO_base + rows[:, None].to(tl.int64) * stride_dot + offs_d[None, :]
        if MASKED:
            row_ok = rows < Lq
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE_base + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA_base + rows, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE_base + rows)
            delta = tl.load(DELTA_base + rows)
        if FP32_DOT:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # transposed scores: (BLOCK_N, BLOCK_M); lse = +inf (empty rows) gives p = 0
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :] * LOG2E_C)
        if MASKED:
            visible = (offs_n[:, None] < Lk) & (rows[None, :] < Lq)
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + diag)
            pT = tl.where(visible, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
    return dk, dv


@_autotune(BWD_KV_CONFIGS)
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr,  # forward inputs (layouts as in _attn_fwd_kernel)
    DO_ptr,  # gradient of the output, like Q
    LSE_ptr, DELTA_ptr,  # (B, H, Tq) or (H, total_q) fp32
    DK_ptr, DV_ptr,  # like K (written)
    SEQ_Q_ptr, SEQ_K_ptr,  # int32 lengths (B,) or cu_seqlens (B+1,)
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_lb, stride_lh,  # LSE / DELTA strides
    EXTENT_Q, EXTENT_K,
    qk_scale,  # softmax_scale * log2(e)
    sm_scale,  # softmax_scale (dK = scale * dS^T Q)
    SEQ_BUCKET,  # power-of-two bucket of max_seqlen_k (autotune key only)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, _q_rows = _seq_bounds(SEQ_Q_ptr, b, EXTENT_Q, VARLEN)
    k_start, Lk, k_rows = _seq_bounds(SEQ_K_ptr, b, EXTENT_K, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= k_rows:
        return
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    qs64, ks64 = q_start.to(tl.int64), k_start.to(tl.int64)
    Q_base = Q_ptr + b64 * stride_qb + h64 * stride_qh + qs64 * stride_qt
    DO_base = DO_ptr + b64 * stride_dob + h64 * stride_doh + qs64 * stride_dot
    LSE_base = LSE_ptr + b64 * stride_lb + h64 * stride_lh + qs64
    DELTA_base = DELTA_ptr + b64 * stride_lb + h64 * stride_lh + qs64

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_rows = offs_n[:, None].to(tl.int64)
    key_ok = offs_n[:, None] < Lk
    k = tl.load(K_ptr + b64 * stride_kb + h64 * stride_kh + (ks64 + key_rows) * stride_kt + offs_d[None, :],
                mask=key_ok, other=0.0)
    v = tl.load(V_ptr + b64 * stride_vb + h64 * stride_vh + (ks64 + key_rows) * stride_vt + offs_d[None, :],
                mask=key_ok, other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Query blocks: masked [lo, mid), unmasked [mid, full_hi), masked [full_hi, end).
    diag = Lk - Lq
    if CAUSAL:
        lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M  # first row that sees key n0
        mid = (tl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # all keys seen
    else:
        lo = n0 * 0
        mid = lo
    end = tl.where(n0 < Lk, Lq, 0)  # padded key blocks past Lk: no work, zeros stored
    lo = tl.minimum(lo, end)
    full_hi = tl.maximum(end // BLOCK_M * BLOCK_M, lo)
    mid = tl.minimum(tl.maximum(mid, lo), full_hi)
    partial_keys = n0 + BLOCK_N > Lk  # last key block: every step evaluates the mask
    mid = tl.where(partial_keys, lo, mid)
    full_hi = tl.where(partial_keys, lo, full_hi)

    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, lo, mid, qk_scale,
                                  BLOCK_M, True, CAUSAL, FP32_DOT)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, mid, full_hi, qk_scale,
                                  BLOCK_M, False, CAUSAL, FP32_DOT)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, full_hi, end, qk_scale,
                                  BLOCK_M, True, CAUSAL, FP32_DOT)
    dk = dk * sm_scale
    store = offs_n[:, None] < k_rows
    tl.store(DK_ptr + b64 * stride_dkb + h64 * stride_dkh + (ks64 + key_rows) * stride_dkt + offs_d[None, :],
             dk.to(DK_ptr.dtype.element_ty), mask=store)
    tl.store(DV_ptr + b64 * stride_dvb + h64 * stride_dvh + (ks64 + key_rows) * stride_dvt + offs_d[None, :],
             dv.to(DV_ptr.dtype.element_ty), mask=store)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse_log2, delta,  # (BLOCK_M, D) fp32 accumulator; this program's Q, dO, lse*log2e, delta
    K_base, V_base, stride_kt, stride_vt,
    offs_m, offs_n0, offs_d,
    Lk, diag, lo, hi, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n0
        k_ptrs = K_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
        v_ptrs = V_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < Lk, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < Lk, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse_log2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = cols[None, :] < Lk
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + diag)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@_autotune(BWD_Q_CONFIGS)
@triton.jit
def _attn_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr,  # forward inputs
    DO_ptr,  # gradient of the output, like Q
    LSE_ptr, DELTA_ptr,  # (B, H, Tq) or (H, total_q) fp32
    DQ_ptr,  # like Q (written)
    SEQ_Q_ptr, SEQ_K_ptr,  # int32 lengths (B,) or cu_seqlens (B+1,)
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt,
    stride_lb, stride_lh,
    EXTENT_Q, EXTENT_K,
    qk_scale,  # softmax_scale * log2(e)
    sm_scale,  # softmax_scale (dQ = scale * dS K)
    SEQ_BUCKET,  # power-of-two bucket of max_seqlen_q (autotune key only)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, Lq, q_rows = _seq_bounds(SEQ_Q_ptr, b, EXTENT_Q, VARLEN)
    k_start, Lk, _k_rows = _seq_bounds(SEQ_K_ptr, b, EXTENT_K, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= q_rows:
        return
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    qs64, ks64 = q_start.to(tl.int64), k_start.to(tl.int64)
    K_base = K_ptr + b64 * stride_kb + h64 * stride_kh + ks64 * stride_kt
    V_base = V_ptr + b64 * stride_vb + h64 * stride_vh + ks64 * stride_vt

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    row_ok = offs_m < Lq
    q = tl.load(Q_ptr + b64 * stride_qb + h64 * stride_qh + (qs64 + rows) * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO_ptr + b64 * stride_dob + h64 * stride_doh + (qs64 + rows) * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    stat = b64 * stride_lb + h64 * stride_lh + qs64 + offs_m
    lse_log2 = tl.load(LSE_ptr + stat, mask=row_ok, other=float("inf")) * LOG2E_C
    delta = tl.load(DELTA_ptr + stat, mask=row_ok, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag, full_hi, hi = _key_ranges(m0, Lq, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _attn_bwd_dq_inner(dq, q, do, lse_log2, delta, K_base, V_base, stride_kt, stride_vt,
                            offs_m, offs_n0, offs_d, Lk, diag, 0, full_hi, qk_scale,
                            BLOCK_N, False, CAUSAL, FP32_DOT)
    dq = _attn_bwd_dq_inner(dq, q, do, lse_log2, delta, K_base, V_base, stride_kt, stride_vt,
                            offs_m, offs_n0, offs_d, Lk, diag, full_hi, hi, qk_scale,
                            BLOCK_N, True, CAUSAL, FP32_DOT)
    dq = dq * sm_scale
    tl.store(DQ_ptr + b64 * stride_dqb + h64 * stride_dqh + (qs64 + rows) * stride_dqt + offs_d[None, :],
             dq.to(DQ_ptr.dtype.element_ty), mask=(offs_m < q_rows)[:, None])


# ----------------------------------------------------------------------------------------------
# Host launchers: reshape-free (strides are passed), allocate, launch
# ----------------------------------------------------------------------------------------------
def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Copy only when the last stride is not 1 (e.g. expanded gradients)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides: padded (B, H, T, D), or varlen (total, H, D) with batch stride 0."""
    if x.dim() == 3:
        return 0, x.stride(1), x.stride(0)
    return x.stride(0), x.stride(1), x.stride(2)


def _geometry(q: torch.Tensor, k: torch.Tensor, seq_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int):
    """(varlen, B, H, D, extent_q, extent_k, grid rows q, grid rows k) for either layout."""
    if q.dim() == 3:
        return True, seq_q.numel() - 1, q.shape[1], q.shape[2], q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k
    # padded: every program row up to T stores (zeros past the length), whatever max_seqlen says
    return False, q.shape[0], q.shape[1], q.shape[3], q.shape[2], k.shape[2], q.shape[2], k.shape[2]


def _stats_shape(q: torch.Tensor) -> tuple[int, ...]:
    """LSE / delta: (B, H, Tq) padded, (H, total_q) varlen; fp32, rows contiguous."""
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else tuple(q.shape[:3])


def _stats_strides(lse: torch.Tensor) -> tuple[int, int]:
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def _bucket(n: int) -> int:
    return _pow2(n, 16, 8192)


def _fp32_dot(dtype: torch.dtype) -> bool:
    # the interpreter's bf16 (and numpy fp16 matmul) arithmetic is not the GPU's: compute every tile in fp32
    return interpreting() or dtype == torch.float32


def flash_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_q: torch.Tensor, seq_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns (out like q (contiguous), lse fp32 ``_stats_shape(q)``)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    varlen, B, H, D, ext_q, ext_k, rows_q, _rows_k = _geometry(q, k, seq_q, max_seqlen_q, max_seqlen_k)
    out = empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = empty(*_stats_shape(q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or rows_q == 0:
        return out.zero_(), lse.fill_(float("inf"))
    grid = lambda meta: (triton.cdiv(rows_q, meta["BLOCK_M"]), H, B)  # noqa: E731
    bucket = _bucket(rows_q)
    launch(
        _attn_fwd_kernel, grid, (D, causal, varlen, bucket, q.dtype),
        q, k, v, out, lse, seq_q, seq_k,
        *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(out), *_stats_strides(lse),
        ext_q, ext_k, softmax_scale * LOG2E, bucket,
        HEAD_DIM=D, CAUSAL=causal, VARLEN=varlen, FP32_DOT=_fp32_dot(q.dtype),
    )
    return out, lse


def flash_attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    seq_q: torch.Tensor, seq_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch delta preprocess, dK/dV and dQ kernels. Returns contiguous (dq, dk, dv)."""
    do, q, k, v = _unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v)
    varlen, B, H, D, ext_q, ext_k, rows_q, rows_k = _geometry(q, k, seq_q, max_seqlen_q, max_seqlen_k)
    dq = empty(*q.shape, dtype=q.dtype, device=q.device)
    dk = empty(*k.shape, dtype=k.dtype, device=k.device)
    dv = empty(*v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0 or rows_q == 0 or rows_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = empty(*lse.shape, dtype=torch.float32, device=q.device)
    stats = _stats_strides(lse)
    BLOCK = 16 if interpreting() else 64
    _attn_bwd_preprocess_kernel[(triton.cdiv(rows_q, BLOCK), H, B)](
        out, do, delta, seq_q, *_row_strides(out), *_row_strides(do), *stats, ext_q,
        HEAD_DIM=D, VARLEN=varlen, BLOCK_M=BLOCK,
    )
    common = dict(HEAD_DIM=D, CAUSAL=causal, VARLEN=varlen, FP32_DOT=_fp32_dot(q.dtype))
    strides_in = (*_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(do))
    grid_kv = lambda meta: (triton.cdiv(rows_k, meta["BLOCK_N"]), H, B)  # noqa: E731
    bucket_k, bucket_q = _bucket(rows_k), _bucket(rows_q)
    launch(
        _attn_bwd_dkdv_kernel, grid_kv, (D, causal, varlen, bucket_k, q.dtype),
        q, k, v, do, lse, delta, dk, dv, seq_q, seq_k,
        *strides_in, *_row_strides(dk), *_row_strides(dv), *stats,
        ext_q, ext_k, softmax_scale * LOG2E, softmax_scale, bucket_k, **common,
    )
    grid_q = lambda meta: (triton.cdiv(rows_q, meta["BLOCK_M"]), H, B)  # noqa: E731
    launch(
        _attn_bwd_dq_kernel, grid_q, (D, causal, varlen, bucket_q, q.dtype),
        q, k, v, do, lse, delta, dq, seq_q, seq_k,
        *strides_in, *_row_strides(dq), *stats,
        ext_q, ext_k, softmax_scale * LOG2E, softmax_scale, bucket_q, **common,
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake kernels and autograd
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fastmt::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_q: torch.Tensor, seq_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)


@_flash_attn_fwd_op.register_fake
def _(q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), q.new_empty(_stats_shape(q), dtype=torch.float32)


@torch.library.custom_op("fastmt::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    seq_q: torch.Tensor, seq_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_bwd(do, q, k, v, out, lse, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)


@_flash_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seq_q, seq_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, d_out, _d_lse):
    q, k, v, out, lse, seq_q, seq_k = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd_op(d_out, q, k, v, out, lse, seq_q, seq_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_flash_attn_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class FlashAttnFn(torch.autograd.Function):
    """The eager path: the launchers under a plain autograd.Function (the custom ops' dispatch costs host
    time per call that only torch.compile needs). Same saved tensors and results as the ops."""

    @staticmethod
    def forward(ctx, q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
        out, lse = flash_attn_fwd(q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse, seq_q, seq_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse, seq_q, seq_k = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(d_out, q, k, v, out, lse, seq_q, seq_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def sequence_attention(q, k, v, seq_q, seq_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                       softmax_scale: float) -> torch.Tensor:
    """Per-sequence-tiled attention on validated inputs. Under torch.compile: the custom op; eagerly: the
    autograd.Function, or the bare launcher when no gradient is needed."""
    args = (q, k, v, seq_q, seq_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    if torch.compiler.is_compiling():
        return _flash_attn_fwd_op(*args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FlashAttnFn.apply(*args)
    return flash_attn_fwd(*args)[0]


# ----------------------------------------------------------------------------------------------
# Public function and module
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


def triton_supports(q: torch.Tensor) -> bool:
    """Whether our kernels serve ``q``'s dtype, head dim and device (see ``_check_triton``)."""
    return _triton_unsupported(q) is None


def _triton_unsupported(q: torch.Tensor) -> str | None:
    """Why our kernels cannot serve ``q`` (None when they can): dtype and head dim first, then the device,
    so a CPU tensor of an unsupported dtype reports its dtype on every machine."""
    D = q.shape[-1]
    # fp32 only for CPU tensors under the interpreter (on CUDA tl.dot would round it to tf32)
    dtypes = (torch.float16, torch.bfloat16) + (() if q.is_cuda else (torch.float32,))
    if q.dtype not in dtypes:
        return f"dtype={q.dtype} (supported on CUDA: fp16, bf16; under TRITON_INTERPRET=1 on the CPU also fp32)"
    if D not in HEAD_DIMS:
        return f"head dim D={D} (supported: {HEAD_DIMS})"
    if not triton_usable(q):
        return f"device={q.device} (Triton needs CUDA tensors, or TRITON_INTERPRET=1 on the CPU)"
    return None


ATTN_TILINGS = ("auto", "sequence", "stream")
TILING_ENV = "FASTMT_ATTN_TILING"
# "auto" tiles the stream when segments are short on average: the mean slot length max(C_q, C_k) / N
# (static: no host sync, no recompile) is at most this many tokens, about one 64-row tile
STREAM_MEAN_MAX = 64


def attention_tiling(total_q: int, total_k: int, slots: int) -> str:
    """Which Triton kernel family serves a varlen call: "stream" (tiles span segments, ``kernels.
    packed_attention``) or "sequence" (per-sequence tiles, this file). ``FASTMT_ATTN_TILING`` in
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
    """The "auto" rule. CPU: the reference. CUDA: our kernel whenever a mask is involved (lengths,
    varlen, bottom-right causal with Tq != Tk) and it supports the dtype/head dim, since SDPA's
    flash backend refuses masks and its fallbacks materialise them; SDPA (flash backend) when no
    mask is needed, or when our kernel does not support the case."""
    if not q.is_cuda:
        return "reference"
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
    ``segment_ids_q`` (total_q,) / ``segment_ids_k`` (total_k,): ``kernels.packed_attention.segment_ids(cu_seqlens,
    total)``
    computed once per batch and passed to every layer; without them the stream kernels compute them
    on each call (one small device op per side).
    ``backend``: "auto", "triton", "sdpa" or "reference"; ``FASTMT_ATTN_BACKEND`` overrides "auto".
    "auto" on CPU tensors is the reference; on CUDA it is our kernel whenever a mask is involved
    (lengths, varlen, causal with Tq != Tk) and the kernel supports the case (fp16/bf16, head dim
    in 16/32/64/128), else SDPA (its flash backend for unmasked / square-causal attention).
    "triton" raises ValueError for what the kernels do not support (``_triton_unsupported``).
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
        reason = _triton_unsupported(q)
        if reason is not None:
            raise ValueError(f"attention: backend='triton' does not support {reason}")
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
