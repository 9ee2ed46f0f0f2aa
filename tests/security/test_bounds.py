"""One set of bounds (issue 35): every numeric config field carries its range in the field schema
(declared with each field, ``data/declare.py``; ``train/bounds.py`` ``BOUNDS`` derived) and it applies to every source of a value: the command line, ``--config``, a run
folder's ``config.json``, a checkpoint, an export folder's records. Resource fields are capped by the machine, and a
model is built on the meta device, its size checked, before training allocates it as before inference.

Probes that would allocate or spawn without the bounds run in a child capped in memory (``capped``): on a build
without them they fail by a MemoryError, not by taking the machine down."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from data import declare
from tests.security.conftest import capped, forged_checkpoint, legacy_run, one_error_line
from train import bounds, fields
from train.config import Config, get_config, load_config_file


def test_every_numeric_field_declares_its_bounds():
    INFOS = fields.field_infos(Config)
    numeric = [k for k, i in INFOS.items() if any(t in i.type_text() for t in ("int", "float"))]
    assert numeric and all(INFOS[k].bounds is not None for k in numeric), [k for k in numeric if not INFOS[k].bounds]
    assert set(bounds.BOUNDS) <= set(INFOS)  # no bound for a field that does not exist


# ----------------------------------------------------------------------------------------------
# every source: the command line, --config, a run's config.json
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value", [("data.num_workers", 5000), ("data.build_workers", 100_000),
                                        ("model.enc_layers", 100_000), ("eval.beam_size", 10**6),
                                        ("run.cpu_threads", 3000), ("data.max_tokens", 2**40)])
def test_a_value_past_its_bound_is_refused_from_every_source(tmp_path, capsys, key, value):
    from train.cli.flags import resolve_config

    section, name = key.split(".")
    with pytest.raises(SystemExit) as e:  # the command line
        resolve_config(["--preset", "tiny", f"--{key}", str(value)])
    assert e.value.code == 2 and key in capsys.readouterr().err
    cfg = get_config("tiny").to_dict()
    cfg[section][name] = value
    path = tmp_path / "config.json"  # --config, and a copied run folder's config.json (what "train longer" names)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as err:
        load_config_file(path)
    assert str(path) in str(err.value)
    with pytest.raises(SystemExit) as e:
        resolve_config(["--config", str(path), "--resume", "auto"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):  # a checkpoint's config
        Config.from_dict(cfg, where="best.pt")


def test_the_bounds_let_every_preset_through():
    from train.config import PRESETS

    for name in PRESETS:
        get_config(name)  # (the bounds are checked when a Config is made)


def test_the_hypotheses_decoded_at_once_are_bounded_together(tmp_path):
    cfg = get_config("tiny").to_dict()
    cfg["eval"].update(beam_size=declare.MAX_BEAM, batch_size=4096)
    assert declare.MAX_BEAM * 4096 > declare.MAX_HYPOTHESES
    with pytest.raises(ValueError, match="hypotheses decoded at once"):
        Config.from_dict(cfg)


# ----------------------------------------------------------------------------------------------
# a checkpoint and an export folder
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, needle", [
    ({"eval": {"beam_size": 10**6}}, "eval.beam_size"),
    ({"eval": {"batch_size": 10**7}}, "eval.batch_size"),
    ({"eval": {"max_len_b": 10**9}}, "eval.max_len_b"),
    ({"run": {"cpu_threads": 3000}}, "run.cpu_threads"),
    ({"model": {"enc_layers": 100_000}}, "model.enc_layers"),
], ids=["beam", "batch", "length", "threads", "layers"])
def test_a_colleagues_checkpoint_cannot_size_a_decoding(tmp_path, changes, needle):
    ckpt = forged_checkpoint(tmp_path / "best.pt", **changes)
    r = capped(["-m", "train.translate", "--ckpt", str(ckpt), "--device", "cpu", "the cat"])
    one_error_line(r, needle, str(ckpt))


def test_decoding_flags_are_bounded_as_their_fields(tmp_path):
    from tests.security.conftest import LEGACY_CKPT

    r = capped(["-m", "train.translate", "--ckpt", str(LEGACY_CKPT), "--device", "cpu", "--beam", "100000", "x"])
    one_error_line(r, "--beam", str(declare.MAX_BEAM))


def test_threads_from_an_export_folder_are_bounded(tmp_path):
    pytest.importorskip("ctranslate2")
    from tests.security.test_one_door import _ct2_folder

    d = _ct2_folder(tmp_path, run={"cpu_threads": 3000})
    r = capped(["-m", "train.translate", "--ckpt", str(d), "--device", "cpu", "hello"], timeout=120)
    one_error_line(r, "run.cpu_threads", "fastmt_config.json")


def test_threads_are_capped_by_this_machines_cores():
    from train.evaluation.decode import configure_cpu

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        configure_cpu(torch.device("cpu"), {"run": {"cpu_threads": cores + 60}})
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)


def test_a_config_workers_file_never_forks_thousands(tmp_path):
    """The issue's machine-wide OOM: a copied run folder's config.json asking for 5000 DataLoader workers."""
    run = legacy_run(tmp_path)
    cfg = json.loads((run / "config.json").read_text())
    cfg["data"]["num_workers"] = 5000
    (run / "config.json").write_text(json.dumps(cfg))
    from train.cli.flags import resolve_config

    with pytest.raises(SystemExit) as e:
        resolve_config(["--config", str(run / "config.json"), "--resume", "auto"])
    assert e.value.code == 2 and declare.MAX_WORKERS < 5000


# ----------------------------------------------------------------------------------------------
# the meta-device build before training
# ----------------------------------------------------------------------------------------------
def test_training_builds_the_model_on_meta_first_and_refuses_what_the_machine_cannot_hold(tmp_path):
    """Every field within its bounds, the model together far beyond any memory: refused before allocating."""
    r = capped(["-m", "train", "--preset", "tiny", "--data.dataset", "toy", "--data.toy_rows", "300",
                "--data.vocab_size", "300", "--data.valid_size", "20", "--data.test_size", "20",
                "--data.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path / "runs"),
                "--run.device", "cpu", "--model.d_model", "16384", "--model.n_heads", "16",
                "--model.d_ff", "262144", "--model.enc_layers", "1024", "--model.dec_layers", "1024"], timeout=300)
    one_error_line(r, "parameters", "Nothing was allocated")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_resumed_checkpoint_is_compared_with_its_config_before_training_allocates(tmp_path):
    from tests.security.test_checkpoints import _legacy_config
    from train.errors import UserError
    from train.loop import Trainer

    run = legacy_run(tmp_path)
    ckpt = torch.load(run / "checkpoints" / "step-00000003.pt", weights_only=False)
    ckpt["config"]["model"]["d_ff"] = 32  # the stored tensors say 16
    torch.save(ckpt, run / "checkpoints" / "step-00000003.pt")
    cfg = _legacy_config(tmp_path, epochs=2, max_batches_per_epoch=3)
    cfg = Config.from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "d_ff": 32}})
    with pytest.raises(UserError, match="forged"):
        Trainer(cfg, resume=str(run / "checkpoints" / "step-00000003.pt"), log=lambda *a: None)
    assert sorted(p.name for p in Path(run).iterdir()) == ["checkpoints", "config.json", "metrics.jsonl", "run.json"]


@pytest.mark.parametrize("damage", ["rng", "optimizer", "position"])
def test_a_checkpoint_whose_training_state_does_not_load_is_one_line_and_changes_nothing(tmp_path, damage):
    from tests.security.test_checkpoints import _legacy_config
    from train.errors import UserError
    from train.loop import Trainer

    run = legacy_run(tmp_path)
    path = run / "checkpoints" / "step-00000003.pt"
    ckpt = torch.load(path, weights_only=False)
    if damage == "rng":
        ckpt["rng"]["python"] = [3, [1, 2, 3], None]  # not a Mersenne Twister state
    elif damage == "optimizer":
        ckpt["optimizer"] = {"state": "x", "param_groups": 5}
    else:
        ckpt["position"]["epoch"] = "one"
    torch.save(ckpt, path)
    before = {p.name: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(UserError, match="training state does not load|loads as this run.s"):
        Trainer(_legacy_config(tmp_path, epochs=2, max_batches_per_epoch=3), resume="auto", log=lambda *a: None)
    assert {p.name: p.stat().st_mtime_ns for p in run.rglob("*")} == before
