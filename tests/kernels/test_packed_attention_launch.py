"""``packed_attention.launch``: once an autotuner has chosen a config for a key, later launches with that
key go straight to the JIT function with that config (no autotuner Python per call); a new key goes
back to the autotuner; ``FASTMT_AUTOTUNE=0`` takes the first config the kernel's pruner keeps.

Runs in a subprocess with the interpreter OFF (the CUDA autotuning setup: every config, the pruner),
with CPU tensors let past the device check, ``Autotuner.run`` stubbed to "choose" each kernel's last
config and ``JITFunction.run`` stubbed to record what would launch.
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
    fa.triton_usable = lambda t: True

    def config(c):
        return [c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]

    tuners = {n: getattr(pa, n) for n in ("_stream_fwd_kernel", "_stream_bwd_dq_kernel",
                                          "_stream_bwd_dkdv_kernel")}
    tuners.update({n: getattr(fa, n) for n in ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel",
                                               "_attn_bwd_dq_kernel")})
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


def test_tuned_configs_are_reused_per_key_and_autotune_can_be_skipped():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTMT_AUTOTUNE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels = {"stream": ["_stream_fwd_kernel", "_stream_bwd_dq_kernel", "_stream_bwd_dkdv_kernel"],
               "padded": ["_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"]}
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
