"""models/components.py: one registry per component whose names are exactly the config's choices, factories that
refuse a name without an implementation (never another component in its place), norm modules that compute
LN(x + residual) then the activation on every backend with the same parameter names, and the state dict's names."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

from models import ModelConfig, Transformer
from models import components as C
from models.layers import EncoderBlock, Stack
from models.transformer import LAYOUTS
from train.config import Config
from train.fields import field_infos

CHOICES = {k: v.choices for k, v in field_infos(Config).items()}
REGISTRIES = {"model.activation": C.ACTIVATIONS, "model.attn_backend": C.ATTENTION, "model.positions": C.POSITIONS,
              "model.layout": LAYOUTS}


@pytest.mark.parametrize("field", sorted(REGISTRIES))
def test_registry_names_are_the_declared_choices(field):
    assert CHOICES[field] and set(REGISTRIES[field]) == set(CHOICES[field])


def test_norm_registry_names_are_the_declared_choices():
    """Every backend model.norm declares computes LayerNorm; no kind runs on a backend the config lacks; the kinds
    are model.norm_kind's choices once ModelConfig declares one (LayerNorm alone before)."""
    assert set(C.NORMS["layernorm"]) == set(CHOICES["model.norm"])
    assert all(set(backends) <= set(CHOICES["model.norm"]) for backends in C.NORMS.values())
    assert set(C.NORMS) == set(CHOICES.get("model.norm_kind") or ("layernorm",))


def _cfg(**bad) -> ModelConfig:
    """A valid tiny config with ``bad`` set past its validation (as a caller that skips the config would)."""
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, enc_layers=1, dec_layers=1, max_positions=16)
    for k, v in bad.items():
        object.__setattr__(cfg, k, v)
    return cfg


@pytest.mark.parametrize("field, value", [("norm", "rms"), ("activation", "silu"), ("attn_backend", "flash"),
                                          ("positions", "rope"), ("layout", "ragged")])
def test_unknown_name_refused_when_the_model_is_built(field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r}.*(is not one of|cannot compute)") as e:
        Transformer(_cfg(**{field: value}))
    for choice in CHOICES[f"model.{field}"]:
        assert repr(choice) in str(e.value), (choice, str(e.value))


def test_each_factory_refuses_an_unknown_name():
    for factory, field in ((C.activation_for, "activation"), (C.attention_for, "attn_backend"),
                           (C.positions_for, "positions")):
        with pytest.raises(ValueError, match=rf"model\.{field}='nope' is not one of"):
            factory(_cfg(**{field: "nope"}))
    with pytest.raises(ValueError, match=r"model\.norm='nope' cannot compute norm kind 'layernorm'"):
        C.norm_for(_cfg(norm="nope"), 8)
    with pytest.raises(ValueError, match=rf"model\.norm_kind='nope' is not one of {re.escape(repr(tuple(C.NORMS)))}"):
        C.norm_for(SimpleNamespace(norm="torch", norm_kind="nope"), 8)
    with pytest.raises(ValueError, match=r"activation='nope' is not one of"):
        C.norm_for(_cfg(), 8, activation="nope")


def test_a_norm_kind_is_refused_on_a_backend_that_lacks_it(monkeypatch):
    """How a PyTorch-only kind (e.g. RMSNorm) plugs in: one entry; the fused backend then refuses it by name."""
    monkeypatch.setitem(C.NORMS, "other", {"torch": C.TorchLayerNorm})
    assert isinstance(C.norm_for(SimpleNamespace(norm="torch", norm_kind="other"), 8), C.TorchLayerNorm)
    with pytest.raises(ValueError, match=r"model\.norm='fused' cannot compute norm kind 'other'.*'torch'"):
        C.norm_for(SimpleNamespace(norm="fused", norm_kind="other"), 8)


@pytest.mark.parametrize("norm", sorted(C.NORMS["layernorm"]))
@pytest.mark.parametrize("activation", [None, *C.ACTIVATIONS])
def test_norm_modules_compute_layernorm_then_the_activation(norm, activation, monkeypatch):
    monkeypatch.delenv("FASTMT_NORM_BACKEND", raising=False)
    torch.manual_seed(0)
    module = C.norm_for(_cfg(norm=norm), 12, activation=activation)
    assert sorted(n for n, _ in module.named_parameters()) == ["bias", "weight"]  # checkpoints load across backends
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    x, res = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    ref = {None: lambda y: y, "relu": torch.relu, "gelu": lambda y: 0.5 * y * (1 + torch.erf(y / math.sqrt(2))),
           "gelu_tanh": lambda y: 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))}[activation]

    def layernorm(s):
        mu, var = s.mean(-1, keepdim=True), s.var(-1, unbiased=False, keepdim=True)
        return (s - mu) / torch.sqrt(var + 1e-5) * module.weight + module.bias

    torch.testing.assert_close(module(x), ref(layernorm(x)), atol=1e-5, rtol=1e-5)
    if activation is None:
        y, s = module(x, residual=res)
        torch.testing.assert_close(s, x + res, atol=0, rtol=0)
        torch.testing.assert_close(y, layernorm(x + res), atol=1e-5, rtol=1e-5)
        assert module.plain_exact() and torch.equal(module.plain(x + res), module(x + res))


def test_activations_are_their_formulas():
    x = torch.linspace(-4, 4, 101)
    torch.testing.assert_close(C.ACTIVATIONS["relu"](x), x.clamp(min=0), atol=0, rtol=0)
    torch.testing.assert_close(C.ACTIVATIONS["gelu"](x), 0.5 * x * (1 + torch.erf(x / math.sqrt(2))))
    torch.testing.assert_close(C.ACTIVATIONS["gelu_tanh"](x),
                               0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))))
    assert not torch.equal(C.ACTIVATIONS["gelu"](x), C.ACTIVATIONS["gelu_tanh"](x))


def test_positions():
    table = C.positions_for(_cfg()).weight  # sinusoids, (16, 16)
    p, i = 5, 3
    assert torch.isclose(table[p, 2 * i], torch.tensor(math.sin(p / 10000 ** (2 * i / 16))))
    assert torch.isclose(table[p, 2 * i + 1], torch.tensor(math.cos(p / 10000 ** (2 * i / 16))))
    assert dict(C.positions_for(_cfg()).state_dict()) == {}  # fixed: nothing in a checkpoint
    torch.manual_seed(0)
    learned = C.positions_for(_cfg(positions="learned"))
    assert learned.weight.shape == (16, 16) and 0.01 < learned.weight.std().item() < 0.03


def test_state_dict_names_are_what_checkpoints_hold():
    """Checkpoints and both exporters read these names: the refactor into factories kept every one."""
    cfg = dataclasses.replace(_cfg(), positions="learned", tie_embeddings=False, ffn_norm=True, enc_layers=2,
                              dec_layers=2, sharing="all")
    norm = ("ln.weight", "ln.bias")
    block = {"enc": ["norm_attn", "attn.qkv", "attn.out", "norm_ffn", "ffn.w1", "ffn.act", "ffn.w2"],
             "dec": ["norm_self", "self_attn.qkv", "self_attn.out", "norm_cross", "cross_attn.q", "cross_attn.kv",
                     "cross_attn.out", "norm_ffn", "ffn.w1", "ffn.act", "ffn.w2"]}
    expected = ["src_embed.weight", "tgt_embed.weight", "lm_head.weight", "src_pos.weight", "tgt_pos.weight"]
    for side, stack in (("enc", "encoder"), ("dec", "decoder")):
        for part in block[side]:
            names = norm if part.startswith("norm") or part.endswith("act") else ("weight",)
            expected += [f"{stack}.blocks.0.{part}.{n}" for n in names]
        expected += [f"{stack}.final_norm.{n}" for n in norm]
    assert list(Transformer(cfg).state_dict()) == expected


def test_stack_takes_the_config():
    cfg = dataclasses.replace(_cfg(), enc_layers=4, enc_unique=2, dec_unique=1, sharing="cycle_rev",
                              checkpointing=True)
    stack = Stack(cfg, "enc", EncoderBlock)
    assert len(stack.blocks) == 2 and stack.schedule == [0, 1, 1, 0] and stack.checkpointing
    h = torch.randn(2, 3, 16)
    out = stack.eval()(h, Transformer(cfg)._side(torch.zeros(2, 3), torch.tensor([3, 2], dtype=torch.int32),
                                                 None, None))
    assert out.shape == h.shape
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)  # the final LayerNorm (gain 1)
