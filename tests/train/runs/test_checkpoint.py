"""Checkpoints: atomic writes, write failures in one line with nothing lost, fallback past a corrupt newest file."""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import train.runs.saving as sv
from train.runs.checkpoint import (
    CheckpointReadError,
    CheckpointWriteError,
    latest_checkpoint,
    latest_loadable_checkpoint,
    load_checkpoint,
    rng_state,
    set_rng_state,
    step_checkpoints,
)
from train.runs.saving import CheckpointManager, atomic_save


def _state(step: int, n: int = 4096) -> dict:
    return {"model": {"w": torch.full((n,), float(step))}, "config": {}, "position": {"epoch": 0, "batch_index": 0, "step": step}}


def _temps(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if ".tmp-" in p.name]


def _truncate(path: Path) -> None:
    """Half of the file, written as a new inode (best.pt may be a hard link to it)."""
    data = path.read_bytes()
    tmp = path.with_name("cut")
    tmp.write_bytes(data[: len(data) // 2])
    os.replace(tmp, path)


def test_save_load_prune_and_best(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2, mode="max")
    for step, bleu in [(1, 1.0), (2, float("nan")), (3, 0.5), (4, 2.0)]:
        m.save(_state(step), step, bleu)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    assert latest_checkpoint(tmp_path).name == "step-00000004.pt"
    assert m.best_value == 2.0 and load_checkpoint(tmp_path / "best.pt")["position"]["step"] == 4
    assert not _temps(tmp_path)
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match=r"missing keys \['config', 'position'\]"):
        load_checkpoint(tmp_path / "other.pt")


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------------------------
# reading: a corrupt newest checkpoint
# ----------------------------------------------------------------------------------------------
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        m.save(_state(step), step)
    newest = tmp_path / "step-00000003.pt"
    _truncate(newest)
    size = newest.stat().st_size
    logs = []
    path, ckpt = latest_loadable_checkpoint(tmp_path, logs.append)
    assert path.name == "step-00000002.pt" and ckpt["position"]["step"] == 2
    assert torch.equal(ckpt["model"]["w"], _state(2)["model"]["w"])
    assert len(logs) == 1 and str(newest) in logs[0] and f"{size:,} bytes" in logs[0] and "does not load" in logs[0]
    # left in place (refusing changes nothing): pruning never deletes a file it cannot read
    assert newest.stat().st_size == size and "left in place" in logs[0]


def test_no_checkpoint_loads_is_an_error_and_no_checkpoint_is_none(tmp_path):
    assert latest_loadable_checkpoint(tmp_path / "missing") == (None, None)
    m = CheckpointManager(tmp_path, keep_last=2)
    m.save(_state(1), 1)
    (tmp_path / "step-00000002.pt").write_bytes(b"not a checkpoint")
    _truncate(tmp_path / "step-00000001.pt")
    logs = []
    with pytest.raises(CheckpointReadError, match="none of the 2 checkpoint"):
        latest_loadable_checkpoint(tmp_path, logs.append)
    assert len(logs) == 2


# ----------------------------------------------------------------------------------------------
# writing: disk full, read-only, other failures
# ----------------------------------------------------------------------------------------------
def _manager_with_one_checkpoint(tmp_path) -> tuple[CheckpointManager, dict[str, bytes]]:
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save(_state(1), 1, metric=1.0)
    return m, {p.name: p.read_bytes() for p in tmp_path.iterdir()}


def _assert_nothing_lost(tmp_path, m, before):
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp, no pruning, same bytes
    assert m.best_value == 1.0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_real_disk_full_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m, before = _manager_with_one_checkpoint(tmp_path)
    # the temp file's fd is /dev/full: every write fails with the kernel's real ENOSPC
    real = tempfile.mkstemp

    def full_mkstemp(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
        return fd, name

    monkeypatch.setattr("data.files.tempfile.mkstemp", full_mkstemp)
    with pytest.raises(CheckpointWriteError) as e:
        m.save(_state(2), 2, metric=5.0)
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and "\n" not in msg
    assert "step-00000002.pt: no space left on device" in msg and "MB free on /" in msg
    assert "the checkpoint needs ~0 MB" in msg and "--run.out_dir" in msg and "step-00000001.pt" in msg
    _assert_nothing_lost(tmp_path, m, before)


_STREAM_ERROR = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


@pytest.mark.parametrize("after_oserror, free_mb, cause", [
    (True, 10_000, "no space left on device: 10000 MB free"),
    (False, 1, "no space left on device: 1 MB free on .*, the checkpoint needs ~4 MB"),
    (False, 10_000, r"the write failed \(\[enforce fail at inline_container"),
], ids=["after-ENOSPC", "alone-little-space", "alone-space-left"])
def test_torch_stream_writer_failure_is_translated(tmp_path, monkeypatch, after_oserror, free_mb, cause):
    """On a full disk ``torch.save`` raises this RuntimeError while closing the zip after the write's
    ENOSPC (then the errno is in its context), or alone when writing to a file name (then free space decides)."""
    m, before = _manager_with_one_checkpoint(tmp_path)

    def failing_save(obj, f):
        f.write(b"partial")
        if not after_oserror:
            raise RuntimeError(_STREAM_ERROR)
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError(_STREAM_ERROR)  # noqa: B904 - torch raises it this way

    monkeypatch.setattr(sv.torch, "save", failing_save)
    monkeypatch.setattr(sv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 0, free_mb * 2**20))
    with pytest.raises(CheckpointWriteError, match=cause) as e:
        m.save(_state(2, n=2**20), 2, metric=5.0)  # 4 MB of float32
    assert e.value.errno == (errno.ENOSPC if "no space" in cause else None)
    _assert_nothing_lost(tmp_path, m, before)


@pytest.mark.parametrize("code, cause", [(errno.ENOSPC, "no space left on device"),
                                         (errno.EDQUOT, "disk quota exceeded"),
                                         (errno.EIO, r"the write failed \(Input/output error\)")])
def test_fsync_failure_is_translated(tmp_path, monkeypatch, code, cause):
    m, before = _manager_with_one_checkpoint(tmp_path)

    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(sv.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointWriteError, match=cause) as e:
        m.save(_state(2), 2, metric=5.0)
    assert e.value.errno == code and isinstance(e.value.__cause__, OSError)
    _assert_nothing_lost(tmp_path, m, before)


def test_a_file_size_limit_is_named_not_the_disk(tmp_path):
    """EFBIG (``ulimit -f``, a job's file-size limit) is the process's limit, not the disk's: the line names the limit
    and how to raise it, and nothing is lost. A real limit, set for the write and put back."""
    import resource
    import signal

    m, before = _manager_with_one_checkpoint(tmp_path)
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, old_limit[1]))
        with pytest.raises(CheckpointWriteError, match=r"file-size limit \(ulimit -f: 65,536 bytes\)") as e:
            m.save(_state(2, n=64 * 1024), 2, metric=5.0)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert e.value.errno == errno.EFBIG and "ulimit -f unlimited" in str(e.value) and "check the disk" not in str(e.value)
    _assert_nothing_lost(tmp_path, m, before)


def test_read_only_file_system_is_translated(tmp_path, monkeypatch):
    m, before = _manager_with_one_checkpoint(tmp_path)

    def read_only_mkstemp(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(kwargs.get("dir")))

    monkeypatch.setattr("data.files.tempfile.mkstemp", read_only_mkstemp)
    with pytest.raises(CheckpointWriteError, match=r"step-00000002\.pt: read-only file system \(/") as e:
        m.save(_state(2), 2, metric=5.0)
    assert "remount it read-write" in str(e.value)
    _assert_nothing_lost(tmp_path, m, before)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores file permissions")
def test_real_read_only_folder_is_translated(tmp_path):
    m, before = _manager_with_one_checkpoint(tmp_path)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(CheckpointWriteError, match="permission denied") as e:
            m.save(_state(2), 2, metric=5.0)
        assert e.value.errno == errno.EACCES
    finally:
        tmp_path.chmod(0o755)
    _assert_nothing_lost(tmp_path, m, before)


def test_other_errors_pass_through_and_leave_no_temp_file(tmp_path):
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a bug in the state, not the disk
        atomic_save({"f": lambda: 0}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


def test_average_checkpoints_is_the_mean_of_the_weights(tmp_path):
    from train.runs.checkpoint import average_checkpoints

    paths = []
    for i, w in enumerate((1.0, 2.0, 6.0)):
        state = {"model": {"w": torch.full((3,), w), "steps": torch.tensor(i)}, "config": {}, "position": {"epoch": 0, "batch_index": 0, "step": i}}
        paths.append(tmp_path / f"step-{i:08d}.pt")
        torch.save(state, paths[-1])
    avg = average_checkpoints(paths)
    assert torch.equal(avg["model"]["w"], torch.full((3,), 3.0))
    assert avg["model"]["steps"] == 2 and avg["position"]["step"] == 2  # integer buffers: the newest's
    assert avg["averaged_from"] == [str(p) for p in paths]


# ----------------------------------------------------------------------------------------------
# lineage: pruning and resume consider the run's own checkpoints only
# ----------------------------------------------------------------------------------------------
def _run_state(step: int, run_id: str | None) -> dict:
    state = _state(step)
    if run_id is not None:
        state["lineage"] = {"run_id": run_id, "parent": None}
    return state


def test_pruning_keeps_other_lineages_and_unreadable_files(tmp_path):
    torch.save(_run_state(1, "other"), tmp_path / "step-00000001.pt")
    (tmp_path / "step-00000002.pt").write_bytes(b"not a checkpoint")
    m = CheckpointManager(tmp_path, keep_last=1, run_id="mine")
    for step in (3, 4, 5):
        m.save(_run_state(step, "mine"), step)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000001.pt", "step-00000002.pt",
                                                           "step-00000005.pt"]
    assert [p.name for p in m.own_checkpoints()] == ["step-00000005.pt"]
    legacy = CheckpointManager(tmp_path, keep_last=1)  # no run id: every readable step file (older runs)
    legacy.save(_run_state(6, None), 6)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000002.pt", "step-00000006.pt"]


def test_latest_loadable_skips_other_lineages_and_refuses_when_none_is_the_runs(tmp_path):
    torch.save(_run_state(1, "mine"), tmp_path / "step-00000001.pt")
    torch.save(_run_state(2, "other"), tmp_path / "step-00000002.pt")
    logs = []
    path, ckpt = latest_loadable_checkpoint(tmp_path, logs.append, run_id="mine")
    assert path.name == "step-00000001.pt" and "belong to another run" in logs[0] and len(logs) == 1
    assert (tmp_path / "step-00000002.pt").is_file()  # left in place
    (tmp_path / "step-00000001.pt").write_bytes(b"x")
    for _ in range(2):  # every time, and nothing renamed
        with pytest.raises(CheckpointReadError, match="none of the 2 checkpoint"):
            latest_loadable_checkpoint(tmp_path, lambda m: None, run_id="mine")


# ----------------------------------------------------------------------------------------------
# background writes (train/runs/snapshot.py)
# ----------------------------------------------------------------------------------------------
def _live_state(step: int) -> dict:
    """A state shaped like the Trainer's: parameters as views into one flat buffer (copied by the writer
    thread: >= DEFER_BYTES), small tensors, an optimizer section, a history list."""
    flat = torch.arange(2**19, dtype=torch.float32) + step  # 2 MiB
    return {"model": {"a.weight": flat[:1000].view(10, 100), "b.bias": flat[1000:1010], "pos": torch.ones(3)},
            "optimizer": {"state": {0: {"exp_avg": flat * 0.5}}}, "config": {"model": {"d": 1}},
            "tokenizer": {"key": "k"}, "position": {"epoch": step, "batch_index": 0, "step": step},
            "history": [{"epoch": step, "step": step}], "rng": {"torch": torch.get_rng_state()}}


def _held_writes(monkeypatch):
    """Hold every background write until the returned event is set."""
    go = __import__("threading").Event()
    real = sv.atomic_save

    def held(obj, path):
        assert go.wait(timeout=120)
        return real(obj, path)

    monkeypatch.setattr(sv, "atomic_save", held)
    return go


def test_background_save_returns_before_the_write_and_writes_the_state_as_saved(tmp_path, monkeypatch):
    """``save`` returns while the write is held; once ``wait_staged`` says the copy is taken, the live tensors
    change (the next step) and the history grows, yet the file holds the state as it was at ``save``, views
    still sharing one storage; best.pt holds only what inference needs, and the best weights stay in memory."""
    go = _held_writes(monkeypatch)
    m = CheckpointManager(tmp_path, keep_last=2, mode="max", background=True)
    live = _live_state(1)
    expect = {k: v.clone() for k, v in live["model"].items()}
    path = m.save(live, 1, metric=1.0)
    assert not path.exists() and not (tmp_path / "best.pt").exists()  # the write is not done
    m.wait_staged()
    live["model"]["a.weight"].add_(7)  # the optimizer step after the checkpoint
    live["optimizer"]["state"][0]["exp_avg"].zero_()
    live["history"].append({"epoch": 99, "step": 99})
    go.set()
    m.wait()
    saved = load_checkpoint(path)
    assert all(torch.equal(saved["model"][k], v) for k, v in expect.items())
    assert saved["history"] == [{"epoch": 1, "step": 1}] and saved["optimizer"]["state"][0]["exp_avg"][5] == 3.0
    a, b = saved["model"]["a.weight"], saved["model"]["b.bias"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # views of one storage, as saved
    best = load_checkpoint(tmp_path / "best.pt")
    assert set(best) == {"model", "config", "tokenizer", "position", "kind"} and best["kind"] == "weights"
    assert all(torch.equal(best["model"][k], v) for k, v in expect.items())
    m.save(_live_state(2), 2, metric=0.5)  # not better: its snapshot reuses the staging buffers, not the best's
    m.save(_live_state(3), 3, metric=0.2)
    m.wait()
    assert all(torch.equal(m.best_state["model"][k], v) for k, v in expect.items())
    assert m.best_state["position"]["step"] == 1 and m.saves == 3
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000002.pt", "step-00000003.pt"]
    assert load_checkpoint(tmp_path / "step-00000003.pt")["model"]["b.bias"][0] == 1003.0
    assert not _temps(tmp_path)


def test_a_background_write_failure_is_raised_at_the_next_wait(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=1, background=True)
    m.save(_live_state(1), 1, metric=1.0)
    m.wait()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_space(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sv.torch, "save", no_space)
    m.save(_live_state(2), 2, metric=0.5)  # returns: the failure is the writer's
    with pytest.raises(CheckpointWriteError, match="step-00000002.pt: no space left on device.*step-00000001.pt"):
        m.wait()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
