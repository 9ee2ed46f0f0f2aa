"""Three one-line answers (issue 45's notes): Ctrl-C in ``translate`` says so and exits 130, as ``stats`` does; a key
given twice in a ``--config`` file (or a run's config.json) is refused, never the last one silently taken; a value
a checkpoint holds is reported as the checkpoint's, never as if typed on the command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models import Transformer, get_preset
from train.cli.translate import main as translate_main
from train.config import get_config, load_config_file
from train.errors import EXIT_ABORTED
from train.overrides import DuplicateKeyError


def write_ckpt(path: Path, tok, config: dict | None = None) -> Path:
    mcfg = get_preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, enc_layers=1,
                      dec_layers=1, max_positions=24)
    record = {**get_config("tiny").record(), "model": dataclasses.asdict(mcfg)}  # every section, as the trainer's
    for section, values in (config or {}).items():
        record[section] = {**record[section], **values}
    torch.save({"model": Transformer(mcfg).state_dict(), "config": record,
                "position": {"epoch": 1, "batch_index": 0, "step": 1},
                "tokenizer": {"model_file": "spm.model", "key": tok.key, "model_bytes": tok.model_bytes()}}, path)
    return path


def test_ctrl_c_in_translate_is_one_line_and_130(toy_bundle, tmp_path, monkeypatch, capsys):
    ckpt = write_ckpt(tmp_path / "a.pt", toy_bundle.tokenizer)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("train.cli.translate.translate_lines", interrupted)
    assert translate_main(["--ckpt", str(ckpt), "the cat sleeps"]) == EXIT_ABORTED
    err = capsys.readouterr().err.strip()
    assert "interrupted (Ctrl-C)" in err and "\n" not in err and "Traceback" not in err


def test_a_checkpoints_precision_is_reported_as_the_checkpoints(toy_bundle, tmp_path, capsys):
    ckpt = write_ckpt(tmp_path / "a.pt", toy_bundle.tokenizer, {"run": {"precision": "fp64"}})
    assert translate_main(["--ckpt", str(ckpt), "the cat sleeps"]) == 2
    err = capsys.readouterr().err.strip()
    assert "its config's run.precision 'fp64'" in err and "--precision fp64" not in err and "\n" not in err
    assert translate_main(["--ckpt", str(ckpt), "--precision", "fp64", "x"]) == 2  # typed: said as typed
    assert "--precision fp64: must be one of" in capsys.readouterr().err
    assert translate_main(["--ckpt", str(ckpt), "--precision", "fp32", "the cat sleeps"]) == 0


@pytest.mark.parametrize("where", ["section", "top"])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, where):
    text = json.dumps(dataclasses.asdict(get_config("tiny")), indent=1, default=str)
    if where == "section":
        text = text.replace('"lr": ', '"lr": 0.5, "lr": ', 1)
        key = '"lr"'
    else:
        text = text.replace('{\n "', '{\n "eval": {"beam_size": 9}, "', 1)  # the whole section twice
        key = '"eval"'
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(DuplicateKeyError, match=f"{path}: the key {key} is given twice") as e:
        load_config_file(path, get_config("tiny"))
    assert "\n" not in str(e.value)


def test_a_config_file_without_duplicates_still_loads(tmp_path):
    cfg = get_config("tiny")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict(), default=str))
    assert load_config_file(path, cfg).to_dict() == cfg.to_dict()

