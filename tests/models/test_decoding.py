"""Cached decoding: step logits equal the full forward, greedy/beam correctness, a copy task learned."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig, Transformer
from models.decoding import beam_search, greedy_decode
from tests.models.utils import BOS, EOS, PAD, make_batch, model_inputs

IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


def build(vocab=40, seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    base = dict(vocab_size=vocab, d_model=32, n_heads=2, d_ff=48, enc_layers=2, dec_layers=2, dropout=0.0,
                max_positions=32, tie_embeddings=False)
    return Transformer(ModelConfig(**{**base, **kw})).eval()


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="none"),
    pytest.param(dict(sharing="cycle_rev", dec_layers=4, dec_unique=2, enc_unique=1, positions="learned",
                      attn_backend="sdpa", norm="torch"), id="cycle_rev-learned-sdpa-torchnorm"),
])
def test_decode_steps_match_full_forward(kw):
    model = build(**kw)
    batch = make_batch([6, 2, 4], [5, 5, 5], 40, seed=1)  # ragged sources, full-length targets
    full = model(**model_inputs(batch))  # (B, T, V)
    state = model.start_decoding(batch["src"], batch["src_lengths"], max_len=5)
    with torch.no_grad():
        steps = torch.stack([model.decode_step(batch["tgt_in"][:, t].long(), state) for t in range(5)], 1)
    torch.testing.assert_close(steps, full.detach(), atol=1e-5, rtol=1e-4)


def sequence_logprobs(model, src, src_len, seqs: list[list[int]], forbidden: list[int]) -> torch.Tensor:
    """Full-forward (uncached) log-probability of each generated sequence, ``forbidden`` ids excluded."""
    n, T = len(seqs), max(len(s) for s in seqs)
    tgt_in = torch.zeros(n, T, dtype=torch.int32)
    tgt_out = torch.zeros(n, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tgt_in[i, : len(s)] = torch.tensor([BOS] + s[:-1])
        tgt_out[i, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    with torch.no_grad():
        logits = model(src.expand(n, -1), tgt_in, src_len.expand(n), lens).float()
        logits[..., forbidden] = -math.inf
        logp = F.log_softmax(logits, -1)
    picked = logp.gather(-1, tgt_out[..., None])[..., 0]  # (n, T)
    return torch.where(torch.arange(T)[None] < lens[:, None], picked, 0.0).sum(1)


def test_greedy_equals_argmax_of_uncached_reforward():
    model = build()
    batch = make_batch([7, 3, 5, 1], [2, 2, 2, 2], 40, seed=2)
    ratio, extra = 1.0, 2
    out = greedy_decode(model, batch["src"], batch["src_lengths"], max_len_ratio=ratio, max_len_extra=extra, **IDS)
    assert len(out) == 4
    for b, toks in enumerate(out):
        limit = int(batch["src_lengths"][b]) * ratio + extra
        assert len(toks) <= limit and EOS not in toks and BOS not in toks
        seq = toks + ([EOS] if len(toks) < limit else [])  # stopped early only by EOS
        tgt_in = torch.tensor([[BOS] + seq[:-1]], dtype=torch.int32)
        with torch.no_grad():
            logits = model(batch["src"][b : b + 1], tgt_in, batch["src_lengths"][b : b + 1],
                           torch.tensor([len(seq)], dtype=torch.int32))
        logits[..., [PAD, BOS]] = -math.inf
        assert logits[0].argmax(-1).tolist() == seq


def test_beam_size_one_equals_greedy():
    model = build(seed=3)
    batch = make_batch([7, 3, 5, 1, 6], [2] * 5, 40, seed=3)
    args = (model, batch["src"], batch["src_lengths"])
    assert beam_search(*args, beam_size=1, **IDS) == greedy_decode(*args, **IDS)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_wide_beam_is_exact_search(length_penalty):
    """A beam wider than the hypothesis space finds the best-scoring sequence of an exhaustive search."""
    V, limit = 7, 3  # 4 specials + 3 words; at most 3 generated tokens
    model = build(vocab=V, seed=4)
    batch = make_batch([4], [2], V, seed=4)
    src, src_len = batch["src"], batch["src_lengths"]
    best = beam_search(model, src, src_len, beam_size=200, length_penalty=length_penalty, max_len_ratio=0.0,
                       max_len_extra=limit, **IDS)[0]
    # every sequence: some words (UNK is one; PAD and BOS are never generated) then EOS, or `limit` words
    words = [t for t in range(V) if t not in (EOS, PAD, BOS)]
    seqs = [list(p) + [EOS] for n in range(limit) for p in itertools.product(words, repeat=n)]
    seqs += [list(p) for p in itertools.product(words, repeat=limit)]
    lp = sequence_logprobs(model, src, src_len, seqs, forbidden=[PAD, BOS])
    scores = torch.tensor([lp[i] / ((5 + len(s)) / 6) ** length_penalty for i, s in enumerate(seqs)])
    i = int(scores.argmax())
    target = seqs[i][:-1] if seqs[i][-1] == EOS else seqs[i]
    if best != target:  # allow only a numerical tie
        j = next(k for k, s in enumerate(seqs) if (s[:-1] if s[-1] == EOS else s) == best and len(s) >= len(best))
        assert math.isclose(scores[j], scores[i], abs_tol=1e-5), (best, target)


def test_tiny_model_learns_to_copy():
    """A tiny model overfits a synthetic copy task; greedy and beam search then reproduce the sources."""
    torch.manual_seed(0)
    V, n = 12, 32
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 8, (n,), generator=g).tolist()  # tokens + EOS
    batch = make_batch(lens, lens, V, seed=5)
    src = batch["src"]
    words = [src[i, : lens[i] - 1].tolist() for i in range(n)]
    tgt_in, tgt_out = torch.zeros_like(src), torch.zeros_like(src)
    for i, w in enumerate(words):  # target = source
        tgt_in[i, : lens[i]] = torch.tensor([BOS] + w)
        tgt_out[i, : lens[i]] = torch.tensor(w + [EOS])
    batch.update(tgt_in=tgt_in, tgt_out=tgt_out)
    model = Transformer(ModelConfig(vocab_size=V, d_model=32, n_heads=2, d_ff=64, enc_layers=1, dec_layers=1,
                                    dropout=0.0, max_positions=16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(600):
        logits = model(**model_inputs(batch))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten().long(), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.002:
            break
    assert loss.item() < 0.005
    args = (model, src, batch["src_lengths"])
    assert greedy_decode(*args, **IDS) == words
    assert beam_search(*args, beam_size=3, **IDS) == words
    assert model.training  # decoding restored the mode
