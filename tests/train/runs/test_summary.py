"""A summary a person reads (issue 23 item 6): a short block naming the run folder, best and test BLEU, the
wall time split, and commands that use this run's checkpoint; the resolved config saved as config.json;
one meaning of ``wall_seconds``; curves.png named only when written, with BLEU against wall seconds and
loss against steps; progress bars that count the steps the run will take."""

from __future__ import annotations

import json

import pytest

from tests.train.runs_helpers import train_argv
from tests.utils import records, tiny_trainer
from train.cli.train import main
from train.config import Config
from train.errors import EXIT_OK
from train.runs.metrics import plot_curves
from train.runs.report import _seconds


def test_the_end_of_a_run_is_a_short_block_with_the_next_commands(toy_bundle, tmp_path, capsys):
    argv = train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--epochs", "2", "--run.max_batches_per_epoch", "3",
                      plot=True)
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "t"
    block = out[out.index("\nrun folder:"):].strip().splitlines()
    assert block[0] == f"run folder:  {run}  (config.json, metrics.jsonl, provenance.json, checkpoints/, curves.png)"
    assert block[1] == "finished:    done after 2 epoch(s), 6 steps"
    assert len(block) <= 14 and max(map(len, block)) < 250 and "summary: {" not in out
    best = run / "checkpoints" / "best.pt"
    assert any(line.startswith("test BLEU:") and "beam 2" in line for line in block)
    assert any(line.strip() == f'translate:    {_py()} -m train.translate --ckpt {best} "The cat sleeps."' for line in block)
    assert any(f"-m train.evaluate --ckpt {best} --src" in line for line in block)
    assert any(f"-m train --config {run / 'config.json'} --resume auto --epochs 4" in line for line in block)
    assert (run / "curves.png").stat().st_size > 1000
    # one wall_seconds: the done record's is the summary's, its parts add up to it, epochs come before it
    done = records(run, "done")[0]
    wall_line = next(line for line in block if line.startswith("wall time:"))
    # (formatted as the summary formats seconds: an in-process run's clock starts with pytest's process, so a
    # slow or busy machine can pass 600 s here, where the format changes)
    assert wall_line.startswith(f"wall time:   {_seconds(done['wall_seconds'])} = setup ")
    assert sum(done["time_split"].values()) == pytest.approx(done["wall_seconds"])
    assert all(r["wall_seconds"] <= done["wall_seconds"] for r in records(run, "epoch"))
    # config.json is the resolved config as --print-config writes it (the vocabulary set from the tokenizer)
    saved = json.loads((run / "config.json").read_text())
    assert main([*argv, "--print-config"]) == EXIT_OK
    printed = json.loads(capsys.readouterr().out)
    saved_model, printed_model = saved.pop("model"), printed.pop("model")
    assert saved == printed
    assert {k: v for k, v in saved_model.items() if k != "vocab_size"} == {
        k: v for k, v in printed_model.items() if k != "vocab_size"}
    assert saved_model["vocab_size"] == toy_bundle.tokenizer.vocab_size
    whole = {**saved, "model": saved_model}  # and it reads back as the same Config
    assert json.loads(json.dumps(Config.from_dict(whole).record())) == whole


def _py() -> str:
    from train.runs.report import python_command

    return python_command()


def test_curves_png_is_named_only_when_written(toy_bundle, tmp_path, capsys):
    argv = train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--max-steps", "2")  # --run.plot false
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "curves.png" not in out and not (tmp_path / "runs" / "t" / "curves.png").exists()
    assert "best BLEU:   none" in out and "--max-steps 4" in out  # no validation ran; how to go on
    assert "step-00000002.pt" in out  # no best.pt: the commands name the checkpoint that exists


def test_curves_show_bleu_against_wall_seconds_and_loss_against_steps(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    rows = [{"kind": "epoch", "epoch": e, "step": 10 * e, "wall_seconds": 30.0 + 20 * e, "train_loss": 5.0 - e,
             "train_loss_last_batch": 5.1 - e, "valid_loss": 4.0 - e / 2, "bleu": 3.0 * e, "chrf": 10.0 * e}
            for e in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png").stat().st_size > 1000
    loss_ax, bleu_ax = figures[0].axes
    assert loss_ax.get_xlabel() == "optimizer step" and "wall seconds" in bleu_ax.get_xlabel()
    bleu = next(line for line in bleu_ax.get_lines() if line.get_label() == "validation BLEU")
    assert list(bleu.get_xdata()) == [50.0, 70.0, 90.0] and list(bleu.get_ydata()) == [3.0, 6.0, 9.0]
    assert [list(line.get_xdata()) for line in loss_ax.get_lines()] == [[10, 20, 30]] * 3
    labels = [t.get_text() for ax in (loss_ax, bleu_ax) for t in ax.get_legend().get_texts()]
    assert labels and not any("seed" in t for t in labels)


def test_the_progress_bar_counts_the_steps_the_run_will_take(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, max_steps=2, progress=True)
    n = tr._micro_batches_in_epoch(0)
    assert n > 2
    bar = tr._progress(0, n)
    assert bar.total == 2
    bar.close()
    tr.close()
