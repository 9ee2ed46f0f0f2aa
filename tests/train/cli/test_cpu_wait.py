"""Issue 45 class 10: every fastmt command but training starts torch with OpenMP's passive wait policy (idle threads
sleep instead of spinning through the time slices of a thread whose core another program took), set before torch is
imported; a training keeps OpenMP's spinning default (fastest alone) and adapts its thread count instead
(tests/train/test_cpu_threads.py); a policy the user set is kept, one a fastmt parent set is chosen again. Checked in
the child process of each documented entry, never by timing (the speed, quiet and beside busy neighbours:
bench/results/cpu-threads.md)."""

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
    pytest.param(["train.translate", "--help"], id="translate"),
    pytest.param(["train.stats", "--help"], id="stats"),  # (train.evaluate's entry is translate's, line for line)
]
TRAINING = [
    pytest.param(["train", "--preset", "tiny", "--print-config"], id="python-m-train"),
    pytest.param(["train.commands", "train", "--preset", "tiny", "--print-config"], id="fastmt-train"),
]


def _run(entry: list[str], env_policy: str | None, mark: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "FASTMT_OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(REPO)
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    if mark is not None:
        env["FASTMT_OMP_WAIT_POLICY"] = mark
    r = subprocess.run([sys.executable, "-c", _CHILD, *entry], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split("=", 1) for line in r.stderr.splitlines() if line.startswith("AT_TORCH="))


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_imports_torch_with_the_passive_wait_policy(entry):
    seen = _run(entry, None)
    assert seen["AT_TORCH"] == "PASSIVE", seen


@pytest.mark.parametrize("entry", TRAINING)
def test_a_training_keeps_openmps_own_wait_and_drops_the_passive_one_a_fastmt_parent_set(entry):
    assert _run(entry, None)["AT_TORCH"] == "None"  # unset: OpenMP's default (it adapts its threads instead)
    assert _run(entry, "PASSIVE", mark="PASSIVE")["AT_TORCH"] == "None"  # a `fastmt bench` parent's choice
    assert _run(entry, "PASSIVE")["AT_TORCH"] == "PASSIVE"  # the user's own


def test_a_wait_policy_the_user_set_is_kept():
    seen = _run(["train.commands", "model", "tiny"], "ACTIVE")
    assert seen["AT_TORCH"] == "ACTIVE", seen
    assert _run(["train.translate", "--help"], "ACTIVE", mark="PASSIVE")["AT_TORCH"] == "ACTIVE"


def test_the_busy_machine_warning_says_what_the_threads_do(monkeypatch):
    """Honest warning: adapting threads says so; with a fixed count it names the wait policy in force."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    import train.cli.flags
    from train.cli import cpu_wait
    from train.cli.flags import resolve_config

    monkeypatch.setattr(train.cli.flags.os, "getloadavg", lambda: (len(os.sched_getaffinity(0)) + 5.0, 0.0, 0.0))
    for flags, policy, env, says in (
            ([], cpu_wait.SPIN, None, "adapts its CPU threads while it trains (one while other programs"),
            (["--run.cpu_adapt", "false"], "PASSIVE", "PASSIVE", "wait passively (OMP_WAIT_POLICY=PASSIVE"),
            (["--run.cpu_adapt", "false"], cpu_wait.SPIN, None, "may spin-wait (OMP_WAIT_POLICY=unset)")):
        monkeypatch.setattr(cpu_wait, "in_force", policy)
        if env is None:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        else:
            monkeypatch.setenv("OMP_WAIT_POLICY", env)
        notes: list[str] = []
        resolve_config(["--preset", "tiny", *flags], log=notes.append)
        (warning,) = notes
        assert says in warning, warning
    notes = []
    resolve_config(["--preset", "tiny", "--run.cpu_threads", "1"], log=notes.append)
    assert notes == []  # one thread never waits: nothing to warn about
