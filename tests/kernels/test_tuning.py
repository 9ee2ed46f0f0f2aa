"""Pinned autotune configs (kernels/pinned.py) and the warm compile of our kernels (kernels/tuning.py).

With the interpreter OFF (the real CUDA autotuning setup) on CPU tensors, in subprocesses: every pin is one of
its kernel's configs that the pruner keeps for the pinned key; a pinned key's first launch takes its pin without
the Autotuner (``FASTMT_AUTOTUNE=full`` tunes it); ``warm_compile``'s collection launches nothing and the pool's
compiles land in the Triton cache the launches then read (bench/aot.py's compile-only driver stands for the GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMT_AUTOTUNE")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), **env_extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PINS = """
    import json
    import kernels.layernorm as ln
    import kernels.packed_attention as pa
    import kernels.sequence_attention as sa
    from kernels.pinned import PINNED

    modules = (ln, pa, sa)
    bad, count = [], 0
    for arch, table in PINNED.items():
        for name, keys in table.items():
            kernel = next(getattr(m, name) for m in modules if hasattr(m, name))
            for key, pin in keys.items():
                count += 1
                fields = key.split(",")
                if name.startswith("_layer_norm"):
                    kept = kernel.early_config_prune(kernel.configs, {"N": int(fields[0])})
                else:
                    kept = kernel.early_config_prune(kernel.configs, {}, HEAD_DIM=int(fields[0]))
                as_pin = [(c.kwargs, c.num_warps, c.num_stages) for c in kept]
                if (pin["kwargs"], pin["num_warps"], pin["num_stages"]) not in as_pin or not pin.get("source"):
                    bad.append([arch, name, key, pin])
    print(json.dumps({"bad": bad, "count": count, "archs": list(PINNED)}))
"""


def test_every_pin_is_a_config_the_pruner_keeps_for_its_key():
    report = _run(_PINS)
    assert report["archs"] == [90] and report["count"] > 0, report
    assert not report["bad"], f"pins that are not one of the kernel's pruned configs: {report['bad']}"


_FIRST_LAUNCH = """
    import json, os
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    calls = []

    def fake_tune(self, *args, **kwargs):  # "tunes" without launching: the last config wins
        calls.append(["autotuner", self.base_fn.__name__])
        self.best_config = self.configs[-1]

    def fake_launch(self, *args, grid, warmup, **kwargs):
        calls.append(["jit", self.fn.__name__, {k: v for k, v in kwargs.items() if k.isupper()},
                      kwargs.get("num_warps")])

    Autotuner.run = fake_tune
    JITFunction.run = fake_launch

    import kernels.flash_attention as fa
    import kernels.layernorm as ln
    from kernels import _utils
    from kernels.pinned import PINNED
    fa.triton_usable = ln.triton_usable = lambda t: True
    _utils._ARCH.append(90)  # as on an H100/H200

    def step():
        os.environ["FASTMT_ATTN_TILING"] = "stream"
        q, k, v = (torch.randn(1500, 1, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 700, 1500], dtype=torch.int32)  # 2 segments: key (64, True, 256, 2048, bf16)
        out = fa.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=800,
                           max_seqlen_k=800, backend="triton")
        out.backward(torch.ones_like(out))
        x = torch.randn(6, 512, dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(6, 512, requires_grad=True)  # an fp32 residual stream, fp32 parameters
        w, b = torch.ones(512, requires_grad=True), torch.zeros(512, requires_grad=True)
        y, s = ln.layer_norm(x, w, b, r, return_residual=True, backend="triton")
        (y.float().sum() + s.sum()).backward()

    report = {}
    for policy in ("1", "full"):
        os.environ["FASTMT_AUTOTUNE"] = policy
        _utils._CHOSEN.clear()
        calls.clear()
        step()
        report[policy] = list(calls)
    report["pins"] = {name: {key: [pin["kwargs"], pin["num_warps"]] for key, pin in keys.items()}
                      for name, keys in PINNED[90].items()}
    print(json.dumps(report))
"""


def test_a_pinned_key_launches_its_pin_without_tuning_and_full_tunes_it():
    report = _run(_FIRST_LAUNCH)
    kernels = {"_stream_attention_fwd_kernel": "64,True,256,2048,bfloat16",
               "_stream_attention_bwd_dq_kernel": "64,True,256,2048,bfloat16",
               "_stream_attention_bwd_dkdv_kernel": "64,True,256,2048,bfloat16",
               "_layer_norm_fwd_kernel": "512,0,bfloat16,float32,float32,float32",
               "_layer_norm_bwd_kernel": "512,0,bfloat16,float32,float32,float32,float32"}
    pinned, full = report["1"], report["full"]
    assert not [c for c in pinned if c[0] == "autotuner"], f"a pinned key was tuned: {pinned}"
    launched = {c[1]: c[2:] for c in pinned}
    for name, key in kernels.items():
        assert key in report["pins"][name], f"the probe's key {key} is not pinned for {name}: update the probe"
        (meta, warps), (pin, pin_warps) = launched[name], report["pins"][name][key]
        assert ({k: meta.get(k) for k in pin}, warps) == (pin, pin_warps), (name, launched[name], pin, pin_warps)
    assert sorted(c[1] for c in full if c[0] == "autotuner") == sorted(kernels), full


_WARM = """
    import json, os
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from bench.aot import compile_only
    from kernels import _utils, tuning
    from kernels.layernorm import layer_norm_bwd, layer_norm_fwd

    def step():  # one LayerNorm forward and backward at a width no pin covers, the first config each
        x, r = torch.randn(5, 48, dtype=torch.bfloat16), torch.randn(5, 48)
        w, b = torch.ones(48), torch.zeros(48)
        y, s, stats = layer_norm_fwd(x, w, b, r, 1e-5, "gelu")
        dx, _ = layer_norm_bwd(y, s, s, w, b, stats, "gelu")
        return y, dx

    assert tuning.warm_compile(step).wait()["kernels"] == 0  # no CUDA here: a no-op, step never called

    y = None
    with compile_only(90) as units:  # collect under the compile-only driver: nothing compiles
        def collect_step():
            global y
            y, _ = step()
        specs = tuning.collect(collect_step)
    report = {"specs": [s[1] for s in specs], "nan_y": bool(torch.isnan(y).all()), "collect_units": len(units.units)}
    if os.environ.get("POOL") == "1":
        report["summary"] = tuning.compile_in_pool(specs, 90, workers=2).wait()  # 2 spawned workers
        with compile_only(90) as units:  # the launches now: every kernel from the cache the workers filled
            step()
        report["hits"] = [u["cache_hit"] for u in units.units]
    print(json.dumps(report))
"""


def test_warm_compile_collects_without_compiling_or_launching(tmp_path):
    report = _run(_WARM, TRITON_CACHE_DIR=str(tmp_path / "triton"), FASTMT_AUTOTUNE="0", FASTMT_POISON="1")
    assert report["specs"] == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"], report
    assert report["collect_units"] == 0, report  # recorded, not compiled
    assert report["nan_y"], "the collection launched the forward (its poisoned output was written)"


@pytest.mark.slow  # ~40 s on two loaded cores: spawns two workers that import torch
def test_warm_compile_pool_fills_the_cache_the_launches_read(tmp_path):
    report = _run(_WARM, TRITON_CACHE_DIR=str(tmp_path / "triton"), FASTMT_AUTOTUNE="0", FASTMT_POISON="1", POOL="1")
    assert report["specs"] == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"], report
    assert report["summary"]["kernels"] == 2 and report["summary"]["failed"] == 0, report["summary"]
    assert report["hits"] == [True, True], report  # compiled by the pool, loaded by the launches
