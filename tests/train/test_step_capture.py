"""The step graph's CUDA path (warm-up, capture, replay; accumulation's k + 1 graphs; the copy ahead's streams and
events) rehearsed on the CPU with a faithful stand-in for a CUDA graph.

``RecordedGraph`` records, during "capture", every aten op with the very tensors it read and wrote (a
``TorchDispatchMode``), then undoes the capture's writes (a real capture runs no kernel); ``replay`` runs the ops
again on those same tensors, writing each new result into the tensor recorded for it. Like a CUDA graph it keeps
addresses and every Python value baked in at capture: a learning rate passed as a float, a branch taken on the
host, a batch copied outside the static buffers or an output not copied before the next replay would make the
replayed steps differ from the eager ones, and these tests compare them step by step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.utils import first_batches, tiny_trainer
from train.graph_step import StepGraphPlan

PACKED = dict(model={"layout": "packed", "dropout": 0.0}, data={"batching": "packed"})


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's ``Tensor(a!)`` arguments, lists included)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its value before the capture)
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _written(func, args, kwargs):
            if id(t) not in self._seen:
                self._seen.add(id(t))
                self.saved.append((t, t.detach().clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """torch.cuda.CUDAGraph on the CPU (module docstring)."""

    captures = 0

    def __init__(self):
        self.ops: list = []
        self.replays = 0

    @torch.no_grad()
    def replay(self):
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old_t, new_t in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(old_t, torch.Tensor) and new_t is not old_t:
                    old_t.copy_(new_t)


class _Stream:
    def __init__(self, *device):
        self.waits = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        self.waits += 1


class _Event:
    def __init__(self):
        self.records = 0

    def record(self, stream=None):
        self.records += 1


@pytest.fixture
def cpu_cuda_graphs(monkeypatch):
    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        rec = _Recorder()
        with rec:
            yield
        with torch.no_grad():  # a capture runs no kernel: undo what recording ran, newest first
            for t, before in reversed(rec.saved):
                t.copy_(before)
        g.ops = rec.ops
        RecordedGraph.captures += 1

    step_stream = _Stream()
    for name, value in dict(Stream=_Stream, stream=lambda s: contextlib.nullcontext(),
                            current_stream=lambda *d: step_stream, CUDAGraph=RecordedGraph, graph=graph,
                            Event=_Event).items():
        monkeypatch.setattr(torch.cuda, name, value)
    RecordedGraph.captures = 0
    return step_stream


def _run(bundle, tmp, *, capture: bool, k: int, steps: int, optim: str, batches=None):
    data = {**PACKED["data"], "cache_dir": bundle.cfg.cache_dir}
    tr = tiny_trainer(bundle, tmp, model=PACKED["model"], data=data, step_graph=True,
                      optim={"name": optim, "grad_clip": 0.5, "accum_steps": k})
    if capture:  # what plan_step_graph says on CUDA
        tr.step_plan = StepGraphPlan(True, True, "step graph (rehearsal)")
    batches = batches or first_batches(tr, steps * k)
    losses = [float(tr.train_step(batches[i:i + k])) for i in range(0, steps * k, k)]
    return tr, batches, losses


@pytest.mark.parametrize("optim, k", [("adamw", 1), ("lion", 1), ("adamw", 2)])
def test_captured_steps_replay_the_eager_steps(toy_bundle, tmp_path, cpu_cuda_graphs, optim, k):
    """3 warm-up steps, one capture, then replays (OneCycle moves the lr every step, clipping on): every step's
    loss and the final weights and moments are the uncaptured step's; one graph per step (k + 1 with
    accumulation); the copy ahead waited for each batch and recorded its events."""
    steps = 7
    ref, batches, want = _run(toy_bundle, tmp_path / "ref", capture=False, k=k, steps=steps, optim=optim)
    tr, _, got = _run(toy_bundle, tmp_path / "cap", capture=True, k=k, steps=steps, optim=optim, batches=batches)
    sg = tr.step_graph
    assert sg.capture and sg.prefetch and sg.captures == (1 if k == 1 else 2) == RecordedGraph.captures
    assert sg.graphs_per_step() == (1 if k == 1 else k + 1)
    # each graph's 4th call is captured, then replayed (accumulation: the micro-batch graph's 4th is in step 2)
    assert sg.replays == (steps - 3 if k == 1 else (steps * k - 3) + (steps - 3))
    assert cpu_cuda_graphs.waits == steps * k  # the step's stream waited for each batch's copy
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, v in ref.model.state_dict().items():
        torch.testing.assert_close(tr.model.state_dict()[name], v, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(ref.flat.flat, tr.flat.flat):
        torch.testing.assert_close(ref.optimizer.state[a]["exp_avg"], tr.optimizer.state[b]["exp_avg"],
                                   rtol=1e-4, atol=1e-7)
    ref.close()
    tr.close()


def test_a_replayed_nonfinite_step_is_skipped_on_the_device(toy_bundle, tmp_path, cpu_cuda_graphs):
    """After capture, a batch whose loss is NaN (a NaN embedding row it reads) skips the update in the replay:
    weights unchanged, one skip counted; the next finite step updates again."""
    tr, batches, _ = _run(toy_bundle, tmp_path, capture=True, k=1, steps=4, optim="adamw")
    more = first_batches(tr, 6)[4:]
    with torch.no_grad():
        saved = tr.model.src_embed.weight[3].clone()
        tr.model.src_embed.weight[3].fill_(float("nan"))
    assert bool((more[0].src == 3).any())  # every source ends with EOS (id 3): the batch reads the NaN row
    before = [f.detach().clone() for f in tr.flat.flat]
    loss = tr.train_step([more[0]])
    assert not torch.isfinite(loss) and int(tr.counters.skipped) == 1 and tr.step_graph.replays_last_step == 1
    for f, b in zip(tr.flat.flat, before):
        torch.testing.assert_close(f.detach(), b, equal_nan=True)
    with torch.no_grad():
        tr.model.src_embed.weight[3].copy_(saved)
    assert torch.isfinite(tr.train_step([more[1]])) and int(tr.counters.skipped) == 1
    assert any(not torch.equal(f.detach(), b) for f, b in zip(tr.flat.flat, before))
    tr.close()
