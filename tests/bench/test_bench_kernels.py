"""bench.harness counting/writers against hand-computed values, the corpus cases, the provider registry,
the timing helpers, and CPU smoke runs of bench.kernels."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import cases as C
from bench import harness as H
from bench import kernels as K
from bench import registry, runner, timing
from bench.attention import document_mask_mod, floor_bytes, segment_ids


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
    a = C.ragged_lengths(64, 128, 0.5, C.generator(3))
    assert a == C.ragged_lengths(64, 128, 0.5, C.generator(3))
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
    for case in C.build_cases(smoke=True, only=None):
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
        else:  # a bytes-counted op: its rate is its bytes over its time; LayerNorm's bytes by hand too
            if r["bench"] == "layernorm":
                assert float(r["bytes"]) == H.layer_norm_bytes(int(r["rows"]), int(r["width"]), mode=r["mode"])
            assert float(r["gbps"]) == pytest.approx(float(r["bytes"]) / (ms * 1e-3) / 1e9, rel=1e-4)


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
    # the test's own provider (tests/bench/fault_provider.py), in all three padded smoke attention groups;
    # registered into a copy of the registry, so other tests never see it
    registry.load()  # the op modules register once per process: into the real registry, before the copy
    monkeypatch.setattr(registry, "_PROVIDERS", list(registry._PROVIDERS))
    monkeypatch.delitem(sys.modules, "tests.bench.fault_provider", raising=False)
    rc = K.main(["--smoke", "--out", str(tmp_path), "--isolate", "process", "--only", "attention",
                 "--provider-module", "tests.bench.fault_provider", "--providers", "sdpa,fault",
                 "--compile-backend", "eager", "--no-plot"])
    assert rc == 0
    rows = H.read_csv(next(tmp_path.glob("kernels-*.csv")))
    fault = {(r["group"], r["status"]) for r in rows if r["provider"] == "fault"}
    assert fault == {("train-ragged", "crash"), ("train-dense", "crash"), ("long", "skipped")}
    sdpa = [r for r in rows if r["provider"] == "sdpa"]
    assert len(sdpa) == 2 * len(H.MODES) and all(r["status"] == "ok" for r in sdpa)


@pytest.mark.slow
def test_isolated_worker_past_the_budget_is_killed_with_its_children(tmp_path, monkeypatch):
    """A worker that hangs past the budget is killed with its whole process group (a child it started too),
    its provider in flight gets 'crash' rows and the run still writes its CSV (~35 s)."""
    registry.load()
    monkeypatch.setattr(registry, "_PROVIDERS", list(registry._PROVIDERS))
    monkeypatch.delitem(sys.modules, "tests.bench.fault_provider", raising=False)
    monkeypatch.setattr(runner, "WORKER_GRACE_S", 0.0)
    pid_file = tmp_path / "hang.pid"
    monkeypatch.setenv("FASTMT_TEST_HANG_PID", str(pid_file))
    rc = K.main(["--smoke", "--out", str(tmp_path), "--isolate", "process", "--only", "attention",
                 "--provider-module", "tests.bench.fault_provider", "--providers", "hang", "--budget-s", "25",
                 "--compile-backend", "eager", "--no-plot"])
    assert rc == 0
    rows = H.read_csv(next(tmp_path.glob("kernels-*.csv")))
    hang = [r for r in rows if r["provider"] == "hang"]
    assert {r["status"] for r in hang} <= {"crash", "skipped"} and any(r["status"] == "crash" for r in hang)
    child = int(pid_file.read_text())
    for _ in range(100):  # the group got TERM then KILL: the child is gone (or a zombie being reaped)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(FileNotFoundError):
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        raise AssertionError(f"the hung worker's child {child} outlived the run")


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


# ----------------------------------------------------------------------------------------------
# Corpus cases: segment lengths and packed batches built as training builds them
# ----------------------------------------------------------------------------------------------
def test_lognormal_params_hit_mean_and_p99():
    mu, sigma = C.lognormal_params(16.5, 75.0)
    assert math.exp(mu + sigma**2 / 2) == pytest.approx(16.5)
    assert math.exp(mu + 2.3263478740408408 * sigma) == pytest.approx(75.0, rel=1e-6)
    with pytest.raises(ValueError, match="p99 10"):
        C.lognormal_params(16.5, 10.0)


def test_generated_lengths_follow_the_target_distribution():
    src, tgt = C.generated_lengths(seed=0)
    assert len(src) == len(tgt) > 0.99 * C.GENERATED_PAIRS  # almost nothing over max_len
    for side in (src, tgt):
        assert side.dtype == np.int32 and side.min() >= 2 and side.max() <= C.CORPUS_MAX_LEN
        assert side.mean() == pytest.approx(C.LENGTH_MEAN, rel=0.03)
        assert np.percentile(side, 99) == pytest.approx(C.LENGTH_P99, rel=0.06)
    assert np.corrcoef(np.log(src), np.log(tgt))[0, 1] > 0.9  # a pair's sides go together
    again, _ = C.generated_lengths(seed=0)
    assert np.array_equal(src, again)


def check_packed(batch, layout, src_len, tgt_len):
    """The packed collate's invariants on one batch (docs/ARCHITECTURE.md, "Packed batches")."""
    k = len(batch)
    for cu, seg, cap, lengths in ((batch.cu_seqlens_src, batch.src_lengths, layout.src_capacity, src_len),
                                  (batch.cu_seqlens_tgt, batch.tgt_lengths, layout.tgt_capacity, tgt_len)):
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == cap
        assert torch.equal(cu[1:] - cu[:-1], seg)
        assert int(seg.max()) <= layout.max_len and int(seg.min()) >= 0
        assert seg[:k].tolist() == lengths[batch.index.numpy()].tolist()  # real pairs first, in order
        tail = seg[k:].tolist()
        assert tail == sorted(tail, key=bool)  # empty slots, then the dummy tail
    assert batch.cu_seqlens_src.shape == batch.cu_seqlens_tgt.shape == (layout.slots + 1,)


@pytest.mark.parametrize("tokens", [4096, 16384])
def test_packed_corpus_batch_is_the_collates(tokens):
    src, tgt = C.generated_lengths(seed=0)
    batch, layout = C.packed_batch(src, tgt, tokens, C.CORPUS_MAX_LEN)
    check_packed(batch, layout, src, tgt)
    assert layout.src_capacity + layout.tgt_capacity - tokens < 2 * 64
    # the stream is nearly full of real pairs (PEERS.md: 4,096 tokens hold ~124 segments of ~16)
    assert int(batch.src_lengths[: len(batch)].sum()) > 0.9 * layout.src_capacity
    assert len(batch) == pytest.approx(tokens / (2 * C.LENGTH_MEAN), rel=0.25)


def test_corpus_lengths_from_a_data_bundle(tmp_path):
    from data import DataConfig

    rng = np.random.default_rng(0)
    words = ["casa", "gatto", "libro", "sole", "mare", "notte", "strada", "amico", "porta", "fiume"]
    rows = []
    for _ in range(300):
        n = int(rng.integers(1, 30))
        rows.append({"translation": {"en": " ".join(rng.choice(words, n)), "it": " ".join(rng.choice(words, n))}})
    files = tmp_path / "toy.jsonl"
    files.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(data_files=(str(files),), cache_dir=str(tmp_path / "cache"), vocab_size=400, max_len=64,
                     valid_size=20, test_size=20, num_workers=0, spm_threads=1)
    src, tgt = C.corpus_lengths_from(cfg)
    assert len(src) == len(tgt) == 260 and src.min() >= 2 and max(src.max(), tgt.max()) <= 64
    batch, layout = C.packed_batch(src, tgt, 512, 64)
    check_packed(batch, layout, src, tgt)


def corpus_case(kind: str, H: int = 2, D: int = 16, tokens: int = 256, max_len: int = 32) -> C.Case:
    return C.Case("attention", "corpus", registry.names("attention", "corpus"), H=H, D=D, causal=kind == "dec-self",
                  kind=kind, max_tokens=tokens, max_len=max_len, seed=1, host_split=True)


OPTS = argparse.Namespace(data_files=None, length_mean=C.LENGTH_MEAN, length_p99=C.LENGTH_P99,
                          compile_backend="eager", min_fill=0.5)


@pytest.mark.parametrize("kind", C.CORPUS_KINDS)
def test_corpus_inputs_take_the_right_streams(kind):
    d = C.make_corpus_inputs(corpus_case(kind), torch.bfloat16, torch.device("cpu"), OPTS)
    src, tgt = C.generated_lengths(max_len=32)
    batch, layout = C.packed_batch(src, tgt, 256, 32, seed=1)
    q_side = batch.src_lengths if kind == "enc-self" else batch.tgt_lengths
    k_side = batch.tgt_lengths if kind == "dec-self" else batch.src_lengths
    assert d.lengths_q == q_side.tolist() and d.lengths_k == k_side.tolist() and d.real == len(batch)
    assert d.q.shape == (sum(d.lengths_q), 2, 16) and d.k.shape == d.v.shape == (sum(d.lengths_k), 2, 16)
    assert d.causal == (kind == "dec-self") and d.max_len == layout.max_len
    assert d.checked == (0, d.real - 1)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_document_mask_is_block_diagonal(causal):
    lengths_q, lengths_k = [3, 0, 5, 1, 4], [3, 0, 5, 1, 4] if causal else [2, 4, 6, 0, 1]
    cu_q = torch.tensor(np.cumsum([0, *lengths_q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *lengths_k]), dtype=torch.int32)
    cq, ck = int(cu_q[-1]), int(cu_k[-1])
    mask_mod = document_mask_mod(segment_ids(cu_q, cq), segment_ids(cu_k, ck), causal)
    got = mask_mod(0, 0, torch.arange(cq)[:, None], torch.arange(ck)[None, :])
    want = torch.zeros(cq, ck, dtype=torch.bool)
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        block = torch.ones(lq, lk, dtype=torch.bool)
        want[cu_q[i] : cu_q[i] + lq, cu_k[i] : cu_k[i] + lk] = block.tril() if causal else block
    assert torch.equal(got, want)


def test_attention_memory_floor_by_hand():
    # 100 query and 80 key tokens, H 8, D 64, bf16: fwd q, k, v in + o out; bwd q, k, v, o, dO in + dQ, dK, dV out
    per = 8 * 64 * 2
    assert floor_bytes(100, 80, 8, 64, 2, "fwd") == (100 + 80 + 80 + 100) * per
    assert floor_bytes(100, 80, 8, 64, 2, "bwd") == (3 * 100 + 2 * 80 + 100 + 2 * 80) * per
    assert floor_bytes(100, 80, 8, 64, 2, "fwd+bwd") == floor_bytes(100, 80, 8, 64, 2, "bwd")
    with pytest.raises(ValueError, match="mode"):
        floor_bytes(1, 1, 1, 1, 2, "both")


def test_our_corpus_providers_through_the_interpreter():
    """Both tilings of our kernel on a packed decoder batch match the fp32 reference (~10 s)."""
    case = corpus_case("dec-self", H=1, tokens=128, max_len=16)
    d = C.make_corpus_inputs(case, torch.bfloat16, torch.device("cpu"), OPTS)
    ref = registry.op("attention").reference(case, d)
    for name in ("ours-sequence", "ours-stream"):
        provider = registry.get("attention", name, "corpus")
        with H.environ(provider.env):
            assert os.environ["FASTMT_ATTN_TILING"] == name.removeprefix("ours-")
            prep = provider.prepare(case, d, OPTS)
            first = runner.first_call(prep.fn, prep.leaves, torch.device("cpu"))
        assert first.seconds > 0 and first.keep == (0,) and first.note == ""
        assert runner.rel_err(prep.check(first.outs[0]), ref) < 2e-2, name
        assert all(t.grad is None for t in prep.leaves)  # reset after the first backward


# ----------------------------------------------------------------------------------------------
# The provider registry and the timing helpers
# ----------------------------------------------------------------------------------------------
def test_registry_lists_providers_per_op_and_group():
    registry.load()
    assert registry.names("attention", "corpus") == ("ours-sequence", "ours-stream", "torch-varlen", "flex",
                                                     "sdpa-padded")
    assert registry.names("attention", "long") == ("ours", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
    assert registry.names("layernorm", "ln") == ("ours", "eager", "compile")
    # one name, two input layouts: separate prepare functions per group
    assert registry.get("attention", "torch-varlen", "corpus").prepare is not registry.get(
        "attention", "torch-varlen", "train-ragged").prepare
    assert registry.get("attention", "ours-stream", "corpus").env == {"FASTMT_ATTN_TILING": "stream"}
    assert registry.get("attention", "ours-sequence", "corpus").triton
    with pytest.raises(KeyError, match="flex"):
        registry.get("attention", "flex", "train-ragged")


def test_registry_rejects_a_second_provider_for_the_same_group(monkeypatch):
    registry.load()
    monkeypatch.setattr(registry, "_PROVIDERS", list(registry._PROVIDERS))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("attention", "sdpa", groups=("train-dense",))(lambda case, d, opts: None)
    registry.register("attention", "sdpa", groups=("corpus",))(lambda case, d, opts: None)  # a new group: fine
    assert "sdpa" in registry.names("attention", "corpus")
    with pytest.raises(ImportError, match="no_such_module"):
        registry.load(["no_such_module"])


def test_cpu_timing_helpers():
    x = torch.randn(32, 32, requires_grad=True)
    first = runner.first_call(lambda: (x @ x, x.detach() + 1), [x], torch.device("cpu"))
    assert first.keep == (0,) and len(first.douts) == 1 and first.seconds > 0 and x.grad is None
    fn = lambda: torch.autograd.backward((x @ x,), first.douts)  # noqa: E731
    kt = timing.kernel_time(lambda _: fn(), fn, device=torch.device("cpu"), leaves=[x], warmup_ms=0.5, rep_ms=2)
    assert kt.timer.startswith("wallclock") and 0 < kt.timing.p20 <= kt.timing.ms <= kt.timing.p80
    with timing.triton_launches() as names:
        pass
    assert names is None or names == []


@pytest.mark.gpu
def test_cuda_graph_kernel_time_replays_the_same_gradients():
    """The captured fwd+bwd writes the gradients eager autograd computes; op time includes the host."""
    dev = torch.device("cuda")
    x = torch.randn(256, 256, device=dev, requires_grad=True)
    w = torch.randn(256, 256, device=dev)
    dy = torch.randn(256, 256, device=dev)
    fn = lambda: torch.autograd.backward(((x @ w).relu(),), (dy,))  # noqa: E731
    fn()
    want = x.grad.clone()
    x.grad = None
    grads = []
    kt = timing.kernel_time(lambda _: (fn(), grads.append(x.grad)), fn, device=dev, leaves=[x], warmup_ms=1, rep_ms=5)
    assert kt.timer == "cuda-graph"
    op = timing.op_time(fn, device=dev, leaves=[x], warmup_ms=1, rep_ms=5)
    assert op.ms > 0 and kt.timing.ms > 0
    torch.testing.assert_close(grads[-1], want)


def test_smoke_corpus_family_writes_csv_and_markdown(tmp_path):
    rc = K.main(["--smoke", "--groups", "corpus", "--modes", "fwd+bwd", "--out", str(tmp_path), "--isolate", "none",
                 "--no-plot"])
    assert rc == 0
    rows = H.read_csv(next(tmp_path.glob("kernels-*.csv")))
    assert {r["case"] for r in rows} == {f"corpus-256-{k}" for k in C.CORPUS_KINDS}
    assert {r["provider"] for r in rows} == set(registry.names("attention", "corpus"))
    assert len(rows) == 3 * len(registry.names("attention", "corpus")) and {r["mode"] for r in rows} == {"fwd+bwd"}
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and {r["provider"] for r in ok} >= {"sdpa-padded"}
    for r in ok:
        assert int(r["segments"]) >= 1 and float(r["rel_err"]) < 5e-2
        assert float(r["first_call_s"]) > 0 and float(r["op_ms"]) > 0 and r["kernel_timer"]
        assert float(r["floor_ms"]) == pytest.approx(float(r["floor_bytes"]) / float(r["peak_gbps"]) / 1e6, rel=1e-4)
        assert float(r["pct_floor"]) == pytest.approx(100 * float(r["floor_ms"]) / float(r["ms"]), rel=1e-3)
        assert r["sdpa_backend"] and "log-normal" in r["lengths"]
    if not torch.cuda.is_available():
        refused = [r for r in rows if r["provider"] in ("torch-varlen", "flex")]
        assert refused and all(r["status"] == "unsupported" and "CUDA" in r["error"] for r in refused)
    md = next(tmp_path.glob("kernels-*.md")).read_text()
    assert "packed corpus batches" in md and "## Packed corpus attention fwd+bwd" in md
