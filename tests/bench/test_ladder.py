"""CPU smoke of the speedup ladder (bench/ladder.py) and the time-to-quality record (bench/quality.py).

One module-scoped ladder run (eager rungs 0, 1, 3, a rung forced to fail, one compared past it, one over
its time cap) keeps this file at ~20 s on 2 cores; the full smoke ladder (compile rungs included) and the
timed-recompile check are marked slow.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from bench import ladder as L
from bench import report as R
from data.toy import write_toy_corpus

REQUIRED = ("rung", "tokens_per_second", "speedup_vs_baseline", "mfu", "peak_dtype", "padding_fraction",
            "peak_memory_gb", "sdpa_backend", "gpu", "git_sha")


@pytest.fixture(scope="module")
def ladder_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ladder")
    corpus = write_toy_corpus(tmp / "toy.jsonl", n=600)
    s = L.LadderSettings(smoke=True, device=torch.device("cpu"), data_files=(str(corpus),), out=tmp / "out",
                         steps=2, warmup=1, readme=False, work_dir=tmp / "work")
    by_id = {r.id: r for r in L.RUNGS}
    rungs = [by_id["0"], by_id["1"], by_id["3"],
             L.Rung("x", "+ forced failure", ("bf16", "token_bucket", "model.d_model=-1"), "3"),  # rejected
             L.Rung("y", "+ SDPA after the failure", ("bf16", "token_bucket", "sdpa"), "x"),
             L.Rung("z", "+ capped at once", ("bf16",), "1", cap_s=0.0)]
    rows, ctx = L.run_ladder(s, rungs, log=lambda *_: None)
    paths = L.write_outputs(rows, ctx, s.out, smoke=True)
    return rows, ctx, paths


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_outputs_written_with_required_columns(ladder_run):
    rows, ctx, paths = ladder_run
    assert set(paths) == {"csv", "md", "png"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert paths["csv"].name == "ladder-cpu.csv"
    table = _csv(paths["csv"])
    assert [r["rung"] for r in table] == ["0", "1", "3", "x", "y", "z"]
    for col in REQUIRED:
        assert col in table[0], col
    assert all(r["gpu"] == "cpu" and r["git_sha"] for r in table)
    md = paths["md"].read_text()
    assert "| rung |" in md and "forced failure" in md and "stand-in corpus" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rung0_and_measurements_are_sane(ladder_run):
    rows, _, _ = ladder_run
    by = {r["rung"]: r for r in rows}
    r0 = by["0"]
    assert r0["status"] == "ok" and r0["precision"] == "fp32" and r0["batching"] == "fixed"
    assert r0["tokens_per_second"] > 0 and r0["step_ms"] > 0 and r0["steps"] == 2
    assert 0 < r0["padding_fraction"] < 1
    assert math.isnan(r0["peak_memory_gb"])  # CPU: no device memory counter
    assert r0["epoch_seconds_projected"] == pytest.approx(r0["epoch_real_tokens"] / r0["tokens_per_second"])
    assert by["3"]["batching"] == "token_bucket" and by["3"]["precision"] == "bf16"  # cumulative
    assert by["3"]["padding_fraction"] < r0["padding_fraction"]
    assert all(math.isfinite(by[k]["final_loss"]) for k in ("0", "1", "3", "y"))


def test_mfu_against_the_peak_of_the_rungs_own_dtype(ladder_run):
    """MFU divides by the peak of the dtype each rung computes in; without a peak (CPU) it is NaN with a
    reason, never a ratio against another dtype's peak."""
    rows, _, paths = ladder_run
    by = {r["rung"]: r for r in rows}
    assert by["0"]["peak_dtype"] == "fp32"  # fp32 rung, fp32 matmul precision "highest"
    assert by["1"]["peak_dtype"] == by["3"]["peak_dtype"] == by["y"]["peak_dtype"] == "bf16"
    for k in ("0", "1", "3", "y"):
        r = by[k]
        if math.isnan(r["peak_tflops"]):
            assert math.isnan(r["mfu"]) and r["mfu_note"], r
        else:
            assert 0 < r["mfu"] <= 1, r
            assert r["mfu"] == pytest.approx(r["model_tflops"] / r["peak_tflops"])
    table = {r["rung"]: r for r in _csv(paths["csv"])}  # the smoke ladder runs on the CPU: empty MFU, a reason
    assert table["0"]["mfu"] == "" and "no MFU on cpu" in table["0"]["mfu_note"]
    assert table["1"]["peak_dtype"] == "bf16" and table["0"]["peak_dtype"] == "fp32"


def test_sdpa_rung_reports_the_kernel_torch_picks(ladder_run):
    rows, _, _ = ladder_run
    by = {r["rung"]: r for r in rows}
    assert by["0"]["sdpa_backend"] == "" and by["3"]["sdpa_backend"] == ""  # reference attention: no SDPA
    names = {"flash_attention", "efficient_attention", "cudnn_attention", "math"}
    got = by["y"]["sdpa_backend"]
    assert got in names or all(part.split(":")[1] in names for part in got.split()), got


def test_rung_over_its_cap_is_a_capped_row(ladder_run):
    rows, _, _ = ladder_run
    z = next(r for r in rows if r["rung"] == "z")
    assert z["status"] == "capped" and "time cap of 0 s" in z["error"] and z["cap_s"] == 0.0
    assert math.isnan(z["speedup_vs_baseline"]) and "tokens_per_second" not in z


def test_speedups_relative_to_rung0_and_parent(ladder_run):
    rows, _, paths = ladder_run
    by = {r["rung"]: r for r in _csv(paths["csv"])}
    t = {k: float(v["tokens_per_second"]) for k, v in by.items() if v["status"] == "ok"}
    assert float(by["0"]["speedup_vs_baseline"]) == pytest.approx(1.0)
    for k in ("1", "3", "y"):
        assert float(by[k]["speedup_vs_baseline"]) == pytest.approx(t[k] / t["0"], rel=1e-4)
    assert float(by["1"]["speedup_vs_previous"]) == pytest.approx(t["1"] / t["0"], rel=1e-4)
    assert float(by["3"]["speedup_vs_previous"]) == pytest.approx(t["3"] / t["1"], rel=1e-4)  # 2 not run
    # y is compared with 3 because x failed, and says so; its own configuration is its switches
    assert by["y"]["parent"] == "3" and "rung x did not run" in by["y"]["note"]
    assert float(by["y"]["speedup_vs_previous"]) == pytest.approx(t["y"] / t["3"], rel=1e-4)
    assert by["y"]["attn_backend"] == "sdpa" and by["y"]["batching"] == "token_bucket"


def test_failed_rung_is_an_error_row(ladder_run):
    rows, _, _ = ladder_run
    x = next(r for r in rows if r["rung"] == "x")
    assert x["status"] == "error" and "d_model" in x["error"] and x["error"].startswith("unsupported")
    assert math.isnan(x["speedup_vs_baseline"]) and "tokens_per_second" not in x


def test_add_speedups_arithmetic():
    rows = [{"rung": "0", "status": "ok", "tokens_per_second": 100.0, "parent": ""},
            {"rung": "1", "status": "ok", "tokens_per_second": 250.0, "parent": "0"},
            {"rung": "2", "status": "error", "parent": "1"},
            {"rung": "3", "status": "ok", "tokens_per_second": 1000.0, "parent": "1"}]
    L.add_speedups(rows)
    assert [r["speedup_vs_baseline"] for r in rows[:2]] == [1.0, 2.5]
    assert rows[3]["speedup_vs_baseline"] == 10.0 and rows[3]["speedup_vs_previous"] == 4.0
    assert math.isnan(rows[0]["speedup_vs_previous"]) and math.isnan(rows[2]["speedup_vs_baseline"])
    rows[0]["status"] = "error"  # no baseline: no speedups at all, never a division by a missing rung
    L.add_speedups(rows)
    assert math.isnan(rows[1]["speedup_vs_baseline"])


def test_rungs_are_independent_and_comparisons_fall_back_past_failures():
    by_id = {r.id: r for r in L.RUNGS}
    parent, ov = L.rung_overrides(by_id["7"], {"0", "5", "6a"}, by_id)  # 6b did not run -> compared with 6a
    assert parent == "6a"
    # rung 7's configuration is its own switches, whatever ran before it
    assert ov == L.rung_overrides(by_id["7"], set(), by_id)[1] == {
        "run.precision": "bf16", "run.compile": "true", "data.batching": "packed", "model.layout": "packed",
        "model.attn_backend": "triton", "model.norm": "fused"}
    assert L.rung_overrides(by_id["3"], {"0"}, by_id) == ("0", {"run.precision": "bf16",
                                                                  "data.batching": "token_bucket"})
    # every standard rung is its comparison's switches plus something: it adds a technique
    for r in L.RUNGS:
        if r.compare is not None:
            base = by_id[r.compare].overrides()
            assert r.overrides() != base and base.items() - r.overrides().items() <= {
                ("model.attn_backend", "sdpa"), ("data.batching", "token_bucket"),
                ("model.layout", "varlen"), ("data.batching", "dynamic")}, r.id  # replaced, not dropped
    with pytest.raises(ValueError, match="unknown switch 'bogus'"):
        L.Rung("q", "bad", ("bogus",), "0").overrides()
    assert L.select_rungs("3,5") == [by_id["0"], by_id["3"], by_id["5"]]
    with pytest.raises(ValueError, match="unknown rung"):
        L.select_rungs("42")


def test_readme_region_rewritten_only_between_markers(ladder_run, tmp_path):
    rows, ctx, paths = ladder_run
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\nbefore\n{R.README_START}\nold\n{R.README_END}\nafter\n")
    assert R.update_readme(rows, ctx, paths, readme=readme)
    text = readme.read_text()
    assert text.startswith("# title\nbefore\n") and text.endswith(f"{R.README_END}\nafter\n")
    assert "old" not in text and "stand-in corpus" in text and "| rung |" in text
    other = tmp_path / "NOMARK.md"
    other.write_text("no markers\n")
    assert not R.update_readme(rows, ctx, paths, readme=other) and other.read_text() == "no markers\n"


@pytest.mark.slow
def test_full_smoke_cli(tmp_path):
    """Every rung through the command line (compile rungs via aot_eager: ~1-2 min on 2 cores)."""
    assert L.main(["--smoke", "--out", str(tmp_path), "--cap-s", "900"]) == 0  # caps: for GPUs, not loaded CPUs
    table = _csv(tmp_path / "ladder-cpu.csv")
    assert [r["rung"] for r in table] == [r.id for r in L.RUNGS]
    by = {r["rung"]: r for r in table}
    assert by["5"]["status"] == "ok" and by["5"]["graph_breaks"] == "0"
    assert by["9a"]["status"] == "skipped"


@pytest.mark.slow
def test_recompile_in_timed_steps_marks_rung_invalid(tmp_path):
    """A compiled rung with one graph per shape (dynamic=False) on token buckets recompiles while timed."""
    corpus = write_toy_corpus(tmp_path / "toy.jsonl", n=600)
    s = L.LadderSettings(smoke=True, device=torch.device("cpu"), data_files=(str(corpus),), out=tmp_path / "out",
                         steps=2, warmup=1, readme=False, work_dir=tmp_path / "work")
    by_id = {r.id: r for r in L.RUNGS}
    rung = L.Rung("r", "+ compile, one graph per shape", ("bf16", "token_bucket", "compile",
                                                          "run.compile_dynamic=false"), "3")
    rows, _ = L.run_ladder(s, [by_id["0"], rung], log=lambda *_: None)
    r = rows[1]
    assert r["recompiles_timed"] > 0 and r["status"] == "invalid" and "compiled during the timed" in r["error"]
    assert math.isnan(r["speedup_vs_baseline"]) and r["tokens_per_second"] > 0  # measured, not trusted


# ----------------------------------------------------------------------------------------------
# bench/quality.py: the time-to-quality record of a run folder
# ----------------------------------------------------------------------------------------------
def test_quality_record(tmp_path):
    from bench import quality as Q

    run = tmp_path / "runs" / "fast-18ep"
    run.mkdir(parents=True)
    (run / "provenance.json").write_text(json.dumps({
        "git_sha": "abc123", "gpu": None, "torch": "2.13", "config": {"run": {"epochs": 3, "name": "fast-18ep"},
                                                                        "data": {"data_files": ["x/train.jsonl"]}},
        "data_split": {"source": "files:x/train.jsonl"}}))
    recs = [{"kind": "epoch", "epoch": e, "train_loss": 3.0 - e / 2, "train_loss_last_batch": 2.9 - e / 2,
             "valid_loss": 3.1 - e / 2, "bleu": 10.0 * e, "chrf": 20.0 + e, "epoch_seconds": 10.0 + (30 if e == 1 else 0),
             "eval_seconds": 2.0, "tokens_per_second": 1e5, "mfu": 0.3} for e in (1, 2, 3)]
    recs.append({"kind": "test", "epoch": 3, "test_loss": 1.9, "test_bleu": 17.5, "test_chrf": 40.1,
                 "eval_seconds": 3.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    paths = Q.main(["--run", str(run), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "quality-cpu.md").read_text()
    assert "stand-in corpus" in md and "abc123" in md and "17.5" in md
    rows = _csv(tmp_path / "res" / "quality-cpu.csv")
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert float(rows[-1]["wall_seconds"]) == pytest.approx(40 + 10 + 10 + 3 * 2.0)
    assert paths == 0
    # BLEU 10, 20, 30 by epoch: 20 is first reached at epoch 2 (wall 40 + 2 + 10 + 2 = 54 s), 35 never
    assert "time to valid BLEU 20: **54.0 s** (epoch 2" in md and "time to valid BLEU 35: not reached" in md
    assert float(rows[0]["time_to_bleu_20"]) == pytest.approx(54.0) and rows[0]["time_to_bleu_35"] == ""


def test_quality_uses_the_runs_own_clock_and_thresholds(tmp_path):
    """wall_seconds since process start (data and compile included) wins over the sum of epoch times."""
    from bench import quality as Q

    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "provenance.json").write_text(json.dumps({"config": {"eval": {"bleu_thresholds": [9.0, 30.0]}}}))
    recs = [{"kind": "epoch", "epoch": e, "bleu": 10.0 * e, "epoch_seconds": 1.0, "eval_seconds": 0.5,
             "wall_seconds": 20.0 + 3 * e, "first_step_seconds": 12.5} for e in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    Q.write_quality(run, tmp_path / "res")
    md = (tmp_path / "res" / "quality-cpu.md").read_text()
    assert "time to valid BLEU 9: **23.0 s** (epoch 1" in md and "time to valid BLEU 30: **29.0 s** (epoch 3" in md
    assert "first step (compile + CUDA-graph capture) 12.5 s" in md
    assert "**5.2 %** of the wall time" in md  # 1.5 s of evaluation in 29 s
