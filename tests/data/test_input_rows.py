"""Every input row trains or is counted by reason with file and line; unusable input: one sentence."""

import json
import os

import datasets
import numpy as np
import pytest

from data import build_data
from data.clean import MAX_EXAMPLES, DataInputError
from data.sources import load_local
from tests.data.helpers import cfg_for, make_rows, write_jsonl

QUIET = dict(log=lambda *_: None)


def _lines(rows) -> list[str]:
    return [json.dumps(r, ensure_ascii=False) for r in rows]


def _accounted(b, n_input_rows: int) -> None:
    """rows read = input rows; kept = what the splits hold; every other row sits under one reason."""
    r = b.report
    assert r.rows == n_input_rows
    assert r.kept == sum(len(s) for s in b.splits.values())
    assert r.kept + sum(r.dropped.values()) == r.rows


def test_bad_lines_counted_with_file_and_line(tmp_path):
    good = _lines(make_rows(200))
    bad = {  # 1-based line number -> (text, reason)
        3: ("this is not json", "bad_json"),
        7: ('{"id": "1", "translation": {"en": "a", "it": ', "bad_json"),
        11: ("[1, 2]", "not_an_object"),
        12: ('"just a string"', "not_an_object"),
        20: ('{"id": "x", "en": "flat", "it": "row"}', "no_translation"),
        30: ("   ", "blank_line"),
        31: ('{"id": "y", "translation": ["en", "it"]}', "not_a_dict"),
    }
    lines = list(good)
    for n in sorted(bad):
        lines.insert(n - 1, bad[n][0])
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    logs = []
    b = build_data(cfg_for(tmp_path, str(path)), log=logs.append)
    _accounted(b, len(lines))
    for reason in {r for _, r in bad.values()}:
        want = [f"{path}:{n}:" for n in sorted(bad) if bad[n][1] == reason]
        assert b.report.dropped[reason] == len(want), reason
        assert [e.split(" ")[0] for e in b.report.examples[reason]] == want, reason
    assert b.split_record["sizes"]["train"] + 40 == b.report.kept  # every good row is kept
    text = "\n".join(logs)
    assert "warning: 7 of 207 input rows dropped" in text and f"{path}:11: a JSON list" in text


def test_latin1_file_rows_counted_as_bad_encoding(tmp_path):
    rows = make_rows(150)
    for r in rows[::3]:  # every third row has an accent: the rest is plain ASCII and still valid UTF-8
        r["translation"]["it"] += " è così"
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(("\n".join(_lines(rows)) + "\n").encode("latin-1"))
    b = build_data(cfg_for(tmp_path, str(path), valid_size=5, test_size=5), **QUIET)
    _accounted(b, 150)
    assert b.report.dropped["bad_encoding"] == 50 and b.report.kept == 100
    first = b.report.examples["bad_encoding"][0]
    assert first.startswith(f"{path}:1: byte 0xe8") and "not UTF-8" in first
    assert len(b.report.examples["bad_encoding"]) == MAX_EXAMPLES
    assert "iconv" in str(b.report)


def test_tsv_wrong_column_count_counted(tmp_path):
    rows = make_rows(120, seed=2)
    lines = [f"{r['translation']['en']}\t{r['translation']['it']}" for r in rows]
    lines[9] = "one\ttwo\tthree"
    lines[40] = "no tab at all"
    path = tmp_path / "d.tsv"
    path.write_text("\n".join(lines) + "\n")
    b = build_data(cfg_for(tmp_path, str(path), valid_size=10, test_size=10), **QUIET)
    _accounted(b, 120)
    assert b.report.dropped["wrong_columns"] == 2
    assert [e.split(" ")[0] for e in b.report.examples["wrong_columns"]] == [f"{path}:10:", f"{path}:41:"]
    assert "3 tab-separated columns" in b.report.examples["wrong_columns"][0]


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_empty_file_one_sentence_naming_it(tmp_path, content):
    good = write_jsonl(tmp_path / "good.jsonl", make_rows(100))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    with pytest.raises(DataInputError) as e:
        build_data(cfg_for(tmp_path, (good, str(empty))), **QUIET)
    msg = str(e.value)
    assert msg.startswith(str(empty)) and "valid_size" not in msg and "rows read" in msg


def test_file_with_no_usable_rows_names_file_and_shows_report(tmp_path):
    path = tmp_path / "allbad.jsonl"
    path.write_text("nope\n" * 4 + json.dumps({"translation": {"en": "", "it": "x"}}) + "\n")
    with pytest.raises(DataInputError) as e:
        build_data(cfg_for(tmp_path, str(path)), **QUIET)
    msg = str(e.value)
    assert msg.startswith(f"{path}: none of its 5 lines is a usable pair")
    assert "valid_size" not in msg and "test_size" not in msg
    assert (
        "bad_json" in msg and f"{path}:1: Expecting value" in msg and f"{path}:5:" in msg and "empty" in msg
    )


def test_reader_matches_datasets_on_valid_files(tmp_path):
    """On clean files the line reader gives exactly what HF datasets gives (so fingerprints do not change)."""
    rows = make_rows(300, seed=5)
    rows[3]["translation"]["it"] = "unicode – ü 🐈 \u2028 inside"  # a line separator in a JSON string
    jl = write_jsonl(tmp_path / "a.jsonl", rows)
    ref = datasets.load_dataset("json", data_files=[jl], split="train", cache_dir=str(tmp_path / "hf"))
    assert load_local((jl,), "en", "it").translation == list(ref["translation"])
    tsv = tmp_path / "a.tsv"
    tsv.write_text("".join(f"{r['translation']['en']}\t{r['translation']['it']}\r\n" for r in rows[:50]))
    feats = datasets.Features({"en": datasets.Value("string"), "it": datasets.Value("string")})
    ref = datasets.load_dataset(
        "csv",
        data_files=[str(tsv)],
        split="train",
        delimiter="\t",
        header=None,
        column_names=["en", "it"],
        quoting=3,
        keep_default_na=False,
        na_filter=False,
        features=feats,
        cache_dir=str(tmp_path / "hf"),
    )
    got = load_local((str(tsv),), "en", "it").translation
    assert [{k: v.strip() for k, v in r.items()} for r in got] == [
        {"en": e.strip(), "it": i.strip()} for e, i in zip(ref["en"], ref["it"])
    ]


def test_bom_json_array_parquet_and_mixed_formats(tmp_path):
    rows = make_rows(90, seed=4)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows[:30]).encode())
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(rows[30:60] + [[1, 2], {"id": "z"}]))
    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows[60:]).to_parquet(str(pq))
    raw = load_local((str(bom), str(arr), str(pq)), "en", "it")
    assert raw.translation == [r["translation"] for r in rows]
    assert raw.where(0) == f"{bom}:1" and raw.where(30) == f"{arr}[0]" and raw.where(60) == f"{pq} row 0"
    assert (
        raw.report.rows == 2
        and raw.report.dropped["not_an_object"] == raw.report.dropped["no_translation"] == 1
    )
    assert raw.report.examples["no_translation"] == [f"{arr}[31]: keys ['id']"]
    assert raw.kept_per_file(np.arange(90)) == [30, 30, 30]


def test_broken_single_document_inputs_name_the_file(tmp_path):
    arr = tmp_path / "bad.json"
    arr.write_text('[{"translation": {"en": "a", "it": "b"}},\n  oops]')
    with pytest.raises(DataInputError, match=rf"{arr}:2:\d+: not valid JSON"):
        load_local((str(arr),), "en", "it")
    pq = tmp_path / "bad.parquet"
    pq.write_text("not parquet")
    with pytest.raises(DataInputError, match=f"{pq}: not a readable parquet file"):
        load_local((str(pq),), "en", "it")
    flat = tmp_path / "flat.parquet"
    datasets.Dataset.from_list([{"en": "a", "it": "b"}]).to_parquet(str(flat))
    with pytest.raises(DataInputError, match=r"no 'translation' column \(found \['en', 'it'\]\)"):
        load_local((str(flat),), "en", "it")
    with pytest.raises(ValueError, match=r"unsupported data file extension\(s\) \['.csv'\]"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_local((str(tmp_path / "x.csv"),), "en", "it")


def test_max_len_dropping_everything_says_so_with_lengths(tmp_path):
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(200))
    with pytest.raises(DataInputError) as e:
        build_data(cfg_for(tmp_path, files, max_len=2), **QUIET)
    msg = str(e.value)
    assert "every one of the 160 training pairs is over the length limits (160 too_long with max_len=2" in msg
    assert "no batches" not in msg and "p50" in msg and "p99" in msg
    suggested = int(msg.split("data.max_len=")[1].split(" ")[0])
    ok = build_data(cfg_for(tmp_path, files, max_len=suggested, max_tokens=2 * suggested), **QUIET)
    assert len(ok.splits["train"]) >= 0.95 * 160  # the suggested max_len keeps the bulk


def test_too_long_examples_point_at_input_lines(tmp_path):
    rows = make_rows(120)
    rows[17]["translation"]["en"] = "gatto " * 200
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    b = build_data(cfg_for(tmp_path, path), **QUIET)
    assert b.report.dropped["too_long"] == 1
    assert b.report.examples["too_long"][0].startswith(f"{path}:18: src ")


@pytest.mark.parametrize("mode", ["token_bucket", "packed", "fixed"])
def test_valid_size_zero_gives_an_empty_valid_split(tmp_path, mode):
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(150))
    b = build_data(cfg_for(tmp_path, files, valid_size=0, test_size=0.1, batching=mode, seq_len=64), **QUIET)
    assert len(b.splits["valid"]) == 0 and len(b.splits["test"]) == 15 and len(b.splits["train"]) == 135
    assert b.num_batches("valid") == 0 and list(b.loader("valid")) == []
    assert b.num_batches("train") > 0
    _accounted(b, 150)


def test_malformed_json_of_any_kind_is_a_counted_row_with_file_and_line(tmp_path):
    """Issue 20 row 10: a lone surrogate escape, deep nesting, an over-long number: counted, never raised."""
    lines = _lines(make_rows(150))
    bad = {
        4: ('{"id": "s", "translation": {"en": "ok \\ud800 half", "it": "ciao"}}', "bad_unicode"),
        9: ("[" * 100_000 + "]" * 100_000, "bad_json"),
        15: ('{"id": "n", "translation": {"en": "a", "it": "b"}, "x": ' + "1" * 5000 + "}", "bad_json"),
        21: ('{"id": "t", "translation": {"en": "x", "it": "\\udfff"}}', "bad_unicode"),
    }
    for n in sorted(bad):
        lines.insert(n - 1, bad[n][0])
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(lines) + "\n")
    b = build_data(cfg_for(tmp_path, str(path)), **QUIET)
    _accounted(b, len(lines))
    assert b.report.dropped["bad_unicode"] == 2 and b.report.dropped["bad_json"] == 2
    assert [e.split(" ")[0] for e in b.report.examples["bad_unicode"]] == [f"{path}:4:", f"{path}:21:"]
    assert [e.split(" ")[0] for e in b.report.examples["bad_json"]] == [f"{path}:9:", f"{path}:15:"]
    assert "U+D800" in b.report.examples["bad_unicode"][0] and "nested too deeply" in b.report.examples["bad_json"][0]


def test_paths_are_never_split_and_env_uses_the_path_separator(tmp_path, monkeypatch):
    """Issue 20 row 9: a path holding a space or a comma is one path; $FASTMT_DATA_FILES uses os.pathsep."""
    from data import DataConfig

    odd = tmp_path / "my data, v2"
    odd.mkdir()
    a = write_jsonl(odd / "a b.jsonl", make_rows(150, seed=1))
    c = write_jsonl(odd / "c,d.jsonl", make_rows(150, seed=2))
    one = build_data(cfg_for(tmp_path, a), **QUIET)
    assert one.report.rows == 150 and one.split_record["source"] == f"files:{a}"
    monkeypatch.setenv("FASTMT_DATA_FILES", f"{a}{os.pathsep}{c}")
    cfg = cfg_for(tmp_path, (), dataset=DataConfig().dataset)
    assert cfg.resolved_data_files() == (a, c)
    assert build_data(cfg, **QUIET).report.rows == 300
    monkeypatch.setenv("FASTMT_DATA_FILES", f"{a},{c}")  # not the separator: one path that does not exist
    with pytest.raises(DataInputError, match=rf"not found.*FASTMT_DATA_FILES holds paths separated by '{os.pathsep}'"):
        build_data(cfg_for(tmp_path, (), dataset=DataConfig().dataset), **QUIET)


def test_vocab_below_what_the_text_needs_names_the_minimum(tmp_path):
    """Issue 20 row 13, data side: SentencePiece's refusal becomes one sentence with the value and the fix."""
    rows = make_rows(200)
    greek = "αβγδεζηθικλμνξοπρστυφχψωБГДЖЗИЙЛПФЦЧШЩЭЮЯ"
    for i, r in enumerate(rows):
        r["translation"]["it"] += " " + greek[i % len(greek)] * 2 + greek[(i * 7) % len(greek)]
    cfg = cfg_for(tmp_path, write_jsonl(tmp_path / "d.jsonl", rows), vocab_size=300)
    with pytest.raises(DataInputError) as e:
        build_data(cfg, **QUIET)
    msg = str(e.value)
    need = int(msg.split("below the ")[1].split(" ")[0])
    assert "data.vocab_size=300" in msg and f"--data.vocab_size {need} or more" in msg and need > 300
    assert "\n" not in msg
    assert build_data(cfg_for(tmp_path, cfg.data_files, vocab_size=need), **QUIET).tokenizer.vocab_size >= need
