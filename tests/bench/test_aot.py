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


_KEYS_AND_REBINDING = """
import json, sys
import torch
import kernels._utils as u
from bench import aot

original = u.triton_usable
bound = [m.__name__ for m in aot.kernel_modules() if any(v is original for v in vars(m).values())]
with aot.compile_only(90):
    inside = {m: getattr(sys.modules[m], "triton_usable")(torch.empty(1)) for m in bound}
after = [m for m in bound if getattr(sys.modules[m], "triton_usable") is not original]
print(json.dumps({"bound": bound, "inside": inside, "after": after, "keys": aot.cache_keys(90),
                  "hash": aot.kernels_sha256()}))
"""


def _aot(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *((["-c", code]) if code else []), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_compile_only_rebinds_triton_usable_in_every_module_and_restores_it():
    out = _aot(_KEYS_AND_REBINDING)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # every module that imported the name (not only _utils) sees the patch, and gets the original back
    assert {"kernels._utils", "kernels.lion", "kernels.layernorm", "kernels.flash_attention"} <= set(got["bound"])
    assert all(got["inside"].values()) and got["after"] == []


_CHECKS = """
import json
from bench import aot
here = aot.cache_keys(90)
stale = {key: aot.check({**here, key: value}, here) for key, value in (
    ("kernels_sha256", "0" * 64), ("triton_key_sha256", "x"), ("backend", "y"))}
other_commit = aot.check({**here, "git_sha": "f" * 40}, here)
print(json.dumps({"keys": here, "same": aot.check(dict(here), here), "stale": stale, "other_commit": other_commit}))
"""


def test_check_fails_on_any_difference_of_the_carried_cache(tmp_path):
    out = _aot(_CHECKS)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    import hashlib

    h = hashlib.sha256()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    assert got["keys"]["kernels_sha256"] == h.hexdigest() and got["keys"]["git_sha"]
    assert got["same"][0] == 0 and "keys match" in got["same"][1]
    # an edit of kernels/*.py, another triton build or ptxas: each named, each a failure
    for key, (status, line) in got["stale"].items():
        assert status == 1 and "KEYS DIFFER" in line and key in line, (key, line)
    # another commit with the same kernels' source: every entry is still valid (Triton's key has no commit in
    # it); the check says so and names both commits (it used to say "every kernel compiles here")
    status, line = got["other_commit"]
    assert status == 0 and "keys match" in line and "ffffffffffff" in line, line
    keys_file = tmp_path / "AOT-KEYS.json"  # the command line's exit status, as gpu_run.sh's setup runs it
    keys_file.write_text(json.dumps({**got["keys"], "kernels_sha256": "0" * 64}))
    stale = _aot("", "-m", "bench.aot", "--check", str(keys_file))
    assert stale.returncode == 1 and "kernels_sha256" in stale.stdout, stale.stdout + stale.stderr
