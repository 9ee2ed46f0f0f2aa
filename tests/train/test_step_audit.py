"""The static-buffer training step (train/graph_step.py) and the step audit (bench/step.py) on the CPU.

The CUDA capture itself cannot run here; what it captures can: the same function run eagerly must be pure (no
host read, no Python float from a tensor, every state in tensors), give the eager step's results, and compile with
``fullgraph=True``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.utils import SyncCounter, first_batches, tiny_trainer

ROOT = Path(__file__).resolve().parents[2]
PACKED = dict(model={"layout": "packed", "dropout": 0.0}, data={"batching": "packed"})


def _trainer(bundle, tmp, **changes):
    data = {**PACKED["data"], "cache_dir": bundle.cfg.cache_dir, **changes.pop("data", {})}
    return tiny_trainer(bundle, tmp, model={**PACKED["model"], **changes.pop("model", {})}, data=data, **changes)


class _NoHostRead(TorchDispatchMode):
    """Fails on an aten op that hands a value to the host (``.item()``, ``bool(t)``, ``nonzero``...)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "masked_select", "_unique2"):
            raise AssertionError(f"host read in the step: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optim", ["adamw", "lion"])
def test_static_step_matches_the_eager_step(toy_bundle, tmp_path, optim):
    """Three steps (clipping on, a schedule that moves the lr) through the static buffers give the eager step's
    losses and weights, and leave the optimizer state in the fused AdamW's layout (step a device tensor)."""
    got = {}
    for on in (False, True):
        tr = _trainer(toy_bundle, tmp_path / str(on), step_graph=on, optim={"name": optim, "grad_clip": 0.5})
        assert tr.step_plan.on is on and not tr.step_plan.capture
        losses = [float(tr.train_step(b)) for b in first_batches(tr, 3)]
        got[on] = (losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
                   [g["lr"] for g in tr.optimizer.param_groups])
        if on and optim == "adamw":
            st = tr.optimizer.state[tr.flat.flat[0]]
            assert st["step"].dtype == torch.float32 and float(st["step"]) == 3.0
        tr.close()
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-6)
    assert got[True][2] == got[False][2]  # the schedule stepped the same
    for k, v in got[False][1].items():
        torch.testing.assert_close(got[True][1][k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_static_step_is_pure_and_skips_a_nonfinite_step_on_the_device(toy_bundle, tmp_path, monkeypatch):
    """The captured function reads nothing on the host (a dispatch mode fails on ``_local_scalar_dense``, Python's
    read-backs are counted), and a NaN loss skips the update: weights, moments and step unchanged, counted.
    Eager CPU attention checks its index tensors' values on purpose (never on CUDA nor compiled): off here, as there."""
    import kernels.flash_attention as fa

    monkeypatch.setattr(fa, "_inspectable", lambda index: False)
    tr = _trainer(toy_bundle, tmp_path, step_graph=True)
    b1, b2 = first_batches(tr, 2)
    tr.train_step(b1)  # builds the StepGraph and its buffers
    with SyncCounter() as sync, _NoHostRead():
        tr.train_step(b2)
    assert sync.host_reads() == 0, sync.events
    sg = tr.step_graph
    with torch.no_grad():
        tr.model.src_embed.weight[0].fill_(float("nan"))  # every loss is NaN
    before = [f.detach().clone() for f in tr.flat.flat]
    st = tr.optimizer.state[tr.flat.flat[0]]
    m_before, step_before = st["exp_avg"].clone(), st["step"].clone()
    with _NoHostRead():
        bufs = sg.stage(b1)
        sg._step(bufs)
    for f, b in zip(tr.flat.flat, before):
        torch.testing.assert_close(f.detach(), b, equal_nan=True)
    torch.testing.assert_close(st["exp_avg"], m_before)
    assert float(st["step"]) == float(step_before) and int(tr.counters.skipped) == 1
    tr.close()


@pytest.mark.parametrize("optim, k", [("adamw", 2), ("lion", 3)])
def test_accumulated_static_step_matches_the_eager_step(toy_bundle, tmp_path, optim, k):
    """Gradient accumulation through the static buffers (k forward-backward calls adding into the flat gradients,
    then one update that zeroes them) gives the eager accumulated step's losses, weights and moments, step after
    step (micro-batches of different token counts: each divided by the whole step's count)."""
    got = {}
    for on in (False, True):
        tr = _trainer(toy_bundle, tmp_path / str(on), step_graph=on,
                      optim={"name": optim, "grad_clip": 0.5, "accum_steps": k})
        assert tr.step_plan.on is on
        batches = first_batches(tr, 3 * k)
        assert len({b.num_target_tokens for b in batches}) > 1  # the division by the step's count is exercised
        losses = [float(tr.train_step(batches[i:i + k])) for i in range(0, 3 * k, k)]
        state = tr.optimizer.state[tr.flat.flat[0]]
        got[on] = (losses, {n: v.detach().clone() for n, v in tr.model.state_dict().items()},
                   state["exp_avg"].clone())
        if on:
            assert tr.step_graph.graphs_per_step() == 0  # CPU: nothing captured
            assert all(float(f.grad.abs().sum()) == 0 for f in tr.flat.flat)  # the sums zeroed for the next step
        tr.close()
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[True][2], got[False][2], rtol=1e-4, atol=1e-6)
    for n, v in got[False][1].items():
        torch.testing.assert_close(got[True][1][n], v, rtol=1e-4, atol=1e-5, msg=n)


def test_accumulated_static_step_with_a_short_group_matches_the_eager_step(toy_bundle, tmp_path):
    """An epoch's last step may hold fewer micro-batches than accum_steps (even one): groups of 2, 1, 2 give the
    eager step's losses and weights (a one-batch step must not leave its gradients in the sums the next adds to)."""
    got = {}
    for on in (False, True):
        tr = _trainer(toy_bundle, tmp_path / str(on), step_graph=on, optim={"accum_steps": 2, "grad_clip": 0.5})
        b = first_batches(tr, 5)
        losses = [float(tr.train_step(g)) for g in (b[0:2], b[2:3], b[3:5])]
        got[on] = (losses, {n: v.detach().clone() for n, v in tr.model.state_dict().items()})
        tr.close()
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-6)
    for n, v in got[False][1].items():
        torch.testing.assert_close(got[True][1][n], v, rtol=1e-4, atol=1e-5, msg=n)


def test_accumulated_static_step_skips_a_step_with_a_nonfinite_micro_batch(toy_bundle, tmp_path, monkeypatch):
    """One non-finite micro-batch of k skips the whole update on the device (no host read), counts one skip, and
    the next step starts from clean sums: it equals a step from the same weights on a fresh trainer."""
    import kernels.flash_attention as fa

    monkeypatch.setattr(fa, "_inspectable", lambda index: False)
    tr = _trainer(toy_bundle, tmp_path, step_graph=True, optim={"accum_steps": 2})
    b1, b2, b3, b4 = first_batches(tr, 4)
    tr.train_step([b1, b2])
    sg = tr.step_graph
    weights = [f.detach().clone() for f in tr.flat.flat]
    real = sg._forward_backward
    calls = []

    def poisoned(bufs):  # the second micro-batch's loss and gradients are NaN
        loss, grads = real(bufs)
        calls.append(1)
        return (loss * float("nan"), tuple(g * float("nan") for g in grads)) if len(calls) == 2 else (loss, grads)

    monkeypatch.setattr(sg, "_forward_backward", poisoned)
    with SyncCounter() as sync, _NoHostRead():
        loss = sg([b3, b4])
    assert sync.host_reads() == 0, sync.events
    assert not torch.isfinite(loss) and int(tr.counters.skipped) == 1
    for f, w in zip(tr.flat.flat, weights):
        torch.testing.assert_close(f.detach(), w)
    assert all(bool(torch.isfinite(f.grad).all()) and float(f.grad.abs().sum()) == 0 for f in tr.flat.flat)
    monkeypatch.setattr(sg, "_forward_backward", real)
    assert torch.isfinite(sg([b3, b4]))
    tr.close()


def test_update_and_forward_compile_fullgraph(toy_bundle, tmp_path):
    """With compile on, the step is 3 regions: the whole model + loss (scope "model", fullgraph: no break), its
    backward, and the update (``torch.compile(fullgraph=True)``: a break would raise)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tr = _trainer(toy_bundle, tmp_path, step_graph=True, compile=True, compile_backend="aot_eager",
                  compile_scope="model")
    for b in first_batches(tr, 3):
        tr.train_step(b)
    tr.close()
    assert sum(counters["graph_break"].values()) == 0
    assert int(counters["stats"]["unique_graphs"]) == 2  # the model + loss, and the update
    torch._dynamo.reset()


def test_model_forward_traces_fullgraph(toy_bundle, tmp_path):
    """The packed model's forward (embeddings, segment ids, both stacks, final norms) is one graph."""
    tr = _trainer(toy_bundle, tmp_path)
    (b,) = first_batches(tr, 1)
    torch._dynamo.reset()
    fn = torch.compile(tr.model, fullgraph=True, backend="eager")
    ref = tr.model(**b.model_inputs())
    torch.testing.assert_close(fn(**b.model_inputs()), ref)
    tr.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("change, why", [
    (dict(precision="fp16"), "fp16"),
    (dict(data={"batching": "token_bucket"}), "batching='token_bucket'"),
    (dict(optim={"name": "adam"}), "optim.name='adam'"),
])
def test_plan_falls_back_with_the_reason(tmp_path, change, why):
    from tests.utils import tiny_config
    from train.graph_step import plan_step_graph

    model = PACKED["model"] if "data" not in change else {"layout": "padded"}
    cfg = tiny_config(tmp_path, model=model, **{"step_graph": True, **change,
                                                 "data": {**PACKED["data"], **change.get("data", {})}})
    plan = plan_step_graph(cfg, "cuda", distributed=False)
    assert not plan.on and why in plan.reason and plan.reason.count("\n") == 0
    assert not plan_step_graph(cfg, "cuda", distributed=True).on
    default = tiny_config(tmp_path, model=PACKED["model"], data=PACKED["data"])
    assert plan_step_graph(default, "cuda", distributed=False).capture  # None: on for CUDA
    assert not plan_step_graph(default, "cpu", distributed=False).on  # ... off on the CPU


def test_audit_json(tmp_path):
    """``python -m bench.step --json`` at a small size: the structure it reports is the issue's (CPU)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "bench.step", "--json", "--steps", "3", "--warmup", "2",
                          "--backend", "aot_eager", "--size", "toy"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["device"] == "cpu" and rec["graphs_per_step"] == 0
    assert rec["regions_per_step"] <= 3 and rec["eager_ops_per_step"] <= 10
    assert rec["host_syncs_per_step"] == 0
    assert rec["flops_per_step"] > 0 and rec["step_ms"] > 0 and rec["tokens_per_s"] > 0
