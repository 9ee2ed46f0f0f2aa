"""bench/aot.py: our Triton kernels compile for sm_90 on a CPU machine, one compile unit per kernel and
constexpr key whatever the sequence lengths, into a Triton cache a second process (the GPU run) hits.

The probe runs in subprocesses with the interpreter off (``@triton.jit`` must give compilable functions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import torch
from bench.aot import compile_only
from kernels.packed_attention import segment_ids, stream_attention_fwd
from kernels.sequence_attention import sequence_attention_fwd

with compile_only(90) as units:
    for T in (17, 32, 1):  # three lengths: divisible by 16, not, and 1 (each used to be its own compile)
        q = torch.empty(2, 1, T, 16, dtype=torch.bfloat16)
        lengths = torch.full((2,), T, dtype=torch.int32)
        sequence_attention_fwd(q, q, q, lengths, lengths, T, T, False, 0.25)
    for lens in ([5, 12], [16, 16], [1, 0]):
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        q = torch.empty(sum(lens), 1, 16, dtype=torch.bfloat16)
        stream_attention_fwd(q, q, q, cu, cu, segment_ids(cu, sum(lens)), False, 0.25)
print(json.dumps([(u["kernel"], u["cache_hit"]) for u in units.units]))
"""


def _probe(cache: Path) -> list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(cache), FASTMT_AUTOTUNE="0")
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_compile_per_kernel_whatever_the_lengths_and_a_cache_the_next_process_hits(tmp_path):
    cache = tmp_path / "triton"
    first = _probe(cache)
    assert sorted(first) == [["_sequence_attention_fwd_kernel", False], ["_stream_attention_fwd_kernel", False]]
    assert any(cache.rglob("*.cubin"))  # compiled for the GPU, here
    assert _probe(cache) == [[name, True] for name, _ in first]  # a second process: loaded, not compiled
