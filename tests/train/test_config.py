"""Config presets, validation, and the --section.field CLI."""

from __future__ import annotations

import json

import pytest

from train.cli.flags import resolve_config
from train.cli.train import main
from train.config import PRESETS, Config, OptimConfig, RunConfig, apply_overrides, get_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_round_trip(name):
    cfg = get_config(name)
    assert cfg.run.name == name
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_preset_contents():
    s18, s16, fast, base = get_config("s18"), get_config("s16"), get_config("fast"), get_config("baseline")
    m = s18.model
    assert (m.enc_layers, m.dec_layers, m.d_model, m.n_heads, m.d_ff) == (6, 6, 512, 8, 2048)
    assert (s16.model.enc_unique, s16.model.sharing, s16.model.d_ff) == (3, "cycle_rev", 128)
    assert (s18.optim.name, s18.optim.lr, s18.optim.weight_decay, s18.optim.pct_start) == ("lion", 1e-4, 1e-2, 0.28)
    assert (fast.run.precision, fast.run.compile, fast.data.batching, fast.model.norm, fast.model.layout) == (
        "bf16", True, "packed", "fused", "packed")
    assert (base.run.precision, base.run.compile, base.data.batching, base.data.seq_len) == ("fp32", False, "fixed", 350)
    assert (base.optim.name, base.optim.lr, base.model.attn_backend, base.model.norm) == ("adam", 1e-4, "reference", "torch")
    assert get_config("tiny").run.compile is False


def test_overrides_parse_types():
    cfg = apply_overrides(get_config("tiny"), {
        "optim.lr": "3e-4", "optim.betas": "0.8,0.95", "run.compile": "true", "run.max_steps": "none",
        "optim.grad_clip": "None", "data.valid_size": "0.1", "data.test_size": "7", "model.d_model": "96",
        "run.precision": "bf16", "data.data_files": "my data/a, b.jsonl",
    })
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.8, 0.95) and cfg.run.compile is True
    assert cfg.run.max_steps is None and cfg.optim.grad_clip is None
    assert cfg.data.valid_size == 0.1 and isinstance(cfg.data.test_size, int) and cfg.data.test_size == 7
    assert cfg.model.d_model == 96 and cfg.run.precision == "bf16"
    assert cfg.data.data_files == ("my data/a, b.jsonl",)  # one path, never split on spaces or commas
    two = apply_overrides(get_config("tiny"), {"data.data_files": ["a b.jsonl", "c.jsonl"]})  # flag given twice
    assert two.data.data_files == ("a b.jsonl", "c.jsonl")
    assert apply_overrides(get_config("tiny"), {"data.data_files": '["x y.jsonl", "z,w.jsonl"]'}
                           ).data.data_files == ("x y.jsonl", "z,w.jsonl")


@pytest.mark.parametrize("overrides, match", [
    ({"optim.lrr": "1"}, r"unknown field --optim.lrr; did you mean --optim.lr\?"),
    ({"opt.lr": "1"}, r"unknown option --opt.lr; did you mean --optim.lr\?"),
    ({"run.epochs": ["1", "2"]}, r"--run.epochs given 2 times"),
    ({"optim.lr": "fast"}, r"--optim.lr: 'fast' is not a float"),
    ({"run.epochs": "2.5"}, r"--run.epochs: '2.5' is not an int"),
    ({"run.compile": "maybe"}, r"--run.compile: cannot parse 'maybe'"),
    ({"optim.lr": "nan"}, r"--optim.lr=nan must be a finite number"),
    ({"optim.betas": "0.9,inf"}, r"--optim.betas=inf must be a finite number"),
    ({"run.precision": "fp8"}, r"'fp8' is not one of \['bf16', 'fp16', 'fp32'\]"),
    ({"optim.betas": "0.9"}, r"expected 2 comma-separated values"),
    ({"optim.lr": "-1"}, r"optim.lr=-1.0 must be > 0"),  # value checks run again after the override
    ({"optim.accum_steps": "0"}, r"accum_steps=0 must be >= 1"),
])
def test_overrides_reject(overrides, match):
    with pytest.raises(ValueError, match=match):
        apply_overrides(get_config("tiny"), overrides)


def test_dataclass_validation():
    with pytest.raises(ValueError, match="pct_start"):
        OptimConfig(pct_start=1.5)
    with pytest.raises(ValueError, match="keep_last"):
        RunConfig(keep_last=0)


def test_cli(capsys, tmp_path):
    cfg, args = resolve_config(["--preset", "s16", "--optim.lr", "2e-4", "--run.name=abc", "--epochs", "3",
                                "--max-steps", "10", "--resume", "auto"])
    assert (cfg.optim.lr, cfg.run.name, cfg.run.epochs, cfg.run.max_steps, args.resume) == (2e-4, "abc", 3, 10, "auto")
    for argv, msg in [(["--preset", "tiny", "--model.nope", "1"], "unknown field --model.nope"),
                      (["--preset", "tiny", "--run.epochs", "x"], "is not an int"),
                      (["--preset", "tiny", "stray"], "unrecognized argument 'stray'"),
                      (["--preset", "tiny", "--data-files", str(tmp_path / "missing.jsonl")], "data files not found"),
                      (["--preset", "tiny", "--auto"], "either --auto or --preset"),
                      ([], "choose --preset")]:
        with pytest.raises(SystemExit) as e:
            resolve_config(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_cli_auto_on_cpu_says_why(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert main(["--auto", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert "no CUDA device -> preset 'tiny'" in err  # on stderr: stdout stays a valid --config file
    assert json.loads(out)["run"]["name"] == "tiny"
