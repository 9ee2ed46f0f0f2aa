"""Adding a config field never strands an older run (issue 38): a field that a run's own ``config.json`` or its
checkpoints lack (written by a fastmt before the field existed) is its declared default, said in one line and
recorded, so the printed "train longer" command, ``--resume`` and ``--init-from`` keep working. A hand-written
``--config`` stays strict."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from data.declare import declaration, default_of
from tests.utils import records, tiny_config, tiny_trainer
from train.config import Config, get_config, load_config_file
from train.fields import field_infos, sections
from train.loop import Trainer
from train.runs.checkpoint import step_checkpoints
from train.runs.resume import compare_configs

# one field of each resume class, as a fastmt before them would have written a run without them (each at its
# default in the test's run: a field added later defaults to what fastmt did before it)
LATER_FIELDS = ("model.tie_embeddings", "run.seed", "optim.anneal", "data.overlong", "run.nonfinite_guard",
                "data.split_grouping", "eval.cuda_graphs")


def _forget(config: dict, names=LATER_FIELDS) -> dict:
    for name in names:
        section, _, key = name.partition(".")
        config[section].pop(key, None)  # (best.pt may be a link to a step checkpoint: done once)
    return config


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
def test_a_field_the_checkpoint_lacks_is_its_declared_default(name):
    """For every field: a checkpoint without it compares as its declared default (no change, recorded), and a
    value other than the default is judged by the field's resume class, never as a change from None."""
    section, _, key = name.partition(".")
    info = field_infos(Config)[name]
    default = default_of({f.name: f for f in dataclasses.fields(dict(sections(Config))[section])}[key])
    if info.resume.kind == "derived" or default is dataclasses.MISSING:
        pytest.skip("set from the tokenizer: never compared")
    cfg = get_config("tiny")
    now = cfg.to_dict()
    now[section][key] = default
    saved = json.loads(json.dumps(now, default=str))
    del saved[section][key]
    for boundary in (True, False):
        changes = compare_configs(saved, json.loads(json.dumps(now, default=str)), epoch_boundary=boundary)
        assert not (changes.safe or changes.replan or changes.refused), changes
        assert changes.defaulted == {name: json.loads(json.dumps(default, default=str))}
        assert changes.record()["defaulted"] == changes.defaulted


def test_the_legacy_value_is_compared_not_none():
    saved = get_config("tiny").to_dict()
    now = json.loads(json.dumps(saved, default=str))
    del saved["model"]["tie_embeddings"]
    now["model"]["tie_embeddings"] = False  # the default is True: a real change of the architecture
    changes = compare_configs(saved, now, epoch_boundary=True)
    assert changes.refused == {"model.tie_embeddings": (True, False)}
    del saved["optim"]["anneal"]
    now["optim"]["anneal"] = "cos"
    assert compare_configs(saved, now, epoch_boundary=False).replan["optim.anneal"] == ("linear", "cos")


def test_an_older_run_continues_from_its_config_json_and_is_fine_tuned(tmp_path, toy_bundle):
    tr = tiny_trainer(toy_bundle, tmp_path, name="old", epochs=1, max_batches_per_epoch=3)
    tr.fit()
    run = tr.run_dir
    _as_older_fastmt(run)

    # the printed "train longer" command: --config <run>/config.json --resume auto
    notes = []
    cfg = load_config_file(run / "config.json", log=notes.append)
    assert len(notes) == 1 and all(n in notes[0] for n in LATER_FIELDS) and str(run / "config.json") in notes[0]
    assert cfg.model.tie_embeddings is True and cfg.run.seed == 0 and cfg.data.overlong == "error"
    # a hand-written file (not a run folder's config.json) must give every field
    mine = tmp_path / "mine.json"
    mine.write_text((run / "config.json").read_text())
    with pytest.raises(ValueError, match="no value for"):
        load_config_file(mine)
    # a field with no default (the vocabulary, which the tokenizer sets) cannot be taken as declared: still refused
    damaged = json.loads((run / "config.json").read_text())
    del damaged["model"]["vocab_size"]
    (run / "config.json").write_text(json.dumps(damaged))
    with pytest.raises(ValueError, match=r"no value for .*model\.vocab_size"):
        load_config_file(run / "config.json")
    _as_older_fastmt(run)  # back as the older fastmt wrote it
    damaged["model"]["vocab_size"] = tr.cfg.model.vocab_size
    (run / "config.json").write_text(json.dumps(damaged))

    # the run's own values where the file has them (the test's tiny settings), the run longer
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, epochs=2),
                              data=dataclasses.replace(cfg.data, cache_dir=toy_bundle.cfg.cache_dir))
    log = []
    resumed = Trainer(cfg, data=toy_bundle, resume="auto", log=log.append)
    resumed.fit()
    said = [line for line in log if "lacks" in line]
    assert len(said) == 1 and all(n in said[0] for n in LATER_FIELDS), log
    rec = records(run, "resume")[-1]
    assert set(rec["defaulted"]) == set(LATER_FIELDS) and rec["defaulted"]["optim.anneal"] == "linear"
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
    assert any("lacks" in line and "model.tie_embeddings" in line for line in log), log
    init = records(tuned.run_dir, "init")[0]
    assert init["defaulted"] == {"model.tie_embeddings": True}
