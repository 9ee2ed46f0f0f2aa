"""The flash-attention kernels (per-sequence and stream-tiled) compile for Hopper (sm_90a) on a CPU
machine, with the H100 configs for head dim 64 / bf16: tensor-core ``wgmma`` for the ``tl.dot``
tiles, 16-byte global loads,
shared memory within the 227 KB an sm_90 block may use, and (when Triton's bundled ptxas is there)
no register spills.

The compile runs in a subprocess with ``TRITON_INTERPRET=0``: under the interpreter ``@triton.jit``
gives interpreted functions, which cannot be lowered. Run this file directly to print the facts:
``python tests/kernels/test_attention_codegen.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

# ~25-40 s of compiling on the 2-core CPU machines: kept in CI, the one check that the Hopper
# tensor-core path (wgmma) is taken, with no spills, before any GPU time is spent

SM90_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may opt into on H100/H200


def _compile_facts() -> dict:
    """Compile each kernel with its first (H100 hd-64) config; return codegen facts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.packed_attention as pa
    import kernels.sequence_attention as sa

    def signature(fn, constexprs):
        sig = {}
        for name in fn.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.startswith(("SEQ_", "CU_", "SEG_")) and name.endswith("_ptr"):
                sig[name] = "*i32"
            elif name.startswith(("LSE", "DELTA")):
                sig[name] = "*fp32"
            elif name.endswith("_ptr"):
                sig[name] = "*bf16"
            elif name in ("qk_scale", "sm_scale"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
        return sig

    ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
    facts = {}
    kernels = (("fwd", sa._sequence_attention_fwd_kernel, sa.FWD_CONFIGS[0]),
               ("bwd_dkdv", sa._sequence_attention_bwd_dkdv_kernel, sa.BWD_KV_CONFIGS[0]),
               ("bwd_dq", sa._sequence_attention_bwd_dq_kernel, sa.BWD_Q_CONFIGS[0]),
               ("stream_fwd", pa._stream_attention_fwd_kernel, pa.STREAM_FWD_CONFIGS[0]),
               ("stream_bwd_dq", pa._stream_attention_bwd_dq_kernel, pa.STREAM_BWD_Q_CONFIGS[0]),
               ("stream_bwd_dkdv", pa._stream_attention_bwd_dkdv_kernel, pa.STREAM_BWD_KV_CONFIGS[0]))
    for name, autotuned, (block_m, block_n, warps, stages) in kernels:
        fn = autotuned.fn  # the JITFunction under the autotuner
        constexprs = dict(HEAD_DIM=64, CAUSAL=True, FP32_DOT=False, BLOCK_M=block_m, BLOCK_N=block_n)
        if "VARLEN" in fn.arg_names:
            constexprs["VARLEN"] = True
        sig = signature(fn, constexprs)
        # what a launch on torch allocations specialises: 16-byte aligned pointers, strides % 16 == 0 (D = 64)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n.startswith("stride_")}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        ptx = compiled.asm["ptx"]
        entry = dict(config=[block_m, block_n, warps, stages], sm90a=".target sm_90a" in ptx,
                     wgmma=ptx.count("wgmma.mma_async"), shared=compiled.metadata.shared,
                     vector_loads=ptx.count("ld.global.v4") + ptx.count("cp.async.cg.shared.global"),
                     registers=None, spill_bytes=None)
        if os.path.exists(ptxas):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"{name}.ptx")
                with open(path, "w") as f:
                    f.write(ptx)
                log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", path + ".cubin"],
                                     capture_output=True, text=True).stderr
            for line in log.splitlines():
                if "Used" in line and "registers" in line:
                    entry["registers"] = int(line.split("Used")[1].split("registers")[0])
                if "spill stores" in line:
                    entry["spill_bytes"] = int(line.split("bytes spill stores")[0].split(",")[-1])
        facts[name] = entry
    return facts


@pytest.fixture(scope="module")
def facts():
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq", "stream_fwd", "stream_bwd_dq", "stream_bwd_dkdv"])
def test_sm90a_codegen(facts, kernel):
    f = facts[kernel]
    assert f["sm90a"], f
    assert f["wgmma"] > 0, f"{kernel}: tl.dot tiles did not lower to wgmma: {f}"
    assert 0 < f["shared"] <= SM90_SHARED_LIMIT, f
    assert f["vector_loads"] > 0, f"{kernel}: no 16-byte global loads: {f}"
    if f["spill_bytes"] is not None:
        assert f["spill_bytes"] == 0, f"{kernel}: register spills with config {f['config']}: {f}"


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    print(json.dumps(_compile_facts()))
