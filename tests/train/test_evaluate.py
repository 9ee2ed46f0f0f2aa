"""train.evaluation.decode: fixed-shape batches return each sentence's own translation, greedy and beam,
in the input order; the decoders (and their buffers) are kept between evaluations; BLEU/chrF report
what decoding cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import Transformer
from models.decoding import DecodeStats, beam_search, greedy_decode
from tests.utils import BOS, EOS, PAD, UNK, assert_same_hypotheses, build, build_eos
from train.evaluation import decode, scores
from train.evaluation.decode import translate
from train.evaluation.scores import bleu_chrf

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
    (decoder,) = decode._decoders[model].values()
    shapes = set(decoder._runs)  # keys (batch shape, autocast dtype, device)
    assert {shape for shape, _, _ in shapes} <= {(4, 8), (4, 12), (4, 16), (4, 24)}  # 2..21 tokens, 4 rows
    assert translate(model, tok, texts, CPU, beam_size=2, batch_size=4, fixed_shapes=True) == first
    assert set(decoder._runs) == shapes and len(decode._decoders[model]) == 1
    assert translate(model, tok, texts[:3], CPU, beam_size=2, batch_size=4, fixed_shapes=True) == first[:3]
    assert translate(model, tok, texts, CPU, beam_size=2, batch_size=4) == first  # natural shapes (CPU default)
    assert len(decode._decoders[model]) == 1  # ... with a decoder of their own


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


# -- the protocol: validation capped, the test split whole, cut sources counted, signatures ---------------
def _hyps_and_bleu(model, tok, src: list[str], refs: list[str], **kw) -> tuple[list[str], float, float]:
    import sacrebleu

    hyps = translate(model, tok, src, CPU, **kw)
    return hyps, sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score


def test_spread_takes_k_evenly_spaced_rows():
    assert scores.spread(10, None) == list(range(10)) and scores.spread(3, 5) == [0, 1, 2]
    for n, k in ((1000, 500), (1000, 7), (23, 22), (5, 1)):
        rows = scores.spread(n, k)
        assert len(rows) == k == len(set(rows)) and rows == sorted(rows) and 0 <= rows[0] and rows[-1] < n
        # every tenth of the split holds its share of the rows (a first-N cut would hold them all in the first)
        for part in range(10):
            lo, hi = part * n // 10, (part + 1) * n // 10
            assert abs(sum(lo <= r < hi for r in rows) - k * (hi - lo) / n) <= 1


def test_validation_is_capped_and_the_test_split_is_scored_whole(toy_bundle):
    """eval.max_sentences=10 decodes 10 sentences spread over the valid split (not its first 10: a corpus in
    source order made those all one source, H200 2026-11-27) and every test sentence; the scores are sacreBLEU's
    of exactly those translations, with the signatures."""
    from train.config import EvalConfig

    tok = toy_bundle.tokenizer
    model = build(seed=3, vocab_size=tok.vocab_size, max_positions=64)
    ev = EvalConfig(max_sentences=10, beam_size=2, batch_size=16)
    auto = torch.autocast("cpu", enabled=False)
    valid = scores.evaluate_split(model, toy_bundle, "valid", CPU, ev, autocast=auto, decode="beam", loss=False)
    test = scores.evaluate_split(model, toy_bundle, "test", CPU, ev, autocast=auto, decode="beam", loss=False)
    sp = toy_bundle.splits["test"]
    assert valid["sentences"] == 10 and len(sp) > 10 and test["sentences"] == len(sp)
    vs = toy_bundle.splits["valid"]
    assert len(vs) >= 20  # so that a first-10 cut and the spread differ
    assert [src for src, _, _ in valid["samples"]] == [vs.src_text[i] for i in scores.spread(len(vs), 10)]
    assert [ref for _, ref, _ in valid["samples"]] == [vs.tgt_text[i] for i in scores.spread(len(vs), 10)]
    assert valid["samples"][-1][0] == vs.src_text[scores.spread(len(vs), 10)[-1]] != vs.src_text[9]
    hyps, bleu, chrf = _hyps_and_bleu(model, tok, list(sp.src_text), list(sp.tgt_text), beam_size=2, batch_size=16)
    assert [h for _, _, h in test["samples"]] == hyps
    assert (test["bleu"], test["chrf"]) == (pytest.approx(bleu, abs=1e-9), pytest.approx(chrf, abs=1e-9))
    for r in (valid, test):
        assert r["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
        assert r["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")


def test_overlong_test_sources_are_translated_and_counted(toy_bundle):
    """A model with 12 positions: the test sources longer than that are still decoded (from their first 11
    tokens + EOS), none is dropped, and they are counted."""
    from models.decoding import greedy_decode

    tok = toy_bundle.tokenizer
    model = build(seed=4, vocab_size=tok.vocab_size, max_positions=12)
    sp = toy_bundle.splits["test"]
    ids = tok.encode(list(sp.src_text))
    long = [i for i, x in enumerate(ids) if len(x) + 1 > 12]
    assert 0 < len(long) < len(sp)
    r = bleu_chrf(model, toy_bundle, "test", CPU, max_sentences=None, beam_size=1, batch_size=8, max_len_ratio=1.5,
                  max_len_extra=10, decode="greedy")
    assert r["sentences"] == len(sp) and r["truncated_sources"] == len(long) and r["max_positions"] == 12
    for i in long[:3]:
        src = torch.tensor([*ids[i][:11].tolist(), EOS], dtype=torch.int32)[None]  # (1, 12)
        want = greedy_decode(model, src, torch.tensor([12], dtype=torch.int32), bos_id=BOS, eos_id=EOS, pad_id=PAD)
        assert r["samples"][i][2] == tok.decode(want)[0]


class _Split:
    """The texts of a split (all ``score_split`` reads of it)."""

    def __init__(self, src_text: list[str], tgt_text: list[str]):
        self.src_text, self.tgt_text = src_text, tgt_text

    def __len__(self) -> int:
        return len(self.src_text)


def test_whole_texts_are_decoded_whatever_the_token_arrays_hold(toy_bundle):
    """The data layer that keeps over-long valid/test pairs (whole texts, token arrays cut to data.max_len, a
    count in split_record["truncated"]): BLEU decodes each whole text, cut only at the model's positions,
    and the record passes the data layer's count on."""
    from types import SimpleNamespace

    tok = toy_bundle.tokenizer
    sp = toy_bundle.splits["test"]
    long = " ".join(["the big green tree sees the old man"] * 4)
    texts, refs = [long, *sp.src_text[:3]], ["l'albero", *sp.tgt_text[:3]]
    assert 32 < len(tok.encode([long])[0]) + 1 < 64  # over data.max_len (32), within the model's 64 positions
    bundle = SimpleNamespace(splits={"test": _Split(texts, refs)}, tokenizer=tok, split_record={"truncated": {"test": 1}})
    model = build(seed=5, vocab_size=tok.vocab_size, max_positions=64)
    r = bleu_chrf(model, bundle, "test", CPU, max_sentences=None, beam_size=1, batch_size=8, max_len_ratio=1.5,
                  max_len_extra=10, decode="greedy")
    assert r["sentences"] == 4 and r["loss_truncated_pairs"] == 1 and r["truncated_sources"] == 0
    assert [h for _, _, h in r["samples"]] == translate(model, tok, texts, CPU, decode="greedy", batch_size=8)
