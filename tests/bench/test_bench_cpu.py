"""`make bench` and `make profile` on a CPU (issue 23 item 8): no failing rows, a plain reason where a row does
not apply, real numbers, only the plot panels that have data, a quiet profile with a real step time, and
results of CPU runs kept out of the committed bench/results/."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from bench import harness as H
from bench import kernels as K
from bench import ladder as L
from bench import report as R
from bench import runner
from data.toy import write_toy_corpus

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU machine shows")


def test_compiled_providers_time_their_backward(tmp_path):
    """The compile rows' bwd mode ("non-empty donated buffers ... retain_graph" before) runs like the others."""
    rc = K.main(["--smoke", "--only", "layernorm", "--providers", "eager,compile", "--isolate", "none",
                 "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    with (tmp_path / "kernels-cpu.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["provider"], r["mode"]) for r in rows} == {(p, m) for p in ("eager", "compile") for m in H.MODES}
    assert all(r["status"] == "ok" for r in rows), [(r["provider"], r["mode"], r["error"][:80]) for r in rows]


def test_console_rates_keep_their_digits(capsys):
    runner._progress({"ev": "row", "row": {"status": "ok", "case": "c", "provider": "p", "mode": "fwd", "ms": 0.5,
                                           "tflops": 0.000654}})
    runner._progress({"ev": "row", "row": {"status": "ok", "case": "c", "provider": "p", "mode": "fwd", "ms": 0.5,
                                           "gbps": 0.42}})
    out = capsys.readouterr().out
    assert "6.54e-04 TFLOP/s" in out and "0.42 GB/s" in out and " 0.00 " not in out and " 0 GB/s" not in out


def _figure(monkeypatch, rows):
    saved = {}

    def save(fig, path, suptitle=""):
        saved["fig"] = fig
        return path

    monkeypatch.setattr(H, "save_figure", save)
    prov = {"gpu": "cpu", "gpu_slug": "cpu", "torch": "2.13", "triton": "3.6", "git_sha": "abc"}
    R.write_plot(None, rows, prov, H.Peaks(copy_gbps=100.0, matmul_tflops=0.1, dtype="bfloat16", copy_bytes=4 * 2**20, matmul_n=128))
    fig = saved["fig"]
    shown = [ax for ax in fig.axes if ax.axison]
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    return shown, texts


def test_the_kernel_plot_draws_only_panels_with_data(monkeypatch):
    ln = {"bench": "layernorm", "mode": "fwd+bwd", "status": "ok", "provider": "eager", "case": "ln-R64-N32",
          "group": "ln", "width": 32, "rows": 64, "gbps": 3.5, "ms": 0.2, "op_ms": 0.21}
    skipped = {**ln, "provider": "ours", "status": "skipped", "gbps": None}
    shown, texts = _figure(monkeypatch, [ln, skipped])
    assert [ax.get_title() for ax in shown] == ["LayerNorm+residual+GELU fwd+bwd",
                                                "LayerNorm+GELU fwd+bwd, op time (host included)"]
    assert "no data" not in texts
    shown, texts = _figure(monkeypatch, [skipped])
    assert shown == [] and any("Triton providers need CUDA" in t for t in texts)


def test_an_invalid_rung_says_why_once():
    row = {"rung": "6a", "technique": "+ varlen", "tokens_per_second": 19.3, **L.timed_status(8)}
    text = R.ladder_table([row], text=True)
    assert "invalid: 8 graph(s) compiled during the timed steps" in text and "invalid: invalid" not in text
    assert L.timed_status(0) == {"status": "ok"} and L.timed_status(None) == {"status": "ok"}


def test_rungs_that_need_cuda_say_why_on_a_cpu(tmp_path):
    corpus = write_toy_corpus(tmp_path / "toy.jsonl", n=300)
    s = L.LadderSettings(smoke=True, device=torch.device("cpu"), data_files=(str(corpus),), out=tmp_path / "out",
                         steps=1, warmup=0, readme=False, work_dir=tmp_path / "work")
    rows, _ = L.run_ladder(s, L.select_rungs("0,6a,7,9a,9b"), log=lambda *_: None)
    by = {r["rung"]: r for r in rows}
    assert by["0"]["status"] == "ok"
    for rung in ("6a", "7", "9a", "9b"):
        assert by[rung]["status"] == "skipped" and "CUDA only: " in by[rung]["note"], by[rung]
    assert "runs its PyTorch reference" in by["6a"]["note"] and "fused LayerNorm" in by["7"]["note"]
    assert not any(r.get("status") in ("error", "invalid") for r in rows)


def test_a_cpu_runs_quality_record_stays_out_of_bench_results(tmp_path):
    from bench import quality as Q

    before = sorted(p.name for p in H.RESULTS_DIR.iterdir())
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "provenance.json").write_text(json.dumps({"gpu": None, "config": {"run": {"epochs": 1}}}))
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 1, "bleu": 1.0, "epoch_seconds": 1.0,
                                                   "eval_seconds": 0.5, "wall_seconds": 3.0}) + "\n")
    assert Q.main(["--run", str(run)]) == 0
    assert (run / "quality-cpu.md").is_file()
    assert sorted(p.name for p in H.RESULTS_DIR.iterdir()) == before
    (run / "provenance.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3"}))
    assert Q.default_out(run) == H.RESULTS_DIR  # a GPU run's record is a result to commit


def test_profile_logs_stay_off_the_console(tmp_path, capfd):
    """Recompile and graph-break logs go to dynamo.log only (they flooded the console), and the C++ lines
    the profiler prints go to the given file."""
    from bench import profile as P

    def breaks(x):
        y = x.sin()
        print("a print is a graph break")  # noqa: T201
        return y.cos()

    torch._dynamo.reset()
    with P.capture_dynamo_logs(tmp_path / "dynamo.log"):
        f = torch.compile(breaks, backend="eager")
        f(torch.randn(3))
        f(torch.randn(5))  # a recompile
    out, err = capfd.readouterr()
    assert err == "" and out.count("\n") == 2  # only the function's own prints
    log = (tmp_path / "dynamo.log").read_text()
    assert "Graph break" in log and "ecompil" in log
    with P.stderr_into(tmp_path / "run.log"):
        import os

        os.write(2, b"from C++\n")
    assert capfd.readouterr().err == "" and (tmp_path / "run.log").read_text() == "from C++\n"
    torch._dynamo.reset()
