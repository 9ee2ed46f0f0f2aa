"""Run folders: name checks, the run lock across real processes, the run marker and new-folder claims,
move-aside (bench.peers only), temp cleanup, metrics cut."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.runs.folder import (
    LOCK_NAME,
    MARKER_NAME,
    RunFolderError,
    RunLock,
    RunLockedError,
    claim_run_folder,
    cut_metrics,
    discard_unused_run_folder,
    done_record,
    folder_state,
    free_run_name,
    keep_through,
    read_marker,
    remove_stale_temp_files,
    run_finished,
    validate_run_name,
    write_marker,
)

REPO = Path(__file__).resolve().parents[3]


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
    (" x", "whitespace"), ("x" * 201, "201 bytes"), ("é" * 101, "202 bytes"),
], ids=["empty", "dot", "dotdot", "dots", "slash", "parent", "backslash", "nul", "newline", "dash", "space",
        "long", "long-in-bytes"])
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
    code = ("import sys; from train.runs.folder import RunLock; l = RunLock(sys.argv[1]).acquire(); "
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
        assert f"PID {proc.pid} " in msg and "train.runs.folder" in msg  # the holder's command line
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
    import train.runs.lock as rundir

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


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_is_killed(tmp_path):
    """DataLoader workers are forked: the lock must still die with the run's process."""
    run = tmp_path / "r"
    ready = tmp_path / "child-ready"
    code = ("import os, sys, time; from train.runs.folder import RunLock; l = RunLock(sys.argv[1]).acquire()\n"
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


# ----------------------------------------------------------------------------------------------
# the run marker: what a folder is, claiming new folders, removing unused ones
# ----------------------------------------------------------------------------------------------
def _user_folder(path: Path) -> dict[str, bytes]:
    """A folder a user made (files, a subfolder, no marker); returns its content for later comparison."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "sub" / "__init__.py").write_text("x = 1\n")
    return _tree(path)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_folder_state(tmp_path):
    assert folder_state(tmp_path / "none") == "missing"
    (tmp_path / "empty").mkdir()
    assert folder_state(tmp_path / "empty") == "empty"
    (tmp_path / "empty" / LOCK_NAME).write_text("")  # a lock file alone is still nothing
    assert folder_state(tmp_path / "empty") == "empty"
    _user_folder(tmp_path / "user")
    assert folder_state(tmp_path / "user") == "other"
    (tmp_path / "file").write_text("x")
    assert folder_state(tmp_path / "file") == "other"
    (tmp_path / "link").symlink_to(tmp_path / "empty")  # a link is judged by its folder
    assert folder_state(tmp_path / "link") == "empty"
    (tmp_path / "dangling").symlink_to(tmp_path / "none")
    assert folder_state(tmp_path / "dangling") == "other"
    write_marker(tmp_path / "empty", "abc")
    assert folder_state(tmp_path / "empty") == "run" and read_marker(tmp_path / "empty")["run_id"] == "abc"
    assert folder_state(tmp_path / "link") == "run"
    (tmp_path / "user" / MARKER_NAME).write_text('{"not": "ours"}')  # a run.json fastmt did not write
    assert folder_state(tmp_path / "user") == "other"
    legacy = tmp_path / "legacy"  # a run folder of an earlier fastmt: provenance.json + metrics.jsonl
    legacy.mkdir()
    (legacy / "provenance.json").write_text(json.dumps({"config": {}, "git_sha": None, "torch": "2"}))
    (legacy / "metrics.jsonl").write_text("")
    assert folder_state(legacy) == "run"


def test_claim_makes_a_new_folder_and_never_reuses_a_run(tmp_path):
    a, lock_a = claim_run_folder(tmp_path / "runs", "x", "id-a")
    assert a == tmp_path / "runs" / "x" and read_marker(a)["run_id"] == "id-a" and lock_a.held
    assert free_run_name(tmp_path / "runs", "x") == "x-2"
    b, lock_b = claim_run_folder(tmp_path / "runs", "x", "id-b", parent={"run_id": "id-a", "step": 4})
    assert b.name == "x-2" and read_marker(b)["parent"] == {"run_id": "id-a", "step": 4}
    lock_a.release()
    c, lock_c = claim_run_folder(tmp_path / "runs", "x", "id-c")  # released runs are runs too
    assert c.name == "x-3" and read_marker(a)["run_id"] == "id-a"
    for lock in (lock_b, lock_c):
        lock.release()
    (tmp_path / "runs" / "y").mkdir()  # an empty folder holds nothing to clobber: used as is
    y, lock_y = claim_run_folder(tmp_path / "runs", "y", "id-y")
    assert y.name == "y" and read_marker(y)["run_id"] == "id-y"
    lock_y.release()


def test_claim_refuses_a_folder_fastmt_did_not_make_and_changes_nothing(tmp_path):
    """A run name that is a package of the repo (``--run.out_dir .``), or any user folder: refused in one line,
    nothing moved, nothing written (this folder used to be renamed '<name>.prev-<time>')."""
    before = _user_folder(tmp_path / "data")
    with pytest.raises(RunFolderError) as e:
        claim_run_folder(tmp_path, "data", "id")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "data") in msg and "--run.name" in msg and "no fastmt run marker" in msg
    assert _tree(tmp_path / "data") == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_two_claims_at_once_get_two_folders(tmp_path):
    """Folders are made with mkdir (exclusive), the lock taken after: a process that claims the same name at
    the same moment ends up in another folder, never in ours."""
    code = ("import sys, time; from train.runs.folder import claim_run_folder\n"
            "d, lock = claim_run_folder(sys.argv[1], 'x', sys.argv[2]); print(d.name, flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"id{i}"], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i in range(3)]
    names = [p.stdout.readline().strip() for p in procs]
    for p in procs:
        p.stdin.close()
        p.wait()
    assert sorted(names) == ["x", "x-2", "x-3"]
    assert sorted(read_marker(tmp_path / n)["run_id"] for n in names) == ["id0", "id1", "id2"]


def test_an_unused_run_folder_is_removed_and_a_used_or_foreign_one_kept(tmp_path):
    d, lock = claim_run_folder(tmp_path, "x", "id")
    (d / "config.json").write_text("{}")
    (d / "metrics.jsonl").write_text("")
    (d / "provenance.json").write_text("{}")
    (d / "tensorboard").mkdir()
    (d / "tensorboard" / "events.out").write_bytes(b"e")
    (d / "checkpoints").mkdir()
    lock.release()
    assert discard_unused_run_folder(d, lambda m: None) and not d.exists()
    d, lock = claim_run_folder(tmp_path, "x", "id")
    lock.release()
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "step-00000001.pt").write_bytes(b"work")
    assert not discard_unused_run_folder(d) and (d / "checkpoints" / "step-00000001.pt").exists()
    (d / "checkpoints" / "step-00000001.pt").unlink()
    (d / "mine.txt").write_text("someone's file")
    assert not discard_unused_run_folder(d) and (d / "mine.txt").exists()
    assert not discard_unused_run_folder(tmp_path)  # no marker: never touched
    (tmp_path / "users").mkdir()  # an empty folder a user made: used, then emptied of our files but kept
    u, lock = claim_run_folder(tmp_path, "users", "id")
    lock.release()
    assert discard_unused_run_folder(u) and u.is_dir() and not any(u.iterdir())


def test_a_taken_name_whose_next_name_is_too_long_is_one_line(tmp_path):
    """A 199-character name that is taken: ``<name>-2`` would be 201 characters; the refusal is the run-folder
    error (exit 2, one line), not a ValueError traceback."""
    name = "a" * 199
    first, lock = claim_run_folder(tmp_path / "runs", name, "id-a")
    lock.release()
    with pytest.raises(RunFolderError, match="choose another --run.name"):
        claim_run_folder(tmp_path / "runs", name, "id-b")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [name]
