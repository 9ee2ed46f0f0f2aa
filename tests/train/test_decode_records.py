"""CUDA-graph decoding in a training run, on CPU stand-ins for torch.cuda's graph API
(tests/models/test_decoding.py ``fake_cuda_graphs``): every decode bucket is captured once per process (the
first evaluation captures, the next ones replay), and a decoder that falls back to eager decoding says so
in the epoch records (count and reason, in that evaluation and every later one) and in the run's summary."""

from __future__ import annotations

import pytest

from tests.models.test_decoding import fake_cuda_graphs  # noqa: F401 - the fixture
from tests.utils import records, tiny_trainer
from train.evaluation import scores as evaluate


@pytest.fixture
def graphs_on_cpu(monkeypatch, fake_cuda_graphs):  # noqa: F811 - the imported fixture
    """Evaluation decodes as on a GPU: fixed shapes and CUDA graphs (the stand-ins), whatever the device."""
    real = evaluate.bleu_chrf

    def as_on_cuda(*args, **kwargs):
        return real(*args, **{**kwargs, "fixed_shapes": True, "cuda_graph": True})

    monkeypatch.setattr(evaluate, "bleu_chrf", as_on_cuda)
    return fake_cuda_graphs


def _fit(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=3, max_batches_per_epoch=2, test_at_end=True)
    summary = tr.fit()
    return summary, records(tr.run_dir, "epoch")


def test_buckets_are_captured_once_per_process(toy_bundle, tmp_path, graphs_on_cpu):
    graphs_on_cpu.other_thread_allocates = True  # thread-local captures do not mind the loader's threads
    summary, epochs = _fit(toy_bundle, tmp_path)
    first, *later = epochs
    assert first["graphs_captured"] > 0 and all(r["graphs_captured"] == 0 for r in later)
    assert all(r["decode_fallbacks"] == 0 and r["capture_failures"] == 0 and r["decode_eager_reason"] is None
               for r in epochs)
    assert summary["decode_fallbacks"] == 0


def test_a_fallback_is_in_the_records_and_the_summary(toy_bundle, tmp_path, graphs_on_cpu):
    graphs_on_cpu.fail_next = 2  # the first bucket's capture fails twice: eager decoding for the rest of the run
    with pytest.warns(UserWarning, match="capture failed twice"):
        summary, epochs = _fit(toy_bundle, tmp_path)
    first, *later = epochs
    assert (first["capture_failures"], first["decode_fallbacks"], first["graphs_captured"]) == (2, 1, 0)
    assert "operation not permitted when stream is capturing" in first["decode_eager_reason"]
    assert all(r["decode_fallbacks"] == 0 and r["decode_eager_reason"] == first["decode_eager_reason"]
               for r in later)
    assert summary["decode_fallbacks"] == 1
