"""train.evaluate's decoding: fixed-shape batches return each sentence's own translation, greedy and beam,
in the input order; the decoders (and their buffers) are kept between evaluations; BLEU/chrF report
what decoding cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import Transformer
from models.decoding import DecodeStats, beam_search, greedy_decode
from tests.utils import BOS, EOS, PAD, UNK, assert_same_hypotheses, build, build_eos
from train import evaluate
from train.evaluate import bleu_chrf, translate

CPU = torch.device("cpu")


class IdTokenizer:
    """Text is space-separated token ids, so translations can be checked id by id."""

    pad_id, unk_id, bos_id, eos_id = PAD, UNK, BOS, EOS

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array([int(w) for w in text.split()], dtype=np.int32) for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [" ".join(map(str, row)) for row in ids]


def eos_model(seed: int) -> Transformer:
    """A random tiny model (vocabulary 40) whose EOS logit is scaled up: sentences end at different lengths."""
    return build_eos(40, seed, 2.5)


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(map(str, rng.integers(4, 40, int(rng.integers(1, 21))))) for _ in range(n)]


@pytest.mark.parametrize("decode,beam", [("beam", 3), ("greedy", 1)])
def test_translate_equals_one_sentence_at_a_time(decode, beam):
    """11 sentences in batches of 4 rows (the last padded), sources padded to bucket widths: each
    sentence gets what decoding it alone at its own width gives."""
    model, tok = eos_model(0), IdTokenizer()
    texts = sentences(11, seed=1)
    stats = DecodeStats()
    got = translate(model, tok, texts, CPU, beam_size=beam, batch_size=4, decode=decode, length_penalty=1.0,
                    fixed_shapes=True, stats=stats)
    assert stats.batches == 3
    want, limits = [], []
    for ids in tok.encode(texts):
        src = torch.tensor(np.append(ids, EOS), dtype=torch.int32)[None]  # (1, L): + EOS, no padding
        lens = torch.tensor([src.shape[1]], dtype=torch.int32)
        if decode == "beam":
            want += beam_search(model, src, lens, bos_id=BOS, eos_id=EOS, pad_id=PAD, beam_size=beam,
                                length_penalty=1.0)
        else:
            want += greedy_decode(model, src, lens, bos_id=BOS, eos_id=EOS, pad_id=PAD)
        limits.append(int(1.5 * src.shape[1] + 10))
    if decode == "greedy":  # no ties in practice: greedy must agree exactly
        assert [list(map(int, t.split())) for t in got] == want
    else:
        src_all = [torch.tensor(np.append(ids, EOS), dtype=torch.int32) for ids in tok.encode(texts)]
        for i, text in enumerate(got):
            batch = {"src": src_all[i][None], "src_lengths": torch.tensor([len(src_all[i])], dtype=torch.int32)}
            assert_same_hypotheses(model, batch, [list(map(int, text.split()))], [want[i]], [limits[i]], 1.0)
    assert len({len(w) for w in want}) >= 3  # sentences end at different lengths


def test_decoders_kept_between_calls():
    """A second evaluation reuses the first one's decoder and per-shape buffers; few shapes in all."""
    model, tok = eos_model(1), IdTokenizer()
    texts = sentences(13, seed=2)
    first = translate(model, tok, texts, CPU, beam_size=2, batch_size=4, fixed_shapes=True)
    (decoder,) = evaluate._decoders[model].values()
    shapes = set(decoder._runs)  # keys (batch shape, autocast dtype, device)
    assert {shape for shape, _, _ in shapes} <= {(4, 8), (4, 12), (4, 16), (4, 24)}  # 2..21 tokens, 4 rows
    assert translate(model, tok, texts, CPU, beam_size=2, batch_size=4, fixed_shapes=True) == first
    assert set(decoder._runs) == shapes and len(evaluate._decoders[model]) == 1
    assert translate(model, tok, texts[:3], CPU, beam_size=2, batch_size=4, fixed_shapes=True) == first[:3]
    assert translate(model, tok, texts, CPU, beam_size=2, batch_size=4) == first  # natural shapes (CPU default)
    assert len(evaluate._decoders[model]) == 1  # ... with a decoder of their own


def test_translate_rejects_bad_settings():
    model, tok = eos_model(0), IdTokenizer()
    with pytest.raises(ValueError, match="decode='sample'"):
        translate(model, tok, ["5 6"], CPU, decode="sample")
    with pytest.raises(ValueError, match="beam_size=0"):
        translate(model, tok, ["5 6"], CPU, beam_size=0)
    with pytest.raises(ValueError, match="needs fixed_shapes"):
        translate(model, tok, ["5 6"], CPU, cuda_graph=True, fixed_shapes=False)
    assert translate(model, tok, [], CPU) == []


@pytest.mark.parametrize("decode", ["beam", "greedy"])
def test_bleu_chrf_reports_decoding_cost(toy_bundle, decode):
    """Real tokenizer and split: scores and samples as before, plus the decoding's steps, batches and
    host syncs (on the CPU an "all done?" read every step, where it costs nothing, and one per batch)."""
    model = build(seed=0, vocab_size=toy_bundle.tokenizer.vocab_size)
    out = bleu_chrf(model, toy_bundle, "valid", CPU, max_sentences=20, beam_size=2, batch_size=8, max_len_ratio=1.5,
                    max_len_extra=10, decode=decode, fixed_shapes=True)
    assert out["sentences"] == 20 and len(out["samples"]) == 20 and out["decode"] == decode
    assert 0 <= out["bleu"] <= 100 and 0 <= out["chrf"] <= 100 and out["decode_seconds"] > 0
    assert out["decode_batches"] == 3 and out["graphs_captured"] == 0
    assert out["decode_steps"] >= 3 and out["host_syncs"] <= out["decode_steps"] + out["decode_batches"]
