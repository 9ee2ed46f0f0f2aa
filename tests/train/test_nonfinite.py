"""No checkpoint ever holds non-finite weights (issue 20 row 6): a learning rate that makes the weights
overflow stops the run (exit 3) instead of finishing "done" with a non-finite best.pt, and the message
names a checkpoint whose weights really are finite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.train.runs_helpers import train_argv
from tests.utils import tiny_trainer
from train.cli.train import main
from train.epoch_end import NonFiniteLossError
from train.errors import EXIT_NONFINITE
from train.runs.checkpoint import load_checkpoint

# a constant lr of 3e38: the first AdamW update (|step| ~ lr) takes the weights past float32's 3.4e38
OVERFLOW = {"lr": 3e38, "schedule": "constant"}


def _all_finite(path: Path) -> bool:
    return all(torch.isfinite(v).all() for v in load_checkpoint(path)["model"].values() if v.is_floating_point())


def _checkpoints(run_dir: Path) -> list[Path]:
    d = run_dir / "checkpoints"
    return sorted(d.glob("*.pt")) if d.is_dir() else []


def test_an_overflowing_lr_stops_without_a_non_finite_checkpoint(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, optim=OVERFLOW, epochs=2, max_batches_per_epoch=4, log_every=50)
    with pytest.raises(NonFiniteLossError, match="non-finite weights at step 4 .*nothing was saved") as e:
        tr.fit()
    assert "No checkpoint was written before" in str(e.value) and "--optim.lr" in str(e.value)
    assert _checkpoints(tr.run_dir) == []  # no best.pt, no step checkpoint
    assert not tr.run_dir.exists()  # and no empty run folder left behind


def test_the_message_names_a_checkpoint_that_is_finite(toy_bundle, tmp_path):
    """A good first epoch, then (resumed with an lr that overflows) the weights blow up: the error names
    epoch 1's checkpoint, which loads with finite weights, and no later file was written."""
    kw = dict(epochs=3, max_batches_per_epoch=4, log_every=50)
    tiny_trainer(toy_bundle, tmp_path, **kw).fit(stop_after=4)  # epoch 1 ends at step 4
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", optim=OVERFLOW, **kw)
    with pytest.raises(NonFiniteLossError) as e:
        tr.fit()
    named = Path(re.search(r"finite weights is (\S+) \(step 4\)", str(e.value)).group(1))
    assert named.name == "step-00000004.pt" and _all_finite(named)
    assert "--resume auto --run.name t --optim.lr 3e+37" in str(e.value)
    assert [p.name for p in _checkpoints(tr.run_dir)] == ["best.pt", "step-00000004.pt"]
    assert all(_all_finite(p) for p in _checkpoints(tr.run_dir))


def test_the_command_exits_3_with_one_line(toy_bundle, tmp_path, capsys):
    argv = train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--optim.lr", "3e38", "--optim.schedule", "constant",
                      "--epochs", "2", "--run.max_batches_per_epoch", "3", "--run.log_every", "50")
    assert main(argv) == EXIT_NONFINITE
    err = capsys.readouterr().err
    assert err.startswith("error: non-finite weights") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs" / "t").exists()
