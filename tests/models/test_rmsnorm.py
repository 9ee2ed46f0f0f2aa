"""RMSNorm as a normalisation choice (``model.norm_kind rmsnorm``, issue 38): the formula, a model that trains and
decodes with it, the fused kernel refusing it before anything runs, and both export targets refusing it by name."""

from __future__ import annotations

import pytest
import torch

from models import components as C
from models.config import get_preset
from models.transformer import Transformer


def _cfg(**kw):
    return get_preset("tiny", vocab_size=40, d_model=16, n_heads=2, d_ff=24, dropout=0.0, max_positions=32,
                      norm="torch", norm_kind="rmsnorm", **kw)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_rmsnorm_is_its_formula_with_the_norms_interface(activation):
    torch.manual_seed(0)
    module = C.norm_for(_cfg(), 12, activation=activation)
    assert [n for n, _ in module.named_parameters()] == ["weight"]  # no bias, no mean
    with torch.no_grad():
        module.weight.normal_()
    x, res = torch.randn(3, 5, 12), torch.randn(3, 5, 12)

    def rms(s):
        return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * module.weight

    act = (lambda y: y) if activation is None else torch.nn.functional.gelu
    torch.testing.assert_close(module(x), act(rms(x)), atol=1e-5, rtol=1e-5)
    if activation is None:
        y, s = module(x, residual=res)
        torch.testing.assert_close(s, x + res, atol=0, rtol=0)
        torch.testing.assert_close(y, rms(x + res), atol=1e-5, rtol=1e-5)
        assert torch.equal(module.plain(x + res), module(x + res))  # the live decoding step's form


def test_a_model_with_rmsnorm_trains_and_its_greedy_decoding_is_self_consistent():
    from models.decoding import Batch, Decoder

    torch.manual_seed(0)
    model = Transformer(_cfg())
    src = torch.randint(4, 40, (3, 7))
    src[:, -1] = 3
    lengths = torch.full((3,), 7, dtype=torch.int32)
    tgt_in = torch.randint(4, 40, (3, 6))
    tgt_in[:, 0] = 2
    logits = model(src, tgt_in, lengths, torch.full((3,), 6, dtype=torch.int32))
    torch.nn.functional.cross_entropy(logits.reshape(-1, 40), torch.randint(4, 40, (18,))).backward()
    norms = [p for n, p in model.named_parameters() if n.endswith("ln.weight")]
    assert norms and all(p.grad is not None and torch.isfinite(p.grad).all() for p in norms)

    model.eval()
    [out] = Decoder(model, bos_id=2, eos_id=3, pad_id=0, beam_size=None, max_len_ratio=1.0,
                    max_len_extra=2).decode_batches([Batch(src, lengths, None, lengths.tolist())])
    for row, hyp in zip(src, out):  # each decoded token is the argmax of the full forward over its prefix
        tokens = [2, *hyp]
        with torch.no_grad():
            full = model(row[None], torch.tensor([tokens[:-1] or [2]]), lengths[:1],
                         torch.tensor([max(len(tokens) - 1, 1)], dtype=torch.int32))
        full[..., [0, 2]] = -torch.inf  # PAD and BOS are never generated
        assert full[0].argmax(-1).tolist()[: len(tokens) - 1] == tokens[1:]


def test_a_backend_that_lacks_rmsnorm_refuses_it_before_anything_runs(capsys, monkeypatch):
    """The config asks the registry: a kind registered on "torch" alone is refused on "fused" by name."""
    from train.cli.flags import resolve_config

    monkeypatch.setitem(C.NORMS, "rmsnorm", {"torch": C.TorchRMSNorm})

    with pytest.raises(SystemExit) as e:
        resolve_config(["--preset", "fast", "--model.norm_kind", "rmsnorm"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "norm_kind='rmsnorm'" in err and "--model.norm torch" in err
    cfg, _ = resolve_config(["--preset", "fast", "--model.norm_kind", "rmsnorm", "--model.norm", "torch"])
    assert cfg.model.norm_kind == "rmsnorm"
    with pytest.raises(ValueError, match="cannot compute norm kind 'rmsnorm'"):  # the registry, bypassing the config
        cfg = _cfg()
        object.__setattr__(cfg, "norm", "fused")
        C.norm_for(cfg, 16)


@pytest.mark.parametrize("target", ["ct2", "hf"])
def test_both_export_targets_refuse_rmsnorm_by_name(target):
    from train.errors import UserError
    from train.export.supported import refuse_unsupported

    refuse_unsupported(target, get_preset("tiny", vocab_size=40), "ckpt")  # the default exports
    with pytest.raises(UserError, match=r"model\.norm_kind='rmsnorm'|norm_kind"):
        refuse_unsupported(target, _cfg(), "ckpt")


def test_the_kernels_module_refuses_a_bad_activation_by_name():
    """(CPU work: kept out of tests/kernels, whose files the GPU runbook's kernel-test step runs on the device.)"""
    from kernels.layernorm import RMSNorm

    with pytest.raises(ValueError, match="activation='relu6'"):
        RMSNorm(8, activation="relu6")
