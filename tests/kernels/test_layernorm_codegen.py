"""Hopper codegen of the LayerNorm kernels, checked on a CPU machine (no GPU needed).

Compiles ``_layer_norm_fwd_kernel`` and ``_layer_norm_bwd_kernel`` for sm_90a (shared/ENV.md recipe)
with every tile the autotuner may choose for the benchmark shape (width 512, bf16, residual + GELU +
bias), then checks the PTX: target sm_90a, 16-byte vector loads and stores of the bf16 rows, shared
memory within an H100 block, and (with Triton's bundled ptxas) no register spills.

Compilation runs in a subprocess without TRITON_INTERPRET: under the interpreter ``triton.jit``
returns interpreted functions that cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H100_MAX_SHARED = 227 * 1024  # opt-in shared memory per block on sm_90

_SCRIPT = r'''
import json, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton import knobs
import kernels.layernorm as ln

N, DT = 512, "bf16"
POINTERS = {  # kernel -> {pointer arg: element type}
    "fwd": dict(X_ptr=DT, R_ptr=DT, W_ptr=DT, B_ptr=DT, Y_ptr=DT, S_ptr=DT, Stats_ptr="fp32"),
    "bwd": dict(DY_ptr=DT, DS_ptr=DT, S_ptr=DT, W_ptr=DT, B_ptr=DT, Stats_ptr="fp32", DX_ptr=DT,
                Partial_ptr="fp32"),
}
FLAGS = {"fwd": dict(HAS_RESIDUAL=True, HAS_BIAS=True, ACTIVATION=1),
         "bwd": dict(HAS_DS=True, HAS_BIAS=True, ACTIVATION=1)}
KERNELS = {"fwd": ln._layer_norm_fwd_kernel, "bwd": ln._layer_norm_bwd_kernel}


def compile_one(which, config):
    fn = KERNELS[which].fn  # the JITFunction under the Autotuner
    ptrs = POINTERS[which]
    constexprs = {**FLAGS[which], "BLOCK_N": triton.next_power_of_2(N), **config.kwargs}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            signature[name] = "*" + ptrs[name]
        elif name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
        # What the launcher's specialisation sees at width 512: 16-byte aligned pointers and strides.
        if name in ptrs or name.startswith("stride_") or name == "N":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
    ptx = k.asm["ptx"]
    facts = {
        "which": which, "rows": config.kwargs["ROWS"], "num_warps": config.num_warps,
        "target": re.findall(r"^\.target (\S+)", ptx, re.M),
        "shared": k.metadata.shared,
        "ld": sorted(set(re.findall(r"ld\.global(?:\.\w+)*", ptx))),
        "st": sorted(set(re.findall(r"st\.global(?:\.\w+)*", ptx))),
        "ld_v4": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
        "st_v4": len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
        "div_full": len(re.findall(r"\bdiv\.full\.f32", ptx)),  # the GPU's approximate fp32 division
        "div_rn": len(re.findall(r"\bdiv\.rn\.f32", ptx)),  # IEEE division
    }
    ptxas = knobs.nvidia.ptxas.path
    try:
        with open("/tmp/_fastmt_ln_%s.ptx" % which, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, timeout=600)
        info = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.findall(r"(\d+) bytes spill (?:stores|loads)", info)
        facts["registers"] = int(regs.group(1)) if regs else None
        facts["spill_bytes"] = sum(map(int, spill)) if spill else None
    except (OSError, subprocess.SubprocessError):
        facts["registers"] = facts["spill_bytes"] = None
    return facts


result = {}
for which in ("fwd", "bwd"):
    tuner = KERNELS[which]
    configs = tuner.early_config_prune(tuner.configs, {"N": N})
    if sys.argv[1] == "heaviest":  # most elements per thread: the register-pressure worst case
        configs = [max(configs, key=lambda c: (c.kwargs["ROWS"] / c.num_warps, c.kwargs["ROWS"]))]
    result[which] = [compile_one(which, c) for c in configs]
print("FACTS" + json.dumps(result))
'''


def compile_facts(tiles: str) -> dict:
    """{"fwd"|"bwd": [facts per tile]} for tiles "heaviest" (one per kernel) or "all" (every pruned tile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, tiles], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("FACTS"))
    facts = json.loads(line[len("FACTS"):])
    for which, rows in facts.items():  # shown with -s / on failure: the numbers the report quotes
        for f in rows:
            print(which, {k: v for k, v in f.items() if k not in ("ld", "st")}, f["ld"], f["st"])
    return facts


def check_tile(f):
    tile = f"ROWS={f['rows']} num_warps={f['num_warps']}"
    assert f["target"] == ["sm_90a"], tile
    # bf16 rows move in 16-byte vectors (8 elements per thread per access).
    assert f["ld_v4"] > 0 and any(".v4." in op for op in f["ld"]), (tile, f["ld"])
    assert f["st_v4"] > 0, (tile, f["st"])
    assert 0 <= f["shared"] <= H100_MAX_SHARED, (tile, f["shared"])
    # Row means (mean, var; the backward's mean(g), mean(g x_hat)) divide by N with IEEE division: Triton's
    # fp32 `/` is div.full.f32 on the GPU (2 ulp). (It was suspected of the one-column dx error on the H200,
    # 2026-11-27; the error persists with div_rn, so the cause is elsewhere and still open.)
    # The only approximate division left is the forward's rstd = 1 / sqrt(var + eps).
    assert f["div_rn"] > 0, (tile, f["div_rn"])
    if f["which"] == "bwd":
        assert f["div_full"] == 0, (tile, f["div_full"])
    if f["registers"] is not None:
        assert f["registers"] <= 255 and f["spill_bytes"] == 0, (tile, f["registers"], f["spill_bytes"])


def test_sm90a_codegen_width512_bf16_heaviest_tiles():
    facts = compile_facts("heaviest")
    for which in ("fwd", "bwd"):
        assert len(facts[which]) == 1, which
        check_tile(facts[which][0])


@pytest.mark.slow  # ~35 s on a cold Triton cache (two CPU cores)
def test_sm90a_codegen_width512_bf16_all_tiles():
    facts = compile_facts("all")
    for which in ("fwd", "bwd"):
        assert facts[which], f"the pruner kept no {which} tile for width 512"
        for f in facts[which]:
            check_tile(f)
