"""The decoding state a ``Transformer`` fills and steps: per applied decoder layer a self-attention KV cache, per
unique decoder block the cross-attention K/V, and where the next step reads. ``DecodeState`` (with ``KVCache`` and a
``StepPlan`` per step) is the static drivers' (``Transformer.start_decoding`` -> ``decode_step``), ``LiveState`` the
eager drivers' (``start_live`` -> ``live_step``). Tensors only: the model imports this module, nothing here imports
the model."""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange


class StepPlan(NamedTuple):
    """What one decoding step reads besides its tokens (built once per step by ``decode_step``)."""

    pos: torch.Tensor  # int64 (1,) position of the input token, on the device
    span: int  # cache positions the self-attention reads (a python int: the step's only shape)
    k_lengths: torch.Tensor | None  # int32 (B,) visible keys (pos + 1); None: all ``span`` are visible
    gather: torch.Tensor | None  # int64 (B*H*span,) flat cache index of each sequence's keys; None: own row


class KVCache:
    """Preallocated self-attention keys/values of one applied decoder layer: (B, H, T_max, D) each."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, H, 1, D) at position ``pos`` (int64 (1,) device tensor), in place."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))

    def read(self, span: int, gather: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``span`` positions as (B, H, span, D): views of each row's own slots, or with
        ``gather`` (from ``gather_index``) a copy of each sequence's slots wherever they were written."""
        if gather is None:
            return self.k[:, :, :span], self.v[:, :, :span]
        B, H, _, D = self.k.shape
        k = rearrange(self.k, "b h t d -> (b h t) d").index_select(0, gather)  # (B*H*span, D)
        v = rearrange(self.v, "b h t d -> (b h t) d").index_select(0, gather)
        return rearrange(k, "(b h t) d -> b h t d", b=B, h=H), rearrange(v, "(b h t) d -> b h t d", b=B, h=H)

    @staticmethod
    def gather_index(rows: torch.Tensor, heads: int, span: int) -> torch.Tensor:
        """int64 (B*H*span,) flat (b, h, t, :) cache index of position j of sequence b for every head,
        given ``rows`` (B, T_max): the row that holds position j of sequence b (beam ancestry)."""
        T = rows.shape[1]
        h = rearrange(torch.arange(heads, device=rows.device), "h -> 1 h 1")
        j = rearrange(torch.arange(span, device=rows.device), "t -> 1 1 t")
        index = (rearrange(rows[:, :span], "b t -> b 1 t") * heads + h) * T + j  # (B, H, span)
        return rearrange(index, "b h t -> (b h t)")

    def reorder(self, index: torch.Tensor):
        self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class DecodeState:
    """Everything ``decode_step`` needs: per-layer KV caches, cross K/V per unique block, src lengths,
    the input position (``pos`` on the device; ``t`` its host copy, advanced by eager steps only) and,
    for beam search, ``rows``: int64 (B, max_len), the cache row that holds each position of each
    sequence (None: every sequence owns its row)."""

    def __init__(self, caches: list[KVCache], cross_kv: list[tuple[torch.Tensor, torch.Tensor]], src,
                 max_len: int):
        self.caches, self.cross_kv, self.src, self.max_len = caches, cross_kv, src, max_len
        self.t = 0
        self.pos = torch.zeros(1, dtype=torch.long, device=src.lengths.device)
        self.rows: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor):
        """Keep rows ``index`` (int64 (B',)) of every cached tensor, e.g. the surviving beams."""
        if self.rows is not None:
            raise ValueError("DecodeState.reorder: this state tracks beams by `rows` (no reorder needed); "
                             "set state.rows = None to reorder the caches instead")
        for c in self.caches:
            c.reorder(index)
        self.cross_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross_kv]
        self.src = type(self.src)(self.src.lengths.index_select(0, index), None, None, None)  # a Side


class LiveState:
    """What ``live_step`` needs for the n sentences still decoding, each with ``beams`` (K) hypotheses:
    per applied layer one self-attention (K, V) pair (n, H, max_len*K, D), each step's K beams writing the next K
    slots (``slots``: those filled; position j of beam k in slot ``j*K + k`` until ``compact`` keeps only the slots
    a live beam attends to); per unique block the cross (K, V) (n, H, S, D) once per sentence; ``src_bias`` (n, 1, 1, S),
    0 at the real source tokens and -inf past them (SDPA's additive mask, in the cache's dtype); ``t``, the
    input position of the next step (a host int). ``src_lengths``: the source lengths as the host knows them
    (optional): the cross-attention then reads only the longest live source's positions, and no mask when
    every live source has that length (``cross``, ``cross_mask``: what it reads). The buffers are made once:
    ``keep`` moves the kept sentences up in place and the tensors above are views of their first n rows."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], cross_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 src_bias: torch.Tensor, beams: int, max_len: int, src_lengths: list[int] | None = None):
        self._buffers = [t for pair in (*caches, *cross_kv) for t in pair] + [src_bias]
        self._layers = len(caches)
        self.beams, self.max_len, self.t, self.slots = beams, max_len, 0, 0
        self.src_lengths = None if src_lengths is None else list(src_lengths)
        self.plain_norms = False  # every norm a plain F.layer_norm (``plain_norms``): set by ``start_live``
        self._views(src_bias.shape[0])

    def _views(self, n: int) -> None:
        """The first n rows of every buffer, and what the cross-attention reads."""
        rows = [b[:n] for b in self._buffers]
        pairs = list(zip(rows[:-1:2], rows[1:-1:2]))
        self.caches, self.cross_kv, self.src_bias = pairs[: self._layers], pairs[self._layers :], rows[-1]
        self.cross, self.cross_mask = self.cross_kv, self.src_bias
        if self.src_lengths:
            width = max(self.src_lengths)
            self.cross = [(k[:, :, :width], v[:, :, :width]) for k, v in self.cross_kv]
            self.cross_mask = None if min(self.src_lengths) == width else self.src_bias[..., :width]

    def __len__(self) -> int:
        """The sentences decoding."""
        return self.src_bias.shape[0]

    def keep(self, rows: list[int]) -> None:
        """Keep sentences ``rows`` (distinct; row i of the state becomes old row ``rows[i]``) and drop the others:
        only the rows that move are copied, caches by their filled slots only (the rest is never read before a step
        writes it). Ascending rows move every row after the first one that left; filling each hole with one of the
        last rows (``host.HostStream``) moves one row per sentence that left; none moves when only the last left."""
        m = len(rows)
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:
            device = self.src_bias.device
            dst = torch.tensor(moved, dtype=torch.long, device=device)
            src = torch.tensor([rows[i] for i in moved], dtype=torch.long, device=device)
            filled = self.slots
            for i, buf in enumerate(self._buffers):
                part = buf[:, :, :filled] if i < 2 * self._layers else buf  # a self-attention cache: (n, H, T*K, D)
                part.index_copy_(0, dst, part.index_select(0, src))
        if self.src_lengths is not None:
            self.src_lengths = [self.src_lengths[r] for r in rows]
        self._views(m)

    def compact(self, order: torch.Tensor) -> None:
        """Keep, per sentence, the filled self-attention slots ``order`` (int64 (n, m)) as slots ``0 .. m-1``: a step
        then attends over m + K slots instead of ``slots`` + K. Whoever masks the slots moves its mask alike."""
        n, m = order.shape
        _, H, width, D = self._buffers[0].shape  # every self-attention cache: (rows, H, T*K, D)
        first = (torch.arange(n, device=order.device).view(n, 1, 1) * H + torch.arange(H, device=order.device)
                 .view(1, H, 1)) * width  # (n, H, 1): row (sentence, head)'s first slot in the flat (rows*H*T*K, D)
        index = (first + order.view(n, 1, m)).view(-1)  # index_select: a few times faster than gather here
        for buf in self._buffers[: 2 * self._layers]:
            buf[:n, :, :m] = buf.view(-1, D).index_select(0, index).view(n, H, m, D)
        self.slots = m
