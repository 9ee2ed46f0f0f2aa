"""Resume is honest about changes (issue 20 row 5, issue 23 item 3): a changed learning rate or weight decay
is really applied (the schedule re-planned from the current step, shown in the log and metrics), what
cannot change is refused naming the field's old and new values, a finished run is extended with
``--resume auto --epochs N``, and ``--init-from`` starts a new run from a checkpoint's weights."""

from __future__ import annotations

import pytest
import torch

from tests.train.runs_helpers import tree
from tests.utils import records, tiny_config, tiny_trainer
from train.errors import UserError
from train.loop import RunFinishedError, Trainer
from train.optim import build_scheduler
from train.runs.checkpoint import load_checkpoint, step_checkpoints
from train.runs.folder import read_marker
from train.runs.resume import ResumeConfigError, replan_scheduler

KW = dict(epochs=2, max_batches_per_epoch=4)  # 8 steps


def _schedule_lr(cfg, total: int, step: int) -> float:
    """The lr a schedule planned with ``cfg`` over ``total`` steps gives after ``step`` optimizer steps (stepped
    one by one, as the loop does)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    sched = build_scheduler(opt, cfg.optim, total)
    for _ in range(min(step, total - 1)):
        opt.step()
        sched.step()
    return sched.get_last_lr()[0]


@pytest.mark.parametrize("optim", [{"schedule": "onecycle"}, {"schedule": "onecycle", "three_phase": True},
                                   {"schedule": "inverse_sqrt", "warmup_steps": 3}, {"schedule": "constant"}],
                         ids=["onecycle", "three-phase", "inverse-sqrt", "constant"])
def test_a_replanned_schedule_is_the_schedule_stepped_to_that_point(tmp_path, optim):
    cfg = tiny_config(tmp_path, optim=optim)
    for total, step in [(20, 0), (20, 7), (20, 19), (20, 20), (5, 9)]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
        opt.param_groups[0]["initial_lr"] = 123.0  # a loaded optimizer carries the old schedule's bookkeeping
        sched = replan_scheduler(opt, cfg.optim, total, step)
        want = _schedule_lr(cfg, total, step)
        assert sched.get_last_lr()[0] == pytest.approx(want, rel=1e-12) and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]


def test_a_changed_lr_and_weight_decay_are_applied_on_resume(toy_bundle, tmp_path):
    """Row 5: the log said 'optim.lr: old -> X' and the checkpoint recorded X, but training kept the old value."""
    first = tiny_trainer(toy_bundle, tmp_path, **KW)
    first.fit(stop_after=3)
    plain = tiny_trainer(toy_bundle, tmp_path, resume="auto", **KW)  # the same checkpoint, nothing changed
    old_lr = plain.optimizer.param_groups[0]["lr"]
    plain.close()
    logs = []
    new = dict(lr=1e-3, weight_decay=0.2)
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", optim=new, log=logs.append, **KW)
    want = _schedule_lr(tr.cfg, tr.total_steps, 3)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12) and want < old_lr / 2
    assert [g["weight_decay"] for g in tr.optimizer.param_groups] == [0.2, 0.0]  # decay group, no-decay group
    assert any("re-planned" in str(m) and "optim.lr 0.003 -> 0.001" in str(m) for m in logs)
    tr.fit()
    rec = records(tr.run_dir, "resume")[-1]
    assert rec["replanned"]["optim.lr"] == [0.003, 0.001] and rec["replanned"]["optim.weight_decay"] == [0.01, 0.2]
    assert rec["schedule"]["from_step"] == 3 and rec["schedule"]["lr"] == pytest.approx(want)
    last = load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    assert last["config"]["optim"]["lr"] == 1e-3
    assert [g["weight_decay"] for g in last["optimizer"]["param_groups"]] == [0.2, 0.0]
    assert records(tr.run_dir, "epoch")[-1]["lr"] == pytest.approx(_schedule_lr(tr.cfg, tr.total_steps, 8))


def test_changes_that_cannot_be_applied_are_refused_naming_old_and_new(toy_bundle, tmp_path):
    first = tiny_trainer(toy_bundle, tmp_path, **KW)
    first.fit(stop_after=3)
    before = tree(tmp_path / "runs")
    cases = [(dict(model={"d_model": 64}), "model.d_model 32 -> 64"),
             (dict(optim={"name": "lion"}), "optim.name 'adamw' -> 'lion' (the optimizer state"),
             (dict(seed=7), "run.seed 0 -> 7 (the random state comes from the checkpoint"),
             (dict(data={"max_tokens": 1024}), "data.max_tokens 512 -> 1024 (the checkpoint is mid-epoch")]
    for changes, message in cases:
        with pytest.raises(ResumeConfigError, match=message.replace("(", r"\(")) as e:
            tiny_trainer(toy_bundle, tmp_path, resume="auto", **{**KW, **changes})
        # weights of another architecture cannot be loaded: no --init-from advice for a model change
        assert "\n" not in str(e.value) and ("--init-from" in str(e.value)) == ("model" not in changes)
        assert tree(tmp_path / "runs") == before  # refused before anything was written


def test_safe_changes_are_applied_and_logged(toy_bundle, tmp_path):
    first = tiny_trainer(toy_bundle, tmp_path, **KW)
    first.fit(stop_after=3)
    logs = []
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, beam_size=1, log_every=2, **KW)
    assert tr.cfg.eval.beam_size == 1 and tr.cfg.run.log_every == 2
    assert any("applied" in str(m) and "eval.beam_size 2 -> 1" in str(m) for m in logs)
    assert not any("re-planned" in str(m) for m in logs)  # nothing the schedule depends on changed
    tr.close()
    assert records(tr.run_dir, "resume")[0]["applied"]["eval.beam_size"] == [2, 1]


def test_a_finished_run_is_extended_with_more_epochs(toy_bundle, tmp_path):
    """Issue 23 item 3: ``--resume auto --epochs N`` only said the run was finished."""
    first = tiny_trainer(toy_bundle, tmp_path, **KW)
    first.fit()
    with pytest.raises(RunFinishedError, match="--resume auto --epochs 4"):
        tiny_trainer(toy_bundle, tmp_path, resume="auto", **KW)
    logs = []
    more = dict(KW, epochs=3)
    tr = tiny_trainer(toy_bundle, tmp_path, resume="auto", log=logs.append, **more)
    assert tr.run_dir == first.run_dir and tr.step == 8 and tr.total_steps == 12
    assert any("extending the finished run" in str(m) for m in logs)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(_schedule_lr(tr.cfg, 12, 8), rel=1e-12)
    tr.fit()
    rec = records(tr.run_dir, "resume")[0]
    assert rec["mode"] == "extend" and rec["replanned"]["run.epochs"] == [2, 3]
    assert rec["schedule"]["total_steps"] == 12 and rec["schedule"]["previous_total_steps"] == 8
    assert [r["epoch"] for r in records(tr.run_dir, "epoch")] == [1, 2, 3]
    assert [r["kind"] for r in records(tr.run_dir)][-1] == "done" and len(records(tr.run_dir, "done")) == 1
    assert tr.step == 12


def _init_from(toy_bundle, tmp_path, ckpt, **changes) -> Trainer:
    return Trainer(tiny_config(tmp_path, **changes), data=toy_bundle, init_from=ckpt, log=lambda *a: None)


def test_init_from_starts_a_new_run_from_the_weights_with_a_fresh_optimizer(toy_bundle, tmp_path):
    src = tiny_trainer(toy_bundle, tmp_path, name="src", **KW)
    src.fit()
    src_tree = tree(src.run_dir)
    best = src.run_dir / "checkpoints" / "best.pt"
    tr = _init_from(toy_bundle, tmp_path, best, name="tuned", optim={"lr": 1e-3}, epochs=1, max_batches_per_epoch=2)
    weights = load_checkpoint(best)["model"]
    assert all(torch.equal(v, weights[k]) for k, v in tr.model.state_dict().items())
    assert (tr.step, tr.epoch) == (0, 0) and not tr.optimizer.state  # fresh optimizer, step 0
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(_schedule_lr(tr.cfg, tr.total_steps, 0))
    tr.fit()
    parent = read_marker(tr.run_dir)["parent"]
    assert parent["run_id"] == src.run_id and parent["how"] == "init-from" and parent["checkpoint"] == str(best)
    assert records(tr.run_dir)[0]["kind"] == "init" and tree(src.run_dir) == src_tree
    with pytest.raises(ResumeConfigError, match="model.d_ff 64 -> 128"):
        _init_from(toy_bundle, tmp_path, best, name="bad", model={"d_ff": 128})
    with pytest.raises(UserError, match="not both"):  # (--init-from with --resume auto continues the fine-tune)
        Trainer(tiny_config(tmp_path, name="bad"), data=toy_bundle, init_from=best, resume=str(best))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["src", "tuned"]


def test_init_from_fine_tunes_on_other_data_with_the_checkpoints_tokenizer(toy_bundle, tmp_path):
    """--init-from on another corpus (here more toy rows) builds that data with the checkpoint's tokenizer
    (``build_data(cfg, tokenizer=...)``)."""
    src = tiny_trainer(toy_bundle, tmp_path, name="src", **KW)
    src.fit()
    cfg = tiny_config(tmp_path, name="tuned", data={"toy_rows": 1500}, epochs=1, max_batches_per_epoch=2)
    tr = Trainer(cfg, init_from=src.run_dir / "checkpoints" / "best.pt", log=lambda *a: None)
    assert tr.data.tokenizer.key == toy_bundle.tokenizer.key and len(tr.data.splits["train"]) > 1047
    tr.fit()
    assert step_checkpoints(tr.run_dir / "checkpoints")


def test_init_from_hands_the_checkpoints_tokenizer_to_build_data(toy_bundle, tmp_path, monkeypatch):
    """The Trainer's side of ``build_data(cfg, tokenizer=...)``: the checkpoint's tokenizer is handed over."""
    src = tiny_trainer(toy_bundle, tmp_path, name="src", **KW)
    src.fit()
    seen = {}

    def fake_build_data(cfg, log=print, tokenizer=None):
        seen["key"] = tokenizer.key
        return toy_bundle

    monkeypatch.setattr("data.build_data", fake_build_data)
    cfg = tiny_config(tmp_path, name="tuned", data={"toy_rows": 1500})
    Trainer(cfg, init_from=src.run_dir / "checkpoints" / "best.pt", log=lambda *a: None).close()
    assert seen["key"] == toy_bundle.tokenizer.key


def test_data_build_workers_is_a_safe_change():
    """The cache entry is the same for any number of build processes (tests/data: worker-independent), so a
    resume on a machine with another core count is not refused for it."""
    from train.runs.resume import classify

    assert classify("data.build_workers", 8, 2, epoch_boundary=False) == "safe"
    assert classify("data.num_workers", 2, 0, epoch_boundary=False) == "safe"


def test_the_refused_and_epoch_boundary_kinds_the_readme_names():
    """README / module doc: fp16 <-> another precision, eval.best_metric and the architecture are refused;
    other precision changes are safe; batching settings are re-planned at an epoch boundary only."""
    from train.runs.resume import classify

    assert classify("run.precision", "fp16", "bf16", epoch_boundary=True) == "refuse"
    assert classify("run.precision", "fp32", "fp16", epoch_boundary=True) == "refuse"
    assert classify("run.precision", "bf16", "fp32", epoch_boundary=False) == "safe"
    assert classify("eval.best_metric", "bleu", "loss", epoch_boundary=True) == "refuse"
    assert classify("eval.beam_size", 2, 4, epoch_boundary=False) == "safe"
    assert classify("model.d_model", 64, 128, epoch_boundary=True) == "refuse"
    for field_ in ("data.batching", "data.max_tokens", "data.max_len"):
        assert classify(field_, 1, 2, epoch_boundary=True) == "replan"
        assert classify(field_, 1, 2, epoch_boundary=False) == "refuse"
