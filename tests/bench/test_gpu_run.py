"""bench/gpu_run.sh, the GPU runbook, read as the device machine would run it (issue 28): the plan fits a
session's device time, the kernel-test step selects every kernel test that would use the GPU, pass-through
variables keep quoted words, the setup's scratch folders are this run's own, every step ends at its limit
with its children (pytest with its summary and JUnit file; the frontier's contestants and theirs), and the
Lion tests skip cleanly without lion-pytorch. No test here needs CUDA."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
REQUIRED = ("call1", "call2", "call3")


def gpu_run(*args: str, env: dict | None = None, script: Path = SCRIPT, timeout: float = 120) -> str:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    out = subprocess.run(["bash", str(script), *args], env=full, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def show(step: str, **env: str) -> list[str]:
    """The step's command, word by word, as the script would run it."""
    return gpu_run("show", step, env=env).splitlines()


def pytest_args(words: list[str], junit: Path) -> list[str]:
    """The pytest arguments of a test step's command (after ``-m pytest``), its JUnit file moved to ``junit``."""
    args = words[words.index("pytest") + 1:]
    return [f"--junitxml={junit}" if a.startswith("--junitxml=") else a for a in args]


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------
def parse_plan(text: str) -> dict[str, dict]:
    calls: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^(call\d) \((required|optional)\): ", line)
        if head:
            current = calls.setdefault(head[1], {"kind": head[2], "steps": {}})
            continue
        total = re.match(r"^  (call\d) command (\d+) s .*with start-up (\d+) s", line)
        if total:
            calls[total[1]].update(command=int(total[2]), total=int(total[3]))
            continue
        row = re.match(r"^  (\S+)\s+(\d+) s$", line)
        if row and current is not None:
            current["steps"][row[1]] = int(row[2])
    return calls


def test_plan_fits_a_session_with_a_retry_to_spare():
    calls = parse_plan(gpu_run("plan"))
    assert [c for c, v in calls.items() if v["kind"] == "required"] == list(REQUIRED)
    for name, call in calls.items():
        # every call's command time is its setup + its steps' limits + the pack, and at most 9.5 min
        assert call["command"] == sum(call["steps"].values()), (name, call)
        assert call["command"] <= 570, (name, call["command"])
        assert call["total"] > call["command"], f"{name}: start-up not counted"
    assert sum(calls[c]["total"] for c in REQUIRED) <= 40 * 60
    # the evidence that matters in calls 1-3; the ladder, the sweeps and the rest later
    assert {"kernel-test", "bench-kernels"} <= set(calls["call1"]["steps"])
    assert {"train", "quality", "profile"} <= set(calls["call2"]["steps"])
    assert "frontier" in calls["call3"]["steps"]
    early = {s for c in REQUIRED for s in calls[c]["steps"]}
    assert not early & {"ladder", "sweep", "inference", "kernel-test-slow"}
    later = {s for c, v in calls.items() if c not in REQUIRED for s in v["steps"]}
    assert {"ladder", "sweep", "inference", "kernel-test-slow"} <= later


def test_a_longer_step_limit_shows_in_the_plan():
    calls = parse_plan(gpu_run("plan", env={"LIMIT_TRAIN": "900"}))
    assert calls["call2"]["steps"]["train"] == 900 and calls["call2"]["command"] > 570  # the plan is the script's


# ----------------------------------------------------------------------------------------------
# The kernel-test step's selection
# ----------------------------------------------------------------------------------------------
_COLLECT = textwrap.dedent("""
    import json, sys
    import pytest

    class Grab:
        items = []
        def pytest_collection_finish(self, session):  # after -m / -k deselection
            Grab.items = [(i.nodeid, sorted({m.name for m in i.iter_markers()}), str(i.path)) for i in session.items]

    rc = pytest.main(sys.argv[1:] + ["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Grab()])
    print("ITEMS " + json.dumps({"rc": int(rc), "items": Grab.items}))
""")


def collect(args: list[str]) -> tuple[int, list]:
    out = subprocess.run([sys.executable, "-c", _COLLECT, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ITEMS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads(line[len("ITEMS "):])
    return data["rc"], data["items"]


def would_use_the_gpu(items: list) -> set[str]:
    """Tests that run on CUDA when there is one: marked ``gpu`` or ``interpreter`` (our kernels, compiled on a
    GPU), or in a module that builds its tensors on CUDA when it can (a ``torch.cuda.is_available()`` switch)."""
    switches = {}
    for _, _, path in items:
        if path not in switches:
            text = Path(path).read_text()
            switches[path] = "torch.cuda.is_available()" in text or "HAS_CUDA" in text
    return {nodeid for nodeid, marks, path in items if {"gpu", "interpreter"} & set(marks) or switches[path]}


def test_kernel_test_step_selects_every_kernel_test_that_would_use_the_gpu(tmp_path):
    rc, everything = collect(["tests/kernels"])
    assert rc == 0 and everything
    gpu = would_use_the_gpu(everything)
    slow = {n for n, marks, _ in everything if "slow" in marks}
    rc, step = collect(pytest_args(show("kernel-test"), tmp_path / "k.xml"))
    assert rc == 0
    selected = {n for n, _, _ in step}
    left_out = sorted(gpu - slow - selected)
    assert not left_out, f"the kernel-test step leaves out {len(left_out)} GPU tests: {left_out[:10]}"
    # the ones the issue names: Lion against lion-pytorch, mixed-dtype LayerNorm, opcheck
    for name in ("test_lion.py::test_kernel_matches_reference_and_lion_pytorch",
                 "test_layernorm.py::test_mixed_residual_dtype_matches_reference[x-bf16-res-fp32]",
                 "test_lion.py::test_opcheck", "test_layernorm.py::test_opcheck"):
        assert any(name in n for n in selected), name
    # the slow full grids run in the optional kernel-test-slow step
    rc, step_slow = collect(pytest_args(show("kernel-test-slow"), tmp_path / "s.xml"))
    assert rc == 0 and not sorted(gpu & slow - {n for n, _, _ in step_slow})


def test_the_aot_plan_replays_the_kernel_test_steps_selection(tmp_path):
    """bench/aot.py's kernel-test plan runs the step's tests themselves (under its compile-only driver): the
    tests it selects are the ones the step selects, with the step's autotune setting."""
    import ast

    tree = ast.parse((ROOT / "bench" / "aot.py").read_text())
    [selection] = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", "") == "KERNEL_TEST_SELECTION" for t in n.targets)]
    words = show("kernel-test")
    rc_plan, plan = collect(list(selection))
    rc_step, step = collect(pytest_args(words, tmp_path / "k.xml"))
    assert rc_plan == rc_step == 0 and {n for n, _, _ in plan} == {n for n, _, _ in step}
    assert "FASTMT_AUTOTUNE=0" in words  # the plan's autotune setting
    # the step runs the files most important to training first (a step cut at its deadline has run them)
    files = [w for w in words if w.startswith("tests/kernels/")]
    assert files[:2] == ["tests/kernels/test_lion.py", "tests/kernels/test_layernorm.py"]
    assert sorted(files) == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "kernels").glob("test_*.py"))


# ----------------------------------------------------------------------------------------------
# Pass-through variables keep quoted words
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("var, step", [("KERNEL_TEST_ARGS", "kernel-test"), ("TRAIN_ARGS", "train"),
                                       ("BENCH_KERNELS_ARGS", "bench-kernels"), ("PROFILE_ARGS", "profile"),
                                       ("FRONTIER_ARGS", "frontier"), ("LADDER_ARGS", "ladder"),
                                       ("SWEEP_ARGS", "sweep"), ("INFERENCE_ARGS", "inference")])
def test_pass_through_arguments_keep_quoted_words(var, step):
    words = show(step, **{var: """-m 'not slow' -k "a b" --x '$HOME' `id`"""})
    assert words[-7:] == ["-m", "not slow", "-k", "a b", "--x", "$HOME", "`id`"]
    def stable(words):  # the run's time stamp (JUnit path, run name) aside
        return [re.sub(r"\d{8}T\d{6}Z", "<RUN_ID>", w) for w in words]

    assert stable(show(step, **{var: ""})) == stable(show(step))


def test_train_args_replace_the_steps_own_flags_which_fastmt_refuses_twice():
    words = show("train", TRAIN_ARGS="--preset s18 --run.max_wall_seconds=100 --data.dataset toy")
    assert "--auto" not in words and "--run.max_wall_seconds" not in words and "--data-files" not in words
    assert words.count("--run.max_wall_seconds=100") == 1 and words[-4:] == [
        "--preset", "s18", "--run.max_wall_seconds=100", "--data.dataset", "toy"][-4:]
    plain = show("train")
    assert "--auto" in plain and plain.count("--run.max_wall_seconds") == 1
    budget = int(plain[plain.index("--run.max_wall_seconds") + 1])
    assert 0 < budget <= int(parse_plan(gpu_run("plan"))["call2"]["steps"]["train"]) - 60  # time for test, plot


def test_an_unclosed_quote_is_refused_before_anything_runs():
    out = subprocess.run(["bash", str(SCRIPT), "show", "train"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": sys.executable, "TRAIN_ARGS": "--run.name 'x"})
    assert out.returncode == 2 and "TRAIN_ARGS=--run.name 'x is not valid shell words" in out.stderr, out.stderr


def test_kernel_test_args_not_slow_is_a_valid_pytest_selection(tmp_path):
    rc, items = collect(pytest_args(show("kernel-test", KERNEL_TEST_ARGS="-m 'not slow'"), tmp_path / "k.xml"))
    assert rc == 0 and items  # was three words and a pytest usage error


# ----------------------------------------------------------------------------------------------
# Setup: this run's own scratch folders, PYTHONPATH only when the install into it worked
# ----------------------------------------------------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
# a python3 that records what a step gets, delegating everything else to the real one
if [[ $1 == -m && $2 == pip ]]; then
    target=; prev=
    for a in "$@"; do [[ $prev == --target ]] && target=$a; prev=$a; done
    [[ $FAKE_PIP == ok ]] || exit 1
    mkdir -p "$target/fakepkg" && exit 0
fi
if [[ $1 == -m ]]; then
    {
        echo "ARGS $*"
        echo "PYTHONPATH=${PYTHONPATH-<unset>}"
        echo "TRITON_CACHE_DIR=$TRITON_CACHE_DIR"
        echo "HF_HOME=$HF_HOME"
        [[ -n ${PYTHONPATH:-} ]] && stat -c 'SITE %a %U' "$PYTHONPATH"
    } >>"$FAKE_LOG"
    exit 0
fi
exec REAL "$@"
"""


def _copy_with_fake_python(tmp_path: Path, pip: str) -> tuple[Path, dict]:
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "bench" / "gpu_run.sh")
    (repo / ".whl").mkdir()
    (repo / ".whl" / "fake-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    fake.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"PYTHON": str(fake), "FAKE_PIP": pip, "FAKE_LOG": str(tmp_path / "fake.log"), "OUT": str(tmp_path / "out"),
           "TMPDIR": str(scratch), "PYTHONPATH": str(tmp_path / "planted"), "GPU_RUN_DEADLINE_S": "200"}
    env.pop("TRITON_CACHE_DIR", None)
    return repo, env


def _run_copy(repo: Path, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "HF_HOME")}
    out = subprocess.run(["bash", str(repo / "bench" / "gpu_run.sh"), "quality"], env={**full, **env},
                         capture_output=True, text=True, timeout=120)
    assert "END quality: ok" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    log = Path(env["FAKE_LOG"]).read_text()
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line and not line.startswith("ARGS")) | {
        "site": next((x for x in log.splitlines() if x.startswith("SITE ")), "")}


@pytest.mark.parametrize("pip", ["ok", "fails"])
def test_scratch_folders_are_this_runs_and_pythonpath_only_a_working_install(tmp_path, pip):
    repo, env = _copy_with_fake_python(tmp_path, pip)
    seen = _run_copy(repo, env)
    scratch = Path(env["TMPDIR"])
    for key in ("TRITON_CACHE_DIR", "HF_HOME"):  # never a fixed /tmp path another user could fill first
        assert Path(seen[key]).parent.parent == scratch and Path(seen[key]).parent.name.startswith("fastmt-gpu-run.")
    if pip == "ok":
        assert Path(seen["PYTHONPATH"]).parent == Path(seen["TRITON_CACHE_DIR"]).parent  # the run's own folder
        assert seen["site"].startswith("SITE ")
    else:
        assert seen["PYTHONPATH"] == "<unset>"  # a failed install puts nothing on the path
    assert env["PYTHONPATH"] not in seen["PYTHONPATH"]  # nor does an inherited PYTHONPATH
    assert not list(scratch.iterdir())  # the scratch folder is gone after the run
    tgz = Path(env["OUT"]) / "results.tgz"
    assert tgz.is_file() and (Path(env["OUT"]) / "summary.txt").is_file()


def test_two_runs_never_share_a_scratch_folder(tmp_path):
    seen = []
    for i in range(2):
        repo, env = _copy_with_fake_python(tmp_path / str(i), "ok")
        env["TMPDIR"] = str(tmp_path)
        seen.append(_run_copy(repo, env)["TRITON_CACHE_DIR"])
    assert seen[0] != seen[1]


# ----------------------------------------------------------------------------------------------
# Steps end at their limit: pytest with its summary and JUnit file; contestants with their children
# ----------------------------------------------------------------------------------------------
SLOW_TESTS = """
import pathlib, time

def test_one():
    pass

def test_two():
    pathlib.Path("STARTED").write_text("x")
    time.sleep(60)

def test_three():
    pass
"""


def _pytest_with_stop(tmp_path: Path, *extra: str) -> subprocess.Popen:
    (tmp_path / "test_slow_probe.py").write_text(SLOW_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_stop",
                             f"--junitxml={tmp_path / 'junit.xml'}", "--rootdir", str(tmp_path),
                             "test_slow_probe.py", *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_pytest_stops_between_tests_at_its_deadline_with_summary_and_junit(tmp_path):
    (tmp_path / "test_slow_probe.py").write_text(SLOW_TESTS.replace("time.sleep(60)", "time.sleep(1.5)"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_stop",
                          "--stop-after-s=0.5", f"--junitxml={tmp_path / 'junit.xml'}", "--rootdir", str(tmp_path),
                          "test_slow_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "--stop-after-s 0.5 reached" in out.stdout and "2 passed" in out.stdout, out.stdout
    assert 'tests="2"' in (tmp_path / "junit.xml").read_text()  # test_three never started


def test_pytest_on_sigterm_writes_summary_and_junit(tmp_path):
    proc = _pytest_with_stop(tmp_path)
    deadline = time.monotonic() + 60
    while not (tmp_path / "STARTED").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "KeyboardInterrupt" in out and "1 passed" in out, out
    assert (tmp_path / "junit.xml").is_file()


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores its budget and the polite signal
child = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""

RUNNER = """
import sys
from pathlib import Path
from bench import frontier as F
c = F.Contestant("stubborn", "stubborn", "x", ())
r = F.run_contestant(c, [sys.executable, sys.argv[1], sys.argv[2]], Path(sys.argv[3]), timeout_s=float(sys.argv[4]),
                     log=lambda s: None)
print("RESULT", r["status"])
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _stubborn(tmp_path: Path, timeout_s: float) -> tuple[subprocess.Popen, list[int]]:
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    pids = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path / "stubborn.py"), str(pids),
                             str(tmp_path / "log"), str(timeout_s)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    return proc, [int(x) for x in pids.read_text().split()]


def _all_gone(pids: list[int], within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_contestant_and_its_children_die_with_the_frontier_on_sigterm(tmp_path):
    proc, pids = _stubborn(tmp_path, timeout_s=600)
    try:
        proc.send_signal(signal.SIGTERM)  # `timeout` ending the runbook's step
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "Stopped" in out, out
        assert _all_gone(pids), f"still running after the frontier stopped: {[p for p in pids if _alive(p)]}"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_contestant_past_its_budget_dies_with_its_children(tmp_path):
    proc, pids = _stubborn(tmp_path, timeout_s=1.0)
    try:
        out, _ = proc.communicate(timeout=60)
        assert "RESULT timeout" in out, out
        assert _all_gone(pids)
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


LEAVER = """
import subprocess, sys
child = subprocess.Popen(["sleep", "600"])  # left running when the contestant exits
open(sys.argv[1], "w").write(f"{child.pid}")
"""


def test_what_a_contestant_leaves_running_dies_when_it_exits(tmp_path):
    from bench import frontier as F

    (tmp_path / "leaver.py").write_text(LEAVER)
    pid_file = tmp_path / "pid"
    result = F.run_contestant(F.Contestant("leaver", "leaver", "x", ()),
                              [sys.executable, str(tmp_path / "leaver.py"), str(pid_file)], tmp_path / "log",
                              timeout_s=60, log=lambda s: None)
    pid = int(pid_file.read_text())
    try:
        assert result["status"] == "ok" and _all_gone([pid])
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# Lion's tests without lion-pytorch (a bare GPU image)
# ----------------------------------------------------------------------------------------------
def test_lion_tests_skip_cleanly_without_lion_pytorch(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "lion_pytorch.py").write_text(  # what a missing wheel raises
        "raise ModuleNotFoundError(\"No module named 'lion_pytorch'\", name='lion_pytorch')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          *(f"tests/kernels/test_lion.py::{t}" for t in (
                              "test_kernel_matches_reference_and_lion_pytorch[float-f32-n1]",
                              "test_kernel_matches_reference_and_lion_pytorch[tensor-f32-n1]",
                              "test_optimizer_one_launch_per_flat_group_matches_lion_pytorch",
                              "test_found_inf_zero_is_an_ordinary_step"))],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert re.search(r"\b2 passed\b", out.stdout) and re.search(r"\b3 skipped\b", out.stdout), out.stdout[-2000:]
    assert "lion-pytorch is not installed" in out.stdout
