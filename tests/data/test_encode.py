"""`data.encode.WordEncoder` (issue 37): a BPE model's ids of a text are its space-separated words' ids, so the cold
build encodes each distinct word once; every result equals ``sp.encode`` on the whole texts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

import data.encode as enc
from data import build_data
from data.config import DataConfig
from data.encode import WordEncoder, string_array, word_local
from data.tokenizer import spm_settings, train_spm
from tests.data.helpers import cfg_for, make_rows, write_jsonl

ODD = ["", " ", "  ", "a  b", " lead", "trail ", "tab\there", "new\nline", "nbsp\u00a0x", "ideo\u3000space",
       "ctl\x1c\x1d\x1e\x1fsep", "zero\u200bwidth", "e\u0301 \u0301x", "\u00a8x y\u00a8", "\ufb01ne \uff21\uff22",
       "\u2581 word \u2581\u2581", "Σας ΟΔΟΣ", "日本語 の 文", "😀 emoji 👍🏽", "\x00nul", "ß Straße", "İstanbul",
       "x" * 300, "1,234.56 7/8 ½", "don't \"quote\" (p)"]


def _model(tmp_path, model_type="bpe", texts=None):
    texts = texts or [r["translation"][k] for r in make_rows(800, seed=3) for k in ("en", "it")] + ODD
    cfg = DataConfig(vocab_size=400, spm_model=model_type, cache_dir=str(tmp_path))
    train_spm(texts, spm_settings(cfg), tmp_path, 1, cfg)
    return spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))


def _texts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    rows = [r["translation"][k] for r in make_rows(n, seed=seed) for k in ("en", "it")]
    for i in rng.integers(0, len(rows), n // 4):  # odd pieces spliced into ordinary sentences
        rows[i] = f"{rows[i]} {ODD[int(rng.integers(len(ODD)))]} {rows[(i + 1) % len(rows)]}"
    return rows + ODD


def _reference(sp, texts):
    ids = sp.encode(texts, out_type=int)
    return np.array([t for x in ids for t in x], dtype=np.int32), np.array([len(x) for x in ids], dtype=np.int64)


def test_word_by_word_is_sentencepiece_on_whole_texts(tmp_path):
    sp = _model(tmp_path)
    words = WordEncoder(sp, bpe=True, cap=300)  # a small cache: it starts again several times
    assert words.fast
    for seed in range(5):
        texts = _texts(seed, 400)
        got = words.encode(texts)
        want = _reference(sp, texts)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), seed
    assert not words.disagreed and 0 < len(words.ids) <= 300 + 2 * len(_texts(4, 400))
    long = WordEncoder(sp, bpe=True, char_cap=2000)  # long words: the cache starts again by characters too
    for seed in range(3):
        texts = [" ".join(f"{w}{'x' * 200}{seed}{i}" for w in t.split(" ")) for i, t in enumerate(_texts(seed, 50))]
        got, want = long.encode(texts), _reference(sp, texts)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert long.chars <= 2000 + sum(len(w) for t in texts for w in t.split(" "))


def test_texts_from_the_scratch_blob_without_a_copy(tmp_path):
    """Pass B's input: the UTF-8 blob of a chunk and its offsets, sources then targets."""
    sp = _model(tmp_path)
    src, tgt = _texts(7, 100), _texts(8, 100)
    raw = [t.encode() for t in src + tgt]
    off = np.concatenate([[0], np.cumsum([len(b) for b in raw])])
    blob, n = b"".join(raw), len(src)
    words = WordEncoder(sp, bpe=True)
    for texts, offsets in ((src, off[: n + 1]), (tgt, off[n:])):
        arr = string_array(blob, offsets)
        assert arr.to_pylist() == texts
        got, want = words.encode(arr), _reference(sp, texts)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_unigram_and_models_with_inner_boundaries_go_sentence_by_sentence(tmp_path, monkeypatch):
    (tmp_path / "u").mkdir()
    uni = _model(tmp_path / "u", "unigram")
    words = WordEncoder(uni, bpe=False)
    texts = _texts(2, 200)
    assert not words.fast
    got, want = words.encode(texts), _reference(uni, texts)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and not words.ids
    bpe = _model(tmp_path)
    assert word_local(bpe)
    monkeypatch.setattr(bpe, "id_to_piece", lambda i: "ab\u2581c")  # a piece spanning a word boundary
    assert not word_local(bpe) and not WordEncoder(bpe, bpe=True).fast


def test_a_chunk_that_disagrees_is_encoded_whole_and_said(tmp_path, monkeypatch):
    """The per-chunk check: word-by-word ids that differ from SentencePiece on a checked sentence make the chunk
    (and the later ones) go sentence by sentence; the entry is the same, and the build says so."""
    files = (write_jsonl(tmp_path / "d.jsonl", make_rows(600)),)
    good = build_data(cfg_for(tmp_path / "a", files, build_workers=1), log=lambda *_: None)
    real = enc.WordEncoder._by_words

    def wrong(self, texts):
        ids, lens = real(self, texts)
        return ids + 1, lens  # every id off by one

    monkeypatch.setattr(enc.WordEncoder, "_by_words", wrong)
    logs = []
    bad = build_data(cfg_for(tmp_path / "b", files, build_workers=1), log=logs.append)
    assert any("disagreed with SentencePiece" in m for m in logs)
    for s in ("train", "valid", "test"):
        a, b = good.splits[s], bad.splits[s]
        assert np.array_equal(a.src_ids, b.src_ids) and np.array_equal(a.tgt_ids, b.tgt_ids)
        assert np.array_equal(a.src_offsets, b.src_offsets) and np.array_equal(a.rows, b.rows)
    meta = json.loads((Path(bad.split_record["cache"]) / "meta.json").read_text())
    assert set(meta["build"]["phases"]) == {"read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write"}


@pytest.mark.slow
def test_every_code_point_next_to_a_space_is_word_local(tmp_path):
    """The claim of data/encode.py, exhaustively: for every Unicode scalar c, texts with c just before or after a
    space (and doubled, and after a combining mark) encode word by word as whole (~90 s on 2 CPU cores)."""
    sp = _model(tmp_path)
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    bad = []
    for k in range(0, len(cps), 4000):
        texts = []
        for c in map(chr, cps[k:k + 4000]):
            texts += [f"ab{c} cd", f"ab {c}cd", f"ab {c} cd", f"{c} x", f"x {c}", f"e{c}{c} {c}{c}e", f"a {c}\u0301 b"]
        want = sp.encode(texts, out_type=int)
        for t, w in zip(texts, want):
            if [i for x in t.split(" ") for i in sp.encode(x)] != w:
                bad.append(t)
    assert not bad, [[hex(ord(ch)) for ch in t] for t in bad[:5]]
