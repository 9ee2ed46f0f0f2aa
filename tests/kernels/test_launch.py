"""Kernel launches reach one autotuner per kernel, keyed, on every call (the GPU failure of 2026-11-22).

On an H100 each eager call of our kernels cost ~600 ms: ``torch.library.wrap_triton(kernel)[grid]``
inside a ``custom_op`` rebuilt a fresh ``Autotuner`` (empty cache, no key) on every launch whenever the
kernel had ``prune_configs_by``, and re-benchmarked every config. The interpreter uses one config and no
pruner, so interpreter tests cannot see it. This test runs in a subprocess with the interpreter OFF (the
real CUDA autotuning setup: every config, the pruner), lets CPU tensors past the device checks, stubs
``Autotuner.run`` and checks that two identical calls of the public ops reach the same module-level
autotuner objects with their keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = textwrap.dedent(
    """
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    calls = []

    def fake_run(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args), **kwargs)
        calls.append((self, tuple(named[k] for k in self.keys)))
        return None

    def fake_jit_run(self, *args, **kwargs):  # a launch that bypassed every autotuner
        calls.append((self, ("no autotuner", self.fn.__name__)))
        return None

    Autotuner.run = fake_run
    JITFunction.run = fake_jit_run

    import kernels.flash_attention as fa
    import kernels.layernorm as ln
    import kernels.packed_attention as pa
    assert not fa.interpreting()
    fa.triton_usable = ln.triton_usable = lambda t: True  # CPU tensors past the device check

    modules = {"attention": fa, "layernorm": ln, "packed_attention": pa}
    autotuners = {id(obj): f"{mod}.{name}" for mod, m in modules.items() for name, obj in vars(m).items()
                  if isinstance(obj, (Autotuner, JITFunction))}

    def attention_call():
        q, k, v = (torch.randn(2, 2, 24, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
        lengths = torch.tensor([24, 17], dtype=torch.int32)
        out = fa.attention(q, k, v, causal=True, q_lengths=lengths, k_lengths=lengths, backend="triton")
        out.backward(torch.ones_like(out))

    def packed_attention_call():  # tiles that span segments (FASTMT_ATTN_TILING=stream)
        os.environ["FASTMT_ATTN_TILING"] = "stream"
        q, k, v = (torch.randn(40, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 5, 5, 22, 40], dtype=torch.int32)
        out = fa.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=18,
                           max_seqlen_k=18, backend="triton")
        out.backward(torch.ones_like(out))

    def layer_norm_call():
        x = torch.randn(6, 48, requires_grad=True)
        r = torch.randn(6, 48, requires_grad=True)
        w, b = torch.ones(48, requires_grad=True), torch.zeros(48, requires_grad=True)
        y, s = ln.layer_norm(x, w, b, r, activation="gelu", return_residual=True, backend="triton")
        (y.sum() + s.sum()).backward()

    report = {}
    for name, call in (("attention", attention_call), ("packed attention", packed_attention_call),
                       ("layernorm", layer_norm_call)):
        rounds = []
        for _ in range(2):
            calls.clear()
            call()
            rounds.append([(autotuners.get(id(t), "NEW AUTOTUNER"), repr(key)) for t, key in calls])
        report[name] = rounds
    print(json.dumps(report))
    """
)


def test_identical_calls_reuse_module_autotuners_with_keys():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    expected = {
        "attention": {"attention._attn_fwd_kernel", "attention._attn_bwd_dkdv_kernel",
                      "attention._attn_bwd_dq_kernel"},
        "packed attention": {"packed_attention._stream_fwd_kernel", "packed_attention._stream_bwd_dq_kernel",
                             "packed_attention._stream_bwd_dkdv_kernel"},
        "layernorm": {"layernorm._ln_fwd_kernel", "layernorm._ln_bwd_kernel"},
    }
    for op, (first, second) in report.items():
        names = {name for name, _ in first}
        assert "NEW AUTOTUNER" not in names, f"{op}: a launch bypassed the module's autotuners: {first}"
        assert expected[op] <= names, f"{op}: launches reached {names}, expected {expected[op]}"
        assert first == second, f"{op}: the second identical call reached other autotuners/keys: {first} vs {second}"
        assert all(key != "()" for _, key in first), f"{op}: an autotuner ran without a key: {first}"
