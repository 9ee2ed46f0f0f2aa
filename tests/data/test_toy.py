"""The generated toy corpus: deterministic, word for word, the bytes bench.ladder wrote; a "toy" source."""

import hashlib
import json

import pytest

from data import DataConfig, build_data
from data.toy import EN, IT, toy_corpus, write_toy_corpus
from tests.data.helpers import cfg_for


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_toy_corpus_is_deterministic_word_for_word_and_prefix_stable(tmp_path):
    a = write_toy_corpus(tmp_path / "sub" / "a.jsonl", n=400)
    b = write_toy_corpus(tmp_path / "b.jsonl", n=400)
    assert a.read_bytes() == b.read_bytes()
    rows = _read(a)
    assert [r["id"] for r in rows] == [str(i) for i in range(400)]
    to_it = dict(zip(EN, IT))
    for r in rows:
        en, it = r["translation"]["en"].split(), r["translation"]["it"].split()
        assert 2 <= len(en) <= 12 and it == [to_it[w] for w in en]
    assert _read(write_toy_corpus(tmp_path / "c.jsonl", n=150)) == rows[:150]  # row i independent of n
    assert _read(write_toy_corpus(tmp_path / "d.jsonl", n=150, seed=1)) != rows[:150]


# sha256 of the default corpus (n=1500, seed=0) as bench/ladder.py generated it before the move
LADDER_TOY_SHA256 = "15cbc5ea6bcfdca920c4892a5b8dbaf5c5e81c602a5c272f1603df5f8bb80d35"


def test_same_bytes_as_the_bench_ladder_generator(tmp_path):
    """Moving the generator must not change results: byte-identical to what bench/ladder.py wrote."""
    assert (
        hashlib.sha256(write_toy_corpus(tmp_path / "toy.jsonl").read_bytes()).hexdigest() == LADDER_TOY_SHA256
    )


def test_toy_source_writes_into_cache_dir_and_wins_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTMT_DATA_FILES", str(tmp_path / "does-not-exist.jsonl"))
    cfg = cfg_for(tmp_path, (), toy_rows=300, max_len=128)
    assert cfg.is_toy()
    b = build_data(cfg, log=lambda *_: None)
    path = toy_corpus(tmp_path / "cache", 300)
    assert (
        path.parent == tmp_path / "cache" / "toy"
        and path.read_bytes() == write_toy_corpus(tmp_path / "ref.jsonl", n=300).read_bytes()
    )
    assert b.split_record["source"] == "toy:300" and b.report.rows == 300 and b.report.kept == 300
    tr = b.splits["train"]  # train texts are not loaded: decode its token arrays
    train_src = b.tokenizer.decode([tr.src_ids[tr.src_offsets[i] : tr.src_offsets[i + 1]] for i in range(len(tr))])
    assert tr.src_text is None
    assert sorted(train_src + b.splits["valid"].src_text + b.splits["test"].src_text) == sorted(
        r["translation"]["en"] for r in _read(path)
    )
    assert cfg.resolved_data_files() == ()
    files = DataConfig(dataset="toy", data_files=str(path))  # explicit files win over the toy source
    assert not files.is_toy() and files.resolved_data_files() == (str(path),)


def test_toy_config_validation():
    with pytest.raises(ValueError, match="dataset='toy' is an en-it corpus"):
        DataConfig(dataset="toy", tgt_lang="fr")
    with pytest.raises(ValueError, match="toy_rows=0"):
        DataConfig(dataset="toy", toy_rows=0)
