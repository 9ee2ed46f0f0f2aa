"""`data.sources.read_local` is the one reader of local files: `load_local` (a training corpus, lenient) and
`data.build_scan.read_eval_files` (your own valid/test files, strict) number rows the same way, across chunks."""

import json

import pytest

from data import sources
from data.build_scan import read_eval_files
from data.clean import DataInputError, clean_text
from data.sources import load_local, read_local
from tests.data.helpers import make_rows


def _write(path, rows, bad_at: dict[int, str]):
    """A .jsonl file of ``rows`` with the raw text ``bad_at[k]`` as line k (1-based)."""
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    for k, text in sorted(bad_at.items()):
        lines.insert(k - 1, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 256)  # a few lines a chunk: line numbers cross chunks


def test_both_readers_name_the_same_line_across_chunks(tmp_path, small_chunks):
    rows = make_rows(60)
    a = _write(tmp_path / "a.jsonl", rows[:30], {})
    b = _write(tmp_path / "b.jsonl", rows[30:], {27: "not json", 29: '{"id": 1, "translation": {"en": 5, "it": "x"}}'})
    files, chunks = read_local((a, b), "en", "it")
    assert len(list(chunks)) > 6 and [f.read for f in files] == [30, 32]
    raw = load_local((a, b), "en", "it")
    src, tgt, _ = clean_text(raw.translation, "en", "it", raw.report, raw.where)
    assert raw.report.examples["bad_json"][0].startswith(f"{b}:27:")
    assert raw.report.examples["not_a_string"][0].startswith(f"{b}:29:")
    assert src == [r["translation"]["en"].strip() for r in rows] and len(tgt) == 60
    with pytest.raises(DataInputError, match=rf"2 rows cannot be read.*{b}:27: bad_json.*{b}:29: not_a_string"):
        read_eval_files((a, b), "test", "en", "it")


def test_eval_files_read_whole_and_in_order(tmp_path, small_chunks):
    rows = make_rows(40)
    rows[5]["translation"]["it"] = "   "  # an empty side: kept in an evaluation set
    a = _write(tmp_path / "a.jsonl", rows, {})
    src, tgt = read_eval_files((a,), "valid", "en", "it")
    assert src == [r["translation"]["en"].strip() for r in rows] and tgt[5] == ""
    assert tgt == [r["translation"]["it"].strip() for r in rows]
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DataInputError, match=rf"data.valid_files: {empty} is empty"):
        read_eval_files((a, str(empty)), "valid", "en", "it")
