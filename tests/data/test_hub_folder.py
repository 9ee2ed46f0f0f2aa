"""The default data path (``make train`` reads OPUS Books through ``datasets.load_dataset``), run for real on a
local folder in the Hub's layout: ``<dir>/en-it/*.parquet`` and a README.md with a ``configs:`` section, as
``Helsinki-NLP/opus_books`` is laid out, passed as ``--data.dataset DIR --data.dataset_config en-it``. It goes
through ``data.sources.load_hub``, ``hub_chunks`` and ``hub_dataset`` (in build workers, forked or spawned)
exactly as the Hub dataset does. The tests build their folder themselves."""

from __future__ import annotations

import json
import multiprocessing

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import build_data
from data.clean import DataInputError
from tests.utils import toy_data

README = """---
configs:
- config_name: en-it
  data_files:
  - split: train
    path: en-it/train-*
---
# a folder laid out as Helsinki-NLP/opus_books
"""


def toy_rows(n: int, start: int = 0) -> list[dict]:
    """Rows ``start .. start + n`` of the toy corpus (data/toy.py)."""
    from data.toy import toy_rows as rows

    return list(rows(start + n))[start:]


def hub_folder(root, rows: list[dict], *, column: str = "translation"):
    """``root/hub``: one parquet file under ``en-it/`` (several row groups) and the README's configs."""
    folder = root / "hub"
    (folder / "en-it").mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{"id": r["id"], column: r["translation"]} for r in rows])
    pq.write_table(table, folder / "en-it" / "train-00000-of-00001.parquet", row_group_size=100)
    (folder / "README.md").write_text(README)
    return folder


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' own cache under ``tmp_path`` (this process and any spawned worker)."""
    import datasets

    from data import sources

    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(sources, "CHUNK_ROWS", 250)  # several chunks: the build workers read the dataset
    monkeypatch.setattr(sources, "_HUB", {})
    return cache


def cfg_for(tmp_path, folder, **changes):
    return toy_data(tmp_path, dataset=str(folder), dataset_config="en-it", vocab_size=300, valid_size=40,
                    test_size=40, build_workers=2, **changes)


def arrays(bundle) -> dict[str, np.ndarray]:
    return {f"{s}.{k}": np.asarray(getattr(sp, k)) for s, sp in bundle.splits.items()
            for k in ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets", "rows")}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_hub_layout_folder_builds_through_load_dataset_with_workers(tmp_path, hf_cache, monkeypatch,
                                                                      start_method):
    """Build workers (forked: the parent's loaded dataset; spawned: ``hub_dataset`` loads it again) read the
    chunks; the same arrays either way, and a DataLoader with 2 worker processes (started the same way)
    yields every batch of the plan."""
    import data.workers as W

    monkeypatch.setattr(W, "START_METHOD", start_method)
    folder = hub_folder(tmp_path, toy_rows(900))
    logs: list[str] = []
    bundle = build_data(cfg_for(tmp_path, folder, num_workers=2), log=logs.append)
    assert bundle.split_record["source"] == f"hub:{folder}/en-it/train"
    assert sum(bundle.split_record["sizes"].values()) + bundle.report.rows - bundle.report.kept == 900
    assert any("4 chunks with 2 processes" in line for line in logs), logs
    before = multiprocessing.get_start_method()
    multiprocessing.set_start_method(start_method, force=True)  # the DataLoader's workers: started this way too
    try:
        batches = list(bundle.loader("train", epoch=0))
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert len(batches) == bundle.num_batches("train") > 1
    assert sum(int((b.tgt_out != 0).sum()) for b in batches) > 0
    # the other start method, another cache: the very same arrays
    other = "spawn" if start_method == "fork" else "fork"
    monkeypatch.setattr(W, "START_METHOD", other)
    again = build_data(cfg_for(tmp_path, folder, cache_dir=str(tmp_path / "cache2")), log=lambda *_: None)
    a, b = arrays(bundle), arrays(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_warm_start_maps_the_cache_and_an_edited_folder_is_read_again(tmp_path, hf_cache):
    folder = hub_folder(tmp_path, toy_rows(600))
    cfg = cfg_for(tmp_path, folder)
    first = build_data(cfg, log=lambda *_: None)
    logs: list[str] = []
    warm = build_data(cfg, log=logs.append)
    assert any("cache hit" in line for line in logs) and not any("built" in line for line in logs)
    assert all(np.array_equal(x, y) for x, y in zip(arrays(first).values(), arrays(warm).values()))
    hub_folder(tmp_path, toy_rows(700, start=300))  # the folder edited: other and more rows
    logs.clear()
    edited = build_data(cfg, log=logs.append)
    assert any("built" in line for line in logs), logs
    assert edited.report.rows == 700 and edited.split_record["fingerprint"] != first.split_record["fingerprint"]
    assert edited.split_record["cache"] != first.split_record["cache"]


def test_a_missing_config_is_one_error_naming_the_folder_and_its_configs(tmp_path, hf_cache):
    folder = hub_folder(tmp_path, toy_rows(300))
    with pytest.raises(DataInputError, match=r"local folder.*'fr-de'.*en-it"):
        build_data(toy_data(tmp_path, dataset=str(folder), dataset_config="fr-de", vocab_size=300),
                   log=lambda *_: None)


def test_a_folder_without_a_translation_column_is_one_error(tmp_path, hf_cache):
    folder = hub_folder(tmp_path, toy_rows(300), column="pair")
    with pytest.raises(DataInputError, match=r"no 'translation' column \(found \['id', 'pair'\]\)"):
        build_data(cfg_for(tmp_path, folder), log=lambda *_: None)


def test_the_cli_trains_on_a_hub_layout_folder(tmp_path, hf_cache, capsys):
    """``--data.dataset DIR --data.dataset_config en-it``, the flags of the README, through ``python -m train``."""
    from train.cli.train import main

    folder = hub_folder(tmp_path, toy_rows(600))
    code = main(["--preset", "tiny", "--data.dataset", str(folder), "--data.dataset_config", "en-it",
                 "--data.cache_dir", str(tmp_path / "cache"), "--data.vocab_size", "300", "--data.valid_size", "40",
                 "--data.test_size", "40", "--data.max_len", "32", "--data.max_tokens", "512",
                 "--data.num_workers", "0", "--run.out_dir", str(tmp_path / "runs"), "--max-steps", "2",
                 "--run.progress", "false", "--run.plot", "false", "--run.tensorboard", "false",
                 "--run.cpu_threads", "1", "--eval.max_sentences", "4", "--eval.num_samples", "0"])
    assert code == 0, capsys.readouterr()
    prov = json.loads((tmp_path / "runs" / "tiny" / "provenance.json").read_text())
    assert f"hub:{folder}/en-it/train" in json.dumps(prov)
