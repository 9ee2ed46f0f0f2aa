"""`Batch` and the collate that pads a batch straight from the cached token arrays (vectorised numpy).

Layout, with n_i the subword count of example i (no specials in the cache):
  src     (B, S) int32: tokens + EOS, pad after        src_lengths = n_src + 1
  tgt_in  (B, T) int32: BOS + tokens, pad after        tgt_lengths = n_tgt + 1
  tgt_out (B, T) int32: tokens + EOS, pad after (the loss ignores pad)
  cu_seqlens_* (B+1,) int32 prefix sums of the lengths, for varlen attention.

Packed layout (`PackedCollator`, batching="packed"; docs/ARCHITECTURE.md "Packed batches"), fixed C_src,
C_tgt, N for the whole run, k real pairs:
  src     (1, C_src) int32: pair 0 tokens + EOS, pair 1 tokens + EOS, ..., pad in the tail
  tgt_in  (1, C_tgt) int32: BOS + tokens per pair, back to back, pad in the tail
  tgt_out (1, C_tgt) int32: tokens + EOS per pair, pad in the tail
  src_lengths / tgt_lengths (N,) int32 segment lengths: k real pairs, then empty (0) slots, then the
                tail padding cut into dummy segments of <= max_len, so cu_seqlens_*[-1] == C
  src_pos / tgt_pos (1, C) int32: index of each token inside its segment; 0 on the tail padding
  src_seg / tgt_seg (C,) int32: the segment holding each token (kernels.packed_attention.segment_ids of
                cu_seqlens_*), built here in the data workers so the step does not compute them
  index   (k,) int64 example indices of the real pairs (segment j < k is example index[j])
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from .batching import PackLayout, round_up
from .files import load_npy
from .tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """Padded (B rows) or, with ``packed``, one stream per side of N segments; shapes in the module doc."""

    src: torch.Tensor  # (B, S) int32; packed (1, C_src)
    tgt_in: torch.Tensor  # (B, T) int32; packed (1, C_tgt)
    tgt_out: torch.Tensor  # (B, T) int32; packed (1, C_tgt)
    src_lengths: torch.Tensor  # (B,) int32, incl. EOS; packed (N,) segment lengths
    tgt_lengths: torch.Tensor  # (B,) int32, incl. BOS (= incl. EOS in tgt_out); packed (N,)
    cu_seqlens_src: torch.Tensor  # (B+1,) int32; packed (N+1,), last entry C_src
    cu_seqlens_tgt: torch.Tensor  # (B+1,) int32; packed (N+1,), last entry C_tgt
    index: torch.Tensor  # (B,) int64 example indices into the split; packed (k,) the real pairs
    max_src_len: int  # unpadded maxima, python ints (no host sync needed); packed: the static max_len
    max_tgt_len: int
    num_real_tokens: int  # src + tgt tokens incl. EOS / BOS, python int
    num_target_tokens: int  # real target tokens (tgt_out positions the loss counts), python int
    src_pos: torch.Tensor | None = None  # packed: (1, C_src) int32 position inside the segment; else None
    tgt_pos: torch.Tensor | None = None  # packed: (1, C_tgt) int32; else None
    src_seg: torch.Tensor | None = None  # packed: (C_src,) int32 segment of each token; else None
    tgt_seg: torch.Tensor | None = None  # packed: (C_tgt,) int32; else None
    packed: bool = False  # True for batching="packed"

    @property
    def num_padded_tokens(self) -> int:
        """Computed positions: B*S + B*T (packed: C_src + C_tgt)."""
        return self.src.numel() + self.tgt_in.numel()

    def __len__(self) -> int:
        """Number of real pairs (packed: k, not the stream's batch dim of 1)."""
        return self.index.shape[0]

    def model_inputs(self, *, static_max_len: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``models.Transformer.forward`` for this batch, in every layout.

        ``static_max_len``: pass the padded widths as the max lengths (an upper bound is valid). Compiled
        models want this for padded batches: the unpadded maxima are new python ints almost every batch
        (a recompile each); packed batches already carry the run's static bound.
        """
        padded_bound = static_max_len and not self.packed
        return dict(
            src=self.src, tgt_in=self.tgt_in, src_lengths=self.src_lengths, tgt_lengths=self.tgt_lengths,
            cu_seqlens_src=self.cu_seqlens_src, cu_seqlens_tgt=self.cu_seqlens_tgt,
            max_src_len=self.src.shape[1] if padded_bound else self.max_src_len,
            max_tgt_len=self.tgt_in.shape[1] if padded_bound else self.max_tgt_len,
            src_pos=self.src_pos, tgt_pos=self.tgt_pos, src_seg=self.src_seg, tgt_seg=self.tgt_seg,
        )

    def _map(self, fn) -> Batch:
        return Batch(
            **{
                f.name: fn(v) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                for f in fields(self)
            }
        )

    def to(self, device, non_blocking: bool = True) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True)
        return self._map(lambda t: t.pin_memory())


_ARRAYS = ("src_ids", "src_off", "tgt_ids", "tgt_off")


def _mapped_file(a) -> str | None:
    """The .npy file a whole-file memory map (``np.load(..., mmap_mode="r")``) came from, else None."""
    if isinstance(a, np.memmap) and isinstance(a.base, mmap.mmap) and a.filename:
        return str(a.filename)
    return None


class _SharedArrays:
    """Pickles the token arrays of a collator by reference when they are memory maps of the cache: a worker
    process started by spawn/forkserver maps the same file (shared page cache) instead of receiving a copy
    of the corpus; forked workers inherit the mapping anyway."""

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in _ARRAYS:
            path = _mapped_file(state[name])
            if path is not None:
                state[name] = ("mmap", path)
        return state

    def __setstate__(self, state):
        for name in _ARRAYS:
            if isinstance(state[name], tuple) and state[name][0] == "mmap":
                state[name] = load_npy(state[name][1], "cache array")  # the header checked, then mapped
        self.__dict__.update(state)


def _pad_rows(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, width: int, shift: int) -> np.ndarray:
    """(B, width) int32 of pad with row i's tokens flat[starts[i]:starts[i]+lens[i]] placed at column ``shift``."""
    B = len(lens)
    out = np.full((B, width), PAD_ID, dtype=np.int32)
    total = int(lens.sum())
    if total:
        row = np.repeat(np.arange(B), lens)
        col = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        out[row, col + shift] = flat[np.repeat(starts, lens) + col]
    return out


class Collator(_SharedArrays):
    """Turns an index list into a `Batch`, padding each side to its batch max rounded up to ``pad_multiple``,
    or to ``seq_len`` when ``seq_len`` is set (fixed mode, truncating overlong sequences: keeps EOS)."""

    def __init__(
        self, src_ids, src_off, tgt_ids, tgt_off, *, pad_multiple: int = 1, seq_len: int | None = None
    ):
        self.src_ids, self.src_off, self.tgt_ids, self.tgt_off = src_ids, src_off, tgt_ids, tgt_off  # memory maps
        self.pad_multiple, self.seq_len = pad_multiple, seq_len

    def __call__(self, indices) -> Batch:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or len(idx) == 0:
            raise ValueError(f"collate needs a non-empty 1-D index list, got shape {idx.shape}")
        s0, t0 = self.src_off[idx], self.tgt_off[idx]
        ns, nt = self.src_off[idx + 1] - s0, self.tgt_off[idx + 1] - t0  # subword counts, no specials
        if self.seq_len is not None:  # fixed: room for EOS / BOS within seq_len
            ns, nt = np.minimum(ns, self.seq_len - 1), np.minimum(nt, self.seq_len - 1)
            S = T = self.seq_len
        else:
            S = int(round_up(int(ns.max()) + 1, self.pad_multiple))
            T = int(round_up(int(nt.max()) + 1, self.pad_multiple))
        B, rows = len(idx), np.arange(len(idx))
        src = _pad_rows(self.src_ids, s0, ns, S, 0)
        src[rows, ns] = EOS_ID
        tgt_out = _pad_rows(self.tgt_ids, t0, nt, T, 0)
        tgt_out[rows, nt] = EOS_ID
        tgt_in = _pad_rows(self.tgt_ids, t0, nt, T, 1)
        tgt_in[:, 0] = BOS_ID
        sl, tl = (ns + 1).astype(np.int32), (nt + 1).astype(np.int32)
        cu_s = np.zeros(B + 1, dtype=np.int32)
        cu_t = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(sl, out=cu_s[1:])
        np.cumsum(tl, out=cu_t[1:])
        return Batch(
            src=torch.from_numpy(src),
            tgt_in=torch.from_numpy(tgt_in),
            tgt_out=torch.from_numpy(tgt_out),
            src_lengths=torch.from_numpy(sl),
            tgt_lengths=torch.from_numpy(tl),
            cu_seqlens_src=torch.from_numpy(cu_s),
            cu_seqlens_tgt=torch.from_numpy(cu_t),
            index=torch.from_numpy(idx.copy()),
            max_src_len=int(sl.max()),
            max_tgt_len=int(tl.max()),
            num_real_tokens=int(cu_s[-1]) + int(cu_t[-1]),
            num_target_tokens=int(cu_t[-1]),
        )


def _scatter_stream(out: np.ndarray, flat: np.ndarray, starts: np.ndarray, lens: np.ndarray, at: np.ndarray):
    """out[at[i] + j] = flat[starts[i] + j] for j < lens[i]: segment i's tokens placed at stream offset at[i]."""
    total = int(lens.sum())
    if total:
        col = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        out[np.repeat(at, lens) + col] = flat[np.repeat(starts, lens) + col]


def _segments(real: np.ndarray, capacity: int, layout: PackLayout) -> np.ndarray:
    """(N,) int32 segment lengths: the real ones, empty slots, then the tail cut into <= max_len dummies."""
    tail = capacity - int(real.sum())
    n_dummy = -(-tail // layout.max_len)
    assert len(real) + n_dummy <= layout.slots, (len(real), n_dummy, layout)  # pack_layout's slot rule
    seg = np.zeros(layout.slots, dtype=np.int32)
    seg[: len(real)] = real
    if n_dummy:
        seg[layout.slots - n_dummy :] = layout.max_len
        seg[-1] = tail - (n_dummy - 1) * layout.max_len
    return seg


def segment_of_tokens(seg: np.ndarray) -> np.ndarray:
    """(C,) int32 index of the segment holding each token of a stream cut into ``seg`` (N,) lengths (empty segments
    hold none): kernels.packed_attention.segment_ids of its cu_seqlens, on the host."""
    return np.repeat(np.arange(len(seg), dtype=np.int32), seg)


def _positions(seg: np.ndarray, used: int) -> np.ndarray:
    """(1, C) int32 index of each position inside its segment, 0 from ``used`` on (tail padding)."""
    cu = np.cumsum(seg) - seg
    pos = (np.arange(int(seg.sum())) - np.repeat(cu, seg)).astype(np.int32)
    pos[used:] = 0
    return pos[None]


class PackedCollator(_SharedArrays):
    """Turns an index list into a packed `Batch` with the run's fixed ``layout`` (every batch same shapes)."""

    def __init__(self, src_ids, src_off, tgt_ids, tgt_off, *, layout: PackLayout):
        if not isinstance(layout, PackLayout):
            raise TypeError(f"layout must be a data.batching.PackLayout, got {type(layout).__name__}")
        self.src_ids, self.src_off, self.tgt_ids, self.tgt_off = src_ids, src_off, tgt_ids, tgt_off
        self.layout = layout

    def __call__(self, indices) -> Batch:
        L = self.layout
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1 or not 1 <= len(idx) <= L.real_slots:
            raise ValueError(
                f"packed collate needs a 1-D index list of 1..{L.real_slots} pairs (real slots), got shape {idx.shape}"
            )
        s0, t0 = self.src_off[idx], self.tgt_off[idx]
        ns, nt = self.src_off[idx + 1] - s0, self.tgt_off[idx + 1] - t0  # subword counts, no specials
        sl, tl = (ns + 1).astype(np.int32), (nt + 1).astype(np.int32)
        used_s, used_t = int(sl.sum()), int(tl.sum())
        if used_s > L.src_capacity or used_t > L.tgt_capacity or max(sl.max(), tl.max()) > L.max_len:
            raise ValueError(
                f"pairs need {used_s} src / {used_t} tgt tokens (longest {int(sl.max())} / {int(tl.max())}) > "
                f"capacity ({L.src_capacity}, {L.tgt_capacity}) or max_len={L.max_len}; plan with this layout"
            )
        at_s, at_t = np.cumsum(sl) - sl, np.cumsum(tl) - tl  # stream offset of each pair
        src = np.full(L.src_capacity, PAD_ID, dtype=np.int32)
        _scatter_stream(src, self.src_ids, s0, ns, at_s)
        src[at_s + ns] = EOS_ID
        tgt_out = np.full(L.tgt_capacity, PAD_ID, dtype=np.int32)
        _scatter_stream(tgt_out, self.tgt_ids, t0, nt, at_t)
        tgt_out[at_t + nt] = EOS_ID
        tgt_in = np.full(L.tgt_capacity, PAD_ID, dtype=np.int32)
        _scatter_stream(tgt_in, self.tgt_ids, t0, nt, at_t + 1)
        tgt_in[at_t] = BOS_ID
        seg_s, seg_t = _segments(sl, L.src_capacity, L), _segments(tl, L.tgt_capacity, L)
        cu_s = np.zeros(L.slots + 1, dtype=np.int32)
        cu_t = np.zeros(L.slots + 1, dtype=np.int32)
        np.cumsum(seg_s, out=cu_s[1:])
        np.cumsum(seg_t, out=cu_t[1:])
        return Batch(
            src=torch.from_numpy(src[None]),
            tgt_in=torch.from_numpy(tgt_in[None]),
            tgt_out=torch.from_numpy(tgt_out[None]),
            src_lengths=torch.from_numpy(seg_s),
            tgt_lengths=torch.from_numpy(seg_t),
            cu_seqlens_src=torch.from_numpy(cu_s),
            cu_seqlens_tgt=torch.from_numpy(cu_t),
            index=torch.from_numpy(idx.copy()),
            max_src_len=L.max_len,
            max_tgt_len=L.max_len,
            num_real_tokens=used_s + used_t,
            num_target_tokens=used_t,
            src_pos=torch.from_numpy(_positions(seg_s, used_s)),
            tgt_pos=torch.from_numpy(_positions(seg_t, used_t)),
            src_seg=torch.from_numpy(segment_of_tokens(seg_s)),
            tgt_seg=torch.from_numpy(segment_of_tokens(seg_t)),
            packed=True,
        )
