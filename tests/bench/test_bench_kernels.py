"""bench.harness counting/writers against hand-computed values, and a CPU smoke run of bench.kernels."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from bench import harness as H
from bench import kernels as K


# ----------------------------------------------------------------------------------------------
# FLOPs and bytes, by hand
# ----------------------------------------------------------------------------------------------
def test_attention_flops_matches_flash_attention_2_formula():
    # FA2's benchmark: 4 * batch * seqlen**2 * nheads * headdim (// 2 causal); bwd 2.5x, fwd+bwd 3.5x
    B, T, Hh, D = 8, 2048, 16, 128
    fwd = 4 * B * T**2 * Hh * D
    assert H.attention_flops([T] * B, [T] * B, Hh, D, causal=False) == fwd
    assert H.attention_flops([T] * B, [T] * B, Hh, D, causal=True) == fwd / 2
    assert H.attention_flops([T] * B, [T] * B, Hh, D, causal=False, mode="bwd") == 2.5 * fwd
    assert H.attention_flops([T] * B, [T] * B, Hh, D, causal=True, mode="fwd+bwd") == 3.5 * fwd / 2


def test_attention_flops_counts_real_positions_only():
    # lengths 3 and 5 with H=4, D=8: 4 * 4 * 8 * (3*3 + 5*5) = 128 * 34
    assert H.attention_flops([3, 5], [3, 5], 4, 8, causal=False) == 4352
    assert H.attention_flops(torch.tensor([3, 5], dtype=torch.int32), [3, 5], 4, 8, causal=True) == 2176
    assert H.attention_flops(2, 7, 1, 1, causal=False) == 4 * 14  # cross-attention, one sequence


def test_attention_flops_rejects_bad_input():
    with pytest.raises(ValueError, match="mode"):
        H.attention_flops([4], [4], 1, 8, causal=False, mode="backward")
    with pytest.raises(ValueError, match="lengths"):
        H.attention_flops([4, 4], [4], 1, 8, causal=False)


def test_layer_norm_bytes_minimal_traffic():
    R, N = 16384, 512  # bf16 activations and parameters
    act = R * N * 2
    # fwd: x, r in; y, s out; w, b in
    assert H.layer_norm_bytes(R, N, mode="fwd") == 4 * act + 2 * N * 2 == 67_110_912
    # bwd: dy, ds, s in; dx out; w, b in; dw, db out
    assert H.layer_norm_bytes(R, N, mode="bwd") == 4 * act + 4 * N * 2
    assert H.layer_norm_bytes(R, N, mode="fwd+bwd") == 8 * act + 6 * N * 2
    # no residual, fp32 weight only: fwd x in, y out, w in; bwd dy, x in, dx out, w in, dw out
    assert H.layer_norm_bytes(R, N, mode="fwd", residual=False, bias=False, param_bytes=4) == 2 * act + N * 4
    assert H.layer_norm_bytes(R, N, mode="bwd", residual=False, bias=False, param_bytes=4) == 3 * act + 2 * N * 4
    with pytest.raises(ValueError, match="mode"):
        H.layer_norm_bytes(R, N, mode="both")


def test_rates():
    assert H.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert H.gbps(3e9, 1.0) == pytest.approx(3000.0)
    assert math.isnan(H.tflops(1.0, 0.0))


def test_quantiles_match_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    assert H.quantiles(xs, (0.5, 0.2, 0.8)) == pytest.approx(list(np.quantile(xs, [0.5, 0.2, 0.8])))


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("cpu", "cpu"),
])
def test_gpu_slug(name, slug):
    assert H.gpu_slug(name) == slug


def test_wallclock_bench_and_cpu_peaks():
    x = torch.randn(64, 64)
    t = H.bench(lambda: x @ x, device="cpu", warmup_ms=0.5, rep_ms=2.0)
    assert 0 < t.p20 <= t.ms <= t.p80
    peaks = H.measure_peaks("cpu", dtype=torch.float32, copy_bytes=2**20, matmul_n=64, warmup_ms=0.5, rep_ms=2.0)
    assert peaks.copy_gbps > 0 and peaks.matmul_tflops > 0


def test_append_csv_unions_headers(tmp_path):
    path = tmp_path / "r.csv"
    H.append_csv(path, [{"a": 1, "b": 0.5}], columns=("a", "b"))
    H.append_csv(path, [{"a": 2, "b": float("nan")}], columns=("a", "b"))  # same header: plain append
    H.append_csv(path, [{"a": 3, "c": "x"}], columns=("a", "b"))  # new column: file rewritten once
    rows = H.read_csv(path)
    assert [r["a"] for r in rows] == ["1", "2", "3"]
    assert list(rows[0]) == ["a", "b", "c"]
    assert rows[0]["b"] == "0.5" and rows[1]["b"] == "" and rows[2]["c"] == "x" and rows[0]["c"] == ""


def test_ragged_lengths_are_bounded_and_deterministic():
    a = K.ragged_lengths(64, 128, 0.5, K._generator(3))
    assert a == K.ragged_lengths(64, 128, 0.5, K._generator(3))
    assert a[0] == 128 and all(64 <= v <= 128 for v in a)


# ----------------------------------------------------------------------------------------------
# The smoke run: every provider path on tiny shapes, outputs with the promised columns
# ----------------------------------------------------------------------------------------------
REQUIRED = ("provider", "mode", "status", "case", "B", "H", "Tq", "Tk", "D", "causal", "rows", "width",
            "ms", "ms_p20", "ms_p80", "tflops", "gbps", "pct_peak", "peak_mem_mb", "gpu", "torch", "triton",
            "git_sha")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # compile through the plain "eager" backend: the smoke test checks plumbing, not inductor
    rc = K.main(["--smoke", "--out", str(out), "--isolate", "none", "--compile-backend", "eager"])
    assert rc == 0
    csvs = list(out.glob("kernels-*.csv"))
    assert len(csvs) == 1, csvs
    with csvs[0].open(newline="") as f:
        return out, list(csv.DictReader(f))


def test_smoke_writes_csv_markdown_png(smoke):
    out, rows = smoke
    slug = rows[0]["gpu_slug"]
    for ext in ("csv", "md", "png"):
        assert (out / f"kernels-{slug}.{ext}").stat().st_size > 0
    md = (out / f"kernels-{slug}.md").read_text()
    assert "## Targets" in md and rows[0]["gpu"] in md and rows[0]["git_sha"] in md
    assert set(REQUIRED) <= set(rows[0])
    assert all(r["gpu"] and r["git_sha"] and r["torch"] for r in rows)


def test_smoke_covers_every_case_provider_mode_once(smoke):
    _, rows = smoke
    keys = [(r["case"], r["provider"], r["mode"]) for r in rows]
    assert len(keys) == len(set(keys))
    for case in K.build_cases(smoke=True, only=None):
        for p in case.providers:
            for m in H.MODES:
                assert (case.id, p, m) in set(keys), (case.id, p, m)
    assert {r["status"] for r in rows} <= {"ok", "skipped", "unsupported", "not-implemented", "error", "oom"}


def test_smoke_ok_rows_have_consistent_numbers(smoke):
    _, rows = smoke
    ok = [r for r in rows if r["status"] == "ok"]
    for bench, provider in (("attention", "sdpa-math"), ("attention", "reference"), ("layernorm", "eager")):
        assert any(r["bench"] == bench and r["provider"] == provider for r in ok), (bench, provider)
    for r in ok:
        ms, p20, p80 = float(r["ms"]), float(r["ms_p20"]), float(r["ms_p80"])
        assert 0 < p20 <= ms <= p80
        assert float(r["rel_err"]) < 5e-2, r  # every provider computes the same function
        if r["bench"] == "attention":
            assert float(r["tflops"]) == pytest.approx(float(r["flops"]) / (ms * 1e-3) / 1e12, rel=1e-4)
        else:
            expect = H.layer_norm_bytes(int(r["rows"]), int(r["width"]), mode=r["mode"])
            assert float(r["bytes"]) == expect
            assert float(r["gbps"]) == pytest.approx(expect / (ms * 1e-3) / 1e9, rel=1e-4)


def test_smoke_records_refusals_instead_of_crashing(smoke):
    _, rows = smoke
    if torch.cuda.is_available():
        pytest.skip("CPU expectations")
    ours = [r for r in rows if r["provider"] == "ours"]
    assert ours and all(r["status"] == "skipped" and "CUDA" in r["error"] for r in ours)
    eff = [r for r in rows if r["provider"] == "sdpa-efficient"]  # no CPU kernel
    assert eff and all(r["status"] == "unsupported" and r["error"] for r in eff)


@pytest.mark.slow
def test_isolated_worker_crash_is_recorded(tmp_path, monkeypatch):
    """A provider that kills its worker gets 'crash' rows, is left out after two, others still run (~30 s)."""
    monkeypatch.setenv(K.FAULT_ENV, "sdpa-flash")  # in all three smoke attention cases
    rc = K.main(["--smoke", "--out", str(tmp_path), "--isolate", "process", "--only", "attention",
                 "--providers", "sdpa,sdpa-flash", "--compile-backend", "eager", "--no-plot"])
    assert rc == 0
    rows = H.read_csv(next(tmp_path.glob("kernels-*.csv")))
    flash = {(r["group"], r["status"]) for r in rows if r["provider"] == "sdpa-flash"}
    assert flash == {("train-ragged", "crash"), ("train-dense", "crash"), ("long", "skipped")}
    sdpa = [r for r in rows if r["provider"] == "sdpa"]
    assert len(sdpa) == 2 * len(H.MODES) and all(r["status"] == "ok" for r in sdpa)


@pytest.mark.slow
def test_our_layernorm_provider_through_the_interpreter(tmp_path):
    """Our Triton LayerNorm as the benchmark calls it (residual, GELU, both outputs differentiated)."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA run covers it")
    rc = K.main(["--smoke", "--cpu-triton", "--only", "layernorm", "--providers", "ours", "--out", str(tmp_path),
                 "--isolate", "none", "--no-plot"])
    assert rc == 0
    rows = H.read_csv(next(tmp_path.glob("kernels-*.csv")))
    assert len(rows) == len(H.MODES)
    if any(r["status"] == "not-implemented" for r in rows):
        pytest.skip("the Triton LayerNorm has not landed")
    assert all(r["status"] == "ok" and float(r["rel_err"]) < 2e-2 for r in rows), rows
