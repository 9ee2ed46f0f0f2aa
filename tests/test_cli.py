"""The tool as a new user picks it up (issue 23 items 1, 5, 7, 11; issue 20 row 12): the `fastmt` entry point and
its commands, `stats` and `model` under training's flags, the Makefile (setup, help, quoting, data), LICENSE,
and the README's statements and commands. The README's marked commands also run as written from a fresh
shell in CI: .ci/readme-smoke.sh."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from train.cli import commands
from train.cli.flags import resolve_config
from train.config import PRESETS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MAKEFILE = (REPO / "Makefile").read_text()
HAS_MAKE = shutil.which("make") is not None


# ---------------------------------------------------------------------------------------------
# fastmt COMMAND
# ---------------------------------------------------------------------------------------------
def test_the_console_script_is_declared():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"fastmt": "train.commands:main"}
    assert project["license"] == {"text": "MIT"}
    assert (REPO / "LICENSE").read_text().startswith("MIT License")


def test_fastmt_lists_its_commands(capsys):
    assert commands.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*commands.COMMANDS, *commands.BENCH]:
        assert re.search(rf"^  {re.escape(name)} ", out, flags=re.M), name
    assert "75 interrupted" in out and "2 user error" in out
    assert commands.main([]) == 2  # no command: the list on stderr, a usage error


def _has_main(module: str) -> bool:
    import importlib

    return callable(getattr(importlib.import_module(module), "main", None))


def test_every_benchmark_with_a_main_is_a_fastmt_bench_command():
    listed = {module for module, _ in commands.BENCH.values()}
    # the runbook is `fastmt bench packets run` (bench.packets hands `run` to it); env_report is a step of the runbook
    listed |= {"bench.runbook", "bench.env_report"}
    mains = {f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py") if "\ndef main(" in p.read_text()}
    assert mains and mains <= listed, sorted(mains - listed)


@pytest.mark.parametrize("argv", [[name] for name in commands.COMMANDS if name != "bench"]
                         + [["bench", name] for name in commands.BENCH])
def test_every_command_reaches_its_modules_main(argv, capsys):
    module = (commands.BENCH[argv[1]] if argv[0] == "bench" else commands.COMMANDS[argv[0]])[0]
    if module == "bench.aot":  # compiles for a GPU: refuses to import under the Triton interpreter the tests set
        import os
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, "-m", "train.commands", *argv, "--help"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
        return
    assert _has_main(module), f"{module} has no main(argv)"
    try:  # argparse's --help exits 0; a main() that returns its code returns 0
        code = commands.main([*argv, "--help"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    assert "usage:" in capsys.readouterr().out


def test_fastmt_train_is_python_m_train(capsys):
    from train.cli.train import main as train_main

    argv = ["--preset", "s16", "--optim.lr", "2e-4", "--print-config"]
    assert commands.main(["train", *argv]) == 0
    via_fastmt = capsys.readouterr().out
    from train.cli import flags as cli

    assert cli.PROG == "python -m train"  # the name `fastmt train` used is not left behind
    assert train_main(argv) == 0
    assert via_fastmt == capsys.readouterr().out and json.loads(via_fastmt)["optim"]["lr"] == 2e-4


def test_fastmt_runs_as_a_process_and_keeps_exit_codes(tmp_path):
    """A real process: the console script when installed (make setup), else ``python -m train.commands``."""
    script = Path(sys.executable).with_name("fastmt")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "train.commands"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    ok = subprocess.run([*base, "train", "--preset", "tiny", "--print-config"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["run"]["name"] == "tiny", ok.stderr[-2000:]
    bad = subprocess.run([*base, "trian"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean train?" in bad.stderr
    typo = subprocess.run([*base, "train", "--preset", "tiny", "--optim.lrr", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and typo.stderr.startswith("fastmt train: error: unknown field --optim.lrr;")


# ---------------------------------------------------------------------------------------------
# stats and model under training's flags (issue 23 item 5)
# ---------------------------------------------------------------------------------------------
def test_stats_reports_the_rows_the_same_training_command_drops(tmp_path, capsys):
    flags = ["--preset", "tiny", "--data.dataset", "toy", "--data.max_len", "10",
             "--data.cache_dir", str(tmp_path / "cache")]
    assert commands.main(["stats", *flags, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    from data import build_data

    cfg, _ = resolve_config(flags)  # what `fastmt train` with the same flags trains on
    report = build_data(cfg.data, log=lambda *a: None).report.as_dict()
    assert stats["report"] == report
    dropped = json.dumps(report)
    assert "too_long" in dropped and stats["split"]["train"] < 1500 - 500 - 500  # rows were dropped
    assert stats["vocab_size"] <= cfg.data.vocab_size == 1000  # the preset's data settings, not the defaults


def test_model_reports_what_a_run_of_the_preset_builds(capsys):
    import dataclasses

    import torch

    from models import Transformer, count_params
    from train.cli.model import main as model_main
    from train.config import get_config

    cfg = get_config("tiny")
    with torch.device("meta"):
        expected = count_params(Transformer(dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size)))
    assert model_main(["tiny", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["params_unique"] == expected["unique"] == 229_376  # not 678k at vocab 8,000
    assert "vocabulary 1,000" in err and "data.vocab_size" in err
    assert commands.main(["model", "tiny", "--vocab", "8000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params_unique"] > 600_000
    assert model_main(["tiny", "--model.d_model", "128", "--json"]) == 0  # training's overrides apply
    assert json.loads(capsys.readouterr().out)["params_unique"] > expected["unique"]


# ---------------------------------------------------------------------------------------------
# The Makefile (issue 23 items 7, 11; issue 20 row 12)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake_python(tmp_path) -> Path:
    """An interpreter stand-in that prints the arguments it received as JSON (what make passed on)."""
    path = tmp_path / "argv.py"
    path.write_text(f"#!{sys.executable}\nimport json, sys\nprint('ARGV=' + json.dumps(sys.argv[1:]))\n")
    path.chmod(0o755)
    return path


def _make(fake: Path, *args: str, cwd: Path = REPO) -> list[str]:
    proc = subprocess.run(["make", "-s", "-f", str(REPO / "Makefile"), "SETUP=none", f"PYTHON={fake}", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("ARGV=")]
    return json.loads(line[5:])


@pytest.mark.skipif(not HAS_MAKE, reason="needs make")
def test_make_translate_passes_text_as_typed(fake_python, tmp_path):
    canary = tmp_path / "ran"
    text = f"It costs $5 and $(HOME) `touch {canary}` \"quoted\" 'single' $$ \\n"
    argv = _make(fake_python, "translate", "CKPT=runs/my run/best.pt", f"TEXT={text}")
    assert argv == ["-m", "train.translate", "--ckpt", "runs/my run/best.pt", text]
    assert not canary.exists()  # the backticks never ran
    assert _make(fake_python, "translate", "CKPT=x") == ["-m", "train.translate", "--ckpt", "x"]  # stdin
    proc = subprocess.run(["make", "-s", "SETUP=none", f"PYTHON={fake_python}", "translate"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "set CKPT=" in proc.stderr


@pytest.mark.skipif(not HAS_MAKE, reason="needs make")
def test_make_train_lets_args_choose_the_data_and_the_preset(fake_python, tmp_path):
    local = ["DATA_FILES=local.jsonl"]
    assert _make(fake_python, "train", *local) == ["-m", "train", "--auto", "--data-files", "local.jsonl"]
    for args in ("--data.dataset toy", "--data.dataset=toy", "--data-files mine.jsonl", "--config my.json"):
        argv = _make(fake_python, "train", *local, f"ARGS={args}")
        assert "local.jsonl" not in argv and argv[-len(args.split()):] == args.split(), argv
    assert _make(fake_python, "train", "ARGS=--preset s18", "DATA_FILES=") == ["-m", "train", "--preset", "s18"]


@pytest.mark.skipif(not HAS_MAKE, reason="needs make")
def test_make_train_installs_the_runtime_only_and_make_test_the_dev_extra(tmp_path):
    def planned(target: str) -> str:
        proc = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", target], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    train = planned("train")
    assert "install -q -e . -c constraints-cpu.txt" in train and "[dev" not in train and "export]" not in train
    assert '".[dev,export]"' in planned("test")  # the export tests run in CI: ctranslate2, transformers
    cpu = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", "TORCH_INDEX=https://download.pytorch.org/whl/cpu",
                          "setup"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    assert "--index-url 'https://download.pytorch.org/whl/cpu'" in cpu  # values are quoted (tests/security)


@pytest.mark.skipif(not HAS_MAKE, reason="needs make")
def test_make_help_lists_every_target():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    phony = re.search(r"^\.PHONY: (.+)$", MAKEFILE, flags=re.M).group(1).split()
    for target in phony:
        assert re.search(rf"^  make {target}\s+\S", out, flags=re.M), target


# ---------------------------------------------------------------------------------------------
# The README (issue 23 item 11)
# ---------------------------------------------------------------------------------------------
def _code_lines() -> list[str]:
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_points_at_nothing_outside_the_repository():
    assert "../shared" not in README and "/work/" not in README
    for path in re.findall(r"`((?:bench|data|docs|kernels|models|train|tests|\.ci)/[\w./-]+)`", README):
        if "<" not in path and "*" not in path:
            assert (REPO / path).exists(), path


def test_readme_names_only_commands_targets_and_presets_that_exist():
    code = "\n".join(_code_lines()) + "\n" + "\n".join(re.findall(r"`([^`\n]+)`", README))
    for cmd in re.findall(r"^fastmt (\w[\w-]*)", code, flags=re.M):
        assert cmd in commands.COMMANDS or cmd == "COMMAND", cmd
    for name in re.findall(r"\bfastmt bench ([\w-]+)", README):
        assert name in commands.BENCH or name == "NAME", name
    targets = set(re.findall(r"^([a-z-]+):", MAKEFILE, flags=re.M))
    for target in re.findall(r"(?:^|\s)make ([a-z][a-z-]+)", code, flags=re.M):
        assert target in targets, target
    table = README[README.index("| preset | what |"):]
    for preset in PRESETS:
        assert f"| `{preset}` |" in table, f"preset {preset} is not described"
    assert "2.11" in README and "2.13" in README  # the torch versions that are tested


def test_readme_cites_only_sections_that_exist():
    """In the README ("see *Data*") and in what the commands print ("README 'Time to BLEU'", which was none)."""
    headings = set(re.findall(r"^#+ (.+)$", README, flags=re.M))
    for cited in re.findall(r"(?:see|in|See) \*([^*]+)\*", README):
        assert cited in headings, cited
    for path in [*REPO.glob("*/*.py"), *REPO.glob("bench/*.sh")]:
        if path.parts[-2] in ("train", "data", "models", "bench", "kernels"):
            for cited in re.findall(r"README[ ,:]+['\"*]([A-Z][^'\"*]+)['\"*]", path.read_text()):
                assert cited in headings, f"{path.name} cites README section {cited!r}, which does not exist"


def test_readme_explains_its_jargon():
    first = README.index("seeds")
    assert "*seeds*" in README and "training projects fastmt started from" in README
    assert README.index("Presets and configuration") > 0 and first > 0


def test_every_training_command_in_the_readme_parses(capsys):
    """Each `fastmt train` / `python -m train` line of the README resolves with its flags (no training)."""
    lines = [line.split("#")[0].split(">")[0] for line in _code_lines()]
    train = [line.split()[2:] for line in lines if line.startswith(("fastmt train ", "python -m train "))
             and not line.startswith("python -m train.")]
    assert len(train) >= 6
    for argv in train:
        argv = [a.strip("'\"") for a in argv]
        if "--config" in argv:
            continue  # reads the file the line before writes (the smoke script runs it)
        if "--help-fields" in argv:
            continue  # prints and exits (test_cli_fields.py)
        if "--data-files" in argv:
            continue  # names files the reader has; the smoke script and the flag tests cover the flag
        cfg, _ = resolve_config(argv, machine=False)
        assert cfg.run.name


def test_the_smoke_blocks_are_what_ci_runs():
    blocks = re.findall(r"^<!-- smoke -->\n```\n(.*?)^```", README, flags=re.M | re.S)
    assert len(blocks) == 2
    commands_run = [line for b in blocks for line in b.splitlines()]
    trains = [c for c in commands_run if c.startswith("fastmt train --preset tiny --data.dataset toy")]
    assert trains
    # the translate line reads the checkpoint of the run the train line names
    name = re.search(r"--run\.name (\S+)", trains[0])
    run_dir = f"runs/{name.group(1) if name else 'tiny'}/"
    assert any(c.startswith(f"fastmt translate --ckpt {run_dir}") for c in commands_run)
    assert any(c.startswith("make translate ") for c in commands_run)
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci and "bash .ci/readme-smoke.sh" in ci
