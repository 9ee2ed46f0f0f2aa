"""A run folder has an identity and one lineage (issue 20 rows 2, 3, 4, 7; issue 23 item 2): fastmt never
writes into, moves or prunes what is not its run; a checkpoint of another run, or an earlier point of this
one, continues in a new folder; pruning and ``--resume auto`` see the run's own lineage only; a run whose
checkpoints do not load is refused every time."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.train.runs_helpers import train_argv, tree
from tests.utils import records, tiny_trainer
from train.cli.train import main
from train.errors import EXIT_USAGE
from train.runs.checkpoint import CheckpointReadError, load_checkpoint, step_checkpoints
from train.runs.folder import RunFolderError, read_marker

KW = dict(epochs=1, max_batches_per_epoch=2)


def _lineage(path) -> str:
    return load_checkpoint(path)["lineage"]["run_id"]


def test_a_folder_that_is_not_a_run_is_refused_in_one_line_and_left_alone(toy_bundle, tmp_path, capsys):
    """Row 2: ``--run.out_dir`` holding a folder named like the run (here a package of a checkout) used to
    be renamed '<name>.prev-<time>' as "an earlier run"."""
    (tmp_path / "runs" / "data").mkdir(parents=True)
    (tmp_path / "runs" / "data" / "__init__.py").write_text("x = 1\n")
    before = tree(tmp_path)
    with pytest.raises(RunFolderError, match="no fastmt run marker"):
        tiny_trainer(toy_bundle, tmp_path, name="data", **KW)
    assert tree(tmp_path) == before and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["data"]
    code = main(train_argv(toy_bundle.cfg.cache_dir, tmp_path, name="data"))
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert str(tmp_path / "runs" / "data") in err and "--run.name" in err
    assert tree(tmp_path) == before


def test_resuming_another_runs_checkpoint_under_a_finished_runs_name_leaves_it_whole(toy_bundle, tmp_path):
    """Row 3: ``--resume <B's checkpoint>`` under the name of finished run A: A's checkpoints, metrics and
    provenance are untouched; B's weights continue in a new folder whose lineage names B and its step."""
    a = tiny_trainer(toy_bundle, tmp_path, name="a", **KW)
    a.fit()
    b = tiny_trainer(toy_bundle, tmp_path, name="b", seed=1, epochs=2, max_batches_per_epoch=2)
    b.fit()
    a_before, b_before = tree(a.run_dir), tree(b.run_dir)
    b_ckpt = step_checkpoints(b.run_dir / "checkpoints")[0]  # step 2 of B
    logs = []
    c = tiny_trainer(toy_bundle, tmp_path, name="a", resume=b_ckpt, log=logs.append, seed=1, epochs=2,
                     max_batches_per_epoch=2)
    assert c.run_dir.name == "a-2" and c.step == 2
    assert any("is not a checkpoint of run" in str(m) for m in logs)
    c.fit()
    assert tree(a.run_dir) == a_before and tree(b.run_dir) == b_before
    marker = read_marker(c.run_dir)
    assert marker["parent"]["run_id"] == read_marker(b.run_dir)["run_id"] and marker["parent"]["step"] == 2
    assert {_lineage(p) for p in step_checkpoints(c.run_dir / "checkpoints")} == {marker["run_id"]}
    kinds = [r["kind"] for r in records(c.run_dir)]
    assert kinds[0] == "branch" and kinds[-1] == "done"
    # B's epoch 1 came along (marked as inherited) so the new folder's curves show the whole lineage
    assert [r["epoch"] for r in records(c.run_dir, "epoch")] == [1, 2]
    assert records(c.run_dir, "epoch")[0]["inherited_from"] == marker["parent"]["run_id"]


def test_a_roll_back_branches_into_a_new_folder_and_auto_resume_follows_the_branch(toy_bundle, tmp_path):
    """Row 4: rolling back to an earlier checkpoint with a changed setting, then an interruption and
    ``--resume auto``: the branch's checkpoints are never pruned in favour of the abandoned steps, and the
    resume continues the branch."""
    kw = dict(epochs=2, max_batches_per_epoch=4, keep_last=2)
    a = tiny_trainer(toy_bundle, tmp_path, **kw)
    a.fit()
    a_before = tree(a.run_dir)
    early = a.run_dir / "checkpoints" / "step-00000004.pt"
    assert early.is_file() and step_checkpoints(a.run_dir / "checkpoints")[-1].name == "step-00000008.pt"
    branch = tiny_trainer(toy_bundle, tmp_path, resume=early, optim={"lr": 1e-3}, **kw)
    assert branch.run_dir.name == "t-2" and branch.step == 4
    assert branch.fit(stop_after=2)["stop_reason"] == "interrupted"  # as if killed after step 6's checkpoint
    again = tiny_trainer(toy_bundle, tmp_path, name="t-2", resume="auto", optim={"lr": 1e-3}, **kw)
    assert again.step == 6 and again.run_id == read_marker(branch.run_dir)["run_id"]
    again.fit()
    own = step_checkpoints(again.run_dir / "checkpoints")
    assert [p.name for p in own] == ["step-00000006.pt", "step-00000008.pt"]  # keep_last 2 of the branch
    assert {_lineage(p) for p in own} == {again.run_id}
    assert load_checkpoint(own[-1])["config"]["optim"]["lr"] == 1e-3
    assert tree(a.run_dir) == a_before  # the abandoned branch is whole


def test_resume_of_the_newest_point_continues_in_place(toy_bundle, tmp_path):
    """``--resume <the run's own newest checkpoint>`` is a plain resume: same folder, same lineage."""
    a = tiny_trainer(toy_bundle, tmp_path, epochs=2, max_batches_per_epoch=2)
    a.fit(stop_after=3)
    newest = step_checkpoints(a.run_dir / "checkpoints")[-1]
    b = tiny_trainer(toy_bundle, tmp_path, resume=newest, epochs=2, max_batches_per_epoch=2)
    assert b.run_dir == a.run_dir and b.run_id == a.run_id and b.step == 3
    b.close()


def test_pruning_and_auto_resume_see_only_the_runs_own_lineage(toy_bundle, tmp_path):
    """A checkpoint of another run dropped into the folder (newer step number) is neither resumed nor pruned."""
    other = tiny_trainer(toy_bundle, tmp_path, name="other", epochs=1, max_batches_per_epoch=9)
    other.fit()
    a = tiny_trainer(toy_bundle, tmp_path, epochs=3, max_batches_per_epoch=2, keep_last=1)
    a.fit(stop_after=2)
    foreign = a.run_dir / "checkpoints" / "step-00000009.pt"
    shutil.copy(step_checkpoints(other.run_dir / "checkpoints")[-1], foreign)
    logs = []
    b = tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, epochs=3, max_batches_per_epoch=2,
                     keep_last=1)
    assert b.step == 2 and sum("belong to another run" in str(m) for m in logs) == 1
    b.fit()
    assert foreign.is_file() and _lineage(foreign) == other.run_id
    assert [p.name for p in step_checkpoints(b.run_dir / "checkpoints")] == ["step-00000006.pt", foreign.name]


def test_auto_resume_with_no_loadable_checkpoint_refuses_every_time(toy_bundle, tmp_path):
    """Row 7: the first ``--resume auto`` refused and the second started fresh (moving the folder aside)."""
    a = tiny_trainer(toy_bundle, tmp_path, epochs=2, max_batches_per_epoch=2, keep_last=3)
    a.fit(stop_after=3)
    for p in step_checkpoints(a.run_dir / "checkpoints"):
        p.write_bytes(p.read_bytes()[:500])
    for attempt in (1, 2, 3):
        with pytest.raises(CheckpointReadError, match="none of the 2 checkpoint"):
            tiny_trainer(toy_bundle, tmp_path, resume="auto", epochs=2, max_batches_per_epoch=2)
        names = sorted(p.name for p in (a.run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
        assert names == ["step-00000002.pt", "step-00000003.pt"], attempt  # refusing renames nothing
        assert sorted(p.name for p in a.run_dir.parent.iterdir()) == ["t"]


def test_a_run_folder_of_an_earlier_fastmt_is_resumed_and_marked(toy_bundle, tmp_path):
    """Runs written before run.json existed (provenance.json + checkpoints without lineage) still resume."""
    a = tiny_trainer(toy_bundle, tmp_path, epochs=2, max_batches_per_epoch=2)
    a.fit(stop_after=3)
    (a.run_dir / "run.json").unlink()
    for p in step_checkpoints(a.run_dir / "checkpoints"):
        state = load_checkpoint(p)
        del state["lineage"]
        torch.save(state, p)
    b = tiny_trainer(toy_bundle, tmp_path, resume="auto", epochs=2, max_batches_per_epoch=2)
    assert b.run_dir == a.run_dir and b.step == 3
    b.fit()
    marker = read_marker(a.run_dir)
    assert marker["run_id"] == b.run_id and "adopted" in marker
    assert json.loads((a.run_dir / "config.json").read_text())["run"]["name"] == "t"
