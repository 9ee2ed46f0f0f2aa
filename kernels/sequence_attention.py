"""Per-sequence-tiled flash attention kernels (forward + deterministic backward) and their launchers.

One program per (BLOCK_M query rows, head, sequence), FlashAttention-2's algorithm: online softmax in
base 2 (the softmax scale folded with log2(e)), fp32 accumulators, the logsumexp saved in fp32 (natural
log; +inf for rows with no visible key, so the backward gives them exactly 0). Backward without
atomics: ``delta = rowsum(dO * O)``, then dK/dV per key block over the query blocks, then dQ per query
block over the key blocks.

Layouts: padded q (B, H, Tq, D) with int32 lengths (B,), or varlen q (total_q, H, D) with cu_seqlens
(B+1,) (``VARLEN``: sequence b starts at row ``cu_seqlens[b]`` instead of at batch stride b); any
strides with a unit last one. Masking as ``kernels.flash_attention``. Key / query blocks no row of the
block can see (causal, past a length) are skipped, so padding costs no compute; only blocks on a mask
boundary evaluate the mask. Lengths are clamped to the tensors' extents inside the kernels: bad
lengths give wrong numbers, never out-of-bounds accesses.

Dtypes fp16 / bf16 on CUDA (``tl.dot`` on tensor cores, fp32 accumulate), also fp32 under
``TRITON_INTERPRET=1`` (every tile upcast to fp32 after loading there); head dims 16, 32, 64, 128; any
softmax scale. Not supported: fp32 on CUDA, other head dims, dropout, ALiBi / arbitrary masks, GQA,
double backward (``kernels.attention`` checks and dispatches; the custom ops live there too).

Layout of this file (as kernels/packed_attention.py): autotuning space -> Triton kernels -> launchers
``sequence_attention_fwd`` / ``sequence_attention_bwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._utils import (
    LOG2E,
    LOG2E_C,
    autotune,
    block_configs,
    empty,
    fp32_dot,
    interpreting,
    launch,
    pow2,
    unit_last,
)

# ----------------------------------------------------------------------------------------------
# Autotuning space (CUDA only; the interpreter gets one small config: >1 fails there)
# ----------------------------------------------------------------------------------------------
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


def _sequence_autotune(shapes):
    # key: head dim, causality, layout and a power-of-two bucket of the longest sequence (a plain int the
    # kernel ignores), so ragged batches do not retune for every new maximum length. The interpreter is
    # slow per program: small blocks there.
    return autotune(block_configs(shapes), ["HEAD_DIM", "CAUSAL", "VARLEN", "SEQ_BUCKET"],
                    interpret_config=block_configs([(16, 16, 1, 1)])[0], prune=_prune)


# Integer arguments Triton must not specialise on (divisibility by 16, value 1): extents and the
# statistics' strides vary with every sequence length, and each specialisation is a compile of its own
# (bench/aot.py counts them: the CUDA test grid compiled 169 kernels with them); they bound masks and
# loops, never the contiguous head dimension, so nothing vectorises on them.
_NOT_SPECIALIZED = ["EXTENT_Q", "EXTENT_K", "stride_lb", "stride_lh"]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
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
def _fwd_inner(
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


@_sequence_autotune(FWD_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _sequence_attention_fwd_kernel(
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
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, stride_kt, stride_vt,
                                    offs_m, offs_n, offs_d, Lk, diag, 0, full_hi, qk_scale,
                                    BLOCK_N, False, CAUSAL, FP32_DOT)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_base, V_base, stride_kt, stride_vt,
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


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _sequence_attention_bwd_preprocess_kernel(
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
def _bwd_dkdv_inner(
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


@_sequence_autotune(BWD_KV_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _sequence_attention_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr,  # forward inputs (layouts as in _sequence_attention_fwd_kernel)
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

    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, lo, mid, qk_scale,
                                  BLOCK_M, True, CAUSAL, FP32_DOT)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, mid, full_hi, qk_scale,
                                  BLOCK_M, False, CAUSAL, FP32_DOT)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qt, stride_dot,
                                  offs_n, offs_m0, offs_d, Lq, Lk, diag, full_hi, end, qk_scale,
                                  BLOCK_M, True, CAUSAL, FP32_DOT)
    dk = dk * sm_scale
    store = offs_n[:, None] < k_rows
    tl.store(DK_ptr + b64 * stride_dkb + h64 * stride_dkh + (ks64 + key_rows) * stride_dkt + offs_d[None, :],
             dk.to(DK_ptr.dtype.element_ty), mask=store)
    tl.store(DV_ptr + b64 * stride_dvb + h64 * stride_dvh + (ks64 + key_rows) * stride_dvt + offs_d[None, :],
             dv.to(DV_ptr.dtype.element_ty), mask=store)


@triton.jit
def _bwd_dq_inner(
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


@_sequence_autotune(BWD_Q_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _sequence_attention_bwd_dq_kernel(
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
    dq = _bwd_dq_inner(dq, q, do, lse_log2, delta, K_base, V_base, stride_kt, stride_vt,
                            offs_m, offs_n0, offs_d, Lk, diag, 0, full_hi, qk_scale,
                            BLOCK_N, False, CAUSAL, FP32_DOT)
    dq = _bwd_dq_inner(dq, q, do, lse_log2, delta, K_base, V_base, stride_kt, stride_vt,
                            offs_m, offs_n0, offs_d, Lk, diag, full_hi, hi, qk_scale,
                            BLOCK_N, True, CAUSAL, FP32_DOT)
    dq = dq * sm_scale
    tl.store(DQ_ptr + b64 * stride_dqb + h64 * stride_dqh + (qs64 + rows) * stride_dqt + offs_d[None, :],
             dq.to(DQ_ptr.dtype.element_ty), mask=(offs_m < q_rows)[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers: strides are passed (no reshapes), outputs allocated, kernels launched. Inputs were
# validated by ``kernels.attention``.
# ----------------------------------------------------------------------------------------------
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


def lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    """The logsumexp's (and delta's) shape: (B, H, Tq) padded, (H, total_q) varlen; fp32, rows contiguous."""
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else tuple(q.shape[:3])


def _stats_strides(lse: torch.Tensor) -> tuple[int, int]:
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def _bucket(n: int) -> int:
    return pow2(n, 16, 8192)


def sequence_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_q: torch.Tensor, seq_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. ``seq_q`` / ``seq_k``: int32 lengths (B,) padded, cu_seqlens (B+1,)
    varlen. Returns (out like q (contiguous), lse fp32 ``lse_shape(q)``)."""
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    varlen, B, H, D, ext_q, ext_k, rows_q, _rows_k = _geometry(q, k, seq_q, max_seqlen_q, max_seqlen_k)
    out = empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = empty(*lse_shape(q), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or rows_q == 0:
        return out.zero_(), lse.fill_(float("inf"))
    grid = lambda meta: (triton.cdiv(rows_q, meta["BLOCK_M"]), H, B)  # noqa: E731
    bucket = _bucket(rows_q)
    launch(
        _sequence_attention_fwd_kernel, grid, (D, causal, varlen, bucket, q.dtype),
        q, k, v, out, lse, seq_q, seq_k,
        *_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(out), *_stats_strides(lse),
        ext_q, ext_k, softmax_scale * LOG2E, bucket,
        HEAD_DIM=D, CAUSAL=causal, VARLEN=varlen, FP32_DOT=fp32_dot(q.dtype),
    )
    return out, lse


def sequence_attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    seq_q: torch.Tensor, seq_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the delta preprocess, dK/dV and dQ kernels. Returns contiguous (dq, dk, dv)."""
    do, q, k, v = unit_last(do), unit_last(q), unit_last(k), unit_last(v)
    varlen, B, H, D, ext_q, ext_k, rows_q, rows_k = _geometry(q, k, seq_q, max_seqlen_q, max_seqlen_k)
    dq = empty(*q.shape, dtype=q.dtype, device=q.device)
    dk = empty(*k.shape, dtype=k.dtype, device=k.device)
    dv = empty(*v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0 or rows_q == 0 or rows_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = empty(*lse.shape, dtype=torch.float32, device=q.device)
    stats = _stats_strides(lse)
    BLOCK = 16 if interpreting() else 64
    _sequence_attention_bwd_preprocess_kernel[(triton.cdiv(rows_q, BLOCK), H, B)](
        out, do, delta, seq_q, *_row_strides(out), *_row_strides(do), *stats, ext_q,
        HEAD_DIM=D, VARLEN=varlen, BLOCK_M=BLOCK,
    )
    common = dict(HEAD_DIM=D, CAUSAL=causal, VARLEN=varlen, FP32_DOT=fp32_dot(q.dtype))
    strides_in = (*_row_strides(q), *_row_strides(k), *_row_strides(v), *_row_strides(do))
    grid_kv = lambda meta: (triton.cdiv(rows_k, meta["BLOCK_N"]), H, B)  # noqa: E731
    bucket_k, bucket_q = _bucket(rows_k), _bucket(rows_q)
    launch(
        _sequence_attention_bwd_dkdv_kernel, grid_kv, (D, causal, varlen, bucket_k, q.dtype),
        q, k, v, do, lse, delta, dk, dv, seq_q, seq_k,
        *strides_in, *_row_strides(dk), *_row_strides(dv), *stats,
        ext_q, ext_k, softmax_scale * LOG2E, softmax_scale, bucket_k, **common,
    )
    grid_q = lambda meta: (triton.cdiv(rows_q, meta["BLOCK_M"]), H, B)  # noqa: E731
    launch(
        _sequence_attention_bwd_dq_kernel, grid_q, (D, causal, varlen, bucket_q, q.dtype),
        q, k, v, do, lse, delta, dq, seq_q, seq_k,
        *strides_in, *_row_strides(dq), *stats,
        ext_q, ext_k, softmax_scale * LOG2E, softmax_scale, bucket_q, **common,
    )
    return dq, dk, dv
