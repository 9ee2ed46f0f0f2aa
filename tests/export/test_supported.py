"""Each export target states what it represents (train/export/supported.py): every model field is classified for
every target, every supported value is one the equivalence tests export, the training-only fields change nothing
exported, and anything else (a value outside the table, a field it does not know) is refused in one line naming the
field before anything is written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models import ModelConfig, Transformer
from tests.export.conftest import BASE_MODEL, variant_checkpoint
from tests.export.test_command import _refused
from tests.export.test_equivalence import VARIANTS
from tests.utils import tiny_config
from train.cli.export import TARGETS, load_source
from train.config import Config
from train.errors import UserError
from train.export.common import Source
from train.export.supported import ANY, SUPPORTED, TRAINING_ONLY, refuse_unsupported, unsupported
from train.fields import field_infos


def test_every_model_field_is_classified_for_every_target():
    assert set(SUPPORTED) == set(TARGETS)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    choices = {k.split(".", 1)[1]: v.choices for k, v in field_infos(Config).items() if k.startswith("model.")}
    for target, table in SUPPORTED.items():
        assert set(table) == fields, (target, sorted(fields ^ set(table)))
        for name, allowed in table.items():
            assert allowed in (ANY, TRAINING_ONLY) or isinstance(allowed, (set, frozenset)) and allowed, (target, name)
            if isinstance(allowed, (set, frozenset)) and choices.get(name):  # a closed set: only declared choices
                assert allowed <= set(choices[name]), (target, name, allowed, choices[name])


def test_activation_tables_are_the_supported_values():
    """Each exporter's own activation table holds exactly what the target states it supports."""
    from train.export import ct2, hf

    assert set(ct2.ACTIVATIONS) == SUPPORTED["ct2"]["activation"]
    assert set(hf.ACTIVATIONS) == SUPPORTED["hf"]["activation"]
    from ctranslate2.specs import common_spec
    from transformers.activations import ACT2FN

    assert all(hasattr(common_spec.Activation, v) for v in ct2.ACTIVATIONS.values())
    assert all(v in ACT2FN for v in hf.ACTIVATIONS.values())


def test_every_supported_value_is_one_the_equivalence_tests_export():
    """A value in a target's set is exported and compared with fastmt by tests/export/test_equivalence.py: the base
    model's own value, or a VARIANTS entry that the test exports to that target."""
    from pathlib import Path

    base = tiny_config(Path("unused"), model=BASE_MODEL).model
    exported = {t: [dataclasses.asdict(base)] for t in SUPPORTED}
    for name, fields in VARIANTS.items():
        for t in ("hf",) if name == "ffn_norm" else ("ct2", "hf"):  # the targets test_architectures exports it to
            exported[t].append({**dataclasses.asdict(base), **fields})
    for target, table in SUPPORTED.items():
        for field, allowed in table.items():
            if isinstance(allowed, (set, frozenset)):
                for value in allowed:
                    assert any(type(c[field]) is type(value) and c[field] == value for c in exported[target]), \
                        (target, field, value)


def _source(cfg: ModelConfig, state: dict) -> Source:
    model = Transformer(cfg).eval()
    model.load_state_dict(state)
    return Source(path=None, model=model, tok=None, ckpt={})


TRAINING_VARIANTS = {"norm": "torch", "attn_backend": "reference", "layout": "varlen", "dropout": 0.3,
                     "checkpointing": True}


def test_training_only_fields_change_nothing_exported():
    from train.export import ct2, hf

    cfg = ModelConfig(vocab_size=48, d_model=32, n_heads=4, d_ff=64, enc_layers=2, dec_layers=2, max_positions=32)
    torch.manual_seed(0)
    state = Transformer(cfg).state_dict()
    training_only = {n for n, v in SUPPORTED["hf"].items() if v == TRAINING_ONLY}
    assert training_only == {n for n, v in SUPPORTED["ct2"].items() if v == TRAINING_ONLY} == set(TRAINING_VARIANTS)
    ref = _source(cfg, state)
    ref_hf, ref_conf = hf.state_dict(ref), hf.hf_config(ref)
    ref_ct2 = _spec_arrays(ct2, ref)
    for name, value in TRAINING_VARIANTS.items():
        assert getattr(cfg, name) != value
        src = _source(dataclasses.replace(cfg, **{name: value}), state)
        assert hf.hf_config(src) == ref_conf, name
        sd = hf.state_dict(src)
        assert sd.keys() == ref_hf.keys() and all(torch.equal(sd[k], ref_hf[k]) for k in sd), name
        arrays = _spec_arrays(ct2, src)
        assert arrays.keys() == ref_ct2.keys() and all(np.array_equal(arrays[k], ref_ct2[k]) for k in arrays), name


def _spec_arrays(ct2, src: Source) -> dict:
    """Every array of the CTranslate2 spec of ``src`` (without its vocabulary: the tests' sources have no tokenizer)."""
    from unittest import mock

    with mock.patch.object(ct2, "pieces", lambda tok: ["<pad>", "<unk>", "<s>", "</s>"] + [f"p{i}" for i in range(44)]):
        spec = ct2.build_spec(src)
    return {k: np.asarray(v) for k, v in spec.variables().items()}


# ModelConfig as it is once a field is added that the exporters have not classified
NewField = dataclasses.make_dataclass("NewField", [("qk_norm", bool, True)], bases=(ModelConfig,))


@pytest.mark.parametrize("target", sorted(SUPPORTED))
def test_unclassified_field_and_unsupported_value_refused(target):
    cfg = NewField(vocab_size=48)
    assert [p[0] for p in unsupported(target, cfg)] == ["qk_norm"]
    with pytest.raises(UserError, match=rf"--to {target}: C.pt has model\.qk_norm=True.*do not classify"):
        refuse_unsupported(target, cfg, "C.pt")
    bad = ModelConfig(vocab_size=48, pad_id=1)  # both targets name id 0 as <pad>
    with pytest.raises(UserError, match=rf"--to {target}: C.pt has model\.pad_id=1.*supports 0\)"):
        refuse_unsupported(target, bad, "C.pt")
    # a value is matched by type too: True is not the pad id 1, 0.0 is not ffn_norm False
    assert [p[0] for p in unsupported(target, dataclasses.replace(ModelConfig(vocab_size=48), ffn_norm=0))] == \
        ["ffn_norm"]
    refuse_unsupported(target, ModelConfig(vocab_size=48), "C.pt")  # the defaults export


@pytest.mark.parametrize("target", sorted(SUPPORTED))
def test_export_refuses_before_writing(trained, tmp_path, capsys, monkeypatch, target):
    """Through the command: a value outside the table, and a field the table does not classify, are refused in one
    line naming the field and its value, and OUT (and nothing beside it) is written."""
    out = tmp_path / "out"
    ckpt = variant_checkpoint(trained.ckpt, tmp_path / "pad.pt", pad_id=1)
    _refused(capsys, ["--ckpt", str(ckpt), "--to", target, str(out)], "model.pad_id=1", "supports 0")
    monkeypatch.delitem(SUPPORTED[target], "tie_embeddings")  # as a field added without an entry
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", target, str(out)], "model.tie_embeddings=True",
             "do not classify")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pad.pt"]
    # the table decides, not the exporter's own reading: the write functions refuse on their own too
    src = load_source(trained.ckpt)
    from train.export import ct2, hf

    with pytest.raises(UserError, match="tie_embeddings"):
        (ct2.write(src, tmp_path, None) if target == "ct2" else hf.write(src, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pad.pt"]
