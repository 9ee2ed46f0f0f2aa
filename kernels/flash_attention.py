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

(Kernel layers: the Triton forward/backward kernels, launchers and the custom op are added
by the kernels work; until then every call is served by SDPA or the reference.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

from kernels._utils import resolve_backend

ATTN_BACKENDS = ("auto", "triton", "sdpa", "reference")
HEAD_DIMS = (16, 32, 64, 128)


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
    """(total, H, D) packed -> (B, H, max_seqlen, D) zero-padded."""
    B = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(max_seqlen, device=x.device)
    valid = pos[None, :] < lengths[:, None]  # (B, T)
    index = (cu_seqlens[:-1].long()[:, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))
    out = x[index] * valid[:, :, None, None].to(x.dtype)  # (B, T, H, D)
    del B
    return rearrange(out, "b t h d -> b h t d")


def unpad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(B, H, T, D) padded -> (total, H, D) packed, keeping the first length of every sequence."""
    T = x.shape[2]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    valid = torch.arange(T, device=x.device)[None, :] < lengths[:, None]  # (B, T)
    packed = rearrange(x, "b h t d -> b t h d")[valid]  # (total, H, D)
    assert packed.shape[0] == total, (packed.shape, total)
    return packed


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, causal, q_lengths, k_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"attention: {name}.dtype={t.dtype} is not floating point")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
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
    else:
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
    backend: str = "auto",
) -> torch.Tensor:
    """Scaled dot-product attention; returns a tensor shaped like ``q``.

    Padded: q (B, H, Tq, D), k/v (B, H, Tk, D), optional int32 (B,) ``q_lengths``/``k_lengths``.
    Varlen: q (total_q, H, D), k/v (total_k, H, D), int32 (B+1,) ``cu_seqlens_q``/``cu_seqlens_k``
    and python-int ``max_seqlen_q``/``max_seqlen_k``.
    ``backend``: "auto" (our kernel on CUDA when supported, SDPA where it is the faster right
    answer, the reference otherwise), "triton", "sdpa" or "reference"; ``FASTMT_ATTN_BACKEND``
    overrides "auto".
    """
    _check_inputs(q, k, v, causal, q_lengths, k_lengths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    backend = resolve_backend(backend, "FASTMT_ATTN_BACKEND", ATTN_BACKENDS)
    if backend == "auto":
        backend = "reference" if not q.is_cuda else "sdpa"
    if backend == "triton":
        raise NotImplementedError("attention: the Triton backend is not built yet")
    if cu_seqlens_q is not None:
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
