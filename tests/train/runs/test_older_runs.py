"""Adding a config field never strands an older run (issue 38): a field that a run's own ``config.json`` or its
checkpoints lack because it is newer than the file (its declared ``since`` is past the file's config format) is its
declared default, said in one line and recorded, so the printed "train longer" command, ``--resume`` and
``--init-from`` keep working. A field the file's format records is never taken as a default (issue 45: see
test_field_provenance.py). A hand-written ``--config`` stays strict."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from data.declare import FORMAT_KEY, declaration, default_of
from tests.utils import records, tiny_config, tiny_trainer
from train.config import Config, get_config, load_config_file
from train.fields import field_infos, sections
from train.loop import Trainer
from train.runs.checkpoint import step_checkpoints
from train.runs.resume import ResumeConfigError, compare_configs

# the fields a fastmt of config format 1 did not write: added later, each defaults to what fastmt did before it (each
# at its default in the test's run)
LATER_FIELDS = tuple(sorted(k for k, info in field_infos(Config).items() if info.since > 1))


def _forget(config: dict, names=LATER_FIELDS) -> dict:
    config.pop(FORMAT_KEY, None)  # a fastmt before formats were recorded
    for name in names:
        section, _, key = name.partition(".")
        config[section].pop(key, None)  # (best.pt may be a link to a step checkpoint: done once)
    return config


def _written_at(version: int) -> dict:
    """The tiny preset's config as a fastmt of config ``version`` recorded it (every field it had, none newer)."""
    saved = json.loads(json.dumps(get_config("tiny").record(), default=str))
    saved[FORMAT_KEY] = version
    for info in field_infos(Config).values():
        if info.since > version:
            del saved[info.section][info.name]
    return saved


def _as_older_fastmt(run_dir):
    """Rewrite ``run_dir``'s config.json and checkpoints as a fastmt before `LATER_FIELDS` existed wrote them."""
    path = run_dir / "config.json"
    path.write_text(json.dumps(_forget(json.loads(path.read_text())), indent=2))
    for ckpt_path in (run_dir / "checkpoints").glob("*.pt"):
        ckpt = torch.load(ckpt_path, weights_only=False)
        _forget(ckpt["config"])
        torch.save(ckpt, ckpt_path)


def test_every_field_is_declared_with_a_resume_class():
    """No field without its declaration: a new field written as a plain dataclass field fails here."""
    for section, cls in sections(Config):
        for f in dataclasses.fields(cls):
            d = declaration(f)
            assert d is not None, f"{section}.{f.name} is not declared (data/declare.py)"
            assert d.resume.kind in ("safe", "replan", "epoch", "derived", "refuse"), (section, f.name)
            if d.resume.kind == "refuse":
                assert d.resume.why, f"{section}.{f.name}: a refused field says why"


@pytest.mark.parametrize("name", sorted(field_infos(Config)))
def test_a_field_newer_than_the_checkpoint_is_its_declared_default(name):
    """For every field: a checkpoint written before it existed (its format < the field's ``since``) compares as its
    declared default (no change, recorded); one written when it existed that lacks it is refused, never compared as
    the default."""
    section, _, key = name.partition(".")
    info = field_infos(Config)[name]
    default = default_of({f.name: f for f in dataclasses.fields(dict(sections(Config))[section])}[key])
    if info.resume.kind == "derived" or default is dataclasses.MISSING:
        pytest.skip("set from the tokenizer: never compared")
    now = json.loads(json.dumps(get_config("tiny").to_dict(), default=str))
    now[section][key] = json.loads(json.dumps(default, default=str))
    at_since = _written_at(info.since)
    del at_since[section][key]
    with pytest.raises(ResumeConfigError, match=rf"format {info.since}\) lacks {name}, which that format"):
        compare_configs(at_since, now, epoch_boundary=True)
    if info.since == 1:
        return
    older = _written_at(info.since - 1)
    for boundary in (True, False):
        changes = compare_configs(older, now, epoch_boundary=boundary)
        assert not (changes.safe or changes.replan or changes.refused), changes
        assert changes.defaulted[name] == now[section][key]
        assert set(changes.defaulted) == {k for k, i in field_infos(Config).items() if i.since >= info.since}
        assert changes.record()["defaulted"] == changes.defaulted


def test_the_legacy_value_is_compared_not_none():
    saved = _written_at(3)  # before model.norm_kind
    now = json.loads(json.dumps(get_config("tiny").to_dict(), default=str))
    now["model"]["norm_kind"] = "rmsnorm"  # the default is layernorm: a real change of the architecture
    changes = compare_configs(saved, now, epoch_boundary=True, only={"model"})
    assert changes.refused == {"model.norm_kind": ("layernorm", "rmsnorm")}
    saved = _written_at(1)  # before eval.cuda_graphs
    now["eval"]["cuda_graphs"] = False
    assert compare_configs(saved, now, epoch_boundary=False, only={"eval"}).safe["eval.cuda_graphs"] == (True, False)


def test_an_older_run_continues_from_its_config_json_and_is_fine_tuned(tmp_path, toy_bundle):
    tr = tiny_trainer(toy_bundle, tmp_path, name="old", epochs=1, max_batches_per_epoch=3)
    tr.fit()
    run = tr.run_dir
    _as_older_fastmt(run)

    # the printed "train longer" command: --config <run>/config.json --resume auto
    notes = []
    cfg = load_config_file(run / "config.json", log=notes.append)
    assert len(notes) == 1 and all(n in notes[0] for n in LATER_FIELDS) and str(run / "config.json") in notes[0]
    assert cfg.model.norm_kind == "layernorm" and cfg.eval.cuda_graphs is True
    assert cfg.data.split_grouping == "source_target" and cfg.data.valid_files == ()
    # a hand-written file (not a run folder's config.json) must give every field
    mine = tmp_path / "mine.json"
    mine.write_text((run / "config.json").read_text())
    with pytest.raises(ValueError, match="no value for"):
        load_config_file(mine)
    # a field the file's format records is never taken as declared: the value the run's checkpoint records, or (a
    # copy of the run whose checkpoints lack it too) refused; the vocabulary, which has no default, likewise
    copy = tmp_path / "copy" / "old"
    shutil.copytree(run, copy, symlinks=True)
    damaged = json.loads((copy / "config.json").read_text())
    del damaged["model"]["vocab_size"], damaged["optim"]["lr"]
    (copy / "config.json").write_text(json.dumps(damaged))
    notes = []
    taken = load_config_file(copy / "config.json", log=notes.append)
    assert (taken.model.vocab_size, taken.optim.lr) == (tr.cfg.model.vocab_size, tr.cfg.optim.lr)
    assert any("model.vocab_size" in n and "optim.lr" in n and "checkpoints" in n for n in notes), notes
    shutil.rmtree(copy / "checkpoints")
    with pytest.raises(ValueError, match=r"config\.json: written in config format 1, it lacks .*model\.vocab_size"):
        load_config_file(copy / "config.json")

    # the run's own values where the file has them (the test's tiny settings), the run longer
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, epochs=2),
                              data=dataclasses.replace(cfg.data, cache_dir=toy_bundle.cfg.cache_dir))
    log = []
    resumed = Trainer(cfg, data=toy_bundle, resume="auto", log=log.append)
    resumed.fit()
    said = [line for line in log if "lacks" in line]
    assert len(said) == 1 and all(n in said[0] for n in LATER_FIELDS), log
    rec = records(run, "resume")[-1]
    assert set(rec["defaulted"]) == set(LATER_FIELDS) and rec["defaulted"]["model.norm_kind"] == "layernorm"
    assert [r["epoch"] for r in records(run, "epoch")] == [1, 2]
    saved = json.loads((run / "config.json").read_text())
    assert all(n.partition(".")[2] in saved[n.partition(".")[0]] for n in LATER_FIELDS)  # recorded now

    # a fine-tune from the older run's checkpoint
    _as_older_fastmt(run)
    ckpt = step_checkpoints(run / "checkpoints")[-1]
    log = []
    tuned = Trainer(tiny_config(tmp_path, name="tuned", epochs=1, max_batches_per_epoch=2,
                                data={"cache_dir": toy_bundle.cfg.cache_dir}),
                    data=toy_bundle, init_from=ckpt, log=log.append)
    tuned.fit()
    assert any("lacks" in line and "model.norm_kind" in line for line in log), log
    init = records(tuned.run_dir, "init")[0]
    assert init["defaulted"] == {"model.norm_kind": "layernorm"}
