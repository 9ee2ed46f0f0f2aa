"""The Makefile's defaults reach the recipes: a variable the user did not set takes its documented default.

Found when every user value became single-quoted data (issue 27): `unexport V` before `V ?= default` defines V
as empty, so `make train` lost the local corpus default, `SETUP=none` ran `'' -m train`, and `make
test-torch-min` built its venv at `/` (CI's last step). `make -n` prints the recipes without running them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(*args: str) -> str:
    proc = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_train_takes_the_local_corpus_default_when_it_exists(tmp_path):
    corpus = tmp_path / "standin.jsonl"
    corpus.write_text('{"translation": {"en": "a", "it": "b"}}\n')
    train = planned("train", f"STANDIN={corpus}").splitlines()[-1]
    assert f"-m train --auto --data-files '{corpus}'" in train
    # no such file: no data flag (the Hub), and never an empty quoted argument
    train = planned("train", f"STANDIN={tmp_path / 'missing.jsonl'}").splitlines()[-1]
    assert train.rstrip().endswith("-m train --auto") and "''" not in train


def test_setup_none_runs_the_default_python():
    line = planned("train", "SETUP=none", "STANDIN=/nonexistent").splitlines()[-1]
    assert "'python3' -m train --auto" in line


def test_test_torch_min_builds_its_venv_in_the_checkout():
    plan = planned("-B", "test-torch-min")  # -B: the venv's recipe is shown even where it is already built
    assert "'.venv-torch-min/bin/pip' install -q 'torch==2.11.0'" in plan
    assert "'/bin/" not in plan and "venv ''" not in plan
