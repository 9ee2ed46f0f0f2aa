"""`python -m bench.data_scale` (issue 24) end to end at a small size: a generated corpus, a cold build and a
warm start each in a fresh child, rows that say what they measured, the table and plot written where asked,
and nothing written into the committed bench/results/."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_data_scale_measures_a_cold_and_a_warm_start(tmp_path):
    results = ROOT / "bench" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "bench.data_scale", "--sizes", "0.005", "--work", str(tmp_path / "work"),
                          "--out", str(out), "--warm-runs", "1", "--tag", "test"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with (out / "data-scale-cpu.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["phase"], r["pairs"], r["corpus"], r["tag"]) for r in rows] == [
        ("cold", "5000", "synthetic", "test"), ("warm", "5000", "synthetic", "test")]
    cold, warm = rows
    for r in rows:
        assert float(r["build_s"]) > 0 and float(r["process_s"]) >= float(r["build_s"])
        assert float(r["first_batch_s"]) > 0 and float(r["rss_tree_mb"]) > 0 and r["machine"]
    assert float(cold["pairs_per_s_core"]) > 0 and warm["pairs_per_s_core"] == ""
    phases = ("read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write")  # where a cold build's time goes
    assert all(float(cold[f"{k}_s"]) >= 0 for k in phases) and all(warm[f"{k}_s"] == "" for k in phases)
    assert sum(float(cold[f"{k}_s"]) for k in phases) <= float(cold["build_s"])  # parts of the build's wall time
    assert float(cold["cpu_s"]) > 0 and "phases (s): read " in run.stdout
    table = (out / "data-scale-cpu.md").read_text()
    assert "5,000" in table and "Where a cold build's time goes" in table
    assert (out / "data-scale-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before


def test_the_default_work_folder_is_made_for_each_run():
    """No fixed /tmp path (another user of the machine could plant corpora or caches there first)."""
    from bench.data_scale import work_dir

    first, second = work_dir(None), work_dir(None)
    try:
        assert first != second and first.is_dir() and (first.stat().st_mode & 0o777) == 0o700
        assert first.name.startswith("fastmt-data-scale-") and first != Path("/tmp/fastmt-data-scale")
    finally:
        first.rmdir()
        second.rmdir()


def test_a_results_file_written_before_the_phase_columns_keeps_its_rows(tmp_path):
    """bench/results/data-scale-cpu.csv predates the per-phase columns: appending rewrites its header, old rows get
    empty phase cells, nothing is lost."""
    from bench.data_scale import COLUMNS, load_rows
    from bench.harness import append_csv

    old_columns = [c for c in COLUMNS if not c.endswith("_s") or c in ("build_s", "process_s", "first_batch_s")]
    path = tmp_path / "data-scale-cpu.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_columns)
        w.writeheader()
        w.writerow({c: "7" for c in old_columns})
    append_csv(path, [{c: "8" for c in COLUMNS}], COLUMNS)
    rows = load_rows(path)
    assert [r["date"] for r in rows] == ["7", "8"] and rows[0]["encode_s"] == "" and rows[1]["encode_s"] == "8"
    with path.open(newline="") as f:
        assert next(csv.reader(f)) == list(COLUMNS)
