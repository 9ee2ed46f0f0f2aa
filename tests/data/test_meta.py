"""meta.json holds each value once; the split record a run reports is unchanged (same keys, order, values)."""

import json
from pathlib import Path

from data import build_data
from tests.data.helpers import cfg_for, make_rows, write_jsonl

# the split record's keys, in the order runs have always reported them (provenance.json's "data_split")
RECORD_KEYS = ["source", "paths", "fingerprint", "split_digest", "split_seed", "valid_size", "test_size", "grouping",
               "normalisation", "heldout_max_group", "eval_files", "removed_for_eval_files", "overlap", "truncated",
               "rows_before_length_filter", "sizes", "asked", "spm_sample_pairs", "tokenizer_key", "vocab_size",
               "cache", "packing"]


def test_meta_json_holds_each_count_once_and_the_record_is_whole(tmp_path):
    rows = make_rows(240)
    for k in range(0, 240, 40):  # pairs over max_len: the train count before the length filter differs
        rows[k]["translation"]["en"] = " ".join(f"{k}-{i}" for i in range(100)) + "."
    files = (write_jsonl(tmp_path / "a.jsonl", rows),)
    b = build_data(cfg_for(tmp_path, files), log=lambda *_: None)
    meta = json.loads((Path(b.split_record["cache"]) / "meta.json").read_text())
    rec = meta["record"]
    assert "sizes" not in rec and "rows_before_length_filter" not in rec  # copies of counts: derived on load
    sizes = {s: len(sp) for s, sp in b.splits.items()}
    assert meta["counts"] == sizes and b.split_record["sizes"] == sizes
    dropped = b.report.dropped["too_long"] + b.report.dropped["length_ratio"]
    assert dropped >= 1 and meta["train_before_length_filter"] == sizes["train"] + dropped
    assert b.split_record["rows_before_length_filter"] == {
        "train": sizes["train"] + dropped, "valid": sizes["valid"], "test": sizes["test"]}
    assert list(b.split_record) == RECORD_KEYS
    again = build_data(cfg_for(tmp_path, files), log=lambda *_: None)  # the warm path derives the same
    assert again.split_record == b.split_record and list(again.split_record) == RECORD_KEYS


def test_an_entry_layout_change_keeps_the_tokenizer_and_its_key(tmp_path, monkeypatch):
    """A CACHE_FORMAT bump rebuilds the entry but keeps the tokenizer key: checkpoints name their tokenizer by
    key, so a new key refused the resume of every earlier run (seen with the committed legacy checkpoint when
    the format went from 3 to 4)."""
    import data.build as B
    import data.entry as E

    files = (write_jsonl(tmp_path / "a.jsonl", make_rows(240)),)
    first = build_data(cfg_for(tmp_path, files), log=lambda *_: None)
    monkeypatch.setattr(E, "CACHE_FORMAT", E.CACHE_FORMAT + 1)
    monkeypatch.setattr(B, "CACHE_FORMAT", E.CACHE_FORMAT)  # the builder writes the format it imported
    again = build_data(cfg_for(tmp_path, files), log=lambda *_: None)
    assert again.split_record["cache"] != first.split_record["cache"]  # the entry was rebuilt under the new layout
    assert again.tokenizer.key == first.tokenizer.key
    assert again.tokenizer.model_bytes() == first.tokenizer.model_bytes()
