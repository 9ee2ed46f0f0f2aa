"""The training command line as a user meets it: config files, validation before any side effect, flags that
conflict, paths that stay whole, a warning when a GPU recipe is run on a CPU (issue 23 items 4, 5; issue 20
rows 6, 9, 13, 14)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.bounds import INF_OK
from train.cli.flags import resolve_config
from train.config import PRESETS, Config, get_config, load_config_file
from train.fields import field_infos, is_float_type

REPO = Path(__file__).resolve().parents[3]
FLOAT_FIELDS = sorted(k for k, i in field_infos(Config).items() if is_float_type(i.type))


@pytest.fixture(autouse=True)
def _idle_machine(monkeypatch):
    """These tests read warnings: the machine's real load (a busy-machine warning) stays out of them."""
    import train.cli.flags

    monkeypatch.setattr(train.cli.flags.os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def _error(argv, capsys) -> str:
    """The one line a refused command line prints (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        resolve_config(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m train: error: "), err
    return err


# ---------------------------------------------------------------------------------------------
# Non-finite values (issue 20 row 6)
# ---------------------------------------------------------------------------------------------
def test_the_float_fields_are_found():
    # every section has some; the list is what the two tests below walk
    assert {k.partition(".")[0] for k in FLOAT_FIELDS} == {"data", "model", "optim", "run", "eval"}
    assert {"optim.lr", "optim.grad_clip", "optim.betas", "eval.max_len_a", "eval.length_penalty",
            "run.max_wall_seconds", "model.dropout", "data.valid_size"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("key, bad", [(k, b) for k in FLOAT_FIELDS for b in ("nan", "inf", "-inf")
                                      if not (b == "inf" and k in INF_OK)])
def test_every_float_field_refuses_non_finite_values_on_the_command_line(key, bad, capsys):
    tp = field_infos(Config)[key].type
    value = bad
    if typing_tuple_len(tp):  # a tuple of floats: one bad element among good ones
        value = ",".join(["0.5"] * (typing_tuple_len(tp) - 1) + [bad])
    err = _error(["--preset", "tiny", f"--{key}", value], capsys)
    assert f"--{key}=" in err and "must be a finite number" in err


def test_inf_where_it_has_a_meaning():
    assert INF_OK == {"data.max_len_ratio": "inf keeps every length ratio"}
    assert resolve_config(["--preset", "tiny", "--data.max_len_ratio", "inf"])[0].data.max_len_ratio == math.inf


def typing_tuple_len(tp) -> int:
    import typing

    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return 2 if args[-1] is Ellipsis else len(args)
    return 0


@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_every_float_field_refuses_nan_in_a_config_built_in_code(key):
    section, _, name = key.partition(".")
    cfg = get_config("tiny")
    old = getattr(getattr(cfg, section), name)
    bad = tuple([math.nan] * len(old)) if isinstance(old, tuple) else math.nan
    # refused by the section's own check or by Config's finite check, naming the field either way
    with pytest.raises(ValueError, match=rf"{name}=.*nan"):
        dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: bad})})


# ---------------------------------------------------------------------------------------------
# Settings that only failed later (issue 20 row 13): refused at config time, naming both fields
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, names", [
    (["--model.layout", "packed"], ["model.layout", "data.batching", "--data.batching packed"]),
    (["--data.batching", "packed"], ["model.layout", "data.batching", "--model.layout packed"]),
    (["--model.max_positions", "16"], ["model.max_positions", "data.max_len", "--model.max_positions 64"]),
    (["--data.batching", "fixed", "--data.seq_len", "300", "--data.max_tokens", "20000"],
     ["model.max_positions", "data.seq_len"]),
    (["--eval.average_last", "3"], ["eval.average_last", "run.keep_last", "--run.keep_last 3"]),
    (["--eval.best_metric", "valid_loss", "--eval.valid_loss", "false"], ["eval.best_metric", "eval.valid_loss"]),
])
def test_cross_field_conflicts_are_refused_in_one_line(flags, names, capsys):
    err = _error(["--preset", "tiny", *flags], capsys)
    for n in names:
        assert n in err, (n, err)


def test_consistent_settings_pass():
    cfg, _ = resolve_config(["--preset", "tiny", "--data.batching", "packed", "--model.layout", "packed",
                             "--eval.average_last", "2", "--model.max_positions", "64"])
    assert (cfg.data.batching, cfg.model.layout, cfg.model.max_positions) == ("packed", "packed", 64)
    for name in PRESETS:  # every preset is consistent as shipped
        get_config(name)


def test_a_conflict_is_refused_before_anything_is_written(tmp_path):
    """A real `python -m train` with a setting that used to fail only at its first batch (after the run
    folder was moved aside): exit 2, one line, and the existing run folder untouched."""
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "epoch"}\n')
    before = sorted(p.name for p in (tmp_path / "runs").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "FASTMT_DEBUG"} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "train", "--preset", "tiny", "--data.dataset", "toy",
                           "--model.max_positions", "8", "--run.out_dir", str(tmp_path / "runs"), "--run.name",
                           "mine", "--data.cache_dir", str(tmp_path / "cache")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "model.max_positions=8" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == before
    assert (run / "metrics.jsonl").read_text() == '{"kind": "epoch"}\n'
    assert not (tmp_path / "cache").exists()  # not even the data cache was touched


# ---------------------------------------------------------------------------------------------
# Shortcuts and their fields (issue 20 row 14); paths (row 9)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, both", [
    (["--epochs", "2", "--run.epochs", "3"], ("--epochs", "--run.epochs")),
    (["--run.epochs=3", "--epochs", "2"], ("--epochs", "--run.epochs")),
    (["--max-steps", "5", "--run.max_steps", "6"], ("--max-steps", "--run.max_steps")),
    (["--data-files", "a", "--data.data_files", "b"], ("--data-files", "--data.data_files")),
    (["--run.epochs", "2", "--run.epochs", "3"], ("--run.epochs given 2 times",)),
])
def test_a_setting_given_twice_is_an_error(argv, both, capsys):
    err = _error(["--preset", "tiny", *argv], capsys)
    for flag in both:
        assert flag in err


def test_paths_are_never_split(tmp_path, capsys):
    spaced, comma = tmp_path / "my data" / "a b.jsonl", tmp_path / "c,d.jsonl"
    spaced.parent.mkdir()
    for f in (spaced, comma):
        f.write_text("")
    cfg, _ = resolve_config(["--preset", "tiny", "--data-files", str(spaced), str(comma)])
    assert cfg.data.data_files == (str(spaced), str(comma))
    cfg, _ = resolve_config(["--preset", "tiny", "--data.data_files", str(spaced), "--data.data_files", str(comma)])
    assert cfg.data.data_files == (str(spaced), str(comma))
    cfg, _ = resolve_config(["--preset", "tiny", "--data.data_files", json.dumps([str(comma), str(spaced)])])
    assert cfg.data.data_files == (str(comma), str(spaced))
    err = _error(["--preset", "tiny", "--data-files", str(tmp_path / "gone x.jsonl")], capsys)
    assert repr(str(tmp_path / "gone x.jsonl")) in err  # named whole
    os.mkfifo(tmp_path / "pipe")  # exists, but no corpus: said so, not "not found" (and never opened: no hang)
    err = _error(["--preset", "tiny", "--data-files", str(tmp_path / "pipe")], capsys)
    assert "must be regular files" in err and "not found" not in err


def test_debug_flag_and_environment(monkeypatch):
    assert resolve_config(["--preset", "tiny"])[1].debug is False
    assert resolve_config(["--preset", "tiny", "--debug"])[1].debug is True
    monkeypatch.setenv("FASTMT_DEBUG", "1")
    assert resolve_config(["--preset", "tiny"])[1].debug is True


# ---------------------------------------------------------------------------------------------
# The machine (issue 23 items 4 and 10)
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_a_gpu_preset_on_cpu_warns_with_the_fix():
    notes: list[str] = []
    cfg, _ = resolve_config(["--preset", "fast"], log=notes.append)
    (warning,) = [n for n in notes if n.startswith("warning:")]
    assert "preset 'fast'" in warning and "bf16" in warning and "torch.compile" in warning
    assert "--preset tiny" in warning and "--run.precision fp32 --run.compile false" in warning
    # the suggestion silences it
    quiet: list[str] = []
    resolve_config(["--preset", "fast", "--run.precision", "fp32", "--run.compile", "false"], log=quiet.append)
    resolve_config(["--preset", "tiny"], log=quiet.append)
    assert quiet == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_impossible_devices_are_refused(capsys):
    assert "torch sees no CUDA device" in _error(["--preset", "tiny", "--run.device", "cuda"], capsys)
    err = _error(["--preset", "tiny", "--run.compile", "true", "--run.compile_backend", "inductr"], capsys)
    assert "run.compile_backend='inductr'" in err and "did you mean inductor" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_a_busy_machine_is_named_with_what_the_run_does_about_it(monkeypatch):
    import train.cli.flags

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(train.cli.flags.os, "getloadavg", lambda: (cores + 5.0, 0.0, 0.0))
    notes: list[str] = []
    resolve_config(["--preset", "tiny"], log=notes.append)
    (warning,) = notes
    assert f"load {cores + 5.0:.1f} on the {cores} cores" in warning and "run.cpu_adapt" in warning
    notes.clear()
    resolve_config(["--preset", "tiny", "--run.cpu_threads", "1"], log=notes.append)  # the user chose
    monkeypatch.setattr(train.cli.flags.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    resolve_config(["--preset", "tiny"], log=notes.append)
    assert notes == []


def _physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs this process may run on (Linux sysfs)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        cores.add((topo.joinpath("physical_package_id").read_text(), topo.joinpath("core_id").read_text()))
    return len(cores)


@pytest.mark.skipif(not Path("/sys/devices/system/cpu/cpu0/topology/core_id").exists(), reason="Linux sysfs")
def test_cpu_runs_use_every_physical_core_by_default(tmp_path):
    """What a fresh process running the tiny preset on the CPU sets (the tests pin one thread themselves)."""
    code = ("import torch; from train.config import get_config; from train.loop import _configure_backend; "
            "cfg = get_config('tiny'); assert cfg.run.cpu_threads is None, cfg.run.cpu_threads; "
            "_configure_backend(cfg, torch.device('cpu')); print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env | {"PYTHONPATH": str(REPO)}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) == _physical_cores()


# ---------------------------------------------------------------------------------------------
# Config files (issue 23 item 5)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_print_config_output_is_a_config_file(preset, tmp_path, capsys):
    from train.cli.train import main

    assert main(["--preset", preset, "--optim.lr", "2e-4", "--print-config"]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "cfg.json"
    path.write_text(out)
    expected = dataclasses.replace(get_config(preset), optim=dataclasses.replace(get_config(preset).optim, lr=2e-4))
    assert load_config_file(path) == expected
    cfg, _ = resolve_config(["--config", str(path), "--epochs", "3"])  # the command line overrides the file
    assert cfg == dataclasses.replace(expected, run=dataclasses.replace(expected.run, epochs=3))


def test_a_run_folders_config_json_is_a_config_file(tmp_path):
    """What the run folder keeps (``Config.to_dict()`` as JSON, as metrics/provenance write it) reads back."""
    cfg = get_config("fast")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
    assert resolve_config(["--config", str(tmp_path / "config.json")])[0] == cfg


def test_a_partial_file_takes_the_rest_from_the_preset(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text('{"optim": {"lr": 0.001}, "run": {"name": "mine"}}')
    cfg, _ = resolve_config(["--preset", "tiny", "--config", str(path)])
    assert (cfg.optim.lr, cfg.run.name, cfg.model) == (0.001, "mine", get_config("tiny").model)
    err = _error(["--config", str(path)], capsys)  # without a preset the file must be whole
    assert str(path) in err and "--preset" in err


@pytest.mark.parametrize("text, expect", [
    ('{"optim": {"lrr": 0.001}}', r"mine.json: unknown key optim.lrr; did you mean optim.lr\?"),
    ('{"optimizer": {}}', r"mine.json: unknown section 'optimizer'; did you mean optim\?"),
    ('{"optim": {"lr": "fast"}}', r'mine.json: optim.lr="fast" is not a float'),
    ('{"run": {"epochs": 2.5}}', r"mine.json: run.epochs=2.5 is not an int"),
    ('{"optim": {"lr": NaN}}', r"mine.json: optim.lr=nan must be a finite number"),
    ('{"data": {"batching": "pakced"}}', r"mine.json: data.batching=\"pakced\" is not one of .*did you mean packed\?"),
    ('{"optim": {"lr": 1e-3,}}', r"mine.json:1:\d+: not valid JSON"),
    ('{"model": {"layout": "packed"}}', r"mine.json: model.layout='packed' and data.batching='token_bucket'"),
    ('[1, 2]', r"mine.json: a config is a JSON object"),
])
def test_bad_config_files_fail_in_one_line_naming_the_key_and_file(text, expect, tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text(text)
    import re

    err = _error(["--preset", "tiny", "--config", str(path)], capsys)
    assert re.search(expect, err), err
    assert "no such file" in _error(["--preset", "tiny", "--config", str(tmp_path / "nope.json")], capsys)


@pytest.mark.parametrize("key", ["model.vocab_size", "model.pad_id"])
def test_fields_the_tokenizer_sets_are_refused_as_flags_not_ignored(key, capsys):
    """A run overwrites these from its tokenizer: a flag for them used to be accepted and silently ignored
    (``fastmt model tiny --model.vocab_size 5000`` printed the 8,000-piece model)."""
    from train.cli.model import main as model_main
    from train.cli.train import main as train_main

    for main in (train_main, model_main):
        argv = ["--preset", "tiny", f"--{key}", "5000", "--print-config"] if main is train_main else ["tiny", f"--{key}", "5000"]
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert f"--{key} cannot be set" in err and "Traceback" not in err
