"""The cold build reads each chunk's cleaned texts back once (pass B, as one blob); the tokenizer's sample reads
only its rows."""

import pickle

import data.build_encode
import data.build_scan
import data.build_tokenizer
import data.sources
from data import build_data
from tests.data.helpers import cfg_for, make_rows, write_jsonl


def test_each_chunk_decoded_once_and_the_sample_reads_only_its_rows(tmp_path, monkeypatch):
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(600))
    monkeypatch.setattr(data.sources, "CHUNK_BYTES", 4096)  # ~20 chunks
    monkeypatch.setattr(pickle, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("unpickled")))
    reads, real_texts, real_blob = [], data.build_scan.load_texts, data.build_scan.load_blob

    def counted(tmp, i, rows):
        reads.append((i, len(rows)))
        return real_texts(tmp, i, rows)

    def whole(tmp, i):
        reads.append((i, None))
        return real_blob(tmp, i)

    monkeypatch.setattr(data.build_tokenizer, "load_texts", counted)  # where each phase reads them
    monkeypatch.setattr(data.build_encode, "load_blob", whole)
    logs = []
    b = build_data(cfg_for(tmp_path, files, build_workers=1, spm_sample_pairs=150, vocab_size=350), log=logs.append)
    whole = [i for i, n in reads if n is None]
    chunks = len(whole)
    assert chunks > 5 and sorted(whole) == list(range(chunks))  # pass B: every chunk once
    assert sum(n for _, n in reads if n is not None) == 150  # the sample: its 150 pairs, no more
    assert any("sample of 150 train pairs" in line for line in logs)
    assert not list(tmp_path.rglob("a-*"))  # the scratch files are gone
    valid = b.splits["valid"]
    assert b.tokenizer.decode([valid.src_ids[valid.src_offsets[0]:valid.src_offsets[1]].tolist()])[0] == valid.src_text[0]
