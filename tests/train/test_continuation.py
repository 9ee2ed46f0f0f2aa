"""Issue 30: every run can be continued however it was started, from what it recorded.

The continuation matrix: a run started each way (fresh, ``--init-from`` on other data, a ``--resume PATH``
branch, ``$FASTMT_DATA_FILES``, ``--config``, DDP with 2 ranks) is stopped by SIGTERM (exit 75), continued with
the command its summary prints, and must end with the very weights of the same run left uninterrupted (the
README: a resume continues bit for bit). The fine-tune is also continued by its own command plus ``--resume
auto``. In-process runs (``train.__main__.main``) on the toy data, 2 epochs of 3 batches, SIGTERM after step 4.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.toy import toy_corpus
from tests.train.runs_helpers import TOY_FLAGS, train_argv
from train.__main__ import main
from train.checkpoint import load_checkpoint, step_checkpoints
from train.errors import EXIT_INTERRUPTED, EXIT_OK
from train.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--epochs", "2", "--run.max_batches_per_epoch", "3", "--run.keep_last", "9"]
STOP_AT = 4  # mid-epoch 2


def no_toy(argv: list[str]) -> list[str]:
    """``argv`` without ``--data.dataset toy`` (a run on files names them instead)."""
    i = argv.index("--data.dataset")
    return argv[:i] + argv[i + 2:]


def run(argv: list[str], capsys, monkeypatch, stop_at: int | None = None) -> tuple[int, str]:
    """``python -m train argv`` in this process; ``stop_at``: SIGTERM to itself after that step (as a cluster's
    preemption). Returns (exit code, stdout + stderr)."""
    step = Trainer.train_step

    def step_then_sigterm(self, batches):
        loss = step(self, batches)
        if self.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", step_then_sigterm)
        capsys.readouterr()
        code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def printed(out: str, name: str) -> str:
    """The ``next:`` command ``name`` ("resume", "train longer") of a summary."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(f"{name}:")]
    assert lines, out[-3000:]
    return lines[-1].split(":", 1)[1].strip()


def train_args(cmd: str) -> list[str]:
    """The arguments after ``-m train`` of a printed command."""
    words = shlex.split(cmd)
    i = words.index("train", words.index("-m"))
    return words[i + 1:]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(step_checkpoints(run_dir / "checkpoints")[-1])
    assert ckpt["position"]["epoch"] == 2, ckpt["position"]
    return ckpt["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.fixture(scope="module")
def parent(toy_bundle, tmp_path_factory):
    """A finished tiny run (its best.pt and a step checkpoint) and an "other" corpus file for fine-tunes."""
    tmp = tmp_path_factory.mktemp("parent")
    cache = toy_bundle.cfg.cache_dir
    code = main(train_argv(cache, tmp, *SHORT, name="A"))
    assert code == EXIT_OK
    lines = toy_corpus(cache, 1200).read_text().splitlines()
    other = tmp / "other.jsonl"
    other.write_text("\n".join(lines[200:1100]) + "\n")  # another corpus the same tokenizer reads
    run_dir = tmp / "runs" / "A"
    return {"best": run_dir / "checkpoints" / "best.pt", "step": step_checkpoints(run_dir / "checkpoints")[0],
            "other": other, "cache": cache}


def start_argv(how: str, parent: dict, out: Path, name: str, capsys) -> list[str]:
    """The command that starts a run ``how``."""
    base = train_argv(parent["cache"], out, *SHORT, name=name)
    if how in ("fresh", "env"):
        return base if how == "fresh" else no_toy(base)
    if how == "init-from":
        return [*no_toy(base), "--init-from", str(parent["best"]), "--data-files", str(parent["other"])]
    if how == "branch":
        return [*base, "--resume", str(parent["step"])]
    if how == "config":  # a config file written by --print-config, and nothing else
        capsys.readouterr()
        assert main([*base, "--print-config"]) == EXIT_OK
        path = out / f"{name}.json"
        path.write_text(capsys.readouterr().out)
        return ["--config", str(path)]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["fresh", "init-from", "branch", "env", "config"])
def test_a_stopped_run_continues_with_its_printed_command_as_if_never_stopped(how, parent, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    if how == "env":  # the files come from the environment only: the continuation runs without it
        monkeypatch.setenv("FASTMT_DATA_FILES", str(parent["other"]))
    ref_argv, cut_argv = (start_argv(how, parent, tmp_path, n, capsys) for n in ("ref", "cut"))
    assert run(ref_argv, capsys, monkeypatch)[0] == EXIT_OK
    code, out = run(cut_argv, capsys, monkeypatch, stop_at=STOP_AT)
    assert code == EXIT_INTERRUPTED, out[-3000:]
    where = f"at step {STOP_AT} (epoch 2, after batch 1)"  # row 9: one wording, the same position everywhere
    assert f"stopped (interrupted) {where}" in out and f"stopped:     by SIGTERM {where}" in out
    resume = printed(out, "resume")
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    code, out = run(train_args(resume), capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert f": {where}" in out  # the resume line
    runs = tmp_path / "runs"
    assert_same_weights(runs / "ref", runs / "cut")
    assert sorted(p.name for p in runs.iterdir()) == ["cut", "ref"]  # continued in place, no new folder
    if how == "env":  # row 7: config.json names the files
        assert json.loads((runs / "cut" / "config.json").read_text())["data"]["data_files"] == [str(parent["other"])]


def test_an_interrupted_fine_tune_continues_with_the_same_command_and_resume_auto(parent, tmp_path, capsys,
                                                                                 monkeypatch):
    """Row 1: the command that started the fine-tune, plus ``--resume auto`` (was: "not both"; without
    --init-from: "tokenizer mismatch")."""
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    ref = start_argv("init-from", parent, tmp_path, "ref", capsys)
    cut = start_argv("init-from", parent, tmp_path, "ft", capsys)
    assert run(ref, capsys, monkeypatch)[0] == EXIT_OK
    assert run(cut, capsys, monkeypatch, stop_at=STOP_AT)[0] == EXIT_INTERRUPTED
    code, out = run([*cut, "--resume", "auto"], capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert_same_weights(tmp_path / "runs" / "ref", tmp_path / "runs" / "ft")
    from train.rundir import read_marker

    marker = read_marker(tmp_path / "runs" / "ft")  # the lineage is kept: still the child of A's best.pt
    assert marker["parent"]["how"] == "init-from" and marker["parent"]["checkpoint"] == str(parent["best"])
    # a resume that names no data (no --data-files, no --init-from) continues on the fine-tune's own files
    longer = [*no_toy(train_argv(parent["cache"], tmp_path, "--epochs", "3", *SHORT[2:], name="ft")), "--resume", "auto"]
    code, out = run(longer, capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert f"data.data_files=('{parent['other']}',)" in out and "extending the finished run" in out


def test_a_fine_tune_resume_auto_refuses_a_folder_of_another_origin(parent, tmp_path, capsys, monkeypatch):
    argv = start_argv("fresh", parent, tmp_path, "x", capsys)
    assert run(argv, capsys, monkeypatch, stop_at=2)[0] == EXIT_INTERRUPTED
    code, out = run([*no_toy(argv), "--data-files", str(parent["other"]), "--init-from", str(parent["best"]),
                     "--resume", "auto"], capsys, monkeypatch)
    assert code == 2 and "is not a fine-tune of" in out and "it was not started by --init-from" in out


@pytest.mark.slow
def test_a_ddp_run_stopped_by_sigterm_continues_with_its_printed_torchrun_command(parent, tmp_path):
    """DDP (2 gloo ranks on CPU): SIGTERM to the launcher's group after the first epoch; the printed command
    relaunches 2 ranks and the continuation ends with the uninterrupted DDP run's weights."""
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("FASTMT_DATA_FILES", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train"]
    flags = ["--epochs", "2", "--run.max_batches_per_epoch", "40", "--run.log_every", "1"]
    ref = subprocess.run([*launcher, *train_argv(parent["cache"], tmp_path, *flags, name="ref")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    proc = subprocess.Popen([*launcher, *train_argv(parent["cache"], tmp_path, *flags, name="cut")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = tmp_path / "runs" / "cut" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not metrics.is_file() or '"kind": "epoch"' not in metrics.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no first epoch under torchrun"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    resume = printed(out, "resume")
    assert "torch.distributed.run" in resume and "--nproc_per_node 2" in resume
    again = subprocess.run(shlex.split(resume), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert_same_weights(tmp_path / "runs" / "ref", tmp_path / "runs" / "cut")
    # one process on that checkpoint: refused in one line naming both rank counts (row 2)
    longer = ["--epochs", "3", *flags[2:], "--resume", "auto"]
    one = subprocess.run([sys.executable, "-m", "train", *train_argv(parent["cache"], tmp_path, *longer, name="cut")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert one.returncode == 2 and "a run of 2 ranks, this run has 1" in one.stderr, one.stderr[-2000:]


def test_toy_flags_are_the_session_cache():
    assert "--data.dataset" in TOY_FLAGS  # no_toy() relies on it
