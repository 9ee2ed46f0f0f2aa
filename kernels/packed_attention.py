"""Stream-tiled attention kernels (forward + deterministic backward) over packed token streams, whose
tiles span segments, and their launchers.

Layout: the varlen layout of ``kernels.attention`` as packed batches use it: q (C_q, H, D), k/v
(C_k, H, D), segments back to back, ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 (N+1,); segment s of q
attends to segment s of k (self or cross); empty segments are allowed. Masking as
``kernels.flash_attention``.

Why a second tiling: the per-sequence kernels (kernels/sequence_attention.py) give each (segment, head,
BLOCK_M rows) its own program, so short segments leave most of every tile empty. Here a program takes
BLOCK_M consecutive rows of the *stream* (any number of segments) and only the keys those segments own.

Algorithm (FlashAttention-2, online softmax in base 2, fp32 accumulators and statistics)
  * Row r of segment s sees the contiguous stream keys [cu_k[s], hi_r) with hi_r = cu_k[s+1], or when
    causal min(cu_k[s+1], r + 1 + cu_k[s+1] - cu_q[s+1]) (the bottom-right diagonal in stream
    coordinates). A query block loops over the union of its rows' ranges in BLOCK_N steps and masks
    each element by its row's range, so only per-row segment ids are needed, never per-key ones.
  * Backward without atomics, two launches: dQ per query block, which also computes and stores
    delta = rowsum(dO * O) for its rows; then dK/dV per key block over the query rows its keys'
    segments own (the transposed ranges), reading delta.
  * Segment ids (int32 (C,), the segment holding each token): ``segment_ids(cu_seqlens, total)``, one
    ``torch.bucketize`` on the device, no host sync; callers running many layers on one batch compute
    them once and pass them in.
  * dtypes fp16 / bf16 on CUDA, also fp32 under ``TRITON_INTERPRET=1`` (every tile upcast to fp32 after
    loading there); head dims 16, 32, 64, 128; any strides with a unit last one. Segment ids and
    cu_seqlens are clamped to the tensors' extents inside the kernels: bad values give wrong numbers,
    never out-of-bounds accesses. Not supported: dropout, GQA, double backward.

Layout of this file (as kernels/sequence_attention.py): segment ids -> autotuning space -> Triton
kernels -> launchers ``stream_attention_fwd`` / ``stream_attention_bwd`` (their registration, a
``KernelOp``, is in kernels/flash_attention.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._utils import LOG2E, LOG2E_C, autotune, block_configs, empty, fp32_dot, launch, pow2, unit_last


def packed_layout(gen: torch.Generator, capacity: tuple[int, int], slots: int, max_len: int, mean: float,
                  p99: float) -> tuple[list[int], list[int]]:
    """Segment lengths (src, tgt) of one packed batch as data/batching.py builds it: pairs drawn from a
    log-normal with the given mean and p99 until a stream is full, then empty slots, then each tail cut
    into dummy segments of <= max_len; ``slots`` entries per side."""
    sigma = 2.326 - math.sqrt(2.326**2 - 2 * math.log(p99 / mean))  # p99 / mean = exp(2.326 s - s^2 / 2)
    mu = math.log(mean) - sigma**2 / 2
    n_dummy = -(-max(capacity) // max_len)
    src, tgt = [], []
    while len(src) < slots - n_dummy:
        s = int(min(max(round(math.exp(mu + sigma * float(torch.randn(1, generator=gen)))), 1), max_len))
        t = int(min(max(round(s * (0.8 + 0.4 * float(torch.rand(1, generator=gen)))), 1), max_len))
        if sum(src) + s > capacity[0] or sum(tgt) + t > capacity[1]:
            break
        src.append(s)
        tgt.append(t)
    real = len(src)
    for side, cap in ((src, capacity[0]), (tgt, capacity[1])):
        side += [0] * (slots - n_dummy - real)  # empty slots
        tail = cap - sum(side)
        side += [min(max_len, tail - i * max_len) if tail > i * max_len else 0 for i in range(n_dummy)]
        assert sum(side) == cap and len(side) == slots
    return src, tgt


# ----------------------------------------------------------------------------------------------
# Segment ids (plain PyTorch: compiles, no host sync)
# ----------------------------------------------------------------------------------------------
def segment_ids(cu_seqlens: torch.Tensor, total: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """int32 (total,): the segment holding each packed token (empty segments hold none; tokens at or past
    ``cu_seqlens[-1]`` get N = ``cu_seqlens.numel() - 1``). Compute once per batch and side, and pass it to
    ``kernels.attention(..., segment_ids_q=..., segment_ids_k=...)`` in every layer. ``tokens``: int32
    ``arange(total)`` on the device, for callers that keep one across batches (one kernel less per call)."""
    if tokens is None:
        tokens = torch.arange(total, dtype=torch.int32, device=cu_seqlens.device)  # (total,)
    return torch.bucketize(tokens, cu_seqlens[1:], right=True, out_int32=True)  # first segment ending after t


# ----------------------------------------------------------------------------------------------
# Autotuning space (CUDA only; the interpreter gets one config: >1 fails there)
# ----------------------------------------------------------------------------------------------
# H100 (sm_90a) shapes for streams of short segments. 64 rows is one warpgroup's wgmma M; narrow key
# steps (32) waste less of a range of ~64 + segment length keys; 128-row tiles for longer segments;
# 32 x 32 tiles on 2 warps (mma.sync, no wgmma below M = 64) waste the least on the shortest segments.
# The first config is the one FASTMT_AUTOTUNE=0 and the codegen test use.
# fwd / dQ: BLOCK_M query rows per program, BLOCK_N keys per step.
STREAM_FWD_CONFIGS = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (32, 32, 2, 2)]
STREAM_BWD_Q_CONFIGS = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (32, 32, 2, 2)]
# dK/dV: BLOCK_N keys per program, BLOCK_M query rows per step.
STREAM_BWD_KV_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 32, 2, 2)]


def _prune(configs, named_args, **kwargs):
    """Head dim 128: drop 4-warp configs with 128-key steps and 2-warp ones (255 registers and spills in
    the forward / dK/dV on sm_90a, per ptxas)."""
    if kwargs["HEAD_DIM"] < 128:
        return configs
    kept = [c for c in configs if c.num_warps > 2 and not (c.num_warps == 4 and c.kwargs["BLOCK_N"] >= 128)]
    return kept or configs[:1]


def _stream_autotune(shapes):
    # key: head dim, causality, power-of-two buckets of the mean segment length and of the stream length
    # (plain ints the kernels ignore): a run of fixed-shape packed batches tunes once per kernel. The
    # interpreter's blocks are small enough that tiles span segments in tests.
    return autotune(block_configs(shapes), ["HEAD_DIM", "CAUSAL", "MEAN_BUCKET", "ROWS_BUCKET"],
                    interpret_config=block_configs([(32, 32, 1, 1)])[0], prune=_prune)


# Integer arguments Triton must not specialise on (as in kernels/sequence_attention.py): stream lengths,
# slot counts, the statistics' head stride and the autotune-key buckets bound masks and loops only.
_NOT_SPECIALIZED = ["C_q", "C_k", "N", "stride_lh", "MEAN_BUCKET", "ROWS_BUCKET"]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _row_ranges(SEG_ptr, CU_OWN_ptr, CU_OTHER_ptr, rows, n_rows, n_other, N,
                CAUSAL: tl.constexpr, ROWS_ARE_QUERIES: tl.constexpr):
    """For stream rows ``rows`` of one side: [lo, hi) of the other side's stream rows each may pair with.

    Queries (ROWS_ARE_QUERIES): keys [cu_k[s], cu_k[s+1]), causal hi = min(cu_k[s+1], r + 1 + cu_k[s+1] -
    cu_q[s+1]). Keys: queries [cu_q[s], cu_q[s+1]), causal lo = max(cu_q[s], c + cu_q[s+1] - cu_k[s+1]).
    Rows past the stream or outside every segment get an empty range. Clamped to [0, n_other].
    """
    inside = rows < n_rows
    seg = tl.load(SEG_ptr + rows, mask=inside, other=-1)
    ok = inside & (seg >= 0) & (seg < N)
    seg = tl.where(ok, seg, 0)
    lo = tl.load(CU_OTHER_ptr + seg, mask=ok, other=0)
    end_other = tl.load(CU_OTHER_ptr + seg + 1, mask=ok, other=0)
    hi = end_other
    if CAUSAL:
        end_own = tl.load(CU_OWN_ptr + seg + 1, mask=ok, other=0)
        if ROWS_ARE_QUERIES:
            hi = tl.minimum(hi, rows + 1 + end_other - end_own)
        else:
            lo = tl.maximum(lo, rows + end_other - end_own)
    lo = tl.minimum(tl.maximum(lo, 0), n_other)
    hi = tl.where(ok, tl.minimum(tl.maximum(hi, 0), n_other), 0)
    return lo, hi


@triton.jit
def _block_range(lo, hi, n_other):
    """Union [start, end) of the rows' ranges (empty ranges ignored; start >= end when all are empty)."""
    nonempty = lo < hi
    start = tl.min(tl.where(nonempty, lo, n_other), 0)
    end = tl.max(tl.where(nonempty, hi, 0), 0)
    return start, end


@_stream_autotune(STREAM_FWD_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _stream_attention_fwd_kernel(
    Q_ptr,  # (C_q, H, D) packed queries; unit last stride
    K_ptr,  # (C_k, H, D) packed keys
    V_ptr,  # (C_k, H, D) packed values
    O_ptr,  # (C_q, H, D) output (written)
    LSE_ptr,  # (H, C_q) fp32 logsumexp, natural log; +inf where no key is visible (written)
    CU_Q_ptr,  # int32 (N+1,) cu_seqlens_q
    CU_K_ptr,  # int32 (N+1,) cu_seqlens_k
    SEG_Q_ptr,  # int32 (C_q,) segment id of each query row
    stride_qt, stride_qh,  # Q strides: row, head
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_lh,  # LSE head stride (rows contiguous)
    C_q, C_k, N,  # stream lengths, segment slots
    qk_scale,  # softmax_scale * log2(e)
    MEAN_BUCKET, ROWS_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    h64 = h.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_lo, k_hi = _row_ranges(SEG_Q_ptr, CU_Q_ptr, CU_K_ptr, rows, C_q, C_k, N, CAUSAL, True)
    start, end = _block_range(k_lo, k_hi, C_k)

    row_in = rows < C_q
    q = tl.load(Q_ptr + h64 * stride_qh + rows[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                mask=row_in[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    K_base = K_ptr + h64 * stride_kh
    V_base = V_ptr + h64 * stride_vh
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) stream key rows
        col_in = (cols < end)[:, None]
        k = tl.load(K_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=col_in, other=0.0)
        v = tl.load(V_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=col_in, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        visible = (cols[None, :] >= k_lo[:, None]) & (cols[None, :] < k_hi[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: exp2(-inf) = 0
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    valid = l_i > 0.0  # rows with no visible key (or outside every segment) give 0 and lse = +inf
    l_safe = tl.where(valid, l_i, 1.0)
    out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(valid, (m_i + tl.math.log2(l_safe)) / LOG2E_C, float("inf"))
    tl.store(O_ptr + h64 * stride_oh + rows[:, None].to(tl.int64) * stride_ot + offs_d[None, :],
             out.to(O_ptr.dtype.element_ty), mask=row_in[:, None])
    tl.store(LSE_ptr + h64 * stride_lh + rows, lse, mask=row_in)


@_stream_autotune(STREAM_BWD_Q_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _stream_attention_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr,  # forward inputs, (C_q, H, D) / (C_k, H, D)
    O_ptr,  # forward output, (C_q, H, D)
    DO_ptr,  # its gradient, (C_q, H, D)
    LSE_ptr,  # (H, C_q) fp32 forward logsumexp
    DELTA_ptr,  # (H, C_q) fp32 rowsum(dO * O) (written, for the dK/dV kernel)
    DQ_ptr,  # (C_q, H, D) (written)
    CU_Q_ptr, CU_K_ptr,  # int32 (N+1,)
    SEG_Q_ptr,  # int32 (C_q,)
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    stride_lh,  # LSE / DELTA head stride
    C_q, C_k, N,
    qk_scale,  # softmax_scale * log2(e)
    sm_scale,  # softmax_scale (dQ = scale * dS K)
    MEAN_BUCKET, ROWS_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    h64 = h.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_lo, k_hi = _row_ranges(SEG_Q_ptr, CU_Q_ptr, CU_K_ptr, rows, C_q, C_k, N, CAUSAL, True)
    start, end = _block_range(k_lo, k_hi, C_k)

    row_in = rows < C_q
    rows64 = rows[:, None].to(tl.int64)
    row_mask = row_in[:, None]
    q = tl.load(Q_ptr + h64 * stride_qh + rows64 * stride_qt + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO_ptr + h64 * stride_doh + rows64 * stride_dot + offs_d[None, :], mask=row_mask, other=0.0)
    o = tl.load(O_ptr + h64 * stride_oh + rows64 * stride_ot + offs_d[None, :], mask=row_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA_ptr + h64 * stride_lh + rows, delta, mask=row_in)
    lse_log2 = tl.load(LSE_ptr + h64 * stride_lh + rows, mask=row_in, other=float("inf")) * LOG2E_C
    if FP32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    K_base = K_ptr + h64 * stride_kh
    V_base = V_ptr + h64 * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_in = (cols < end)[:, None]
        k = tl.load(K_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=col_in, other=0.0)
        v = tl.load(V_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=col_in, other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = (cols[None, :] >= k_lo[:, None]) & (cols[None, :] < k_hi[:, None])
        # lse = +inf (no visible key) gives p = 0; masked scores may overflow exp2: where() drops them
        p = tl.where(visible, tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse_log2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * sm_scale
    tl.store(DQ_ptr + h64 * stride_dqh + rows64 * stride_dqt + offs_d[None, :],
             dq.to(DQ_ptr.dtype.element_ty), mask=row_mask)


@_stream_autotune(STREAM_BWD_KV_CONFIGS)
@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _stream_attention_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr,  # forward inputs, (C_q, H, D) / (C_k, H, D)
    DO_ptr,  # gradient of the output, (C_q, H, D)
    LSE_ptr, DELTA_ptr,  # (H, C_q) fp32
    DK_ptr, DV_ptr,  # (C_k, H, D) (written)
    CU_Q_ptr, CU_K_ptr,  # int32 (N+1,)
    SEG_K_ptr,  # int32 (C_k,) segment id of each key row
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_dot, stride_doh,
    stride_dkt, stride_dkh,
    stride_dvt, stride_dvh,
    stride_lh,  # LSE / DELTA head stride
    C_q, C_k, N,
    qk_scale,  # softmax_scale * log2(e)
    sm_scale,  # softmax_scale (dK = scale * dS^T Q)
    MEAN_BUCKET, ROWS_BUCKET,  # autotune key only
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, h = tl.program_id(0), tl.program_id(1)
    h64 = h.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's key rows
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_lo, q_hi = _row_ranges(SEG_K_ptr, CU_K_ptr, CU_Q_ptr, cols, C_k, C_q, N, CAUSAL, False)
    start, end = _block_range(q_lo, q_hi, C_q)

    col_in = cols < C_k
    cols64 = cols[:, None].to(tl.int64)
    col_mask = col_in[:, None]
    k = tl.load(K_ptr + h64 * stride_kh + cols64 * stride_kt + offs_d[None, :], mask=col_mask, other=0.0)
    v = tl.load(V_ptr + h64 * stride_vh + cols64 * stride_vt + offs_d[None, :], mask=col_mask, other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    Q_base = Q_ptr + h64 * stride_qh
    DO_base = DO_ptr + h64 * stride_doh
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m  # (BLOCK_M,) stream query rows
        row_in = rows < end
        rows64 = rows[:, None].to(tl.int64)
        q = tl.load(Q_base + rows64 * stride_qt + offs_d[None, :], mask=row_in[:, None], other=0.0)
        do = tl.load(DO_base + rows64 * stride_dot + offs_d[None, :], mask=row_in[:, None], other=0.0)
        lse = tl.load(LSE_ptr + h64 * stride_lh + rows, mask=row_in, other=float("inf"))
        delta = tl.load(DELTA_ptr + h64 * stride_lh + rows, mask=row_in, other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        visible = (rows[None, :] >= q_lo[:, None]) & (rows[None, :] < q_hi[:, None])  # (BLOCK_N, BLOCK_M)
        pT = tl.where(visible, tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :] * LOG2E_C), 0.0)
        dv += tl.dot(pT.to(do.dtype), do)
        dpT = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
    dk = dk * sm_scale
    tl.store(DK_ptr + h64 * stride_dkh + cols64 * stride_dkt + offs_d[None, :],
             dk.to(DK_ptr.dtype.element_ty), mask=col_mask)
    tl.store(DV_ptr + h64 * stride_dvh + cols64 * stride_dvt + offs_d[None, :],
             dv.to(DV_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Launchers: strides are passed (no reshapes), outputs allocated, kernels launched. Inputs were
# validated by ``kernels.attention``.
# ----------------------------------------------------------------------------------------------
def _tune_key(rows: int, slots: int) -> tuple[int, int]:
    """(mean segment length bucket, stream length bucket): the autotuner's shape key."""
    return pow2(-(-rows // max(slots, 1)), 8, 256), pow2(rows, 1024, 65536)


def stream_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    seg_q: torch.Tensor, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the stream forward. Returns (out (C_q, H, D) contiguous, lse fp32 (H, C_q))."""
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    C_q, H, D = q.shape
    C_k, N = k.shape[0], cu_q.numel() - 1
    out = empty(C_q, H, D, dtype=q.dtype, device=q.device)
    lse = empty(H, C_q, dtype=torch.float32, device=q.device)
    if C_q == 0 or H == 0:
        return out, lse
    mean, rows = _tune_key(C_q, N)
    grid = lambda meta: (triton.cdiv(C_q, meta["BLOCK_M"]), H)  # noqa: E731
    launch(_stream_attention_fwd_kernel, grid, (D, causal, mean, rows, q.dtype),
           q, k, v, out, lse, cu_q, cu_k, seg_q,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           out.stride(0), out.stride(1), lse.stride(0), C_q, C_k, N, softmax_scale * LOG2E, mean, rows,
           HEAD_DIM=D, CAUSAL=causal, FP32_DOT=fp32_dot(q.dtype))
    return out, lse


def stream_attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: torch.Tensor, cu_k: torch.Tensor, seg_q: torch.Tensor, seg_k: torch.Tensor, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch dQ (+ delta) then dK/dV. Returns contiguous (dq, dk, dv)."""
    do, q, k, v, out = unit_last(do), unit_last(q), unit_last(k), unit_last(v), unit_last(out)
    C_q, H, D = q.shape
    C_k, N = k.shape[0], cu_q.numel() - 1
    dq = empty(C_q, H, D, dtype=q.dtype, device=q.device)
    dk = empty(C_k, H, D, dtype=k.dtype, device=k.device)
    dv = empty(C_k, H, D, dtype=v.dtype, device=v.device)
    if H == 0 or C_q == 0 or C_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(H, C_q, dtype=torch.float32, device=q.device)  # all written by the dQ kernel
    common = dict(HEAD_DIM=D, CAUSAL=causal, FP32_DOT=fp32_dot(q.dtype))
    scales = (softmax_scale * LOG2E, softmax_scale)
    mean, rows = _tune_key(C_q, N)
    grid_q = lambda meta: (triton.cdiv(C_q, meta["BLOCK_M"]), H)  # noqa: E731
    launch(_stream_attention_bwd_dq_kernel, grid_q, (D, causal, mean, rows, q.dtype),
           q, k, v, out, do, lse, delta, dq, cu_q, cu_k, seg_q,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           out.stride(0), out.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
           lse.stride(0), C_q, C_k, N, *scales, mean, rows, **common)
    mean, rows = _tune_key(C_k, N)
    grid_kv = lambda meta: (triton.cdiv(C_k, meta["BLOCK_N"]), H)  # noqa: E731
    launch(_stream_attention_bwd_dkdv_kernel, grid_kv, (D, causal, mean, rows, q.dtype),
           q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, seg_k,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
           lse.stride(0), C_q, C_k, N, *scales, mean, rows, **common)
    return dq, dk, dv
