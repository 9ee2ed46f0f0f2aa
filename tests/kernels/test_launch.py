"""``kernels._utils.launch``, the one launcher of every autotuned kernel, with the interpreter OFF (the
real CUDA autotuning setup: every config, the pruner) and CPU tensors let past the device checks.

- Identical calls reach one module-level autotuner per kernel, with its key (the GPU failure of
  2026-11-22: ``torch.library.wrap_triton(kernel)[grid]`` inside a ``custom_op`` rebuilt a fresh
  ``Autotuner`` (empty cache, no key) on every launch whenever the kernel had ``prune_configs_by``, and
  re-benchmarked every config; the interpreter uses one config and no pruner, so interpreter tests
  cannot see it). ``Autotuner.run`` is stubbed.
- Once an autotuner has chosen a config for a key, later launches with that key go straight to the JIT
  function with that config (no autotuner Python per call); a new key goes back to the autotuner;
  ``FASTMT_AUTOTUNE=0`` takes the first config the kernel's pruner keeps. ``Autotuner.run`` is stubbed
  to "choose" each kernel's last config and ``JITFunction.run`` to record what would launch.

The layernorm side of the second property (real pruning, ``TUNING_LOG``) is in test_layernorm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_REUSE_PROBE = textwrap.dedent(
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
    import kernels.sequence_attention as sa
    from kernels import _utils
    assert not _utils.interpreting()
    fa.triton_usable = ln.triton_usable = lambda t: True  # CPU tensors past the device check

    modules = {"sequence_attention": sa, "layernorm": ln, "packed_attention": pa}
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


_CHOSEN_PROBE = textwrap.dedent(
    """
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    calls = []

    def fake_tune(self, *args, **kwargs):  # "tunes" without launching: the last config wins
        calls.append(["autotuner", self.base_fn.__name__])
        self.best_config = self.configs[-1]

    def fake_launch(self, *args, grid, warmup, **kwargs):
        calls.append(["jit", self.fn.__name__, kwargs.get("BLOCK_M"), kwargs.get("BLOCK_N"),
                      kwargs.get("num_warps"), kwargs.get("num_stages")])

    Autotuner.run = fake_tune
    JITFunction.run = fake_launch

    import kernels.flash_attention as fa
    import kernels.packed_attention as pa
    import kernels.sequence_attention as sa
    fa.triton_usable = lambda t: True

    def config(c):
        return [c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]

    tuners = {n: getattr(pa, n) for n in ("_stream_attention_fwd_kernel", "_stream_attention_bwd_dq_kernel",
                                          "_stream_attention_bwd_dkdv_kernel")}
    tuners.update({n: getattr(sa, n) for n in ("_sequence_attention_fwd_kernel",
                                               "_sequence_attention_bwd_dkdv_kernel",
                                               "_sequence_attention_bwd_dq_kernel")})
    report = {"last": {n: config(t.configs[-1]) for n, t in tuners.items()},
              "first": {n: config(t.configs[0]) for n, t in tuners.items()}}

    def stream(causal):
        os.environ["FASTMT_ATTN_TILING"] = "stream"
        q, k, v = (torch.randn(300, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 40, 40, 170, 300], dtype=torch.int32)
        out = fa.attention(q, k, v, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130,
                           max_seqlen_k=130, backend="triton")
        out.backward(torch.ones_like(out))

    def padded(causal):
        q, k, v = (torch.randn(2, 2, 300, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = fa.attention(q, k, v, causal=causal, k_lengths=torch.tensor([300, 7], dtype=torch.int32),
                           backend="triton")
        out.backward(torch.ones_like(out))

    for name, call in (("stream", stream), ("padded", padded)):
        rounds = []
        for causal, env in ((True, "1"), (True, "1"), (False, "1"), (False, "0")):
            os.environ["FASTMT_AUTOTUNE"] = env
            calls.clear()
            call(causal)
            rounds.append(list(calls))
        report[name] = rounds
    print(json.dumps(report))
    """
)


def test_identical_calls_reuse_module_autotuners_with_keys():
    # the probe sets its own autotune policy per call: an inherited FASTMT_AUTOTUNE=0 (the GPU runbook's
    # kernel-test step sets it) made the padded kernels launch without their Autotuner and failed this test
    # on the H200 (2026-11-27)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMT_AUTOTUNE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _REUSE_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    expected = {
        "attention": {"sequence_attention._sequence_attention_fwd_kernel",
                      "sequence_attention._sequence_attention_bwd_dkdv_kernel",
                      "sequence_attention._sequence_attention_bwd_dq_kernel"},
        "packed attention": {"packed_attention._stream_attention_fwd_kernel",
                             "packed_attention._stream_attention_bwd_dq_kernel",
                             "packed_attention._stream_attention_bwd_dkdv_kernel"},
        "layernorm": {"layernorm._layer_norm_fwd_kernel", "layernorm._layer_norm_bwd_kernel"},
    }
    for op, (first, second) in report.items():
        names = {name for name, _ in first}
        assert "NEW AUTOTUNER" not in names, f"{op}: a launch bypassed the module's autotuners: {first}"
        assert expected[op] <= names, f"{op}: launches reached {names}, expected {expected[op]}"
        assert first == second, f"{op}: the second identical call reached other autotuners/keys: {first} vs {second}"
        assert all(key != "()" for _, key in first), f"{op}: an autotuner ran without a key: {first}"


def test_tuned_configs_are_reused_per_key_and_autotune_can_be_skipped():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMT_AUTOTUNE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _CHOSEN_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels = {"stream": ["_stream_attention_fwd_kernel", "_stream_attention_bwd_dq_kernel",
                          "_stream_attention_bwd_dkdv_kernel"],
               "padded": ["_sequence_attention_fwd_kernel", "_sequence_attention_bwd_dkdv_kernel",
                          "_sequence_attention_bwd_dq_kernel"]}
    for layout, names in kernels.items():
        first, again, new_key, untuned = report[layout]
        tuned = [c[1] for c in first if c[0] == "autotuner"]
        assert tuned == names, f"{layout}: the first call should reach each autotuner once: {first}"
        assert not [c for c in again if c[0] == "autotuner"], f"{layout}: a tuned key re-tuned: {again}"
        launched = {c[1]: c[2:] for c in again if c[1] in names}
        assert launched == {n: report["last"][n] for n in names}, f"{layout}: not the chosen configs: {again}"
        assert [c[1] for c in new_key if c[0] == "autotuner"] == names, f"{layout}: untuned: {new_key}"
        assert not [c for c in untuned if c[0] == "autotuner"], f"{layout}: FASTMT_AUTOTUNE=0 tuned {untuned}"
        pinned = {c[1]: c[2:] for c in untuned if c[1] in names}  # 300 rows, head dim 64: nothing pruned
        assert pinned == {n: report["first"][n] for n in names}, f"{layout}: FASTMT_AUTOTUNE=0 ran {untuned}"
