"""Batches shaped like data.Batch (pad 0, BOS 2, EOS 3), built from random tokens, and the small models
the model tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import ModelConfig, Transformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
VOCAB = 40


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


def _segments(real: list[int], capacity: int, slots: int, max_len: int) -> torch.Tensor:
    """(N,) int32, as data's packed collate lays them out: real lengths, empty slots, then the tail
    padding cut into dummy segments of max_len (the last one holds the remainder)."""
    tail = capacity - sum(real)
    n_dummy = -(-tail // max_len)
    assert tail >= 0 and len(real) + n_dummy <= slots and max(real) <= max_len, (real, capacity, slots, max_len)
    seg = torch.zeros(slots, dtype=torch.int32)
    seg[: len(real)] = torch.tensor(real, dtype=torch.int32)
    if n_dummy:
        seg[slots - n_dummy :] = max_len
        seg[-1] = tail - (n_dummy - 1) * max_len
    return seg


def pack_batch(batch: dict, capacity: tuple[int, int], slots: int, max_len: int) -> dict:
    """The padded ``batch``'s pairs as one packed batch (docs/ARCHITECTURE.md "Packed batches"):
    (1, C) streams of the sequences back to back, pad (0) in the tail, ``slots`` segments per side
    (real, empty, dummy tail), positions inside each segment (0 on the tail), max lengths = ``max_len``.
    ``real_pairs`` (not a model input) = how many leading segments are real."""
    out = dict(real_pairs=len(batch["src_lengths"]), max_src_len=max_len, max_tgt_len=max_len)
    for side, keys, C in (("src", ("src",), capacity[0]), ("tgt", ("tgt_in", "tgt_out"), capacity[1])):
        lengths = batch[f"{side}_lengths"].tolist()
        seg = _segments(lengths, C, slots, max_len)
        cu = F.pad(seg.cumsum(0, dtype=torch.int32), (1, 0))  # (N+1,), cu[-1] == C
        pos = torch.cat([torch.arange(int(n), dtype=torch.int32) for n in seg])  # (C,)
        pos[sum(lengths):] = 0
        for key in keys:
            stream = torch.zeros(1, C, dtype=torch.int32)
            stream[0, : sum(lengths)] = torch.cat([row[:n] for row, n in zip(batch[key], lengths)])
            out[key] = stream
        out.update({f"{side}_lengths": seg, f"cu_seqlens_{side}": cu, f"{side}_pos": pos[None]})
    return out


def model_inputs(batch: dict) -> dict:
    """The keyword arguments of Transformer.forward."""
    return {k: v for k, v in batch.items() if k not in ("tgt_out", "real_pairs")}


def tgt_mask(batch: dict) -> torch.Tensor:
    """(B, T) bool: real target positions; packed (1, C_tgt): the tokens of the real segments."""
    T = batch["tgt_in"].shape[1]
    if "real_pairs" in batch:
        return torch.arange(T)[None, :] < batch["cu_seqlens_tgt"][batch["real_pairs"]]
    return torch.arange(T)[None, :] < batch["tgt_lengths"][:, None]


# ----------------------------------------------------------------------------------------------
# Small models and the comparisons the tests share
# ----------------------------------------------------------------------------------------------
def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=32, n_heads=2, d_ff=48, enc_layers=2, dec_layers=2, dropout=0.0,
                max_positions=32)
    return ModelConfig(**{**base, **kw})


def build(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(small_cfg(**kw))


def clone_as(model: Transformer, **kw) -> Transformer:
    """Same weights, other switches (layout, backend, norm: none of them changes parameter names)."""
    other = Transformer(small_cfg(**{**_fields(model.cfg), **kw}))
    other.load_state_dict(model.state_dict())
    return other


def _fields(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in ("d_model", "n_heads", "d_ff", "enc_layers", "dec_layers", "enc_unique",
                                         "dec_unique", "sharing", "positions", "tie_embeddings", "activation",
                                         "ffn_norm", "norm", "layout", "attn_backend", "max_positions")}


def logits_and_grads(model: Transformer, batch: dict, forward=None):
    """Logits at real target positions (in sentence order, either layout) and the gradients of a CE
    loss over them, by parameter name. ``forward`` replaces ``model`` for the call (a compiled model)."""
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(**model_inputs(batch))
    mask = tgt_mask(batch)
    real = logits[mask]  # (n_real, V)
    loss = F.cross_entropy(real.float(), batch["tgt_out"][mask].long())
    loss.backward()
    return real.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, atol=1e-5, rtol=1e-4):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=rtol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
