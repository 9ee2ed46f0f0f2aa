"""Issue 45 class 10: every fastmt command starts torch with OpenMP's passive wait policy (idle threads sleep
instead of spinning through the time slices of a thread whose core another program took), set before torch is
imported; a policy the user set is kept. Checked in the child process of each documented entry, never by timing
(the speed, quiet and beside busy neighbours: bench/results/cpu-threads.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# the child runs the entry as `python -m ENTRY ARGS` would, then reports at exit what torch started with
_CHILD = """
import atexit, os, runpy, sys
seen = {}
class Watch:  # the environment at the moment torch is imported (what OpenMP reads when torch loads it)
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch" not in seen:  # the first import, wherever it comes from
            seen["at_torch"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Watch())
def report():
    import torch  # a command that never imported it (--help): what torch would start with here
    print("AT_TORCH=%s" % seen.get("at_torch", "not-imported"), file=sys.__stderr__)
atexit.register(report)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

ENTRIES = [
    pytest.param(["train.commands", "model", "tiny"], id="fastmt-model"),
    pytest.param(["train", "--preset", "tiny", "--print-config"], id="python-m-train"),
    pytest.param(["train.translate", "--help"], id="translate"),
    pytest.param(["train.stats", "--help"], id="stats"),  # (train.evaluate's entry is translate's, line for line)
]


def _run(entry: list[str], env_policy: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(REPO)
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    r = subprocess.run([sys.executable, "-c", _CHILD, *entry], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split("=", 1) for line in r.stderr.splitlines() if line.startswith("AT_TORCH="))


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_imports_torch_with_the_passive_wait_policy(entry):
    seen = _run(entry, None)
    assert seen["AT_TORCH"] == "PASSIVE", seen


def test_a_wait_policy_the_user_set_is_kept():
    seen = _run(["train.commands", "model", "tiny"], "ACTIVE")
    assert seen["AT_TORCH"] == "ACTIVE", seen


def test_the_busy_machine_warning_says_what_the_threads_do(monkeypatch):
    """Honest warning: with the passive policy in force it says so; with a spinning one it names the policy."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    import train.cli.flags
    from train.cli import cpu_wait
    from train.cli.flags import resolve_config

    monkeypatch.setattr(train.cli.flags.os, "getloadavg", lambda: (len(os.sched_getaffinity(0)) + 5.0, 0.0, 0.0))
    for policy, env, says in (("PASSIVE", "PASSIVE", "wait passively (OMP_WAIT_POLICY=PASSIVE"),
                              (None, "ACTIVE", "may spin-wait (OMP_WAIT_POLICY=ACTIVE)")):
        monkeypatch.setattr(cpu_wait, "in_force", policy)
        monkeypatch.setenv("OMP_WAIT_POLICY", env)
        notes: list[str] = []
        resolve_config(["--preset", "tiny"], log=notes.append)
        (warning,) = notes
        assert says in warning and "--run.cpu_threads 1" in warning, warning
