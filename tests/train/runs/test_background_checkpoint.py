"""Checkpoints off the step's path, through the Trainer: the final test decodes the best weights kept in memory
(best.pt is not read back), best.pt holds the weights but no training state (a resume from it is refused in one
line, --init-from takes it), and the summary says what the loop waited and what the writer wrote."""

from __future__ import annotations

import pytest
import torch

import train.epoch_end as epoch_end
from tests.utils import records, tiny_config, tiny_trainer
from train.loop import Trainer
from train.runs.checkpoint import CheckpointMismatchError, load_checkpoint, step_checkpoints
from train.runs.report import summary_lines


def test_the_final_test_uses_the_best_weights_in_memory_and_best_pt_holds_only_them(toy_bundle, tmp_path,
                                                                                   monkeypatch):
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=2, max_batches_per_epoch=2, test_at_end=True)
    best = tr.run_dir / "checkpoints" / "best.pt"
    reads = []
    real = epoch_end.load_checkpoint
    monkeypatch.setattr(epoch_end, "load_checkpoint", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    summary = tr.fit()
    assert reads == []  # nothing read back from disk
    saved = load_checkpoint(best)
    assert saved["kind"] == "weights" and "optimizer" not in saved and "rng" not in saved
    assert all(torch.equal(v, saved["model"][k]) for k, v in tr.model.state_dict().items())  # what the test scored
    test = records(tr.run_dir, "test")[0]
    assert "from memory" in test["weights"] and test["weights"].startswith(f"best.pt (epoch {saved['position']['epoch']}")
    full = load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    assert {"optimizer", "scheduler", "rng", "history"} <= set(full)
    assert summary["checkpoint_saves"] == 2 and summary["checkpoint_write_s"] > 0
    assert 0 <= summary["checkpoint_max_s"] <= summary["checkpoint_s"]
    assert summary["checkpoint_s"] + summary["checkpoint_final_wait_s"] == pytest.approx(
        summary["time_split"]["checkpoints"], abs=1e-3)  # (+ a last wait after the split was taken: ~0)
    line = next(x for x in summary_lines(summary) if x.startswith("checkpoints:"))
    assert "2 saved" in line and "in the background" in line

    with pytest.raises(CheckpointMismatchError, match="holds only the weights.*--init-from"):
        Trainer(tiny_config(tmp_path, name="again", epochs=3, max_batches_per_epoch=2), data=toy_bundle,
                resume=str(best), log=lambda *a: None)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["t"]
