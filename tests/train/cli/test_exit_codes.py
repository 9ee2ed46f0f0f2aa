"""The exit codes of train/errors.py, as the commands end (the README's "Commands" table): each code checked
at the command, not only at the exception a library function raises. Real processes where the code comes
from the interpreter or a signal (1: a bug's traceback; 130: Ctrl-C in translate)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.runs_helpers import train_argv
from train.cli.train import main
from train.errors import EXIT_ABORTED, EXIT_BUG, EXIT_OK, EXIT_USAGE
from train.runs.lock import RunLock

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def finished_run(toy_bundle, tmp_path_factory):
    """A finished two-step run: (its out folder, its folder)."""
    out = tmp_path_factory.mktemp("exit")
    assert main(train_argv(toy_bundle.cfg.cache_dir, out, "--max-steps", "2", name="done")) == EXIT_OK
    return out, out / "runs" / "done"


def test_resume_auto_of_a_finished_run_exits_0_and_says_so(toy_bundle, finished_run, capsys):
    out, run = finished_run
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(train_argv(toy_bundle.cfg.cache_dir, out, "--max-steps", "2", "--resume", "auto", name="done")) == EXIT_OK
    assert "already finished" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_resume_of_a_run_folder_in_use_exits_2_naming_the_process(toy_bundle, finished_run, capsys):
    out, run = finished_run
    with RunLock(run):  # another live process holds the run (here: this one)
        code = main(train_argv(toy_bundle.cfg.cache_dir, out, "--max-steps", "4", "--resume", "auto", name="done"))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err
    assert f"PID {os.getpid()}" in err and err.count("\nerror: ") + err.startswith("error: ") == 1, err


def test_a_bug_exits_1_with_its_traceback(toy_bundle, tmp_path):
    """What is not a user error is a bug: Python's traceback and exit 1 (not a one-line message)."""
    code = ("import sys; import train.loop as L\n"
            "def broken(self, *a, **k):\n    raise ZeroDivisionError('a bug')\n"
            "L.Trainer.train_step = broken\n"
            "from train.cli.train import main\n"
            f"sys.exit(main({train_argv(toy_bundle.cfg.cache_dir, tmp_path, '--max-steps', '1')!r}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == EXIT_BUG, run.stderr[-2000:]
    assert "Traceback" in run.stderr and "ZeroDivisionError: a bug" in run.stderr
    assert not (tmp_path / "runs" / "t").exists()  # the folder the failed run made is gone


def test_ctrl_c_in_translate_exits_130_after_the_lines_it_translated(finished_run):
    _, run = finished_run
    ckpt = sorted((run / "checkpoints").glob("*.pt"))[-1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.translate", "--ckpt", str(ckpt)], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell ignores SIGINT
    try:
        proc.stdin.write("the cat sleeps\n")
        proc.stdin.flush()
        first = proc.stdout.readline()  # the line is translated (and flushed) before the interrupt
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_ABORTED, err[-2000:]
    assert first.endswith("\n") and "Traceback" not in err


def test_ctrl_c_during_a_stats_data_build_exits_130_in_one_line(tmp_path, monkeypatch, capsys):
    """``fastmt stats`` interrupted while it builds the data (the build itself removes its temp entry): the exit code
    of a Ctrl-C in a reading command, one line, no traceback."""
    import data
    from train.cli.stats import main as stats_main

    def interrupted_build(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "build_data", interrupted_build)
    rc = stats_main(["--preset", "tiny", "--data.dataset", "toy", "--data.cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert rc == EXIT_ABORTED and "interrupted (Ctrl-C)" in err and "Traceback" not in err
