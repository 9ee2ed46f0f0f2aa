"""Run folders and records from someone else (issue 27 rows 3, 4, 9; issue 30's damaged run.json): no lock,
record or checkpoint write follows a planted link; the compile caches are private; Makefile variables are data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data.files import FileRefusedError
from tests.security.conftest import FIXTURES, victim
from train.runs.folder import write_marker, write_text_atomic
from train.runs.lock import RunLock
from train.runs.metrics import MetricsLogger, plot_curves, write_provenance
from train.runs.saving import atomic_save

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# row 3: planted links in a run folder
# ----------------------------------------------------------------------------------------------
def test_row3_a_planted_run_lock_link_is_refused(tmp_path):
    v = victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(v)
    with pytest.raises(FileRefusedError, match=r"run lock .*\.lock is a symbolic link"):
        RunLock(run).acquire()
    assert v.read_text() == "precious\n"


def test_row3_metrics_provenance_and_curves_never_write_through_a_link(tmp_path):
    v = victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "provenance.json", "curves.png"):
        (run / name).symlink_to(v)
    m = MetricsLogger(run, tensorboard=False)
    with pytest.raises(FileRefusedError, match="metrics.jsonl"):
        m.log({"kind": "epoch", "epoch": 1, "step": 1, "train_loss": 1.0})
    with pytest.raises(FileRefusedError, match="provenance.json"):
        write_provenance(run, {}, None, {}, step=0, log=lambda *a: None)
    (run / "m.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 1, "step": 1, "train_loss": 1.0}) + "\n")
    if plot_curves(run / "m.jsonl", run / "x.png") is not None:  # matplotlib installed
        with pytest.raises(FileRefusedError, match="curves.png"):
            plot_curves(run / "m.jsonl", run / "curves.png")
    assert v.read_text() == "precious\n"


def test_row3_predictable_temp_names_are_gone(tmp_path):
    """A link planted at the temp name the old writers used (``.<name>.tmp-<pid>``) receives nothing."""
    v = victim(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.json", "run.json"):
        (run / f".{name}.tmp-{os.getpid()}").symlink_to(v)
    (run / "checkpoints" / f".step-00000002.pt.tmp-{os.getpid()}").symlink_to(v)
    write_text_atomic(run / "config.json", "{}\n")
    write_marker(run, "abc")
    atomic_save({"model": {}, "config": {}, "position": {}}, run / "checkpoints" / "step-00000002.pt")
    assert v.read_text() == "precious\n" and (run / "config.json").read_text() == "{}\n"


def test_row3_a_symlinked_checkpoint_is_refused_in_one_line(tmp_path):
    v = victim(tmp_path)
    (tmp_path / "step-00000002.pt").symlink_to(v)
    with pytest.raises(FileRefusedError) as e:
        atomic_save({"model": {}, "config": {}, "position": {}}, tmp_path / "step-00000002.pt")
    assert "step-00000002.pt" in str(e.value) and "symbolic link" in str(e.value) and "\n" not in str(e.value)
    assert v.read_text() == "precious\n" and (tmp_path / "step-00000002.pt").is_symlink()


# ----------------------------------------------------------------------------------------------
# issue 30: a damaged run.json is refused, never silently rewritten as an adopted run
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe"], ids=["empty", "not-json", "not-utf8"])
def test_a_damaged_run_marker_is_refused_and_left_as_it_is(tmp_path, content):
    from tests.security.test_checkpoints import _legacy_config
    from train.runs.folder import RunFolderError
    from train.runs.plan import plan_run

    run = tmp_path / "runs" / "legacy"
    shutil.copytree(FIXTURES / "legacy-run", run)
    (run / "provenance.json").write_text(json.dumps({"config": {}, "git_sha": None, "torch": "2.13"}))
    (run / "run.json").write_bytes(content)
    with pytest.raises(RunFolderError, match="run.json is damaged") as e:
        plan_run(_legacy_config(tmp_path), resume="auto", log=lambda *a: None)
    assert "\n" not in str(e.value) and (run / "run.json").read_bytes() == content


# ----------------------------------------------------------------------------------------------
# row 4: compile caches are private
# ----------------------------------------------------------------------------------------------
_PROBE = """
import json
from train.compile import configure_caches
from train.config import RunConfig
print(json.dumps(configure_caches(RunConfig().cache_dir)))
"""


def test_row4_the_default_compile_cache_is_private_and_not_in_the_current_folder(tmp_path):
    home, work = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR",
                                                          "TRITON_CACHE_DIR")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    dirs = json.loads(r.stdout.strip().splitlines()[-1])
    root = home / ".cache" / "fastmt" / "compile"
    assert Path(dirs["inductor"]).parent == root and Path(dirs["triton"]).parent == root
    assert root.stat().st_mode & 0o777 == 0o700 and not (work / ".cache").exists()


@pytest.mark.parametrize("how", ["others-write", "other-owner"])
def test_row4_a_compile_cache_others_can_write_is_refused(tmp_path, how):
    from train.compile import CacheDirError, configure_caches

    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "others-write":
        shared.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        os.chown(shared, 65534, 65534)
    with pytest.raises(CacheDirError, match="--run.cache_dir") as e:
        configure_caches(str(shared))
    assert "\n" not in str(e.value) and str(shared) in str(e.value)
    assert not any(str(shared) in os.environ.get(k, "") for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))


# ----------------------------------------------------------------------------------------------
# row 9: Makefile variables are data
# ----------------------------------------------------------------------------------------------
def _make(sandbox: Path, *args: str) -> subprocess.CompletedProcess:
    if not shutil.which("make"):
        pytest.skip("no make")
    return subprocess.run(["make", "-s", "-f", str(REPO / "Makefile"), "-C", str(sandbox), *args],
                          capture_output=True, text=True, timeout=120)


def test_row9_make_clean_with_a_space_in_venv_removes_only_that_folder(tmp_path):
    sandbox = tmp_path / "sandbox"
    (sandbox / "x").mkdir(parents=True)
    (sandbox / "x" / "keep").write_text("mine")
    (sandbox / "x y" / "venv" / "bin").mkdir(parents=True)
    r = _make(sandbox, "clean", f"VENV={sandbox}/x y/venv", f"VENV_MIN={sandbox}/none")
    assert r.returncode == 0, r.stderr
    assert (sandbox / "x" / "keep").read_text() == "mine" and not (sandbox / "x y" / "venv").exists()


def test_row9_a_semicolon_in_data_files_or_python_runs_nothing(tmp_path):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    pwned = sandbox / "pwned"
    r = _make(sandbox, "train", "SETUP=none", "PYTHON=true", f"DATA_FILES=a.jsonl;touch {pwned}")
    assert r.returncode == 0, r.stderr
    r = _make(sandbox, "stats", "SETUP=none", f"PYTHON=true;touch {pwned};true", "DATA_FILES=a.jsonl")
    r = _make(sandbox, "train", "SETUP=none", "PYTHON=true", f"DATA_FILES=$(shell touch {pwned})")  # make syntax
    r = _make(sandbox, "clean", f"VENV={sandbox}/$(shell touch {pwned})", f"VENV_MIN={sandbox}/none")
    assert r.returncode == 0 and not pwned.exists()
    dry = _make(sandbox, "-n", "train", "SETUP=none", "PYTHON=/opt/my python/bin/python", "DATA_FILES=a;b c")
    assert "'/opt/my python/bin/python' -m train" in dry.stdout and "--data-files 'a;b' 'c'" in dry.stdout


# ----------------------------------------------------------------------------------------------
# probes beyond the table: FIFOs and hard links planted as records
# ----------------------------------------------------------------------------------------------
def test_a_fifo_or_hard_link_planted_as_metrics_is_refused_without_hanging(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(FileRefusedError, match="not a regular file"):
        MetricsLogger(run, tensorboard=False).log({"kind": "epoch"})
    (run / "metrics.jsonl").unlink()
    v = victim(tmp_path)
    os.link(v, run / "metrics.jsonl")
    with pytest.raises(FileRefusedError, match="hard links"):
        MetricsLogger(run, tensorboard=False).log({"kind": "epoch"})
    assert v.read_text() == "precious\n"


def test_a_run_folder_turned_read_only_is_one_line(tmp_path, tmpfs):
    fs = tmpfs("1m")
    m = MetricsLogger(fs.path / "run", tensorboard=False)
    m.log({"kind": "epoch", "epoch": 1})
    fs.read_only()
    with pytest.raises(FileRefusedError) as e:
        m.log({"kind": "epoch", "epoch": 2})
    assert "read-only" in str(e.value) and "--run.out_dir" in str(e.value) and "\n" not in str(e.value)
