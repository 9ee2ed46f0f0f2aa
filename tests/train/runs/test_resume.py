"""Runs survive interruptions, crashes and concurrent use: exact resume mid-epoch, at an epoch end, and
after kill -9 at an epoch boundary or during the checkpoint write; SIGTERM like Ctrl-C; one writer per run
folder; a finished run says so; a corrupt newest checkpoint falls back to the previous one; metrics.jsonl
never holds an epoch twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.utils import (
    RecordingTrainer,
    assert_equal_params,
    records,
    signal_after_step,
    tiny_trainer,
    torch_threads,
)
from train.loop import RunFinishedError
from train.runs.checkpoint import load_checkpoint, step_checkpoints
from train.runs.folder import RunLockedError

ROOT = Path(__file__).resolve().parents[3]
KW = dict(epochs=2, max_batches_per_epoch=4, keep_last=5)  # 8 steps, an evaluation after step 4


def _recording(toy_bundle, tmp: Path, **kw) -> RecordingTrainer:
    return tiny_trainer(toy_bundle, tmp, cls=RecordingTrainer, **KW, **kw)


@pytest.fixture(scope="module")
def uninterrupted(toy_bundle, tmp_path_factory):
    """The run the interrupted ones are compared with (one thread, as every test here: float sums depend
    on the split)."""
    with torch_threads(1):
        full = _recording(toy_bundle, tmp_path_factory.mktemp("full"))
        full.fit()
    return full


def _same_run(full: RecordingTrainer, resumed: RecordingTrainer, skip: int) -> None:
    assert resumed.losses == full.losses[skip:]  # exact float equality, dropout on
    assert_equal_params(full.model, resumed.model)
    a, b = records(full.run_dir, "epoch"), records(resumed.run_dir, "epoch")
    assert [r["epoch"] for r in b] == [1, 2]  # each epoch once
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]  # epoch means survive the resume too
    assert [r["bleu"] for r in a] == [r["bleu"] for r in b]


def test_resume_mid_epoch_is_exact(toy_bundle, tmp_path, uninterrupted):
    """Interrupted mid-epoch and resumed (dropout on, across an epoch end with evaluation), the run
    continues with bit-identical losses and ends with identical parameters."""
    assert uninterrupted.cfg.model.dropout > 0
    assert len(uninterrupted.losses) == 8
    first = _recording(toy_bundle, tmp_path)
    summary = first.fit(stop_after=3)
    assert summary["stop_reason"] == "interrupted" and first.losses == uninterrupted.losses[:3]
    ckpt = step_checkpoints(first.run_dir / "checkpoints")[-1]
    resumed = _recording(toy_bundle, tmp_path, resume="auto")
    assert (resumed.epoch, resumed.batch_index, resumed.step) == (0, 3, 3)
    assert load_checkpoint(ckpt)["position"]["step"] == 3
    resumed.fit()
    _same_run(uninterrupted, resumed, skip=3)  # including the first loss after the resume


def test_resume_from_an_epoch_end_checkpoint_is_exact(toy_bundle, tmp_path, uninterrupted):
    """The checkpoint written at the end of epoch 1 resumes bit-identically (the loader's iterator used to
    draw from the global RNG after it was restored: epoch-end resumes diverged)."""
    first = _recording(toy_bundle, tmp_path)
    assert first.fit(stop_after=4)["stop_reason"] == "interrupted"
    assert (first.epoch, first.batch_index) == (1, 0)
    resumed = _recording(toy_bundle, tmp_path, resume="auto")
    assert (resumed.epoch, resumed.batch_index, resumed.step) == (1, 0, 4)
    resumed.fit()
    _same_run(uninterrupted, resumed, skip=4)


_KILLABLE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from tests.utils import tiny_config
    from train.runs.saving import CheckpointManager
    from train.loop import Trainer

    cache, tmp, where = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    ready = tmp / "ready"
    torch.set_num_threads(1)  # as the in-process runs it is compared with

    def hang():
        ready.write_text(str(os.getpid()))
        time.sleep(600)

    if where == "epoch-boundary":  # after epoch 1's checkpoint, before the first step of epoch 2
        step = Trainer.train_step
        def train_step(self, batches):
            if self.step == 4:
                self.ckpts.wait()  # (written in the background: on disk once the writer is done)
                hang()
            return step(self, batches)
        Trainer.train_step = train_step
    elif where == "checkpoint-write":  # epoch 2's metrics line is written, its checkpoint is not
        save = CheckpointManager.save
        def slow_save(self, state, step, metric=None):
            if step == 8:
                hang()
            return save(self, state, step, metric)
        CheckpointManager.save = slow_save
    else:  # "background-write": step 8's file half written by the writer thread, which then hangs; the loop
        import io, threading
        from train.epoch_end import EpochEnd
        writing = threading.Event()
        real_save = torch.save
        def slow_torch_save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and "optimizer" in obj and obj["position"]["step"] == 8:
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                writing.set()
                time.sleep(600)
            return real_save(obj, f, *args, **kwargs)
        torch.save = slow_torch_save
        wait = EpochEnd.wait_for_checkpoints
        def wait_for_checkpoints(self):  # the loop went on (the final test ran) while the write was pending
            if writing.wait(timeout=120):
                assert any(r.get("kind") == "test" for r in map(json.loads, self.metrics.path.read_text().splitlines()))
                ready.write_text(str(os.getpid()))
            return wait(self)
        EpochEnd.wait_for_checkpoints = wait_for_checkpoints

    cfg = tiny_config(tmp, data={"cache_dir": cache}, epochs=2, max_batches_per_epoch=4, keep_last=5,
                      test_at_end=where == "background-write")
    Trainer(cfg, log=lambda *a: None).fit()
    """
)


def _start_and_kill(cache: str, tmp: Path, where: str) -> None:
    """Run KW in another process (reading the toy data from ``cache``) and kill -9 it at ``where``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE, cache, str(tmp), where], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp / "ready").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("where", ["epoch-boundary", "checkpoint-write", "background-write"])
def test_kill_9_then_resume_auto_is_exact(toy_bundle, tmp_path, uninterrupted, where):
    """kill -9 between epochs, before the last checkpoint was handed to the writer, or while the writer thread
    was half-way through it (the loop had gone on to the final test): the newest checkpoint on disk is epoch
    1's, whole, and ``--resume auto`` from it ends bit-identical to the uninterrupted run."""
    _start_and_kill(toy_bundle.cfg.cache_dir, tmp_path, where)
    run_dir = tmp_path / "runs" / "t"
    if where == "background-write":  # the half-written file is a temp file: never a step checkpoint
        assert [p.name for p in step_checkpoints(run_dir / "checkpoints")] == ["step-00000004.pt"]
        assert [p.stat().st_size > 0 for p in (run_dir / "checkpoints").glob(".step-00000008.pt.tmp-*")] == [True]
        assert [r["kind"] for r in records(run_dir)][-1] == "test" and not records(run_dir, "done")
    if where != "epoch-boundary":
        assert [r["epoch"] for r in records(run_dir, "epoch")] == [1, 2]  # logged, its checkpoint never landed
    resumed = _recording(toy_bundle, tmp_path, resume="auto")
    assert (resumed.epoch, resumed.step) == (1, 4)
    resumed.fit()
    _same_run(uninterrupted, resumed, skip=4)
    cut = list(run_dir.glob("metrics.cut-*.jsonl"))
    if where != "epoch-boundary":  # the orphan epoch-2 line was kept aside, not lost
        assert len(cut) == 1 and json.loads(cut[0].read_text().splitlines()[0])["epoch"] == 2
    assert not list((run_dir / "checkpoints").glob(".*.tmp-*"))  # no orphan temp files


def test_sigterm_stops_at_a_step_boundary_with_checkpoint(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path)
    signal_after_step(tr, 2, signal.SIGTERM)
    previous = signal.getsignal(signal.SIGTERM)
    assert tr.fit()["stop_reason"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is previous  # restored
    ckpt = torch.load(step_checkpoints(tr.run_dir / "checkpoints")[-1], weights_only=False)
    assert ckpt["position"]["step"] == 2


def test_one_writer_per_run_folder(toy_bundle, tmp_path):
    """A resume of a live run fails at once naming the holder; a fresh run under its name gets its own
    folder; the live run is untouched and the name is free again once it ends."""
    kw = dict(epochs=1, max_batches_per_epoch=2)
    first = tiny_trainer(toy_bundle, tmp_path, **kw)
    with pytest.raises(RunLockedError, match=rf"PID {os.getpid()}"):
        tiny_trainer(toy_bundle, tmp_path, resume="auto", **kw)
    second = tiny_trainer(toy_bundle, tmp_path, **kw)
    assert second.run_dir.name == "t-2"
    second.close()  # never trained: its folder is removed
    assert not second.run_dir.exists()
    first.fit()  # still holds its folder, trains and releases it
    tiny_trainer(toy_bundle, tmp_path, resume="auto", epochs=2, max_batches_per_epoch=2).close()  # free again


def test_a_finished_run_says_so_and_a_corrupt_checkpoint_falls_back(toy_bundle, tmp_path):
    tiny_trainer(toy_bundle, tmp_path, **KW).fit()
    run_dir = tmp_path / "runs" / "t"
    with pytest.raises(RunFinishedError, match="already finished"):
        tiny_trainer(toy_bundle, tmp_path, resume="auto", **KW)
    # drop the "done" line (as if killed before it) and truncate the newest checkpoint
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(x for x in lines if '"done"' not in x) + "\n")
    newest = step_checkpoints(run_dir / "checkpoints")[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    logs = []
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, **KW)
    assert tr.step == 4 and any("does not load" in str(m) for m in logs)
    tr.close()
