"""Batches shaped like data.Batch (pad 0, BOS 2, EOS 3), built from random tokens for model tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def make_batch(src_lengths: list[int], tgt_lengths: list[int], vocab: int, seed: int = 0) -> dict:
    """src = tokens + EOS; tgt_in = BOS + tokens; tgt_out = tokens + EOS; pad 0; widths = max lengths."""
    g = torch.Generator().manual_seed(seed)
    B, S, T = len(src_lengths), max(src_lengths), max(tgt_lengths)
    src = torch.zeros(B, S, dtype=torch.int32)
    tgt_in = torch.zeros(B, T, dtype=torch.int32)
    tgt_out = torch.zeros(B, T, dtype=torch.int32)
    for b, (ls, lt) in enumerate(zip(src_lengths, tgt_lengths)):
        src[b, : ls - 1] = torch.randint(4, vocab, (ls - 1,), generator=g, dtype=torch.int32)
        src[b, ls - 1] = EOS
        words = torch.randint(4, vocab, (lt - 1,), generator=g, dtype=torch.int32)
        tgt_in[b, 0], tgt_in[b, 1:lt] = BOS, words
        tgt_out[b, : lt - 1], tgt_out[b, lt - 1] = words, EOS
    sl = torch.tensor(src_lengths, dtype=torch.int32)
    tl = torch.tensor(tgt_lengths, dtype=torch.int32)
    return dict(src=src, tgt_in=tgt_in, tgt_out=tgt_out, src_lengths=sl, tgt_lengths=tl,
                cu_seqlens_src=F.pad(sl.cumsum(0, dtype=torch.int32), (1, 0)),
                cu_seqlens_tgt=F.pad(tl.cumsum(0, dtype=torch.int32), (1, 0)),
                max_src_len=S, max_tgt_len=T)


def model_inputs(batch: dict) -> dict:
    """The keyword arguments of Transformer.forward."""
    return {k: v for k, v in batch.items() if k != "tgt_out"}


def tgt_mask(batch: dict) -> torch.Tensor:
    """(B, T) bool: real target positions."""
    T = batch["tgt_in"].shape[1]
    return torch.arange(T)[None, :] < batch["tgt_lengths"][:, None]
