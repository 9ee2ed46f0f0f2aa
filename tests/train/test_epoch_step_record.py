"""The epoch record carries the step's numbers packet 1 reads (issue 42): wall ms per optimizer step, the training
thread's CPU ms per step, and the CUDA graphs a step replays (0 here: the CPU captures none)."""

from __future__ import annotations

import json

import pytest

from tests.utils import tiny_trainer


def test_every_epoch_record_says_its_step_ms_host_ms_and_graphs(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=2, max_batches_per_epoch=3, max_sentences=4)
    tr.fit()
    records = [json.loads(line) for line in (tr.run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    assert epochs
    steps_before = 0
    for r in epochs:
        steps = r["step"] - steps_before
        steps_before = r["step"]
        assert r["step_ms"] == pytest.approx(1000 * r["epoch_seconds"] / steps)
        assert 0 < r["host_ms_per_step"]  # the thread did work in every step...
        assert r["graphs_per_step"] == 0  # ...and replayed no CUDA graph (none on the CPU)
