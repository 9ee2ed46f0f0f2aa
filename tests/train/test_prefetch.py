"""The step graph's copy ahead (train/graph_step.py ``StepGraph._copy_ahead``): every batch reaches the static
buffers through a staging set, on a side stream on CUDA. The CPU runs the same two copies synchronously: each
step still reads exactly its own batch, the static buffers keep their addresses (a captured graph stays valid), and
a run interrupted mid-epoch and resumed across an epoch end loses or repeats no batch."""

from __future__ import annotations

import pytest
import torch

from tests.utils import RecordingTrainer, first_batches, tiny_trainer
from train import graph_step
from train.graph_step import FIELDS

PACKED = dict(model={"layout": "packed", "dropout": 0.0}, data={"batching": "packed"})


def _trainer(bundle, tmp, **changes):
    data = {**PACKED["data"], "cache_dir": bundle.cfg.cache_dir, **changes.pop("data", {})}
    return tiny_trainer(bundle, tmp, model=PACKED["model"], data=data, **changes)


@pytest.fixture
def prefetching(monkeypatch):
    """Every StepGraph built with ``prefetch=True`` (on the CPU its default is off: nothing to overlap)."""
    init = graph_step.StepGraph.__init__

    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "prefetch": True})

    monkeypatch.setattr(graph_step.StepGraph, "__init__", forced)


@pytest.mark.parametrize("k", [1, 2])
def test_each_step_reads_its_own_batch_through_stable_buffers(toy_bundle, tmp_path, prefetching, k):
    eager = _trainer(toy_bundle, tmp_path / "eager", optim={"accum_steps": k})
    batches = first_batches(eager, 4 * k)
    want = [float(eager.train_step(batches[i:i + k])) for i in range(0, 4 * k, k)]
    eager.close()
    tr = _trainer(toy_bundle, tmp_path / "graph", step_graph=True, optim={"accum_steps": k})
    addresses, got = set(), []
    for i in range(0, 4 * k, k):
        got.append(float(tr.train_step(batches[i:i + k])))
        sg = tr.step_graph
        assert sg.prefetch and len(sg._buffers) == 1
        (bufs,) = sg._buffers.values()
        last = batches[i + k - 1]  # the static buffers hold the step's last micro-batch, field by field
        for f in FIELDS:
            assert torch.equal(bufs[f], getattr(last, f)), f
        assert float(bufs["meta"][0]) == sum(b.num_target_tokens for b in batches[i:i + k])
        addresses.add(tuple(bufs[f].data_ptr() for f in FIELDS) + (bufs["meta"].data_ptr(),))
    assert len(addresses) == 1  # one set of static addresses for every step
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    tr.close()


@pytest.mark.parametrize("k", [1, 2])
def test_interrupted_and_resumed_run_loses_or_repeats_no_batch(toy_bundle, tmp_path, prefetching, k):
    """Stopped after 4 of 6 steps (3 an epoch: past the epoch end; with accumulation, 6 micro-batches an epoch),
    resumed with ``--resume auto``: the losses are the uninterrupted run's (the same run without prefetching),
    step for step."""
    kw = dict(epochs=2, max_batches_per_epoch=3 * k, step_graph=True, cls=RecordingTrainer,
              optim={"accum_steps": k})
    full = _trainer(toy_bundle, tmp_path / "full", **kw)
    with pytest.MonkeyPatch.context() as mp:  # the reference: the direct copy
        mp.setattr(graph_step.StepGraph, "__init__", _init_without_prefetch)
        full.fit()
    assert len(full.losses) == 6
    first = _trainer(toy_bundle, tmp_path / "cut", **kw)
    assert first.fit(stop_after=4)["stop_reason"] == "interrupted"
    assert first.step_graph.prefetch and first.losses == full.losses[:4]
    resumed = _trainer(toy_bundle, tmp_path / "cut", resume="auto", **kw)
    assert (resumed.epoch, resumed.step) == (1, 4)
    resumed.fit()
    assert resumed.losses == full.losses[4:]


_ORIGINAL_INIT = graph_step.StepGraph.__init__


def _init_without_prefetch(self, *args, **kwargs):
    _ORIGINAL_INIT(self, *args, **{**kwargs, "prefetch": False})
