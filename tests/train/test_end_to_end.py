"""A whole tiny run on the toy corpus: loss falls, records and checkpoints exist, translate works."""

from __future__ import annotations

import io
import json

import pytest

from tests.utils import records, tiny_trainer
from train.cli.translate import main as translate_main
from train.runs.checkpoint import step_checkpoints

REQUIRED = {"epoch", "train_loss", "train_loss_last_batch", "valid_loss", "bleu", "chrf", "epoch_seconds",
            "tokens_per_second", "padding_fraction", "mfu", "peak_memory_gb", "lr"}


def test_tiny_run_end_to_end(toy_bundle, tmp_path, capsys, monkeypatch):
    trainer = tiny_trainer(toy_bundle, tmp_path, log=print, epochs=3, plot=True, tensorboard=True,
                           test_at_end=True, keep_last=2, num_samples=1)
    cfg, summary = trainer.cfg, trainer.fit()
    run = trainer.run_dir
    epochs, test = records(run, "epoch"), records(run, "test")
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    for r in epochs:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["mfu"] is None and r["tokens_per_second"] > 0 and 0 <= r["padding_fraction"] < 0.5
    # OneCycle ends at lr / div_factor / final_div_factor and never extrapolates past its plan
    assert epochs[-1]["lr"] == pytest.approx(cfg.optim.lr / cfg.optim.div_factor / cfg.optim.final_div_factor)
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] - 0.5
    assert epochs[-1]["valid_loss"] < epochs[0]["valid_loss"]
    assert 0 <= epochs[-1]["bleu"] <= 100
    assert len(test) == 1 and summary["test"]["test_bleu"] == test[0]["test_bleu"]

    prov = json.loads((run / "provenance.json").read_text())
    assert prov["config"]["run"]["epochs"] == 3 and prov["torch"] and "git_sha" in prov
    assert prov["data_split"]["sizes"]["train"] == len(toy_bundle.splits["train"])
    assert (run / "curves.png").stat().st_size > 1000
    assert any((run / "tensorboard").iterdir())
    assert len(step_checkpoints(run / "checkpoints")) == 2 and (run / "checkpoints" / "best.pt").is_file()
    out = capsys.readouterr().out
    assert "epoch 3/3: train_loss" in out and "BLEU" in out and "hyp:" in out and "provenance" in out

    assert translate_main(["--ckpt", str(run / "checkpoints" / "best.pt"), "--beam", "2", "the cat", "a dog"]) == 0
    by_args = capsys.readouterr().out.splitlines()
    assert len(by_args) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\n\na dog\n"))  # a blank line in, a blank line out
    assert translate_main(["--ckpt", str(run / "checkpoints" / "best.pt"), "--beam", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [by_args[0], "", by_args[1]]  # the same sentences, in line


def test_checkpoint_averaging_at_the_end(toy_bundle, tmp_path):
    """The last 2 epoch checkpoints are averaged and scored on validation; best.pt is the better of the two."""
    trainer = tiny_trainer(toy_bundle, tmp_path, epochs=3, max_batches_per_epoch=6, keep_last=3, average_last=2)
    trainer.fit()
    avg = records(trainer.run_dir, "average")
    assert len(avg) == 1 and len(avg[0]["checkpoints"]) == 2 and 0 <= avg[0]["bleu"] <= 100
    assert (trainer.run_dir / "checkpoints" / "best.pt").is_file()
    if avg[0]["bleu"] > avg[0]["best_single_bleu"]:
        assert (trainer.run_dir / "checkpoints" / "best-single.pt").is_file()
    with pytest.raises(ValueError, match="keep_last"):  # refused when the config is built, before any folder
        tiny_trainer(toy_bundle, tmp_path / "x", keep_last=2, average_last=3)
    assert not (tmp_path / "x").exists()
