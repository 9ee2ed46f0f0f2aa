"""The training step keeps the GPU busy by construction, checked on CPU (the H100 profile showed the GPU
idle 85 % of a step: a host sync every step, one optimizer launch per parameter).

- host syncs: every way Python reads a tensor back (``item``, ``__bool__``, ``__int__``, ``tolist``,
  ``cpu``, ...) is wrapped, and a ``TorchDispatchMode`` flags the aten ops that sync a CUDA stream
  (``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``unique``...), tests/utils.py ``SyncCounter``:
  a training step performs none of them, in every precision and layout;
- the optimizer's aten op count per step does not grow with the number of parameters.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.utils import OpCounter, SyncCounter, first_batches, tiny_trainer
from train.step import forward_backward, optimizer_step

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "fp32-adamw-padded": dict(),
    "bf16-adamw-packed": dict(precision="bf16", model={"layout": "packed"}, data={"batching": "packed"}),
    "fp16-scaler": dict(precision="fp16", model={"norm": "torch"}),
    "lion-accum2": dict(optim={"name": "lion", "lr": 1e-3, "accum_steps": 2}),
    "no-clip-no-guard": dict(optim={"grad_clip": None}, nonfinite_guard=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_never_sync_the_host(toy_bundle, tmp_path, cuda_like_kernels, case):
    tr = tiny_trainer(toy_bundle, tmp_path, **CASES[case])
    accum = tr.cfg.optim.accum_steps
    batches = first_batches(tr, 3 * accum)
    groups = [batches[i : i + accum] for i in range(0, 3 * accum, accum)]
    tr.train_step(groups[0])  # first step: lazy state (optimizer moments, scaler) is created here
    with SyncCounter() as counter:
        for g in groups[1:]:
            tr.train_step(g)
    assert tr.step == 3
    assert not counter.events, f"host syncs in a training step: {dict(counter.events)}"


def test_a_logging_step_reads_the_host_once(toy_bundle, tmp_path):
    """Every ``log_every`` steps the loop reads the loss and the device-side counters: one read-back, not one
    per value (three before)."""
    tr = tiny_trainer(toy_bundle, tmp_path)
    loss = tr.train_step(first_batches(tr, 1))
    with SyncCounter(aten=False) as counter:
        assert tr._log_step(loss, None, 0.0, 0) is None
    assert counter.host_reads() == 1, dict(counter.events)


def test_the_counter_sees_a_sync():
    """The instrument itself: the old per-step guard (``bool(isfinite(loss))``) and a boolean mask count."""
    with SyncCounter() as counter:
        x = torch.randn(8)
        bool(torch.isfinite(x).all())
        x[x > 0].sum()
        x.sum().item()
    assert counter.events["Tensor.__bool__"] == 1 and counter.events["Tensor.item"] == 1
    assert counter.events["aten.nonzero"] + counter.events["aten._local_scalar_dense"] >= 2


@pytest.mark.parametrize("name", ["adamw", "lion"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_optimizer_ops_do_not_grow_with_the_parameter_count(toy_bundle, tmp_path, name, precision):
    """One step's optimizer phase (gather grads, unscale, clip, guard, update, schedule) issues the same aten
    ops for a 2+2-layer and a 4+4-layer model: O(1) in the number of parameters (~3x more tensors here)."""
    counts, tensors = {}, {}
    for layers in (2, 4):
        tr = tiny_trainer(toy_bundle, tmp_path / f"{layers}", precision=precision,
                          model={"enc_layers": layers, "dec_layers": layers, "norm": "torch"},
                          optim={"name": name, "lr": 1e-3})
        first, b = first_batches(tr, 2)
        tr.train_step(first)  # lazy optimizer state
        tr.model.train()
        loss = torch.zeros(())
        with tr.autocast:
            s = tr.step_module(b.tgt_out, **b.model_inputs())
        tr.scaler.scale(s / b.num_target_tokens).backward()
        with OpCounter() as oc:
            optimizer_step(tr.optimizer, tr.flat, tr.scheduler, tr.scaler, tr.counters, loss.detach(),
                           grad_clip=1.0, guard=True)
        counts[layers] = oc.ops
        tensors[layers] = sum(len(p) for p in tr.flat.params)
    assert tensors[4] > 1.8 * tensors[2]
    assert counts[4] == counts[2], (sum(counts[2].values()), sum(counts[4].values()))
    assert sum(counts[2].values()) < 100  # a fixed, small number of ops per group (2 groups here)


# ----------------------------------------------------------------------------------------------
# Host work of one `fast` step (packed batches, regional compile): what runs outside compiled regions
# ----------------------------------------------------------------------------------------------
class _OutsideRegions(TorchDispatchMode):
    """Counts the aten ops dispatched while no compiled region is running (``depth`` is raised by the
    wrappers ``_host_work`` puts around the regions)."""

    depth = 0

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _OutsideRegions.depth == 0:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _region(fn, calls: list):
    def call(*args, **kwargs):
        calls.append(1)
        _OutsideRegions.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _OutsideRegions.depth -= 1

    return call


def _host_work(bundle, tmp) -> dict:
    """One warm step of the `fast` recipe at 1+1 layers (packed, bf16, blocks compiled with aot_eager):
    compiled-region calls, aten ops outside them (forward) and autograd nodes outside them (backward)."""
    torch._dynamo.reset()
    tr = tiny_trainer(bundle, tmp, precision="bf16", compile=True, compile_backend="aot_eager",
                      compile_scope="blocks", model={"layout": "packed", "enc_layers": 1, "dec_layers": 1},
                      data={"batching": "packed", "cache_dir": bundle.cfg.cache_dir})
    warm1, warm2, b = first_batches(tr, 3)
    tr.train_step(warm1)
    tr.train_step(warm2)
    calls: list = []
    for stack in (tr.model.encoder, tr.model.decoder):
        for block in stack.blocks:
            block._compiled_call_impl = _region(block._compiled_call_impl, calls)
    tr.loss_module.criterion = _region(tr.loss_module.criterion, calls)
    tr.model.train()
    with tr.autocast:
        loss_sum = tr.step_module(b.tgt_out, **b.model_inputs(static_max_len=True))
    forward_calls = len(calls)
    nodes, seen, todo = Counter(), set(), [loss_sum.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes[type(node).__name__] += 1
            todo.extend(fn for fn, _ in node.next_functions)
    # a dispatch mode changes what dynamo runs inside the regions (never counted here), so it comes last
    with _OutsideRegions() as outside, tr.autocast, torch.no_grad():
        tr.step_module(b.tgt_out, **b.model_inputs(static_max_len=True))
    tr.close()
    torch._dynamo.reset()
    return {"forward_region_calls": forward_calls, "backward_region_calls": nodes["CompiledFunctionBackward"],
            "parameters": nodes["AccumulateGrad"], "tensors": sum(len(p) for p in tr.flat.params),
            "eager_forward_ops": dict(outside.ops),
            "eager_backward_nodes": {k: v for k, v in nodes.items()
                                     if k not in ("CompiledFunctionBackward", "AccumulateGrad")}}


def _optimizer_python_lines(bundle, tmp, layers: int) -> int:
    """Lines of fastmt's own Python one warm optimizer phase executes (gather, clip, guard, update, zero)."""
    tr = tiny_trainer(bundle, tmp / str(layers), model={"enc_layers": layers, "dec_layers": layers})
    warm, b = first_batches(tr, 2)
    tr.train_step(warm)
    tr.model.train()
    loss = forward_backward(tr.step_module, [b], device=tr.device, autocast=tr.autocast, scaler=tr.scaler)
    lines = Counter()
    ours = tuple(str(ROOT / pkg) + "/" for pkg in ("train", "models", "kernels", "data"))

    def trace(frame, event, arg):
        if event == "line" and frame.f_code.co_filename.startswith(ours):
            lines[frame.f_code.co_filename] += 1
        return trace

    sys.settrace(trace)
    try:
        optimizer_step(tr.optimizer, tr.flat, tr.scheduler, tr.scaler, tr.counters, loss,
                       grad_clip=tr.cfg.optim.grad_clip, guard=True)
    finally:
        sys.settrace(None)
    tr.close()
    return sum(lines.values())


# aten ops a warm step's forward runs outside the compiled regions, on CPU: per side the embedding (table, scale,
# positions, dropout) and the stack's final norm (residual add, LayerNorm in fp32 under CPU autocast), the
# packed-stream views. No segment ids: the packed collate builds them in the data workers (src_seg / tgt_seg)
EAGER_FORWARD_OPS = {"aten.view": 5, "aten.embedding": 2, "aten.mul": 4,
                     "aten.index": 2, "aten.add": 4, "aten.empty_like": 2, "aten.bernoulli_": 2, "aten.div_": 2,
                     "aten._to_copy": 2, "aten.native_layer_norm": 2, "aten.zeros_like": 2}  # zero first residuals
# autograd nodes of those (embedding, scale, position add, dropout, final norms)
EAGER_BACKWARD_NODES = {"EmbeddingBackward0": 2, "MulBackward0": 4, "AddBackward0": 4, "ToCopyBackward0": 2,
                        "NativeLayerNormBackward0": 2, "ViewBackward0": 1}


def test_fast_step_host_work_is_pinned(toy_bundle, tmp_path):
    """What one step runs outside its compiled regions is a fixed list (stems, final norms: none of it per
    layer), and the optimizer phase runs no Python line per parameter (gather_grads / zero_grad iterate
    in C): the same lines for 1+1 and 2+2 layers (55 parameter tensors; the `fast` preset has 155)."""
    w = _host_work(toy_bundle, tmp_path / "compiled")
    assert w["forward_region_calls"] == w["backward_region_calls"] == 3  # two blocks and the loss
    assert w["parameters"] == w["tensors"] + 2  # and each stack's zero first residual (issue 43)
    assert w["eager_forward_ops"] == EAGER_FORWARD_OPS, w["eager_forward_ops"]
    assert w["eager_backward_nodes"] == EAGER_BACKWARD_NODES, w["eager_backward_nodes"]
    lines = {layers: _optimizer_python_lines(toy_bundle, tmp_path, layers) for layers in (1, 2)}
    assert lines[1] == lines[2] < 80, lines
