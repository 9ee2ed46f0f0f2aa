"""Stops that keep the work (issue 20 row 1): ``python -m train`` as a real process with DataLoader workers,
stopped by SIGTERM or SIGINT sent to its whole process group (``timeout``, SLURM, Kubernetes, ``docker
stop``, Ctrl-C) or to the process alone: one clean line, a checkpoint at a step boundary, exit 75, and
``--resume auto`` continues from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train.runs_helpers import train_argv
from train.config import Config
from train.errors import EXIT_INTERRUPTED
from train.loop import Trainer
from train.runs.checkpoint import load_checkpoint, step_checkpoints

ROOT = Path(__file__).resolve().parents[3]


def train_command(cache: str, out: Path, *extra: str) -> list[str]:
    """``python -m train`` on the tiny preset with the toy data, quiet, everything under ``out``."""
    return [sys.executable, "-m", "train", *train_argv(cache, out, *extra, name="sig")]


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        out.append((int(stat.parent.name), state, int(ppid), int(pgrp)))
    return out


def _children(pid: int) -> list[int]:
    return [p for p, _, ppid, _ in _processes() if ppid == pid]


def _running_in_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    return [p for p, state, _, pgrp in _processes() if pgrp == pgid and state != "Z"]


def _run_until_workers(cmd: list[str], n_workers: int) -> subprocess.Popen:
    """Start ``cmd`` in its own session (its own process group) and wait until its DataLoader workers run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while len(_children(proc.pid)) < n_workers:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its workers started (exit {proc.returncode}):\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    time.sleep(0.5)  # a few steps with the workers feeding batches
    return proc


@pytest.mark.parametrize("target, sig", [("group", signal.SIGTERM), ("process", signal.SIGTERM),
                                         ("group", signal.SIGINT), ("group", signal.SIGUSR1)],
                         ids=["SIGTERM-to-the-group", "SIGTERM-to-the-process", "SIGINT-to-the-group",
                              "SIGUSR1-to-the-group"])
def test_a_signal_stops_at_a_step_with_a_checkpoint_and_exit_75(toy_bundle, tmp_path, target, sig):
    cmd = train_command(toy_bundle.cfg.cache_dir, tmp_path, "--epochs", "1000", "--eval.every", "1000",
                        "--data.num_workers", "2")
    proc = _run_until_workers(cmd, 2)
    try:
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = signal.Signals(sig).name
    assert proc.returncode == EXIT_INTERRUPTED, out[-3000:]
    assert "Traceback" not in out and "Error" not in out, out[-3000:]
    assert out.count(f"{name}: stopping after this step with a checkpoint") == 1
    run = tmp_path / "runs" / "sig"
    newest = step_checkpoints(run / "checkpoints")[-1]
    ckpt = load_checkpoint(newest)
    assert f"stopped:     by {name} at step {ckpt['position']['step']}" in out and str(newest) in out
    assert "--resume auto" in out and ckpt["position"]["step"] >= 1
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or '"done"' not in metrics.read_text()
    # the saved config resumes the run from that checkpoint
    cfg = Config.from_dict(json.loads((run / "config.json").read_text()))
    tr = Trainer(cfg, resume="auto", log=lambda *a: None)
    assert (tr.run_dir, tr.step, tr.batch_index) == (run, ckpt["position"]["step"], ckpt["position"]["batch_index"])
    tr.close()
    assert not any(p.name != "sig" for p in (tmp_path / "runs").iterdir())  # no second folder


def test_a_signal_during_evaluation_stops_at_the_epochs_checkpoint(toy_bundle, tmp_path):
    """SLURM's grace period is short: a stop requested while validating does not take another step."""
    from tests.utils import tiny_trainer

    tr = tiny_trainer(toy_bundle, tmp_path, epochs=3, max_batches_per_epoch=3)
    evaluate = tr._evaluate

    def evaluate_then_sigterm(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(*args)

    tr._evaluate = evaluate_then_sigterm
    summary = tr.fit()
    assert tr.step == 3 and summary["stop_reason"] == "interrupted" and summary.get("signal") == "SIGTERM"
    assert load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])["position"]["step"] == 3


def test_a_signal_during_setup_exits_75_and_leaves_no_run_folder(toy_bundle, tmp_path, monkeypatch, capsys):
    from tests.train.runs_helpers import train_argv
    from train.cli.train import main

    def build_data_then_sigterm(cfg, log=print, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not interrupt the setup")

    monkeypatch.setattr("data.build_data", build_data_then_sigterm)
    previous = signal.getsignal(signal.SIGTERM)
    assert main(train_argv(toy_bundle.cfg.cache_dir, tmp_path)) == EXIT_INTERRUPTED
    assert "SIGTERM before training started" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is previous and not (tmp_path / "runs").exists()


def test_a_second_ctrl_c_aborts_at_once_with_exit_130(toy_bundle, tmp_path, monkeypatch, capsys):
    from tests.train.runs_helpers import train_argv
    from train.cli.train import main

    step = Trainer.train_step

    def step_then_two_ctrl_c(self, batches):
        loss = step(self, batches)
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # stop after this step...
            os.kill(os.getpid(), signal.SIGINT)  # ...no: abort now (KeyboardInterrupt, before any checkpoint)
        return loss

    monkeypatch.setattr(Trainer, "train_step", step_then_two_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores SIGINT
    try:
        code = main(train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--epochs", "50"))
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert code == 130 and "aborted by a second Ctrl-C" in err and "Traceback" not in out + err
    assert out.count("SIGINT: stopping after this step") == 1


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of ``rank`` among the launcher's descendants (the elastic agent may start them in their own
    sessions), from its environment."""
    procs = _processes()
    family, grew = {launcher}, True
    while grew:
        more = {pid for pid, _, ppid, _ in procs if ppid in family} - family
        family |= more
        grew = bool(more)
    for pid in sorted(family - {launcher}):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


@pytest.mark.parametrize("target", ["group", "rank-1"])
def test_torchrun_under_a_group_sigterm_ranks_checkpoint_the_launcher_exits_nonzero(toy_bundle, tmp_path, target):
    """What the README says of ``torchrun``: SIGTERM to the whole group (SLURM, ``timeout``) reaches the launcher
    and both ranks; the ranks stop at one step with one checkpoint (rank 0 logs, once); the launcher exits
    non-zero with its own message (torch's elastic agent, not fastmt's exit code); nothing is left running.
    ``rank-1``: only one rank gets the signal (a node-local preemption): the ranks agree at the next logging
    step and stop together (a rank stopping alone left the other waiting in its next all-reduce)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
           *train_argv(toy_bundle.cfg.cache_dir, tmp_path, "--epochs", "1000", "--eval.every", "1000",
                       name="ddp")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    run = tmp_path / "runs" / "ddp"
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or '"kind": "epoch"' not in (run / "metrics.jsonl").read_text():
            if proc.poll() is not None:
                pytest.fail(f"torchrun ended before the first epoch (exit {proc.returncode}):\n{proc.stdout.read()}")
            assert time.monotonic() < deadline, "no epoch finished under torchrun"
            time.sleep(0.1)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        gone = time.monotonic() + 30
        while _running_in_group(proc.pid):  # the ranks and the launcher's helpers are all gone (zombies count as gone)
            assert time.monotonic() < gone, f"still running in the torchrun group: {_running_in_group(proc.pid)}"
            time.sleep(0.1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode != 0, out[-3000:]
    by = "SIGTERM" if target == "group" else "a signal to another rank"  # what rank 0 (which logs) saw
    assert out.count(f"{by}: stopping after this step with a checkpoint") == 1, out[-3000:]
    newest = step_checkpoints(run / "checkpoints")[-1]
    step = load_checkpoint(newest)["position"]["step"]
    assert f"stopped:     by {by} at step {step}" in out and str(newest) in out, out[-3000:]
    assert '"done"' not in (run / "metrics.jsonl").read_text()
