"""Configurations that used to fail late are supported end to end: no validation split, a handful of steps,
a wall-clock budget, early stopping."""

from __future__ import annotations

from tests.utils import records, tiny_trainer


def test_no_validation_split_trains_and_tests(toy_bundle, tmp_path):
    """valid_size 0 used to train a full epoch and then raise TypeError at the epoch log, losing the epoch."""
    tr = tiny_trainer(toy_bundle, tmp_path, data={"valid_size": 0}, epochs=2, max_batches_per_epoch=3,
                      test_at_end=True)
    summary = tr.fit()
    epochs = records(tr.run_dir, "epoch")
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["bleu"] is None for r in epochs)
    assert summary["stop_reason"] == "done" and summary["test"]["test_bleu"] is not None


def test_five_steps_with_onecycle(toy_bundle, tmp_path):
    """--max-steps 5 with a 20 % warm-up raised ZeroDivisionError inside OneCycle."""
    tr = tiny_trainer(toy_bundle, tmp_path, max_steps=5)
    assert tr.total_steps == 5
    assert tr.fit()["stop_reason"] == "max_steps" and tr.step == 5


def test_wall_budget_stops_at_a_step_boundary_and_evaluates(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=50, max_wall_seconds=1e-3)
    summary = tr.fit()
    epochs = records(tr.run_dir, "epoch")
    assert summary["stop_reason"] == "wall_budget" and tr.step == 1  # the budget had passed before the first step
    assert len(epochs) == 1 and epochs[0]["partial_epoch"] and epochs[0]["bleu"] is not None
    assert epochs[0]["wall_seconds"] > 0 and records(tr.run_dir)[-1]["kind"] == "done"


def test_early_stop_after_patience_evaluations(toy_bundle, tmp_path):
    """With patience 1 the run stops at the first evaluation that brings no new best BLEU."""
    tr = tiny_trainer(toy_bundle, tmp_path, optim={"lr": 1e-6}, epochs=40, max_batches_per_epoch=1, patience=1)
    summary = tr.fit()
    assert summary["stop_reason"] == "early_stop" and tr.epoch == 2
