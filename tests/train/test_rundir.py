"""Run folders: name checks, the run lock across real processes, move-aside, temp cleanup, metrics cut."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.rundir import (
    LOCK_NAME,
    RunLock,
    RunLockedError,
    cut_metrics,
    done_record,
    keep_through,
    move_aside_previous_run,
    remove_stale_temp_files,
    run_finished,
    validate_run_name,
)

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# names
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t", "en-it-tiny", "wmt14_s18.v2", "a.b", ".hidden", "x" * 200, "run 2"])
def test_good_run_names_pass(name):
    assert validate_run_name(name) == name


@pytest.mark.parametrize("name, why", [
    ("", "empty"), (".", "only dots"), ("..", "only dots"), ("...", "only dots"),
    ("a/b", "path separator"), ("../x", "path separator"), ("a\\b", "path separator"),
    ("a\0b", "control character"), ("a\nb", "control character"), ("-x", "starts with '-'"),
    (" x", "whitespace"), ("x" * 201, "201 characters"),
], ids=["empty", "dot", "dotdot", "dots", "slash", "parent", "backslash", "nul", "newline", "dash", "space",
        "long"])
def test_bad_run_names_say_why_and_what_works(name, why):
    with pytest.raises(ValueError) as e:
        validate_run_name(name)
    msg = str(e.value)
    assert why in msg and repr(name) in msg and "en-it-tiny" in msg


# ----------------------------------------------------------------------------------------------
# the lock
# ----------------------------------------------------------------------------------------------
def test_lock_records_holder_and_blocks_a_second_open_in_the_same_process(tmp_path):
    run = tmp_path / "runs" / "r"
    with RunLock(run) as lock:
        info = json.loads((run / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid() and info["host"] and info["started"].endswith("Z")
        with pytest.raises(RunLockedError, match=rf"PID {os.getpid()} \(this process\).*--run\.name"):
            RunLock(run).acquire()
        assert lock.held
    assert not lock.held and not (run / LOCK_NAME).exists()
    with RunLock(run):  # free again
        pass


def _holder(run_dir: Path) -> subprocess.Popen:
    """A second process that takes the lock, says so, and waits for stdin to close."""
    code = ("import sys; from train.rundir import RunLock; l = RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_fails_at_once_naming_the_holder_and_kill9_frees_the_lock(tmp_path):
    run = tmp_path / "r"
    proc = _holder(run)
    try:
        with pytest.raises(RunLockedError) as e:
            RunLock(run).acquire()
        msg = str(e.value)
        assert f"PID {proc.pid} " in msg and "train.rundir" in msg  # the holder's command line
        assert f"kill {proc.pid}" in msg and "--run.name" in msg
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == proc.pid  # the dead holder's file stays...
    with RunLock(run):  # ...and does not block
        assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_clean_release_in_another_process_frees_the_lock(tmp_path):
    proc = _holder(tmp_path / "r")
    proc.stdin.close()
    assert proc.wait() == 0
    with RunLock(tmp_path / "r"):
        pass


# ----------------------------------------------------------------------------------------------
# move aside
# ----------------------------------------------------------------------------------------------
def test_move_aside_needs_the_targets_lock(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RuntimeError, match="hold RunLock"):
        move_aside_previous_run(run, lock=RunLock(run))  # not acquired
    with RunLock(tmp_path / "other") as other, pytest.raises(RuntimeError, match="hold RunLock"):
        move_aside_previous_run(run, lock=other)
    assert (run / "metrics.jsonl").exists()


def test_move_aside_keeps_everything_and_the_lock_on_the_name(tmp_path):
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001.pt").write_bytes(b"ckpt")
    (run / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 1}\n')
    logs = []
    with RunLock(run) as lock:
        moved = move_aside_previous_run(run, logs.append, lock=lock)
        assert moved is not None and moved.name.startswith("r.prev-") and moved.parent == tmp_path
        assert (moved / "checkpoints" / "step-00000001.pt").read_bytes() == b"ckpt"
        assert (moved / "metrics.jsonl").is_file() and not (moved / LOCK_NAME).exists()
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # a fresh folder, still ours
        with pytest.raises(RunLockedError):
            RunLock(run).acquire()
        assert str(moved) in logs[0]
        assert move_aside_previous_run(run, logs.append, lock=lock) is None  # only the lock file: nothing to move
    assert not (run / LOCK_NAME).exists()


# ----------------------------------------------------------------------------------------------
# temp files
# ----------------------------------------------------------------------------------------------
def test_stale_temp_files_are_removed_and_reported(tmp_path):
    names = [".step-00000004.pt.tmp-123", ".best.pt.tmp-99", "step-00000002.pt", "best.pt", "notes.tmp",
             ".step-00000003.pt.tmp-abc"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 10)
    logs = []
    removed = remove_stale_temp_files(tmp_path, logs.append)
    assert sorted(p.name for p in removed) == [".best.pt.tmp-99", ".step-00000004.pt.tmp-123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000003.pt.tmp-abc", "best.pt", "notes.tmp",
                                                           "step-00000002.pt"]
    assert ".step-00000004.pt.tmp-123" in logs[0]
    assert remove_stale_temp_files(tmp_path, logs.append) == [] and len(logs) == 1
    assert remove_stale_temp_files(tmp_path / "missing") == []


# ----------------------------------------------------------------------------------------------
# metrics cut and the end of a run
# ----------------------------------------------------------------------------------------------
def _line(rec) -> bytes:
    return (json.dumps(rec) + "\n").encode()


def test_cut_metrics_back_to_a_checkpoint_loses_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        _line({"kind": "epoch", "epoch": 1, "step": 10}),
        _line({"kind": "step", "step": 15, "loss": 3.0}),
        _line({"kind": "epoch", "epoch": 2, "step": 20}),
        _line({"kind": "step", "step": 25, "loss": 2.0}),
        _line({"kind": "epoch", "epoch": 3, "step": 30}),  # logged, but the kill came before its checkpoint
        _line({"kind": "test", "epoch": 3, "test_bleu": 1.0}),
        _line({"kind": "done", "epoch": 3, "step": 30}),
        b"\xff\xfe not utf-8\n",
        b"[1, 2]\n",
        b'{"kind": "epoch", "epo',  # torn: killed mid-write
    ]
    original = b"".join(lines)
    path.write_bytes(original)
    logs = []
    side = cut_metrics(path, keep={"epoch": 2, "step": 20, "batch_index": 0}, log=logs.append)
    assert side is not None and side.parent == tmp_path and side.name.startswith("metrics.cut-")
    assert path.read_bytes() == b"".join(lines[:3])
    assert side.read_bytes() == b"".join(lines[3:-1]) + lines[-1] + b"\n"  # verbatim, newline added
    assert sorted(path.read_bytes().splitlines() + side.read_bytes().splitlines()) == sorted(original.splitlines())
    assert "line 8, 9, 10" in logs[0] and str(side) in logs[0]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cut_metrics_leaves_a_clean_file_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    data = _line({"kind": "epoch", "epoch": 1, "step": 10}) + b"\n" + _line({"note": "no position"})
    path.write_bytes(data)
    assert cut_metrics(path, keep=(1, 10)) is None and path.read_bytes() == data
    assert cut_metrics(tmp_path / "missing.jsonl", keep=(0, 0)) is None
    assert list(tmp_path.iterdir()) == [path]


def test_cut_metrics_with_a_predicate_and_a_second_cut_gets_its_own_side_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_line({"kind": "epoch", "epoch": e, "step": 10 * e}) for e in (1, 2, 3)))
    first = cut_metrics(path, keep=lambda r: r["epoch"] < 3, log=lambda m: None)
    path.write_bytes(path.read_bytes() + _line({"kind": "epoch", "epoch": 3, "step": 30}))
    second = cut_metrics(path, keep=(1, 10), log=lambda m: None)
    assert first != second and first.exists() and second.exists()
    assert [json.loads(x)["epoch"] for x in path.read_bytes().splitlines()] == [1]
    assert [json.loads(x)["epoch"] for x in second.read_bytes().splitlines()] == [2, 3]


def test_keep_through_rules():
    keep = keep_through(epoch=2, step=20)
    assert keep({"kind": "epoch", "epoch": 2, "step": 20})
    assert not keep({"kind": "epoch", "epoch": 3, "step": 20})
    assert not keep({"kind": "step", "step": 21})
    assert keep({"kind": "step", "step": 19, "epoch": 2})
    assert not keep({"kind": "test", "epoch": 1})
    assert not keep({"kind": "done", "epoch": 1, "step": 1})
    assert keep({"kind": "note"})


def test_run_finished(tmp_path):
    assert run_finished(tmp_path) is None
    path = tmp_path / "metrics.jsonl"
    epoch = _line({"kind": "epoch", "epoch": 1, "step": 10})
    test = _line({"kind": "test", "epoch": 1, "test_bleu": 2.5})
    done = done_record(epoch=1, step=10, stop_reason="done", test_bleu=2.5)
    assert done["kind"] == "done" and done["time"].endswith("Z") and done["test_bleu"] == 2.5
    path.write_bytes(epoch)
    assert run_finished(tmp_path) is None
    path.write_bytes(epoch + test)
    assert run_finished(tmp_path)["kind"] == "test"  # runs logged before "done" existed
    path.write_bytes(epoch + test + _line(done) + b'{"torn')
    assert run_finished(tmp_path) == done
    path.write_bytes(epoch + test + epoch.replace(b"1", b"2"))  # trained on after a test line
    assert run_finished(tmp_path) is None


def test_lock_taken_on_a_file_its_holder_just_removed_is_retaken_on_the_current_file(tmp_path, monkeypatch):
    """Between our open() and flock() the previous holder may release (remove the file): a lock on
    the removed file would exclude nobody, so acquire() must end up on the file at the path."""
    import train.rundir as rundir

    run = tmp_path / "r"
    run.mkdir()
    (run / LOCK_NAME).write_text("")
    real_flock, calls = rundir.fcntl.flock, []

    def flock_after_release(fd, op):
        calls.append(fd)
        if len(calls) == 1:
            (run / LOCK_NAME).unlink()  # the previous holder's release()
        return real_flock(fd, op)

    monkeypatch.setattr(rundir.fcntl, "flock", flock_after_release)
    with RunLock(run) as lock:
        assert len(calls) == 2
        assert os.fstat(lock._fd).st_ino == os.stat(run / LOCK_NAME).st_ino
        monkeypatch.setattr(rundir.fcntl, "flock", real_flock)
        with pytest.raises(RunLockedError):
            RunLock(run).acquire()


def test_move_aside_when_another_run_takes_the_name_in_between(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    lock, other = RunLock(run).acquire(), RunLock(run)
    real_acquire = lock.acquire

    def acquire_after_other():
        other.acquire()  # the other run starts right after our rename
        return real_acquire()

    lock.acquire = acquire_after_other
    with pytest.raises(RunLockedError):
        move_aside_previous_run(run, lambda m: None, lock=lock)
    moved = next(tmp_path.glob("r.prev-*"))
    assert (moved / "metrics.jsonl").is_file() and not (moved / LOCK_NAME).exists()
    assert not lock.held and other.held
    other.release()


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_is_killed(tmp_path):
    """DataLoader workers are forked: the lock must still die with the run's process."""
    run = tmp_path / "r"
    ready = tmp_path / "child-ready"
    code = ("import os, sys, time; from train.rundir import RunLock; l = RunLock(sys.argv[1]).acquire()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    ok = not l.held; l.release(); open(sys.argv[2], 'w').close(); time.sleep(60 if ok else 0)\n"
            "    os._exit(0)\n"
            "print(pid, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run), str(ready)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:  # the child has run its after-fork hook
        time.sleep(0.05)
    assert ready.exists()
    try:
        with pytest.raises(RunLockedError, match=f"PID {proc.pid} "):  # the child's release() removed nothing
            RunLock(run).acquire()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the forked child still runs...
        with RunLock(run):  # ...and holds no lock
            pass
    finally:
        proc.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_dropped_lock_frees_the_name(tmp_path):
    lock = RunLock(tmp_path / "r").acquire()
    del lock
    with RunLock(tmp_path / "r"):
        pass
