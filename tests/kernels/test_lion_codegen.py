"""Hopper codegen of the fused Lion step, checked on a CPU machine (no GPU needed).

Compiles ``_lion_step_kernel`` for sm_90a (shared/ENV.md recipe) as the training loop launches it
(tensor lr, found_inf flag, fp32 param/exp_avg, bf16 or fp32 grads) and checks the PTX: target
sm_90a; every thread moves its elements in 16-byte vectors (param, exp_avg and grad loads, param and
exp_avg stores); exactly the two explicit multiply-adds per element (the launch options turn fp
fusion off: no other contraction changes PyTorch's roundings); and, with Triton's bundled ptxas, no register spills.
Compilation runs in a subprocess without TRITON_INTERPRET (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import json, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton import knobs
import kernels.lion as kl

fn = kl._lion_step_kernel
grad = sys.argv[1]
ptrs = dict(P_ptr="fp32", G_ptr=grad, M_ptr="fp32", LR_ptr="fp32", FoundInf_ptr="fp32")
constexprs = dict(LR_IS_TENSOR=True, HAS_FOUND_INF=True, BLOCK=kl.BLOCK)
signature, attrs = {}, {}
for i, name in enumerate(fn.arg_names):
    signature[name] = ("*" + ptrs[name] if name in ptrs else "constexpr" if name in constexprs
                       else "i32" if name == "n" else "fp32")
    if name in ("P_ptr", "G_ptr", "M_ptr", "n"):  # what the launcher sees for a flat buffer of 16k elements
        attrs[(i,)] = [["tt.divisibility", 16]]
src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(kl.LAUNCH_OPTIONS))  # as launched
ptx = k.asm["ptx"]
facts = {
    "target": re.findall(r"^\.target (\S+)", ptx, re.M),
    "ld_v4": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
    "st_v4": len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
    "st_other": len(re.findall(r"st\.global(?!(?:\.\w+)*\.v4)", ptx)),
    "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)),
    "per_thread": kl.BLOCK // (32 * kl.NUM_WARPS),
}
try:
    with open("/tmp/_fastmt_lion_%s.ptx" % grad, "w") as f:
        f.write(ptx)
    out = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"],
                         capture_output=True, text=True, timeout=600)
    spill = re.findall(r"(\d+) bytes spill (?:stores|loads)", out.stdout + out.stderr)
    facts["spill_bytes"] = sum(map(int, spill)) if spill else None
except (OSError, subprocess.SubprocessError):
    facts["spill_bytes"] = None
print("FACTS" + json.dumps(facts))
'''


@pytest.mark.parametrize("grad", ["bf16", "fp32"])
def test_sm90a_codegen_vector_loads_and_pytorch_roundings(grad):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, grad], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    f = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("FACTS"))[len("FACTS"):])
    print(grad, f)
    assert f["target"] == ["sm_90a"]
    vectors = f["per_thread"] * 4 // 16  # 16-byte vectors per fp32 stream per thread
    grad_vectors = f["per_thread"] * (2 if grad == "bf16" else 4) // 16
    assert f["ld_v4"] >= 2 * vectors + grad_vectors, f  # param, exp_avg, grad
    assert f["st_v4"] == 2 * vectors and f["st_other"] == 0, f  # param and exp_avg, nothing else
    assert f["fma"] == 2 * f["per_thread"], f  # the two explicit tl.fma per element, no contraction
    if f["spill_bytes"] is not None:
        assert f["spill_bytes"] == 0, f
