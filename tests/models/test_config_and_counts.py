"""ModelConfig validation, presets, sharing schedules, parameter and FLOP counts, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import ModelConfig, Transformer, count_params, flops_per_token, get_preset
from models import flops as F
from models.config import layer_schedule
from tests.utils import make_batch, model_inputs, small_cfg
from train.cli.model import main as cli_main


@pytest.mark.parametrize("kw, match", [
    (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
    (dict(d_model=96, n_heads=2, attn_backend="triton"), r"head dim d_model/n_heads=48"),
    (dict(sharing="cycle"), "needs enc_unique"),
    (dict(sharing="cycle_rev", enc_unique=7, dec_unique=3), "enc_unique=7 > enc_layers=6"),
    (dict(sharing="all", enc_unique=2), "needs enc_unique == 1"),
    (dict(dec_unique=3), "needs dec_unique == dec_layers=6"),
    (dict(sharing="alternate"), "sharing='alternate' is not one of"),
    (dict(positions="rotary"), "positions='rotary'"),
    (dict(activation="swish"), "activation='swish'"),
    (dict(norm="rms"), "norm='rms'"),
    (dict(layout="ragged"), "layout='ragged'"),
    (dict(layout="packed", attn_backend="sdpa"), "SDPA does not have.*attn_backend='auto'"),
    (dict(attn_backend="flash"), "attn_backend='flash'"),
    (dict(dropout=1.0), "dropout=1.0"),
    (dict(pad_id=100), r"pad_id=100 must be an id in \[0, vocab_size=100\)"),
    (dict(enc_layers=0), "enc_layers=0 must be a positive int"),
])
def test_bad_config_raises_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=100, **kw)


def test_presets_and_overrides():
    s18, s16 = get_preset("s18", vocab_size=8000), get_preset("s16", vocab_size=8000)
    assert (s18.enc_layers, s18.dec_layers, s18.d_model, s18.n_heads, s18.d_ff, s18.dropout) == (6, 6, 512, 8, 2048, 0.1)
    assert s16.schedule("enc") == s16.schedule("dec") == [0, 1, 2, 2, 1, 0] and s16.d_ff == 128
    assert get_preset("tiny", vocab_size=123, layout="varlen").layout == "varlen"
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        get_preset("tiny", d_modle=64)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("huge")
    with pytest.raises(ValueError, match="n_heads=3"):
        get_preset("s18", n_heads=3)  # overrides are validated


def test_layer_schedules():
    assert layer_schedule("none", 4, 4) == [0, 1, 2, 3]
    assert layer_schedule("all", 4, 1) == [0, 0, 0, 0]
    assert layer_schedule("cycle", 6, 3) == [0, 1, 2, 0, 1, 2]
    assert layer_schedule("cycle_rev", 6, 3) == [0, 1, 2, 2, 1, 0]
    assert layer_schedule("cycle_rev", 5, 2) == [0, 1, 1, 0, 0]


def analytic_params(cfg: ModelConfig) -> tuple[int, int]:
    """(unique, applied) from the architecture's description, independent of the module tree."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    ln = 2 * d  # weight + bias
    ffn = 2 * d * f + (2 * f if cfg.ffn_norm else 0)  # bias-free W1, W2 (+ mid-FFN LN)
    enc = 4 * d * d + 2 * ln + ffn  # QKV + out, two norms, FFN
    dec = 8 * d * d + 3 * ln + ffn  # self QKV + out, cross Q + KV + out, three norms, FFN
    shared = V * d * (1 if cfg.tie_embeddings else 3) + 2 * ln  # embeddings/head + final norms
    shared += 2 * cfg.max_positions * d if cfg.positions == "learned" else 0
    unique = shared + cfg.unique_blocks("enc") * enc + cfg.unique_blocks("dec") * dec
    applied = shared + cfg.enc_layers * enc + cfg.dec_layers * dec
    return unique, applied


@pytest.mark.parametrize("kw", [
    dict(sharing="none"),
    dict(sharing="all"),
    dict(sharing="cycle", enc_unique=2, dec_unique=3),
    dict(sharing="cycle_rev", enc_unique=3, dec_unique=2),
    dict(sharing="cycle_rev", enc_unique=3, dec_unique=3, tie_embeddings=False, positions="learned"),
    dict(ffn_norm=False, norm="torch", activation="relu"),
], ids=["none", "all", "cycle", "cycle_rev", "cycle_rev-untied-learned", "no-ffn-norm-torch"])
def test_param_counts_match_analytic(kw):
    cfg = ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=24, enc_layers=6, dec_layers=5,
                      max_positions=20, **kw)
    counts = count_params(Transformer(cfg))
    unique, applied = analytic_params(cfg)
    assert counts == {"unique": unique, "applied": applied}
    assert (counts["unique"] == counts["applied"]) == (cfg.sharing == "none")


def test_preset_counts_on_meta_device():
    """The seed-like presets at vocab 8000 (numbers quoted in the closing note)."""
    for name in ("s18", "s16"):
        cfg = get_preset(name, vocab_size=8000)
        with torch.device("meta"):
            assert tuple(count_params(Transformer(cfg)).values()) == analytic_params(cfg)


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False, sharing="cycle_rev", enc_unique=1, dec_unique=1)])
def test_flops_per_token_matches_flop_counter(kw):
    """3 x forward matmul FLOPs (torch's FlopCounterMode over a real fwd+bwd), per target token."""
    S, T = 7, 5
    cfg = small_cfg(vocab_size=50, attn_backend="reference", **kw)
    model = Transformer(cfg)
    batch = make_batch([S], [T], 50)
    with FlopCounterMode(display=False) as counter:
        model(**model_inputs(batch)).float().sum().backward()
    # the reference materialises all T*T causal scores; flops_per_token counts the T(T+1)/2 visible ones
    masked = 3 * cfg.dec_layers * 2 * 2 * cfg.d_model * (T * T - T * (T + 1) / 2)
    assert flops_per_token(cfg, S, T) * T + masked == counter.get_total_flops()


# ----------------------------------------------------------------------------------------------
# Peaks and MFU: the peak of the run's own compute dtype, never another's
# ----------------------------------------------------------------------------------------------
FAKE_TABLE = (("Fake PCIe", r"fakegpu.*pcie", {"fp32": 1e12, "tf32": 2e12, "bf16": 4e12, "fp16": 8e12}),
              ("Fake", r"fakegpu", {"fp32": 10e12, "tf32": 20e12, "bf16": 40e12}))  # no fp16 entry


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.get_device_name answers a fake name; the matmul precision is restored after."""
    name = {"value": "FakeGPU PCIe 80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["value"])
    before = torch.get_float32_matmul_precision()
    yield name
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("precision, matmul_precision, dtype, peak", [
    ("fp32", "highest", "fp32", 1e12), ("fp32", "high", "tf32", 2e12),
    ("bf16", "highest", "bf16", 4e12), ("bf16", "high", "bf16", 4e12), ("fp16", "high", "fp16", 8e12)])
def test_run_peak_pairs_precision_with_its_dtype(fake_cuda, precision, matmul_precision, dtype, peak):
    torch.set_float32_matmul_precision(matmul_precision)
    value, got_dtype, why = F.run_peak("cuda", precision, table=FAKE_TABLE)
    assert (value, got_dtype) == (peak, dtype) and why == f"Fake PCIe datasheet, dense {dtype}"
    # the same model FLOP rate gives a different MFU per dtype: it is divided by that dtype's peak
    assert F.mfu(0.5e12, value) == pytest.approx(0.5e12 / peak)


def test_peak_table_order_and_missing_entries(fake_cuda, monkeypatch):
    fake_cuda["value"] = "FakeGPU 80GB"  # not PCIe: the second entry, which has no fp16 peak
    calls = []
    monkeypatch.setattr(F, "_MEASURED", {})
    monkeypatch.setattr(F, "measure_peak", lambda device, dtype: calls.append(dtype) or 3e12)
    assert F.run_peak("cuda", "bf16", table=FAKE_TABLE)[:2] == (40e12, "bf16")
    for _ in range(3):  # no table entry: measured once per process and dtype, then remembered
        value, dtype, why = F.run_peak("cuda", "fp16", table=FAKE_TABLE)
        assert (value, dtype) == (3e12, "fp16") and why.startswith("measured in this run: fp16 matmul")
    assert calls == ["fp16"]
    assert F.run_peak("cuda", "bf16", override=5e12, table=FAKE_TABLE) == (5e12, "bf16", "given peak (run.peak_flops)")


def test_no_peak_on_cpu_and_datasheet_entries():
    for precision in ("fp32", "bf16", "fp16"):
        value, dtype, why = F.run_peak("cpu", precision)
        assert value is None and dtype == precision and "no MFU on cpu" in why
        assert math.isnan(F.mfu(1e9, value))
    # the real table: names as torch.cuda.get_device_name reports them; dense = half the sparse datasheet rate
    assert F.table_peak("NVIDIA H100 80GB HBM3", "bf16") == (989.5e12, "H100 SXM datasheet, dense bf16")
    assert F.table_peak("NVIDIA H100 PCIe", "fp32")[0] == 51e12
    assert F.table_peak("NVIDIA H100 NVL", "tf32")[0] == 417.5e12
    assert F.table_peak("NVIDIA H200", "fp16")[0] == 989.5e12
    assert F.table_peak("NVIDIA A100-SXM4-80GB", "tf32")[0] == 156e12
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100 80GB PCIe"):
        fp32, tf32, bf16, fp16 = (F.table_peak(name, d)[0] for d in F.PEAK_DTYPES)
        assert fp32 < tf32 < bf16 == fp16, name
    assert F.table_peak("NVIDIA GeForce RTX 4090", "bf16")[0] is None
    with pytest.raises(ValueError, match="dtype='int8'"):
        F.table_peak("NVIDIA H100", "int8")
    with pytest.raises(ValueError, match="precision='tf32'"):
        F.peak_dtype("tf32")


def test_cli_json(capsys):
    assert cli_main(["s16", "--vocab", "8000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["params_unique", "params_applied", "flops_per_token"]
    assert isinstance(out["params_unique"], int) and isinstance(out["flops_per_token"], float)
    cfg = get_preset("s16", vocab_size=8000)
    assert (out["params_unique"], out["params_applied"]) == analytic_params(cfg)
    assert out["params_applied"] > out["params_unique"]
    assert out["flops_per_token"] == flops_per_token(cfg, 32, 32)
    assert cli_main(["tiny"]) == 0 and "params unique" in capsys.readouterr().out
