"""Every mistake fails before any side effect (issue 20 row 13): settings that used to fail only later (at
the first long batch, the first evaluation, on the device) fail at once in one line, exit 2, with no
traceback (``FASTMT_DEBUG=1`` shows one), and the output folder is exactly as it was: an earlier run of the
same name is not moved, and no new (empty) run folder is left."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.train.runs_helpers import train_argv, tree
from tests.utils import tiny_trainer, without_warnings
from train.cli.train import main
from train.errors import EXIT_USAGE


def _many_characters_file(path) -> str:
    """A corpus whose 600 distinct characters need more SentencePiece pieces than a 300-piece vocabulary."""
    rng = random.Random(0)
    chars = [chr(0x4E00 + i) for i in range(600)]
    with open(path, "w") as f:
        for i in range(300):
            en = "".join(rng.choice(chars) for _ in range(12))
            f.write(json.dumps({"id": str(i), "translation": {"en": f"line {i} {en}", "it": f"riga {i} {en}"}}) + "\n")
    return str(path)


CASES = {
    "positions-shorter-than-the-data": (["--model.max_positions", "8"], "model.max_positions=8 is shorter"),
    "packed-layout-padded-batches": (["--model.layout", "packed"], "model.layout='packed' and data.batching"),
    "padded-layout-packed-batches": (["--data.batching", "packed"], "model.layout='padded' and data.batching"),
    "cuda-without-cuda": (["--run.device", "cuda"], "--run.device cuda, but torch sees no CUDA device"),
    "averaging-more-than-kept": (["--eval.average_last", "3"], "eval.average_last=3 needs run.keep_last"),
    "missing-resume-checkpoint": (["--resume", "nope.pt"], "--resume nope.pt: checkpoint 'nope.pt' does not exist"),
    "vocabulary-too-small": (["--data-files", "MANY_CHARS"], "data.vocab_size=300 is below the"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_late_failing_setting_fails_first_in_one_line_and_changes_nothing(toy_bundle, tmp_path, capsys, case):
    if case == "cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    flags, message = CASES[case]
    flags = [_many_characters_file(tmp_path / "chars.jsonl") if f == "MANY_CHARS" else f for f in flags]
    argv = train_argv(toy_bundle.cfg.cache_dir, tmp_path, *flags)
    if "--data-files" in flags:  # local files instead of the toy corpus (giving both is refused)
        argv[argv.index("--data.dataset") : argv.index("--data.dataset") + 2] = []
    tiny_trainer(toy_bundle, tmp_path, epochs=1, max_batches_per_epoch=1).fit()  # an earlier run named "t"
    before = tree(tmp_path / "runs")
    if case == "vocabulary-too-small":
        argv[argv.index("--data.vocab_size") + 1] = "300"
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE, out[-2000:] + err[-2000:]
    assert err.startswith(f"error: {message}") or message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err + out
    assert tree(tmp_path / "runs") == before and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["t"]


def test_debug_shows_the_traceback_of_a_user_error(toy_bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FASTMT_DEBUG", "1")
    assert main(train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--model.max_positions", "8")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("or lower data.max_len") and "error: model.max_positions" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_hub_unreachable_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """No local data and no Hub (offline, as in these tests and on the GPU machine): one line naming the fix,
    exit 2, no run folder (found by running the GPU runbook on CPU: it was a traceback, exit 1)."""
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = main(["--preset", "tiny", "--run.out_dir", str(tmp_path / "runs"), "--data.cache_dir", str(tmp_path / "c")])
    err = without_warnings(capsys.readouterr().err)  # a busy machine adds a warning line before the setup
    assert code == EXIT_USAGE and err.startswith("error: could not load") and "--data-files" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_full_disk_during_training_is_one_line_and_exit_2(toy_bundle, tmp_path, monkeypatch, capsys):
    """A checkpoint write that fails (here: ENOSPC from the write) ends the command as the exit codes promise:
    one line naming the file, the cause and the fix, exit 2, no traceback."""
    import errno

    import train.runs.checkpoint as ckpt

    def no_space(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", no_space)
    assert main(train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--max-steps", "2")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert "cannot write checkpoint" in line and "no space left on device" in line and "Fix:" in line
