"""`Batch` and the collate that pads a batch straight from the cached token arrays (vectorised numpy).

Layout, with n_i the subword count of example i (no specials in the cache):
  src     (B, S) int32: tokens + EOS, pad after        src_lengths = n_src + 1
  tgt_in  (B, T) int32: BOS + tokens, pad after        tgt_lengths = n_tgt + 1
  tgt_out (B, T) int32: tokens + EOS, pad after (the loss ignores pad)
  cu_seqlens_* (B+1,) int32 prefix sums of the lengths, for varlen attention.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from .batching import round_up
from .tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) int32
    tgt_in: torch.Tensor  # (B, T) int32
    tgt_out: torch.Tensor  # (B, T) int32
    src_lengths: torch.Tensor  # (B,) int32, incl. EOS
    tgt_lengths: torch.Tensor  # (B,) int32, incl. BOS (= incl. EOS in tgt_out)
    cu_seqlens_src: torch.Tensor  # (B+1,) int32
    cu_seqlens_tgt: torch.Tensor  # (B+1,) int32
    index: torch.Tensor  # (B,) int64 example indices into the split (for debugging and coverage checks)
    max_src_len: int  # unpadded maxima, python ints (no host sync needed)
    max_tgt_len: int
    num_real_tokens: int  # src + tgt tokens incl. EOS / BOS, python int

    @property
    def num_padded_tokens(self) -> int:
        """Computed positions: B*S + B*T."""
        return self.src.numel() + self.tgt_in.numel()

    def __len__(self) -> int:
        return self.src.shape[0]

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


class Collator:
    """Turns an index list into a `Batch`, padding each side to its batch max rounded up to ``pad_multiple``,
    or to ``seq_len`` when ``seq_len`` is set (fixed mode, truncating overlong sequences: keeps EOS)."""

    def __init__(
        self, src_ids, src_off, tgt_ids, tgt_off, *, pad_multiple: int = 1, seq_len: int | None = None
    ):
        self.src_ids, self.src_off, self.tgt_ids, self.tgt_off = src_ids, src_off, tgt_ids, tgt_off
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
        )
