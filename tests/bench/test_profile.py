"""CPU smoke of bench/profile.py: trace and reports written, no graph break in the tiny model's compiled
step (aot_eager), and the checker failing loudly on a function that does break."""

from __future__ import annotations

import json

import pytest
import torch

from bench import profile as P
from data.toy import write_toy_corpus


def test_profile_smoke_tiny_has_no_graph_breaks(tmp_path, capfd):
    corpus = write_toy_corpus(tmp_path / "toy.jsonl", n=300)
    r = P.run_profile("tiny", smoke=True, data_files=[str(corpus)], out_dir=tmp_path / "out", warmup=1, active=1,
                      work=tmp_path / "work", log=lambda *_: None, quiet=True)
    assert capfd.readouterr() == ("", "")  # quiet: recompiles, graph breaks, the profiler's lines in the files
    assert isinstance(r["step_ms"], float) and r["step_ms"] > 0 and r["timed_steps"] == 3  # a step time on CPU
    assert f"- step: **{P.H.fmt(r['step_ms'])} ms** wall" in (r["out"] / "report.md").read_text()
    out = r["out"]
    assert out.name == "profile-cpu"
    for name in ("report.md", "top_kernels.md", "top_kernels.txt", "dynamo.log"):
        assert (out / name).is_file(), name
    trace = json.loads(r["trace"].read_text())
    assert trace["traceEvents"] and r["trace"].stat().st_size < 10 * 2**20
    assert r["steps"]["graph_breaks"] == 0 and r["explain"]["graph_breaks"] == 0
    assert r["steps"]["graphs"] >= 1 and r["explain"]["graphs"] == 1
    P.check_no_graph_breaks(r["steps"], r["explain"])  # does not raise
    report = (out / "report.md").read_text()
    assert "Graph breaks: **none**" in report and "| name |" in (out / "top_kernels.md").read_text()


def test_profile_smoke_packed_preset(tmp_path):
    """The `fast` preset's packed layout (static-shape streams, positions from the batch) profiles end to end
    with the tiny model: the model arguments come from the batch itself (they crashed on the H100)."""
    corpus = write_toy_corpus(tmp_path / "toy.jsonl", n=300)
    cfg = P.profile_config("fast", smoke=True, data_files=[str(corpus)], work=tmp_path / "work")
    assert (cfg.data.batching, cfg.model.layout, cfg.model.d_model) == ("packed", "packed", 64)
    r = P.run_profile("fast", smoke=True, data_files=[str(corpus)], out_dir=tmp_path / "out", warmup=1, active=1,
                      work=tmp_path / "work", log=lambda *_: None)
    assert r["shapes"] == 1  # every packed batch has the same shapes
    assert r["steps"]["graph_breaks"] == 0 and r["explain"]["graph_breaks"] == 0
    assert r["explain"]["graphs"] == 1 and r["recompiles_while_profiling"] == 0


def _breaks(x):
    y = x.sin()
    print("a print is a graph break")  # noqa: T201 - the point of this function
    return y.cos()


def _clean(x):
    return x.sin().cos() * 2


def test_checker_fails_on_a_graph_break(tmp_path):
    bad = P.explain(_breaks, torch.randn(4))
    assert bad["graph_breaks"] >= 1 and bad["graphs"] >= 2 and "print" in " ".join(bad["reasons"])
    with pytest.raises(P.GraphBreakError, match="graph break"):
        P.check_no_graph_breaks(bad, what="_breaks")
    good = P.explain(_clean, torch.randn(4))
    assert good == {"graphs": 1, "graph_breaks": 0, "reasons": []}
    P.check_no_graph_breaks(good)


def test_counters_and_log_capture_see_a_break(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with P.capture_dynamo_logs(tmp_path / "dynamo.log") as log:
        torch.compile(_breaks, backend="eager")(torch.randn(3))
    c = P.dynamo_counters()
    assert c["graph_breaks"] >= 1
    with pytest.raises(P.GraphBreakError):
        P.check_no_graph_breaks(c)
    assert "Graph break" in log.read_text()
    torch._dynamo.reset()


def test_busy_share_is_the_union_of_kernel_time_over_the_steps():
    # two steps spanning [0, 100) and [100, 200) µs; kernels overlap each other and one spills out of the window
    steps = [(0.0, 100.0), (100.0, 200.0)]
    kernels = [(10.0, 30.0), (20.0, 40.0), (150.0, 170.0), (190.0, 260.0), (300.0, 310.0)]
    b = P.busy_stats(kernels, steps)
    assert b["gpu_busy"] == pytest.approx((30 + 20 + 10) / 200)
    assert b["launches_per_step"] == 2.0 and b["step_ms"] == pytest.approx(0.1)
    assert P.busy_stats(kernels, [])["gpu_busy"] is None


@pytest.mark.slow  # compiles the tiny model: ~1 min on 2 cores (the in-process test above checks the same quietly)
def test_make_profile_prints_its_report_and_nothing_else(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "bench.profile", "--warmup", "1", "--active", "1"], cwd=tmp_path,
                          env=os.environ | {"PYTHONPATH": str(repo)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    report = proc.stdout[:proc.stdout.index("[profile] outputs in")]
    assert report.startswith("# Profile of the compiled training step") and "- step: **" in report
    assert "ecompil" not in report.split("## Graph breaks")[0] and proc.stdout.count("[profile]") == 1
