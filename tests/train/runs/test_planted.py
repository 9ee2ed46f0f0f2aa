"""What someone else planted in a run folder, or forged in a checkpoint, is refused before the run reads through it
or changes anything (issue 45, classes 3 and 7).

- A link at ``checkpoints/`` or at the newest checkpoint, or a hard-linked ``metrics.jsonl``: ``--resume auto`` (and
  ``--resume PATH`` in place) refuses in one line naming it, before any checkpoint is read, metrics.jsonl cut,
  config.json rewritten, a provenance file or a lock written. It used to read through the link, cut and rewrite,
  train an epoch and only then stop at the first checkpoint write (or resume from an older checkpoint).
- A checkpoint whose records are not what fastmt writes (``position`` without ``epoch``, ``history: [5]``, a
  ``batch_index`` past its epoch's batches) is one line naming the file and the field, never a traceback.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.utils import tiny_trainer
from train.errors import UserError
from train.runs.checkpoint import (
    CheckpointMismatchError,
    CheckpointReadError,
    load_checkpoint,
    read_checkpoint,
    step_checkpoints,
)
from train.runs.folder import RunFolderError
from train.runs.saving import atomic_save

KW = dict(epochs=2, max_batches_per_epoch=2, keep_last=5)  # 4 steps; stopped after 3: mid-epoch 2


@pytest.fixture
def stopped(toy_bundle, tmp_path):
    """A run stopped mid-way (step 3 of 4) with checkpoints at steps 2 and 3 and an epoch record to cut back to."""
    tr = tiny_trainer(toy_bundle, tmp_path, **KW)
    tr.fit(stop_after=3)
    run = tmp_path / "runs" / "t"
    assert [p.name for p in step_checkpoints(run / "checkpoints")] == ["step-00000002.pt", "step-00000003.pt"]
    return run


def snapshot(run: Path) -> dict[str, object]:
    """Every entry below ``run`` (links not followed) with its kind and, for a regular file, its bytes."""
    out: dict[str, object] = {}
    for root, dirs, files in os.walk(run):
        for name in dirs + files:
            p = Path(root) / name
            out[str(p.relative_to(run))] = (f"link to {os.readlink(p)}" if p.is_symlink() else
                                            p.read_bytes() if p.is_file() else "folder")
    return out


def refused_unchanged(toy_bundle, tmp_path, run: Path, match: str, elsewhere: Path | None = None, **kw) -> str:
    before, outside = snapshot(run), snapshot(elsewhere) if elsewhere else None
    with pytest.raises(RunFolderError, match=match) as e:
        tiny_trainer(toy_bundle, tmp_path, resume=kw.pop("resume", "auto"), **KW, **kw)
    assert "\n" not in str(e.value) and "nothing was read or changed" in str(e.value)
    assert snapshot(run) == before  # no cut, no config.json, no provenance, no lock file left
    if elsewhere is not None:
        assert snapshot(elsewhere) == outside
    return str(e.value)


def test_a_linked_checkpoints_folder_is_refused_before_anything_is_read_or_changed(toy_bundle, tmp_path, stopped):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(stopped / "checkpoints", elsewhere)
    (stopped / "checkpoints").symlink_to(elsewhere)
    message = refused_unchanged(toy_bundle, tmp_path, stopped, r"checkpoints is a symbolic link", elsewhere)
    assert str(elsewhere) in message  # where it points: the user sees what was planted


def test_a_linked_newest_checkpoint_is_refused_not_skipped_for_an_older_one(toy_bundle, tmp_path, stopped):
    newest = stopped / "checkpoints" / "step-00000003.pt"
    moved = tmp_path / "step-00000003.pt"
    shutil.move(newest, moved)
    newest.symlink_to(moved)
    refused_unchanged(toy_bundle, tmp_path, stopped, r"step-00000003\.pt is a symbolic link")
    # --resume PATH naming that run's own (real) older checkpoint continues in place: refused the same way
    refused_unchanged(toy_bundle, tmp_path, stopped, r"step-00000003\.pt is a symbolic link",
                      resume=str(stopped / "checkpoints" / "step-00000003.pt"))


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
def test_a_linked_or_hard_linked_record_is_refused_before_the_cut(toy_bundle, tmp_path, stopped, name):
    theirs = tmp_path / "theirs"
    shutil.copyfile(stopped / name, theirs)
    (stopped / name).unlink()
    if name == "metrics.jsonl":  # appended to in place: a hard link to someone's file would receive the lines
        os.link(theirs, stopped / name)
        match = r"metrics\.jsonl has 1 other hard link"
    else:
        (stopped / name).symlink_to(theirs)
        match = r"config\.json is a symbolic link"
    before = theirs.read_bytes()
    refused_unchanged(toy_bundle, tmp_path, stopped, match)
    assert theirs.read_bytes() == before


# ----------------------------------------------------------------------------------------------
# class 7: forged checkpoint records
# ----------------------------------------------------------------------------------------------
def forge(path: Path, change) -> None:
    ckpt = load_checkpoint(path)
    change(ckpt)
    atomic_save(ckpt, path)


@pytest.mark.parametrize("change, field", [
    (lambda c: c["position"].pop("epoch"), r"lacks position\.epoch"),
    (lambda c: c.__setitem__("history", [5]), r"history\[0\] 5 is not an epoch record"),
    (lambda c: c["history"].append({"kind": "epoch", "epoch": "1", "step": 2}), r"history\[\d\]\.epoch '1' is not"),
    (lambda c: c["position"].__setitem__("step", -1), r"position\.step -1 is not a count"),
    (lambda c: c["position"].__setitem__("clock", [1]), r"position\.clock \[1\] is not a record"),
    (lambda c: c.__setitem__("lineage", {"run_id": 7}), r"lineage\.run_id 7 is not a run id"),
], ids=["no-epoch", "history-int", "history-epoch-str", "negative-step", "clock-list", "run-id-int"])
def test_a_forged_record_is_one_line_naming_the_file_and_field(stopped, tmp_path, change, field):
    path = stopped / "checkpoints" / "step-00000003.pt"
    forge(path, change)
    with pytest.raises(CheckpointReadError, match=field) as e:
        read_checkpoint(path, "--resume")
    assert "step-00000003.pt" in str(e.value) and "\n" not in str(e.value)


def test_a_forged_newest_checkpoint_is_skipped_as_a_damaged_one(toy_bundle, tmp_path, stopped):
    """--resume auto treats it as it treats a truncated checkpoint: reported, left in place, the one before used;
    --resume PATH naming it is refused in one line (it used to be a KeyError in train/runs/plan.py)."""
    newest = stopped / "checkpoints" / "step-00000003.pt"
    forge(newest, lambda c: c["position"].pop("epoch"))
    with pytest.raises(CheckpointReadError, match="lacks position.epoch"):
        tiny_trainer(toy_bundle, tmp_path, resume=str(newest), **KW)
    logs: list[str] = []
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, **KW)
    assert tr.step == 2 and any("step-00000003.pt" in str(m) and "does not load" in str(m) for m in logs)
    tr.close()


def test_a_history_that_is_not_epoch_records_never_reaches_the_summary(toy_bundle, tmp_path, stopped):
    """history [5] used to train an epoch and then fail with AttributeError in the summary, on every resume."""
    for p in step_checkpoints(stopped / "checkpoints"):
        forge(p, lambda c: c.__setitem__("history", [5]))
    before, logs = snapshot(stopped), []
    with pytest.raises(CheckpointReadError, match=r"none of the 2 checkpoint\(s\) .* loads"):
        tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, **KW)
    assert sum("history[0] 5 is not an epoch record" in str(m) for m in logs) == 2
    assert snapshot(stopped) == before


def test_a_batch_index_past_its_epoch_is_refused_before_the_run_folder_changes(toy_bundle, tmp_path, stopped):
    newest = stopped / "checkpoints" / "step-00000003.pt"
    forge(newest, lambda c: c["position"].__setitem__("batch_index", 10**9))
    before = snapshot(stopped)
    with pytest.raises(CheckpointMismatchError, match=r"position\.batch_index 1,000,000,000 is past the \d+ batches"):
        tiny_trainer(toy_bundle, tmp_path, resume="auto", **KW)
    assert snapshot(stopped) == before
    assert issubclass(CheckpointMismatchError, UserError)
