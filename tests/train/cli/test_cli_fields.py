"""Discoverable options (issue 23 item 5): every config field has a type, choices where the set is closed, a
value and one line of help, shown by --help-fields grouped by section; typos get a "did you mean", never a
dump of every name."""

from __future__ import annotations

import dataclasses
import re

import pytest

from train.cli.flags import resolve_config
from train.config import Config, get_config
from train.fields import field_comments, field_infos, suggest

INFOS = field_infos(Config)


def test_every_field_of_every_section_is_described():
    assert {i.section for i in INFOS.values()} == {"data", "model", "optim", "run", "eval"}
    assert len(INFOS) == sum(len(dataclasses.fields(getattr(get_config("tiny"), s))) for s in
                             ("data", "model", "optim", "run", "eval"))
    for key, info in INFOS.items():
        assert len(info.help) >= 10, f"{key} has no help: give the field a comment in its dataclass"
        assert info.type_text(), key


def test_help_is_read_from_the_field_comments():
    from data import DataConfig
    from models import ModelConfig

    # a trailing comment, a comment block above the field, and a comment inside a multi-line value
    assert INFOS["model.d_ff"].help == "FFN hidden width"
    assert INFOS["model.layout"].help.startswith('"padded": (B, T, D) with lengths;')
    assert INFOS["data.valid_size"].help.startswith("int >= 0: rows (0: no valid split)")
    assert "Hub id" in field_comments(DataConfig)["dataset"]  # not the "# --- source ---" heading
    assert "---" not in " ".join(field_comments(DataConfig).values())
    assert set(field_comments(ModelConfig)) == {f.name for f in dataclasses.fields(ModelConfig)}


def test_closed_string_fields_list_their_choices():
    assert INFOS["data.batching"].choices == ("fixed", "dynamic", "sorted", "token_bucket", "packed")
    assert INFOS["run.precision"].choices == ("bf16", "fp16", "fp32")  # from the Literal annotation
    assert INFOS["model.layout"].type_text() == "{padded,varlen,packed}"


@pytest.mark.parametrize("key", sorted(k for k, i in INFOS.items() if i.type is str and i.choices is None))
def test_a_string_field_without_choices_really_takes_any_string(key):
    """The choices table is complete: a str field shown without choices accepts an arbitrary value."""
    section, _, name = key.partition(".")
    cfg = get_config("tiny")
    value = "any-value-7"
    dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})


def test_help_fields_groups_every_field_by_section(capsys):
    with pytest.raises(SystemExit) as e:
        resolve_config(["--preset", "fast", "--help-fields"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    headers = [m.group(1) for m in re.finditer(r"^(\w+): ", out, flags=re.M)]
    assert headers == ["data", "model", "optim", "run", "eval"]
    shown = re.findall(r"^  --(\S+) (.+) = (.+)$", out, flags=re.M)
    assert [k for k, _, _ in shown] == list(INFOS)  # each once, in section order
    fast = get_config("fast")
    values = dict((k, v) for k, _, v in shown)
    assert values["data.batching"] == "'packed'" and values["run.compile"] == "true"  # the preset's values
    assert values["optim.betas"] == "[0.9, 0.98]" and values["run.max_steps"] == "null"
    assert fast.data.batching == "packed"
    lines = out.splitlines()
    for i, line in enumerate(lines):  # every field line is followed by its help line, then its range if any
        if line.startswith("  --"):
            key = line.split()[0][2:]
            bound = INFOS[key].bounds
            help_line, _, resume = lines[i + 1].strip().rpartition("; on --resume: ")
            assert help_line == INFOS[key].help + (f" (range {bound.text()})" if bound else "")
            kind = INFOS[key].resume.kind  # the field's declared resume class, said
            assert resume.startswith({"safe": "may change", "replan": "may change (the schedule", "epoch":
                                      "may change at an epoch", "derived": "set from", "refuse": "fixed ("}[kind])
    assert "(range [1, 64])" in lines[lines.index(next(x for x in lines if x.startswith("  --eval.beam_size"))) + 1]
    assert "fixed (the optimizer state" in lines[lines.index(next(x for x in lines if x.startswith("  --optim.name"))) + 1]


def test_help_fields_of_one_section(capsys):
    with pytest.raises(SystemExit):
        resolve_config(["--help-fields", "optim"])
    out = capsys.readouterr().out
    assert "--optim.lr float = 0.003" in out  # the tiny preset when none is named
    assert "--run." not in out and "--data." not in out


@pytest.mark.parametrize("argv, suggestion", [
    (["--optim.lrr", "1"], "did you mean --optim.lr?"),
    (["--lr", "1"], "did you mean --optim.lr?"),
    (["--optim.learning-rate", "1"], None),
    (["--run.epoch", "1"], "did you mean --run.epochs?"),
    (["--epoch", "1"], "did you mean --epochs or --run.epochs?"),
    (["--mdoel.d_model", "1"], "did you mean --model.d_model"),
    (["--data.batching", "pakced"], "did you mean packed?"),
    (["--run.precision", "bf61"], "did you mean bf16?"),
])
def test_a_typo_gets_the_closest_names_not_a_dump(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as e:
        resolve_config(["--preset", "tiny", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300, err  # one short line
    assert err.count("--") <= 4
    if suggestion:
        assert suggestion in err
    else:
        assert "--help-fields optim" in err


def test_suggest_prefers_the_same_section():
    assert suggest("run.keep_lst", INFOS)[0] == "run.keep_last"
    assert suggest("eval.beam", INFOS)[0] == "eval.beam_size"
    assert suggest("zzzz", INFOS) == []
