"""Checkpoints from someone else (issue 27 rows 1, 5, 6, 10): loading is data, never code; a copied-in file is
neither pruned nor resumed; refusing changes nothing; a forged config allocates nothing. And checkpoints written
by fastmt before this change (the committed legacy-run fixture) still resume and translate."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.security.conftest import FIXTURES
from train.runs.checkpoint import (
    CheckpointIOError,
    CheckpointUnsafeError,
    latest_loadable_checkpoint,
    load_checkpoint,
    read_checkpoint,
    step_checkpoints,
)
from train.runs.folder import write_marker
from train.runs.saving import CheckpointManager

REPO = Path(__file__).resolve().parents[2]
LEGACY = FIXTURES / "legacy-run"
LEGACY_CKPT = LEGACY / "checkpoints" / "step-00000003.pt"


class _WritesMarker:
    """Unpickling this object calls ``open(marker, "w")``: proof that a load ran code from the file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil(path: Path, marker: Path, run_id: str | None = None) -> Path:
    state = {"model": {}, "config": {}, "position": {"epoch": 0, "batch_index": 0, "step": 1}, "x": _WritesMarker(marker)}
    if run_id:
        state["lineage"] = {"run_id": run_id, "parent": None}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def _state(step: int, run_id: str | None) -> dict:
    s = {"model": {"w": torch.full((8,), float(step))}, "config": {}, "position": {"epoch": 0, "step": step, "batch_index": 0}}
    if run_id:
        s["lineage"] = {"run_id": run_id, "parent": None}
    return s


def _run_folder(tmp_path: Path, run_id: str = "mine", adopted: bool = False) -> Path:
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    write_marker(run, run_id, adopted=adopted)
    return run / "checkpoints"


# ----------------------------------------------------------------------------------------------
# row 1: a pickle in a checkpoint never runs
# ----------------------------------------------------------------------------------------------
def test_row1_every_reader_refuses_a_pickle_that_runs_code(tmp_path):
    marker = tmp_path / "marker"
    evil = _evil(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointUnsafeError) as e:
        load_checkpoint(evil)
    msg = str(e.value)
    assert str(evil) in msg and "open" in msg and "\n" not in msg
    with pytest.raises(CheckpointUnsafeError):
        read_checkpoint(evil, "--init-from")
    assert not marker.exists()


def test_row1_pruning_never_unpickles_a_file_dropped_into_the_folder(tmp_path):
    marker = tmp_path / "marker"
    ckpts = _run_folder(tmp_path)
    _evil(ckpts / "step-00000001.pt", marker)
    m = CheckpointManager(ckpts, keep_last=1, run_id="mine")
    for step in (2, 3):
        m.save(_state(step, "mine"), step)
    assert not marker.exists()
    assert (ckpts / "step-00000001.pt").is_file()  # not ours: never pruned


def test_row1_resume_auto_refuses_a_planted_pickle_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    ckpts = _run_folder(tmp_path)
    torch.save(_state(1, "mine"), ckpts / "step-00000001.pt")
    _evil(ckpts / "step-00000002.pt", marker, run_id="mine")
    with pytest.raises(CheckpointUnsafeError, match="step-00000002.pt"):
        latest_loadable_checkpoint(ckpts, lambda m: None, run_id="mine")
    assert not marker.exists() and sorted(p.name for p in ckpts.iterdir()) == ["step-00000001.pt", "step-00000002.pt"]


def test_row1_translate_refuses_in_one_line_with_exit_2(tmp_path):
    marker = tmp_path / "marker"
    evil = _evil(tmp_path / "best.pt", marker)
    r = subprocess.run([sys.executable, "-m", "train.translate", "--ckpt", str(evil), "hello"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and str(evil) in line[0] and "Traceback" not in r.stderr
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# rows 5 and 6: foreign files are left alone, refusing changes nothing, an OS error is not corruption
# ----------------------------------------------------------------------------------------------
def test_row5_a_checkpoint_without_lineage_is_foreign_in_a_marked_folder(tmp_path):
    ckpts = _run_folder(tmp_path)
    torch.save(_state(1, None), ckpts / "step-00000001.pt")  # copied in from elsewhere
    torch.save(_state(9, None), ckpts / "step-00000009.pt")
    m = CheckpointManager(ckpts, keep_last=1, run_id="mine")
    for step in (2, 3):
        m.save(_state(step, "mine"), step)
    assert [p.name for p in step_checkpoints(ckpts)] == ["step-00000001.pt", "step-00000003.pt", "step-00000009.pt"]
    logs = []
    path, _ = latest_loadable_checkpoint(ckpts, logs.append, run_id="mine")
    assert path.name == "step-00000003.pt"  # not the newer copied-in step 9
    assert len([x for x in logs if "another run" in x]) == 1 and "step-00000009.pt" in logs[0]


def test_row5_a_run_older_than_lineage_ids_still_prunes_and_resumes_its_files(tmp_path):
    ckpts = _run_folder(tmp_path, adopted=True)  # the marker says: adopted from an earlier fastmt
    torch.save(_state(1, None), ckpts / "step-00000001.pt")
    m = CheckpointManager(ckpts, keep_last=1, run_id="mine")
    m.save(_state(2, "mine"), 2)
    assert [p.name for p in step_checkpoints(ckpts)] == ["step-00000002.pt"]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_row6_a_corrupt_newest_file_is_reported_and_nothing_is_renamed(tmp_path):
    ckpts = _run_folder(tmp_path)
    for step in (1, 2):
        torch.save(_state(step, "mine"), ckpts / f"step-{step:08d}.pt")
    _truncate(ckpts / "step-00000002.pt")
    before = sorted(p.name for p in ckpts.iterdir())
    logs = []
    path, _ = latest_loadable_checkpoint(ckpts, logs.append, run_id="mine")
    assert path.name == "step-00000001.pt" and "step-00000002.pt" in logs[0]
    assert sorted(p.name for p in ckpts.iterdir()) == before


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO, errno.ENOMEM])
def test_row6_an_os_error_stops_with_its_cause_instead_of_falling_back(tmp_path, monkeypatch, code):
    ckpts = _run_folder(tmp_path)
    for step in (1, 2):
        torch.save(_state(step, "mine"), ckpts / f"step-{step:08d}.pt")
    real = torch.load

    def flaky(f, *args, **kwargs):  # the newest file cannot be read right now (not its content)
        if str(getattr(f, "name", f)).endswith("step-00000002.pt"):
            raise OSError(code, os.strerror(code), str(f))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", flaky)
    with pytest.raises(CheckpointIOError, match="step-00000002.pt") as e:
        latest_loadable_checkpoint(ckpts, lambda m: None, run_id="mine")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001.pt", "step-00000002.pt"]


def test_row6_a_file_this_user_cannot_read_stops_the_resume(shared_tmp):
    """As another uid (root ignores permissions): a newest checkpoint it cannot read is not skipped."""
    from tests.security.conftest import run_as_nobody

    ckpts = _run_folder(shared_tmp)
    for step in (1, 2):
        torch.save(_state(step, "mine"), ckpts / f"step-{step:08d}.pt")
    for p in shared_tmp.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (ckpts / "step-00000002.pt").chmod(0o600)
    probe = ("import sys; from train.runs.checkpoint import latest_loadable_checkpoint as f\n"
             "try:\n    print(f(sys.argv[1], lambda m: None, run_id='mine')[0])\n"
             "except Exception as e:\n    print(type(e).__name__, e)\n")
    r = run_as_nobody(shared_tmp, probe, str(ckpts))
    assert r.stdout.startswith("CheckpointIOError") and "permission denied" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# row 10: a forged config allocates nothing
# ----------------------------------------------------------------------------------------------
def _forged(tmp_path: Path, **model) -> Path:
    ckpt = torch.load(LEGACY_CKPT, weights_only=False)  # the committed fixture: trusted here
    ckpt["config"]["model"].update(model)
    out = tmp_path / "forged.pt"
    torch.save(ckpt, out)
    return out


@pytest.mark.parametrize("model", [{"d_ff": 2**36}, {"positions": "sinusoidal", "max_positions": 2**31}],
                         ids=["huge-ffn", "huge-position-table"])
def test_row10_a_forged_config_is_refused_before_allocating(tmp_path, model):
    forged = _forged(tmp_path, **model)
    assert forged.stat().st_size < 1_000_000
    limit = 6 * 2**30  # the child may not take more than this, whatever the file says

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "train.translate", "--ckpt", str(forged), "--device", "cpu", "hello"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "forged" in r.stderr and str(forged) in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------------------------
# checkpoints written by fastmt before this change keep loading
# ----------------------------------------------------------------------------------------------
def _legacy_config(tmp_path: Path, **changes):
    from tests.utils import tiny_config

    return tiny_config(tmp_path, name="legacy",
                       model=dict(d_model=16, n_heads=2, d_ff=16, enc_layers=1, dec_layers=1, enc_unique=1,
                                  dec_unique=1, max_positions=40),
                       data=dict(toy_rows=300, vocab_size=300, valid_size=20, test_size=20), keep_last=1, **changes)


def test_a_checkpoint_of_the_previous_format_resumes_and_translates(tmp_path):
    from tests.utils import records
    from train.evaluation.decode import Decoding, translate_lines
    from train.evaluation.load import load_for_inference
    from train.loop import Trainer

    run = tmp_path / "runs" / "legacy"
    shutil.copytree(LEGACY, run)
    shutil.copy(run / "checkpoints" / "step-00000003.pt", run / "checkpoints" / "best.pt")
    old = torch.load(LEGACY_CKPT, weights_only=False)
    assert isinstance(old["rng"]["numpy"], tuple)  # the fixture really is the old format (a numpy array inside)
    model, tok, ckpt = load_for_inference(run / "checkpoints" / "best.pt")
    d = Decoding(beam_size=1, length_penalty=0.6, max_len_a=1.5, max_len_b=5, batch_size=4, precision="fp32")
    out = translate_lines(model, tok, ["the cat", "", "red house"], torch.device("cpu"), d)
    assert len(out) == 3 and out[1] == "" and all(isinstance(x, str) for x in out)
    tr = Trainer(_legacy_config(tmp_path, epochs=2, max_batches_per_epoch=3), resume="auto", log=lambda *a: None)
    assert tr.step == 3 and tr.run_id == json.loads((LEGACY / "run.json").read_text())["run_id"]
    tr.fit()
    assert tr.step == 6 and [r["epoch"] for r in records(run, "epoch")] == [1, 2]
    new = step_checkpoints(run / "checkpoints")[-1]
    assert isinstance(load_checkpoint(new)["rng"]["numpy"], dict)  # written in the new, plain format


def test_a_fifo_planted_as_a_checkpoint_never_blocks_pruning_or_resume(tmp_path):
    ckpts = _run_folder(tmp_path)
    torch.save(_state(1, "mine"), ckpts / "step-00000001.pt")
    os.mkfifo(ckpts / "step-00000009.pt")  # opening it for reading would wait forever for a writer
    CheckpointManager(ckpts, keep_last=1, run_id="mine").save(_state(2, "mine"), 2)
    path, _ = latest_loadable_checkpoint(ckpts, lambda m: None, run_id="mine")
    assert path.name == "step-00000002.pt" and (ckpts / "step-00000009.pt").exists()


def test_a_damaged_tokenizer_in_a_checkpoint_is_one_line(tmp_path):
    ckpt = torch.load(LEGACY_CKPT, weights_only=False)
    ckpt["tokenizer"] = {"model_bytes": b"\x00 not a sentencepiece model", "key": "x"}
    torch.save(ckpt, tmp_path / "bad.pt")
    r = subprocess.run([sys.executable, "-m", "train.translate", "--ckpt", str(tmp_path / "bad.pt"), "hi"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "tokenizer does not load" in r.stderr and "Traceback" not in r.stderr
