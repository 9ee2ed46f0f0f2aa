"""A PyTorch emulation of the attention kernels' precision path on a GPU, for CPU tests.

On CUDA the kernels (kernels/sequence_attention.py, kernels/packed_attention.py) multiply fp16/bf16 tiles
on tensor cores with fp32 accumulation and round two operands to the input dtype before the second
matmul of each pair: the forward's P before ``P @ V``, the backward's P before ``P^T dO`` and dS before
``dS K`` / ``dS^T Q``. Under the interpreter (``FP32_DOT``) every tile is fp32, so the CPU tests never see
those roundings. This module reproduces them:

- scores ``S = (q @ k^T) * (scale * log2 e)`` in fp32 from the inputs' exact values (products of two
  fp16/bf16 numbers are exact in fp32);
- the forward's online softmax over key blocks of ``BLOCK_N`` keys, in the tiling's block origins (per
  sequence from its first key; stream tiling from the first key any row of the ``BLOCK_M``-row query block
  sees), with P = exp2(S - running max) rounded to the input dtype before ``P @ V``, fp32 statistics,
  the output rounded to the input dtype when stored and the logsumexp kept in fp32;
- the backward from the stored output and the fp32 logsumexp: delta = rowsum(dO * O), P = exp2(S - lse),
  dV = low(P)^T dO, dS = P * (dO V^T - delta), dQ = low(dS) K * scale, dK = low(dS)^T Q * scale, each
  stored in the input dtype.

Accumulation order inside a tile is not reproduced (fp32 reorderings are ~1e-7 relative, far below the
roundings above). Segments are processed in groups of similar length (exact: segments never interact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._utils import LOG2E
from kernels.flash_attention import visibility_mask


def emulate_varlen(q, k, v, do, cu_q: torch.Tensor, cu_k: torch.Tensor, *, causal: bool, scale: float,
                   tiling: str, block_m: int, block_n: int, p_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of varlen attention (q (C_q, H, D), k/v (C_k, H, D), int32 (N+1,) cu_seqlens) as
    the kernels compute them on a GPU; ``tiling`` "sequence" or "stream" with its forward (BLOCK_M, BLOCK_N).
    ``p_dtype``: the dtype P and dS are rounded to (None: the input dtype, as the kernels do; a coarser one
    shows what the tolerance rule rejects)."""
    dtype = q.dtype
    cu_q, cu_k = cu_q.long().cpu(), cu_k.long().cpu()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    p_dtype = p_dtype or dtype
    origin = _block_origins(cu_q, cu_k, lq, lk, causal, tiling, block_m)  # (C_q,) per query row
    outs = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, q, k, v)]  # out, dq, dk, dv
    for segs in _groups(lq, lk):
        rows_q, ok_q = _rows(cu_q, lq, segs)
        rows_k, ok_k = _rows(cu_k, lk, segs)
        Q, dO = (_gather(x.float(), rows_q, ok_q) for x in (q, do))  # (n, H, Tq, D)
        K, V = (_gather(x.float(), rows_k, ok_k) for x in (k, v))  # (n, H, Tk, D)
        visible = visibility_mask(rows_q.shape[1], rows_k.shape[1], lq[segs], lk[segs], causal)  # (n, 1, Tq, Tk)
        j = torch.arange(rows_k.shape[1])
        blocks = torch.div(j - origin[rows_q][..., None], block_n, rounding_mode="floor")[:, None]
        got = _attention(Q, K, V, dO, visible, blocks, dtype, p_dtype, scale)
        for buf, x, rows, ok in zip(outs, got, (rows_q, rows_q, rows_k, rows_k), (ok_q, ok_q, ok_k, ok_k)):
            buf[rows[ok]] = x.transpose(1, 2)[ok]
    return [x.to(dtype) for x in outs]


def reference_varlen(cu_q: torch.Tensor, cu_k: torch.Tensor, *, causal: bool):
    """``fn(q, k, v) -> out``: the tests' padded reference (``attention_reference``, ``upcast=False``) of each
    varlen segment, differentiable, with segments padded in groups of similar length rather than all to
    the longest (the packed-batch cases' 176 segments x 128 positions made the reference the cost)."""
    from kernels.flash_attention import attention_reference

    cu_q, cu_k = cu_q.long().cpu(), cu_k.long().cpu()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]

    def fn(q, k, v):
        out = q.new_zeros(q.shape)
        for segs in _groups(lq, lk):
            rows_q, ok_q = _rows(cu_q, lq, segs)
            rows_k, ok_k = _rows(cu_k, lk, segs)
            o = attention_reference(_gather(q, rows_q, ok_q), _gather(k, rows_k, ok_k), _gather(v, rows_k, ok_k),
                                    causal=causal, q_lengths=lq[segs].int(), k_lengths=lk[segs].int(), upcast=False)
            out = out.index_put((rows_q[ok_q],), o.transpose(1, 2)[ok_q])
        return out

    return fn


def _groups(lq, lk) -> list[torch.Tensor]:
    """Segment indices in power-of-two groups of their longer side (empty segments with the shortest)."""
    width = torch.maximum(lq, lk).clamp_min(1)
    buckets = 1 << (width - 1).log2().ceil().clamp_min(0).long()
    return [(buckets == b).nonzero().squeeze(1) for b in buckets.unique().tolist()]


def emulate_padded(q, k, v, do, q_lengths, k_lengths, *, causal: bool, scale: float, block_m: int,
                   block_n: int) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of padded attention (q (B, H, Tq, D), optional int32 (B,) lengths) as the
    per-sequence kernels compute them: rows past a length give 0, keys past one get zero gradients."""
    B, _, Tq, _ = q.shape
    Tk = k.shape[2]
    ql = q_lengths.cpu() if q_lengths is not None else torch.full((B,), Tq, dtype=torch.int32)
    kl = k_lengths.cpu() if k_lengths is not None else torch.full((B,), Tk, dtype=torch.int32)
    cu_q, cu_k = (F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0)) for lens in (ql, kl))

    def pack(x, lens):  # (B, H, T, D) -> (total, H, D), the first lens[b] rows of each sequence
        return torch.cat([x[b, :, : int(n)].transpose(0, 1) for b, n in enumerate(lens.tolist())])

    got = emulate_varlen(pack(q, ql), pack(k, kl), pack(v, kl), pack(do, ql), cu_q, cu_k, causal=causal,
                         scale=scale, tiling="sequence", block_m=block_m, block_n=block_n)
    rows_q, ok_q = _rows(cu_q.long(), ql.long(), torch.arange(B), width=Tq)
    rows_k, ok_k = _rows(cu_k.long(), kl.long(), torch.arange(B), width=Tk)
    return [_gather(x, rows, ok) for x, rows, ok in zip(got, (rows_q, rows_q, rows_k, rows_k),
                                                          (ok_q, ok_q, ok_k, ok_k))]


def _rows(cu, lengths, segs, width=None):
    """(n, T) stream row of each position of segments ``segs`` and (n, T) whether it lies in the segment."""
    T = width if width is not None else max(int(lengths[segs].max()), 1)
    pos = torch.arange(T)
    ok = pos[None, :] < lengths[segs][:, None]
    return torch.where(ok, cu[segs][:, None] + pos[None, :], 0), ok


def _gather(x, rows, ok):
    """(C, H, D) stream -> (n, H, T, D), zeros outside the segments."""
    return (x[rows] * ok[..., None, None].to(x.dtype)).transpose(1, 2)


def _block_origins(cu_q, cu_k, lq, lk, causal, tiling, block_m) -> torch.Tensor:
    """int64 (C_q,): for each query row, where its key loop's blocks start, in its segment's key positions."""
    C_q = int(cu_q[-1])
    if tiling == "sequence":  # every sequence's key loop starts at its own first key
        return torch.zeros(C_q, dtype=torch.int64)
    if tiling != "stream":
        raise ValueError(f"tiling={tiling!r}")
    # stream: a BLOCK_M-row query block loops from the first key any of its rows sees (stream coordinates)
    seg = torch.bucketize(torch.arange(C_q), cu_q[1:], right=True)  # (C_q,) segment of each row
    i = torch.arange(C_q) - cu_q[seg]  # row inside its segment
    sees = (lk[seg] > 0) & (~torch.tensor(causal) | (i + lk[seg] - lq[seg] >= 0))  # any key visible
    lo = cu_k[seg]  # first visible key of each row (causality moves only the last)
    origin = torch.zeros(C_q, dtype=torch.int64)
    for m0 in range(0, C_q, block_m):
        rows = slice(m0, m0 + block_m)
        if sees[rows].any():
            origin[rows] = lo[rows][sees[rows]].min() - lo[rows]
    return origin


def _attention(Q, K, V, dO, visible, blocks, dtype, p_dtype, scale):
    """Forward (online softmax over ``blocks``) and backward of one group of segments, at the kernels'
    precision (P and dS rounded to ``p_dtype``): [out, dq, dk, dv] as (n, H, T, D) fp32 holding values of
    ``dtype``."""
    S = torch.einsum("nhid,nhjd->nhij", Q, K) * torch.tensor(scale * LOG2E, dtype=torch.float32)
    n, H, Tq, _ = S.shape
    m = torch.full((n, H, Tq), -torch.inf)
    l = torch.zeros(n, H, Tq)  # noqa: E741 - the algorithm's name
    acc = torch.zeros(n, H, Tq, V.shape[-1])
    ids = blocks.expand_as(visible)[visible]
    for b in range(int(ids.min()), int(ids.max()) + 1) if ids.numel() else ():
        in_block = visible & (blocks == b)  # (n, 1, Tq, Tk)
        cols = in_block.any(dim=(0, 1, 2)).nonzero()
        if cols.numel() == 0:
            continue
        c0, c1 = int(cols.min()), int(cols.max()) + 1  # the keys any row has in this block
        s = torch.where(in_block[..., c0:c1], S[..., c0:c1], -torch.inf)
        m_new = torch.maximum(m, s.amax(-1))
        m_sub = torch.where(m_new == -torch.inf, 0.0, m_new)
        p = torch.exp2(s - m_sub[..., None])
        alpha = torch.exp2(m - m_sub)
        l = l * alpha + p.sum(-1)  # noqa: E741
        acc = acc * alpha[..., None] + torch.einsum("nhij,nhjd->nhid", _low(p, p_dtype), V[:, :, c0:c1])
        m = m_new
    valid = l > 0
    l_safe = torch.where(valid, l, 1.0)
    O = _low(torch.where(valid[..., None], acc / l_safe[..., None], 0.0), dtype)  # the stored output  # noqa: E741
    lse = torch.where(valid, (m + torch.log2(l_safe)) / LOG2E, torch.inf)
    delta = (dO * O).sum(-1, keepdim=True)  # (n, H, Tq, 1) from the stored output
    P = torch.where(visible, torch.exp2(S - lse[..., None] * LOG2E), 0.0)
    dV = torch.einsum("nhij,nhid->nhjd", _low(P, p_dtype), dO)
    dS = P * (torch.einsum("nhid,nhjd->nhij", dO, V) - delta)
    dQ = torch.einsum("nhij,nhjd->nhid", _low(dS, p_dtype), K) * scale
    dK = torch.einsum("nhij,nhid->nhjd", _low(dS, p_dtype), Q) * scale
    return [O, _low(dQ, dtype), _low(dK, dtype), _low(dV, dtype)]


def _low(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (round to nearest even, as the GPU's conversions), kept as fp32."""
    return x.to(dtype).float()
