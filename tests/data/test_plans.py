"""Each epoch's batch plan is computed once in a run, however many epochs (the schedule counts them all first)."""

import numpy as np
import pytest

import data.pipeline as P
from data import build_data
from data.batching import plan_batches
from tests.data.helpers import cfg_for, make_rows, write_jsonl


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plans")
    files = (write_jsonl(tmp / "a.jsonl", make_rows(300)),)
    return build_data(cfg_for(tmp, files, max_tokens=256), log=lambda *_: None)


@pytest.mark.parametrize("mode", ["packed", "token_bucket"])
@pytest.mark.parametrize("epochs", [3, 7])
def test_each_epoch_planned_once_as_a_run_uses_them(bundle, monkeypatch, mode, epochs):
    """The loop's order: every epoch's count first (the schedule), then per epoch its count and its loader."""
    b = P.DataBundle(bundle.cfg, bundle.tokenizer, bundle.splits, bundle.report, bundle.split_record)
    calls = []

    def counted(*args, **kw):
        calls.append(kw["epoch"])
        return plan_batches(*args, **kw)

    monkeypatch.setattr(P, "plan_batches", counted)
    counts = [b.num_batches("train", epoch=e, batching=mode) for e in range(epochs)]
    for e in range(epochs):
        assert b.num_batches("train", epoch=e, batching=mode) == counts[e]
        loader = b.loader("train", epoch=e, batching=mode)
        got = list(loader.batch_sampler)
        sp = b.splits["train"]
        want = plan_batches(sp.src_lengths, sp.tgt_lengths, b.spec(mode), seed=b.cfg.seed, epoch=e)
        assert got == [w.tolist() for w in want] and len(got) == counts[e]
        assert all(x.dtype == np.int64 for x in b.plan("train", epoch=e, batching=mode))
    # packed: a count per epoch (it follows the epoch's order), kept until its loader takes it; token buckets:
    # one count for every epoch (epoch 0's plan, which its loader then reuses)
    assert sorted(calls) == list(range(epochs))
    assert not b._ahead  # nothing kept once every epoch was loaded
