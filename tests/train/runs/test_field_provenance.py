"""Field provenance (issue 45, class 4): a config field a run's record lacks takes its declared default only when the
field is newer than the record (its ``since`` past the record's config format); a value recorded anywhere in the run
(its checkpoint, its config.json) wins over the default; anything else is refused in one line on every command
(train: --config, --resume, --init-from; translate, evaluate, export), before a model is built.

The two examples of the issue: a run's config.json lacking ``optim.lr`` while its checkpoint records it resumed at the
default; a checkpoint lacking ``model.activation`` (trained with relu) translated and exported as gelu."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from data.declare import CONFIG_FORMAT, FORMAT_KEY
from tests.utils import records, tiny_trainer
from train.config import Config, get_config, load_config_file
from train.errors import UserError
from train.fields import field_infos, provenance
from train.loop import Trainer
from train.runs.checkpoint import step_checkpoints
from train.runs.resume import ResumeConfigError

LEGACY_CKPT = Path(__file__).parents[2] / "security" / "fixtures" / "legacy-run" / "checkpoints" / "step-00000003.pt"


@pytest.fixture(scope="module")
def relu_run(tmp_path_factory, toy_bundle):
    """A tiny run trained with relu (not the default gelu) at lr 3e-3 (not the default 1e-4), one checkpoint."""
    tmp = tmp_path_factory.mktemp("relu")
    tr = tiny_trainer(toy_bundle, tmp, name="relu", epochs=1, max_batches_per_epoch=2, model={"activation": "relu"},
                      keep_last=1)
    tr.fit()
    assert tr.cfg.model.activation == "relu" and tr.cfg.optim.lr == 3e-3
    return tr.run_dir


def _rewrite(path, change) -> None:
    """Apply ``change`` to the config record of a config.json or a checkpoint (as a forger or an older fastmt would)."""
    if path.suffix == ".json":
        d = json.loads(path.read_text())
        change(d)
        path.write_text(json.dumps(d))
        return
    ckpt = torch.load(path, weights_only=False)
    change(ckpt["config"])
    torch.save(ckpt, path)


def _unversioned(d: dict) -> None:
    d.pop(FORMAT_KEY, None)  # as the fastmt before this change wrote it


def _copy(run, tmp_path):
    dest = tmp_path / "runs" / run.name  # (a resume finds it by its run.name)
    shutil.copytree(run, dest, symlinks=True)
    return dest


def _ckpt(run):
    return step_checkpoints(run / "checkpoints")[-1]


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------------------------
def _drop_format_6(record: dict) -> None:
    """A record as fastmt wrote it before format 6 (run.step_graph, optim.ema_decay; format 7's run.cpu_adapt)."""
    record["run"].pop("step_graph")
    record["optim"].pop("ema_decay")
    record["run"].pop("cpu_adapt")


def test_every_field_names_the_format_it_appeared_in_and_formats_only_grow():
    """Each field's ``since`` is a format fastmt wrote; the fields of formats 1-4 are those fastmt had then (a field
    added without bumping ``CONFIG_FORMAT`` would change a past format's set: the files written then lack it)."""
    since = {k: info.since for k, info in field_infos(Config).items()}
    assert all(1 <= v <= CONFIG_FORMAT for v in since.values())
    assert sum(v == 1 for v in since.values()) == 100  # fastmt's fields at 57e30c7 (a field added since= 1 fails)
    assert {k for k, v in since.items() if v > 1} == {
        "eval.cuda_graphs", "eval.average_last", "data.build_workers", "data.split_grouping",
        "data.spm_sample_pairs", "data.valid_files", "data.test_files", "model.norm_kind", "run.step_graph",
        "optim.ema_decay", "run.cpu_adapt"}
    assert since["model.norm_kind"] == 4 and since["data.valid_files"] == 3 and since["eval.cuda_graphs"] == 2
    assert get_config("tiny").record()[FORMAT_KEY] == CONFIG_FORMAT


def test_every_record_fastmt_writes_names_its_format(relu_run):
    assert json.loads((relu_run / "config.json").read_text())[FORMAT_KEY] == CONFIG_FORMAT
    assert torch.load(_ckpt(relu_run), weights_only=False)["config"][FORMAT_KEY] == CONFIG_FORMAT


# ----------------------------------------------------------------------------------------------
# example 1: config.json lacks optim.lr, the checkpoint records it -> the recorded value, on resume too
# ----------------------------------------------------------------------------------------------
def test_a_value_the_checkpoint_records_wins_over_the_default_on_resume(relu_run, tmp_path, toy_bundle):
    run = _copy(relu_run, tmp_path)
    _rewrite(run / "config.json", lambda d: (_unversioned(d), d["optim"].pop("lr")))
    notes = []
    cfg = load_config_file(run / "config.json", log=notes.append)  # what --config <run>/config.json reads
    assert cfg.optim.lr == 3e-3  # (the landed tree: 1e-4, "taken as declared")
    assert len(notes) == 1 and "optim.lr=0.003" in notes[0] and str(_ckpt(run)) in notes[0]
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, epochs=2, out_dir=str(tmp_path / "runs")),
                              data=dataclasses.replace(cfg.data, cache_dir=toy_bundle.cfg.cache_dir))
    with Trainer(cfg, data=toy_bundle, resume="auto", log=lambda *a: None) as tr:
        assert tr.cfg.optim.lr == 3e-3 and tr.step > 0
        tr.fit()
    assert "optim.lr" not in records(run, "resume")[-1]["replanned"]


def test_a_field_no_record_of_the_run_holds_is_refused_naming_file_and_field(relu_run, tmp_path):
    run = _copy(relu_run, tmp_path)
    for path in (run / "config.json", _ckpt(run)):
        _rewrite(path, lambda d: (_unversioned(d), d["optim"].pop("lr")))
    with pytest.raises(ValueError) as e:
        load_config_file(run / "config.json")
    msg = str(e.value)
    assert "\n" not in msg and str(run / "config.json") in msg and "optim.lr" in msg and "add it to" in msg


def test_resume_takes_what_the_run_config_json_records_for_a_field_the_checkpoint_lacks(relu_run, tmp_path,
                                                                                         toy_bundle):
    run = _copy(relu_run, tmp_path)
    _rewrite(_ckpt(run), lambda d: (_unversioned(d), d["optim"].pop("lr")))
    cfg = load_config_file(run / "config.json")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, epochs=2, out_dir=str(tmp_path / "runs")),
                              data=dataclasses.replace(cfg.data, cache_dir=toy_bundle.cfg.cache_dir))
    log = []
    with Trainer(cfg, data=toy_bundle, resume="auto", log=log.append) as tr:
        assert tr.cfg.optim.lr == 3e-3 and any("optim.lr=0.003" in x and "config.json" in x for x in log), log
    # neither records it: the resume is refused in one line before anything is written
    _rewrite(run / "config.json", lambda d: d["optim"].pop("lr"))
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(ResumeConfigError, match=r"lacks optim\.lr \(format 1\)") as e:
        Trainer(cfg, data=toy_bundle, resume="auto", log=lambda *a: None)
    assert "\n" not in str(e.value) and str(_ckpt(run)) in str(e.value)
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_fine_tune_from_a_checkpoint_lacking_its_activation_is_refused(relu_run, tmp_path, toy_bundle):
    from tests.utils import tiny_config

    alone = tmp_path / "alone.pt"  # a checkpoint copied out of its run folder: no config.json beside it
    shutil.copy(_ckpt(relu_run), alone)
    _rewrite(alone, lambda d: (_unversioned(d), d["model"].pop("activation")))
    cfg = tiny_config(tmp_path, name="tuned", epochs=1, max_batches_per_epoch=1,
                      data={"cache_dir": toy_bundle.cfg.cache_dir})
    with pytest.raises(ResumeConfigError, match=r"lacks model\.activation"):
        Trainer(cfg, data=toy_bundle, init_from=alone, log=lambda *a: None)
    assert not (tmp_path / "runs" / "tuned").exists()


# ----------------------------------------------------------------------------------------------
# example 2: a checkpoint lacks model.activation (relu) -> refused, or relu from its run's config.json
# ----------------------------------------------------------------------------------------------
def test_translate_evaluate_export_refuse_a_checkpoint_lacking_its_activation(relu_run, tmp_path, capsys):
    from train.cli.evaluate import main as evaluate
    from train.cli.export import main as export
    from train.cli.translate import main as translate
    from train.evaluation.load import load_for_inference

    alone = tmp_path / "alone.pt"
    shutil.copy(_ckpt(relu_run), alone)
    _rewrite(alone, lambda d: (_unversioned(d), d["model"].pop("activation")))
    with pytest.raises(UserError, match=r"lacks model\.activation \(format 1\)"):  # (landed: gelu, no message)
        load_for_inference(alone)
    src = tmp_path / "src.txt"
    src.write_text("the cat\n")
    commands = [(translate, ["--ckpt", str(alone), "--device", "cpu", "hello"]),
                (evaluate, ["--ckpt", str(alone), "--device", "cpu", "--src", str(src)])]
    if importlib.util.find_spec("ctranslate2") is not None:  # (the export extra: absent from the torch-min venv)
        commands.append((export, ["--ckpt", str(alone), "--to", "ct2", str(tmp_path / "out")]))
    for command, argv in commands:
        assert command(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert str(alone) in line and "model.activation" in line
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_lacking_its_activation_takes_its_run_config_json(relu_run, tmp_path, capsys):
    from train.cli.export import load_source
    from train.evaluation.load import load_for_inference

    run = _copy(relu_run, tmp_path)
    _rewrite(_ckpt(run), lambda d: (_unversioned(d), d["model"].pop("activation")))
    notes = []
    model, _, ckpt = load_for_inference(_ckpt(run), log=notes.append)
    assert model.cfg.activation == "relu" and ckpt["config"]["model"]["activation"] == "relu"
    assert len(notes) == 1 and "model.activation='relu'" in notes[0] and "config.json" in notes[0]
    reference, _, _ = load_for_inference(_ckpt(relu_run), log=notes.append)
    ids, lengths = torch.tensor([[5, 6, 7, 3]]), torch.tensor([4], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(model(ids, ids, lengths, lengths), reference(ids, ids, lengths, lengths))
    assert load_source(_ckpt(run)).cfg.activation == "relu"  # export reads the same


# ----------------------------------------------------------------------------------------------
# newer fields still take their defaults (old runs keep loading), with one line
# ----------------------------------------------------------------------------------------------
def test_a_field_newer_than_the_checkpoint_is_its_default_with_one_line(relu_run, tmp_path):
    from train.evaluation.load import load_for_inference

    alone = tmp_path / "old.pt"
    shutil.copy(_ckpt(relu_run), alone)
    _rewrite(alone, lambda d: (_unversioned(d), _drop_format_6(d), d["model"].pop("norm_kind")))  # format 3
    notes = []
    model, _, _ = load_for_inference(alone, log=notes.append)
    assert model.cfg.norm_kind == "layernorm" and model.cfg.activation == "relu"
    assert len(notes) == 1 and "config format 3" in notes[0] and "model.norm_kind='layernorm'" in notes[0]


def test_the_legacy_fixture_loads_with_its_newer_field_said(capsys):
    from train.evaluation.load import load_for_inference

    notes = []
    model, _, ckpt = load_for_inference(LEGACY_CKPT, log=notes.append)
    assert model.cfg.norm_kind == "layernorm" and ckpt["config"][FORMAT_KEY] == 3
    assert len(notes) == 1 and "model.norm_kind" in notes[0]


# ----------------------------------------------------------------------------------------------
# hostile records: forged formats, a wrong type from the other record
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("forged", [-1, 0, CONFIG_FORMAT + 1, 10**30, "5", 5.0, True, None, [5]],
                         ids=["negative", "zero", "future", "huge", "string", "float", "bool", "null", "list"])
def test_a_forged_format_is_refused_in_one_line_everywhere(relu_run, tmp_path, forged):
    from train.evaluation.load import load_for_inference

    run = _copy(relu_run, tmp_path)
    _rewrite(run / "config.json", lambda d: d.update({FORMAT_KEY: forged}))
    with pytest.raises(ValueError, match=r"config format|is not a config format") as e:
        load_config_file(run / "config.json")
    assert "\n" not in str(e.value) and str(run / "config.json") in str(e.value)
    _rewrite(_ckpt(run), lambda d: d.update({FORMAT_KEY: forged}))
    with pytest.raises(UserError, match=r"config format|is not a config format") as e:
        load_for_inference(_ckpt(run))
    assert "\n" not in str(e.value) and str(_ckpt(run)) in str(e.value)


def test_a_format_forged_low_does_not_make_an_existing_field_new(relu_run, tmp_path):
    """A record claiming format 1 while it holds model.norm_kind (format 4) was written at 4 at least: its missing
    activation (format 1) is refused, not defaulted; a claim of format 1 cannot make eval.cuda_graphs new either
    when the record holds data.valid_files (format 3)."""
    from train.evaluation.load import load_for_inference

    alone = tmp_path / "low.pt"
    shutil.copy(_ckpt(relu_run), alone)
    _rewrite(alone, lambda d: (d.update({FORMAT_KEY: 1}), _drop_format_6(d), d["model"].pop("activation"),
                               d["eval"].pop("cuda_graphs")))
    with pytest.raises(UserError, match=r"written in config format 4, it lacks .*model\.activation.*eval\.cuda_graphs"):
        load_for_inference(alone)


def test_a_value_of_the_wrong_type_in_the_other_record_is_refused_naming_it(relu_run, tmp_path):
    run = _copy(relu_run, tmp_path)
    _rewrite(run / "config.json", lambda d: d["optim"].pop("lr"))
    _rewrite(_ckpt(run), lambda d: d["optim"].update(lr="0.003"))
    with pytest.raises(ValueError, match=r"optim\.lr='0\.003' is not a float") as e:
        load_config_file(run / "config.json")
    assert str(_ckpt(run)) in str(e.value)
    _rewrite(_ckpt(run), lambda d: d["optim"].update(lr=-1.0))  # typed, but out of its bounds
    with pytest.raises(ValueError, match=r"optim\.lr=-1\.0 must be > 0"):
        load_config_file(run / "config.json")


def test_provenance_of_a_record_that_is_not_an_object_of_sections():
    with pytest.raises(ValueError, match="a config is a JSON object"):
        provenance(Config, [1, 2], "x.json")
    with pytest.raises(ValueError, match="model must be an object of fields"):
        provenance(Config, {"model": "relu"}, "x.json")
