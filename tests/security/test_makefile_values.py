"""The Makefile never expands a value from the command line or the environment (issue 35): make syntax in any of them
(``$(shell ...)``) runs nothing, for any target (``make help`` too), and the value reaches the command as the text
it was given. Every variable the Makefile reads is tried, each way it can be given."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

VARIABLES = ("VENV", "SETUP", "BASE_PYTHON", "TORCH_SPEC", "TORCH_INDEX", "ARGS", "CKPT", "TEXT", "STANDIN",
             "DATA_FILES", "PYTHON", "TORCH_MIN", "VENV_MIN", "TORCH_MIN_TESTS", "FASTMT_DATA_FILES",
             "SOME_OTHER_NAME")
TARGETS = (("help",), ("-n", "train"), ("-n", "stats"), ("-n", "setup"), ("-n", "-B", "test-torch-min"),
           ("-n", "translate"), ("-n", "clean"))


def _make(sandbox: Path, args: tuple[str, ...], env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(sandbox), **env_extra}
    return subprocess.run(["make", "-s", "-f", str(REPO / "Makefile"), "-C", str(sandbox), *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("how", ["command-line", "environment"])
@pytest.mark.parametrize("name", VARIABLES)
def test_make_syntax_in_a_value_runs_nothing(tmp_path, name, how):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    pwned = tmp_path / "pwned"
    value = f"$(shell touch {pwned})"
    for target in TARGETS:
        if how == "command-line":
            _make(sandbox, (*target, f"{name}={value}"), {})
        else:
            _make(sandbox, target, {name: value})
        assert not pwned.exists(), f"make {' '.join(target)} ran the {how} value of {name}"


def test_values_reach_the_commands_as_given(tmp_path):
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    show = sandbox / "show-env"
    show.write_text("#!/bin/sh\nenv | grep -E '^(FASTMT_DATA_FILES|FOO)=' | sort\necho \"args: $*\"\n")
    show.chmod(0o755)
    r = _make(sandbox, ("stats", "SETUP=none", f"PYTHON={show}", "FOO=$(shell id)", "ARGS=--x '$HOME'"),
              {"FASTMT_DATA_FILES": "/d/$(shell id):/e.jsonl"})
    assert r.returncode == 0, r.stderr
    assert "FASTMT_DATA_FILES=/d/$(shell id):/e.jsonl" in r.stdout and "FOO=$(shell id)" in r.stdout
    assert "args: -m train.stats --auto --x $HOME" in r.stdout  # ARGS: shell words, as the README says
