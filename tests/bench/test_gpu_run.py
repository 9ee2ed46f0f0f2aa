"""The GPU runbook (bench/runbook.py, `python -m bench.packets run`; bench/gpu_run.sh is a wrapper of it), read as
the device machine would run it (issues 28, 46): the plan fits a session's device time, the kernel-test step
selects every kernel test that would use the GPU, pass-through variables keep quoted words, the setup's scratch
folders are this run's own, every step ends at its limit with its children (pytest with its summary and JUnit
file; the frontier's contestants and theirs; the runbook's own SIGTERM), what comes back is packed within the
device's limits, and the Lion tests skip cleanly without lion-pytorch. No test here needs CUDA: the steps' runs
use a fake interpreter that records what each step gets."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from bench import packet_table as T
from bench import runbook as R

ROOT = Path(__file__).resolve().parents[2]
CLEAN = ("TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "PYTHONPATH", "OUT", "GPU_RUN_REHEARSAL",
         "GPU_RUN_DEADLINE_S", *{v for v in T.EXTRA.values()})


def runbook(*words: str, root: Path = ROOT, **env: str) -> tuple[int, str, str]:
    """``python -m bench.packets run WORDS`` in this process: (exit status, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith("LIMIT_")} | env
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = R.main(list(words), environ=environ, root=root)
    return rc, out.getvalue(), err.getvalue()


def gpu_run(*words: str, **env: str) -> str:
    rc, out, err = runbook(*words, **env)
    assert rc == 0, out[-2000:] + err[-2000:]
    return out


def show(step: str, packet: str | None = None, **env: str) -> list[str]:
    """The step's command (in ``packet``, else on its own), word by word, as the runbook would run it."""
    return gpu_run("show", step, *([packet] if packet else []), **env).splitlines()


def pytest_args(words: list[str], junit: Path) -> list[str]:
    """The pytest arguments of a test step's command (after ``-m pytest``), its JUnit file moved to ``junit``."""
    args = words[words.index("pytest") + 1:]
    return [f"--junitxml={junit}" if a.startswith("--junitxml=") else
            f"--outcomes={junit.with_suffix('.outcomes.jsonl')}" if a.startswith("--outcomes=") else a for a in args]


# ----------------------------------------------------------------------------------------------
# The plan: a 15-minute session holds start-up + packet 1 + a rerun of it, or packet 1 + packet 2
# ----------------------------------------------------------------------------------------------
def parse_plan(text: str) -> tuple[dict[str, dict], list[tuple[list[int], int, int]], int]:
    """({packet: {"command": s, "steps": {name: s}}}, session lines as ([terms], total, budget), budget)."""
    packets: dict[str, dict] = {}
    sessions = []
    budget = int(re.search(r"one session of (\d+) s of device time", text)[1])
    for line in text.splitlines():
        m = re.match(r"^([a-z][a-z0-9-]*): (\d+) s = (.*?)  -- ", line)
        if m:
            steps = dict((name, int(sec)) for name, sec in re.findall(r"([a-z-]+) (\d+)", m[3]))
            packets[m[1]] = {"command": int(m[2]), "steps": steps, "order": re.findall(r"([a-z-]+) \d+", m[3])}
        m = re.match(r"^session: (.*) = (\d+) s of (\d+)", line)
        if m:
            sessions.append(([int(x) for x in re.findall(r" (\d+)(?= \+| =|$)", " " + m[1])], int(m[2]), int(m[3])))
    return packets, sessions, budget


def test_plan_fits_a_15_minute_session_with_a_rerun_of_packet1():
    packets, sessions, budget = parse_plan(gpu_run("plan"))
    assert budget == 900 == T.SESSION_S
    assert list(packets) == [p.name for p in T.PACKETS] and list(packets)[:2] == ["packet1", "packet2"]
    for name, p in packets.items():
        # the printed total is the sum of its parts, and it is the table's
        assert p["command"] == sum(p["steps"].values()) == T.BY_NAME[name].command_s, (name, p)
        assert p["command"] <= (240 if name in ("packet2", "peers-eole") else 300), (name, p["command"])
    # start-up + packet1 + packet1 again + idle, and start-up + packet1 + packet2 + idle: each sums and fits
    assert len(sessions) == 2
    for terms, total, of in sessions:
        assert sum(terms) == total <= of == budget, (terms, total)
    assert sessions[0][0][1:3] == [packets["packet1"]["command"]] * 2
    assert sessions[1][0][1:3] == [packets["packet1"]["command"], packets["packet2"]["command"]]
    assert sessions[0][0][0] == T.STARTUP_S and sessions[0][0][-1] == T.IDLE_S
    assert gpu_run("plan") == subprocess.run([sys.executable, "-m", "bench.packets", "plan"], cwd=ROOT, text=True,
                                             capture_output=True, timeout=120).stdout  # one plan, two doors


def test_packet1_runs_make_train_cold_first_then_its_record_then_the_kernels():
    packets, _, _ = parse_plan(gpu_run("plan"))
    assert packets["packet1"]["order"] == ["setup", "train", "quality", "aot", "kernel-test", "pack"]
    assert packets["packet2"]["order"] == ["setup", "peers", "compare", "pack"]
    queue = [s for name, p in packets.items() if name not in ("packet1", "packet2") for s in p["steps"]]
    assert {"bench-kernels", "frontier", "profile", "ladder", "sweep", "kernel-test-slow", "inference",
            "train-cold", "train-warm", "peers-eole", "batch-sweep"} <= set(queue)
    # the queue: the open issues' GPU numbers (43's warm compile, 44's eole, 42's batch sweep), then the headline
    assert list(packets)[2:5] == ["compile-warm", "peers-eole", "batch-sweep-4k"], list(packets)
    assert packets["compile-warm"]["order"] == ["setup", "train-cold", "train-warm", "pack"]
    assert "bench-kernels" in packets["packet3"]["steps"]
    # a step named on its own gets its packet's limit, but the kernel tests, which get a packet's time alone
    assert set(T.STEP_LIMITS) == {s.name for p in T.PACKETS for s in p.steps}
    assert T.STEP_LIMITS["kernel-test"] > T.BY_NAME["packet1"].steps[-1].limit == 70


def test_a_longer_step_limit_shows_in_the_commands_deadline():
    words = show("kernel-test", "packet1", LIMIT_KERNEL_TEST="200")
    assert "--stop-after-s=160" in words  # 200 - min(40, 200 / 4)


@pytest.mark.parametrize("limit, stop", [("70", 53), ("40", 30), ("20", 12), ("400", 360)])
def test_pytest_keeps_a_margin_that_holds_for_short_limits(limit, stop):
    """The stop margin is a quarter of the limit, at least 8 s, at most 40 s: a 40 s limit stops at 30 s (it
    stopped at 20, half the limit, before)."""
    words = show("kernel-test", "packet1", LIMIT_KERNEL_TEST=limit)
    assert f"--stop-after-s={stop}" in words, words


@pytest.mark.parametrize("words, env, says", [
    (("packet0",), {}, "unknown packet or step 'packet0'"),
    (("show", "nope"), {}, "show STEP [PACKET]: STEP one of"),
    (("quality",), {"LIMIT_QUALITY": "ten"}, "LIMIT_QUALITY=ten is not a number of seconds"),
    (("quality",), {"GPU_RUN_DEADLINE_S": "-1"}, "GPU_RUN_DEADLINE_S=-1 is not a number of seconds"),
    (("show", "train"), {"TRAIN_ARGS": "--run.name 'x"}, "TRAIN_ARGS=--run.name 'x is not valid shell words"),
])
def test_bad_words_are_one_line_and_exit_2_before_anything_runs(tmp_path, words, env, says):
    rc, out, err = runbook(*words, OUT=str(tmp_path / "out"), **env)
    assert rc == 2 and err.count("\n") == 1 and says in err, (rc, out, err)
    assert "START" not in out and not (tmp_path / "out").exists()  # no step, no OUT made


# ----------------------------------------------------------------------------------------------
# The kernel-test step's selection: every GPU test, the training path first, no CPU-only test
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


def test_kernel_test_step_selects_every_gpu_test_training_path_first_and_no_cpu_only_test(tmp_path):
    rc, everything = collect(["tests/kernels"])
    assert rc == 0 and everything
    gpu = would_use_the_gpu(everything)
    slow = {n for n, marks, _ in everything if "slow" in marks}
    words = show("kernel-test", "packet1")
    rc, step = collect(pytest_args(words, tmp_path / "k.xml"))
    assert rc == 0
    selected = [n for n, _, _ in step]
    left_out = sorted(gpu - slow - set(selected))
    assert not left_out, f"the kernel-test step leaves out {len(left_out)} GPU tests: {left_out[:10]}"
    cpu_only = sorted(set(selected) - gpu)
    assert not cpu_only, f"the kernel-test step spends the GPU slot on {len(cpu_only)} CPU-only tests: {cpu_only[:10]}"
    # the training path's kernels first: packed attention (causal, cross), the fused LayerNorm incl. mixed
    # dtypes; Lion after them (the default recipe is AdamW)
    # the LayerNorm N=1 cases before everything (the H200 got them wrong, issue 43), every one of them selected
    n1 = [n for n in selected if "test_layernorm.py" in n and ("-N1-" in n or "test_fuzz_against_reference" in n)]
    assert len(n1) >= 3 and selected[:len(n1)] == n1, selected[:8]
    assert {n for n, _, _ in everything if "test_layernorm.py" in n and "-N1-" in n} - slow <= set(n1)
    files = [n.split("::")[0].rsplit("/", 1)[-1] for n in selected[len(n1):]]
    order = list(dict.fromkeys(files))
    assert order[:2] == ["test_packed_attention.py", "test_layernorm.py"], order
    assert order.index("test_lion.py") > order.index("test_layernorm.py")
    for name in ("test_packed_attention.py::", "test_layernorm.py::test_mixed_residual_dtype_matches_reference",
                 "test_lion.py::test_kernel_matches_reference_and_lion_pytorch", "test_layernorm.py::test_opcheck"):
        assert any(name in n for n in selected), name
    assert any("causal" in n for n in selected if "test_packed_attention" in n)
    assert any("cross" in n for n in selected if "test_packed_attention" in n)
    # the slow full grids run in the kernel-test-slow step (packet 10)
    rc, step_slow = collect(pytest_args(show("kernel-test-slow", "packet10"), tmp_path / "s.xml"))
    assert rc == 0 and not sorted(gpu & slow - {n for n, _, _ in step_slow})


def test_the_aot_plan_replays_the_kernel_test_steps_selection(tmp_path):
    """bench/aot.py's kernel-test plan runs the step's tests themselves (under its compile-only driver): the
    tests it selects are the ones the step selects, with the step's autotune setting."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # bench.aot refuses the interpreter
    out = subprocess.run([sys.executable, "-c", "import json; from bench.aot import kernel_test_selection; "
                          "print(json.dumps(kernel_test_selection()))"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    words = show("kernel-test", "packet1")
    rc_plan, plan = collect(json.loads(out.stdout.strip().splitlines()[-1]))
    rc_step, step = collect(pytest_args(words, tmp_path / "k.xml"))
    # the same tests (the step runs the LayerNorm N=1 cases first; the order of compiling does not matter)
    assert rc_plan == rc_step == 0 and sorted(n for n, _, _ in plan) == sorted(n for n, _, _ in step)
    assert "FASTMT_AUTOTUNE=0" in words  # the plan's autotune setting


# ----------------------------------------------------------------------------------------------
# Pass-through variables keep quoted words
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("var, step", [("KERNEL_TEST_ARGS", "kernel-test"), ("TRAIN_ARGS", "train"),
                                       ("BENCH_KERNELS_ARGS", "bench-kernels"), ("PROFILE_ARGS", "profile"),
                                       ("FRONTIER_ARGS", "frontier"), ("LADDER_ARGS", "ladder"),
                                       ("SWEEP_ARGS", "sweep"), ("INFERENCE_ARGS", "inference"),
                                       ("PEERS_ARGS", "peers"), ("PEERS_ARGS", "peers-eole"),
                                       ("BATCH_SWEEP_ARGS", "batch-sweep")])
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
    plain = show("train", "packet1")
    assert "--auto" in plain and plain.count("--run.max_wall_seconds") == 1
    budget = int(plain[plain.index("--run.max_wall_seconds") + 1])
    train_limit = parse_plan(gpu_run("plan"))[0]["packet1"]["steps"]["train"]
    assert 0 < budget <= train_limit - 30  # time for the test split, the done record and the plot
    # packet 2's HF baseline trains under the same wall budget (its curve stands beside packet 1's)
    peers = show("peers", "packet2")
    assert peers[peers.index("--max-wall-seconds") + 1] == str(budget)
    assert peers[peers.index("--preset") + 1] == "fast"  # the same split, tokenizer and validation as --auto on CUDA


def test_the_rehearsal_trains_the_fast_structure_compiled_on_the_cpu_and_never_twice_the_data(tmp_path):
    """The rehearsal's train step compiles (Inductor on the CPU) the `fast` preset's structure at a tiny size, on
    the toy corpus only: with a carried .data/ it used to get --data-files and --data.dataset toy and exit 2."""
    repo = tmp_path / "repo"
    (repo / ".data").mkdir(parents=True)
    (repo / ".data" / "pairs.jsonl").write_text("{}\n")
    (repo / ".data" / "FILES").write_text("pairs.jsonl\n")
    rc, out, err = runbook("show", "train", "packet1", root=repo, GPU_RUN_REHEARSAL="1")
    words = out.splitlines()
    for flag, value in (("--preset", "fast"), ("--run.compile", "true"), ("--run.device", "cpu"),
                        ("--data.dataset", "toy")):
        assert words[words.index(flag) + 1] == value, (flag, words)
    assert "--auto" not in words and "--run.compile" in words
    # the setup drops .data in a rehearsal; `show` reads it as the GPU would, so the step itself must not add it
    # when its smoke form names the data
    assert "--data-files" not in words
    rc, out, _ = runbook("show", "train", "packet1", root=repo)  # on the GPU: the carried files
    assert rc == 0 and str(repo / ".data" / "pairs.jsonl") in out.splitlines()


def test_kernel_test_args_not_slow_is_a_valid_pytest_selection(tmp_path):
    rc, items = collect(pytest_args(show("kernel-test", KERNEL_TEST_ARGS="-m 'not slow'"), tmp_path / "k.xml"))
    assert rc == 0 and items  # was three words and a pytest usage error


def test_the_wrapper_forwards_to_the_python_runbook_with_the_interpreter_it_names(tmp_path):
    """`bash bench/gpu_run.sh ARGS` is `$PYTHON -m bench.packets run ARGS`, from the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in CLEAN} | {"PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "show", "quality", "packet1"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    words = out.stdout.splitlines()
    assert out.returncode == 0 and words[:3] == [sys.executable, "-m", "bench.quality"], out.stderr[-2000:]
    assert words[words.index("--add-thresholds") + 1] == "10,15"
    bad = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "packet0"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown packet or step 'packet0'" in bad.stderr
    assert len((ROOT / "bench" / "gpu_run.sh").read_text().splitlines()) <= 5


def test_plan_next_and_show_need_no_torch():
    """The device image's python3 runs the runbook before the carried wheels; `plan`, `next` and `show` never
    import torch (only a run's steps need the deadline runner, bench.harness)."""
    block = "import sys; sys.modules['torch'] = None; from bench.packets import main; "
    for words in (["run", "plan"], ["run", "show", "train", "packet1"], ["plan"]):
        out = subprocess.run([sys.executable, "-c", block + f"sys.exit(main({words!r}))"], cwd=ROOT, text=True,
                             capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0 and out.stdout, (words, out.stderr[-2000:])


# ----------------------------------------------------------------------------------------------
# A run, with a fake interpreter that records what each step gets: this run's own scratch folders, PYTHONPATH
# only when the install into it worked, cold caches, the pack, the record
# ----------------------------------------------------------------------------------------------
FAKE_PYTHON = """#!REAL
# a python3 that records what a step gets ({"call": module, "triton": entries, "inductor": entries, ...}); a pip
# install makes its target (FAKE_PIP=ok) or fails; FAKE_RC_<module> is a step's exit status; FAKE_SLEEP: `train`
# starts a child and sleeps (its pids in FAKE_PIDS); `-c` (the runbook's probes) runs for real
import json, os, pathlib, subprocess, sys, time
args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:
    if os.environ.get("FAKE_PIP") != "ok":
        sys.exit(1)
    site = pathlib.Path(args[args.index("--target") + 1])
    (site / "fakepkg").mkdir(parents=True)
    sys.exit(0)
if args[:1] == ["-m"]:
    def n(var, deep):
        d = pathlib.Path(os.environ[var])
        return sum(1 for _ in (d.rglob("*") if deep else d.iterdir()))
    path = os.environ.get("PYTHONPATH")
    seen = {"call": args[1], "args": args, "triton": n("TRITON_CACHE_DIR", False),
            "inductor": n("TORCHINDUCTOR_CACHE_DIR", True), "PYTHONPATH": path or "<unset>",
            "TRITON_CACHE_DIR": os.environ["TRITON_CACHE_DIR"], "HF_HOME": os.environ["HF_HOME"],
            "site": oct(os.stat(path).st_mode & 0o777) if path else None}
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(seen) + "\\n")
    if args[1] == "train" and os.environ.get("FAKE_SLEEP"):
        child = subprocess.Popen(["sleep", "600"])
        pathlib.Path(os.environ["FAKE_PIDS"]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    sys.exit(int(os.environ.get("FAKE_RC_" + args[1].replace(".", "_"), "0")))
os.execv(sys.executable, [sys.executable, *args])
"""


def fake_repo(tmp_path: Path, pip: str = "ok") -> tuple[Path, dict]:
    """A checkout with the kernel tests' files, a carried wheel and a fake interpreter; the run's environment."""
    repo = tmp_path / "repo"
    (repo / "tests" / "kernels").mkdir(parents=True)
    for name in T.KERNEL_TEST_FILES:
        (repo / "tests" / "kernels" / name).write_text("")
    (repo / ".whl").mkdir()
    (repo / ".whl" / "fake-1.0-py3-none-any.whl").write_bytes(b"not a wheel")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.replace("REAL", sys.executable))
    fake.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"PYTHON": str(fake), "FAKE_PIP": pip, "FAKE_LOG": str(tmp_path / "fake.log"), "OUT": str(tmp_path / "out"),
           "TMPDIR": str(scratch), "PYTHONPATH": str(tmp_path / "planted"), "GPU_RUN_DEADLINE_S": "200",
           "FASTMT_GIT_SHA": "abc1234"}
    return repo, env


def run_fake(repo: Path, env: dict, *words: str, rc: int = 0) -> tuple[list[dict], str]:
    """Run WORDS (default: the quality step) in ``repo``: what each step saw, and the run's stdout."""
    got, out, err = runbook(*(words or ("quality",)), root=repo, **env)
    assert got == rc, out[-3000:] + err[-2000:]
    log = Path(env["FAKE_LOG"])
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else [], out


@pytest.mark.parametrize("pip", ["ok", "fails"])
def test_scratch_folders_are_this_runs_and_pythonpath_only_a_working_install(tmp_path, pip):
    repo, env = fake_repo(tmp_path, pip)
    calls, out = run_fake(repo, env)
    seen = next(c for c in calls if c["call"] == "bench.quality")
    scratch = Path(env["TMPDIR"])
    for key in ("TRITON_CACHE_DIR", "HF_HOME"):  # never a fixed /tmp path another user could fill first
        assert Path(seen[key]).parent.parent == scratch and Path(seen[key]).parent.name.startswith("fastmt-gpu-run.")
    if pip == "ok":
        assert Path(seen["PYTHONPATH"]).parent == Path(seen["TRITON_CACHE_DIR"]).parent  # the run's own folder
        assert seen["site"] is not None
    else:
        assert seen["PYTHONPATH"] == "<unset>"  # a failed install puts nothing on the path
    assert env["PYTHONPATH"] not in seen["PYTHONPATH"]  # nor does an inherited PYTHONPATH
    assert not list(scratch.iterdir())  # the scratch folder is gone after the run
    assert re.search(r"END quality: ok", out)
    assert (Path(env["OUT"]) / "results.tgz").is_file() and (Path(env["OUT"]) / "summary.txt").is_file()


def test_two_runs_never_share_a_scratch_folder(tmp_path):
    seen = []
    for i in range(2):
        repo, env = fake_repo(tmp_path / str(i))
        env["TMPDIR"] = str(tmp_path)
        seen.append(next(c for c in run_fake(repo, env)[0] if c["call"] == "bench.quality")["TRITON_CACHE_DIR"])
    assert seen[0] != seen[1]


def _fake_aot_tgz(repo: Path, tmp_path: Path) -> None:
    src = tmp_path / "aot-src"
    (src / "abcdef").mkdir(parents=True)
    (src / "abcdef" / "kernel.json").write_text("{}")
    (src / "AOT-KEYS.json").write_text("{}")
    with tarfile.open(repo / ".whl" / "triton-aot-sm90.tgz", "w:gz") as tar:
        for p in src.iterdir():
            tar.add(p, arcname=p.name)


def test_packet1_trains_with_empty_caches_and_unpacks_the_aot_cache_for_the_kernel_tests(tmp_path):
    repo, env = fake_repo(tmp_path)
    _fake_aot_tgz(repo, tmp_path)
    env.pop("GPU_RUN_DEADLINE_S")
    calls, _ = run_fake(repo, env, "packet1")
    first = {c["call"]: (c["triton"], c["inductor"]) for c in reversed(calls)}
    assert first["train"] == (0, 0), first  # Triton's and Inductor's caches empty: a cold `make train`
    assert first["pytest"][0] >= 2, first  # the kernel tests run on the AOT cache, unpacked after the training
    order = [c["call"] for c in calls]
    assert order.index("train") < order.index("bench.quality") < order.index("bench.aot") < order.index("pytest")
    out = Path(env["OUT"])
    with tarfile.open(out / "results.tgz") as tar:
        names = tar.getnames()
        record = json.loads(tar.extractfile("bench/results/packet-record.json").read())
    assert record["packet"] == "packet1" and record["caches"] == "cold aot" and record["sha"] == "abc1234"
    assert [s["name"] for s in record["steps"]] == ["train", "quality", "aot", "kernel-test"]
    assert record["complete"] and record["clean"] and record["code"] == T.code_hash(T.BY_NAME["packet1"], repo)
    assert any(n.endswith("/summary.txt") for n in names) and any(n.endswith("/train.log") for n in names)
    summary = (out / "summary.txt").read_text()
    assert "==== packet record" in summary and '"packet": "packet1"' in summary
    assert T.check_out(out) == []


def test_a_warm_machines_rerun_is_cold_again(tmp_path):
    """Two packet-1 runs one after the other on the same machine: the second's train step finds empty caches
    again (each run's caches live in its own scratch folder, never in ~/.cache)."""
    repo, env = fake_repo(tmp_path)
    _fake_aot_tgz(repo, tmp_path)
    env.pop("GPU_RUN_DEADLINE_S")
    run_fake(repo, env, "packet1")
    Path(env["FAKE_LOG"]).write_text("")
    env["OUT"] = str(tmp_path / "out2")
    calls, _ = run_fake(repo, env, "packet1")
    assert next(c for c in calls if c["call"] == "train")["triton"] == 0


def test_a_used_out_is_refused_and_nothing_of_the_earlier_run_is_overwritten(tmp_path):
    repo, env = fake_repo(tmp_path)
    run_fake(repo, env)
    before = {p.name: p.read_bytes() for p in Path(env["OUT"]).iterdir()}
    got, out, err = runbook("quality", root=repo, **env)
    assert got == 2 and err.count("\n") == 1 and "already holds results.tgz and summary.txt" in err, err
    assert "START" not in out and {p.name: p.read_bytes() for p in Path(env["OUT"]).iterdir()} == before


@pytest.mark.parametrize("rc, status", [(1, "FAILED (rc 1)"), (124, "TIMEOUT after"), (137, "TIMEOUT after")])
def test_a_failed_or_timed_out_step_is_recorded_and_the_next_step_still_runs(tmp_path, rc, status):
    repo, env = fake_repo(tmp_path)
    calls, out = run_fake(repo, env | {"FAKE_RC_train": str(rc)}, "train", "quality", rc=1)
    assert [c["call"] for c in calls] == ["bench.env_report", "train", "bench.quality"]
    assert re.search(rf"END train: {re.escape(status)}", out) and "END quality: ok" in out
    summary = (Path(env["OUT"]) / "summary.txt").read_text()
    assert re.search(rf"  train +{re.escape(status)}", summary)


def test_no_step_starts_past_the_deadline(tmp_path):
    repo, env = fake_repo(tmp_path)
    env["GPU_RUN_DEADLINE_S"] = "20"  # 20 - 15 (the pack) leaves 5 s: under a step's minimum share
    calls, out = run_fake(repo, env, "quality", rc=1)
    assert "SKIP quality" in out and "bench.quality" not in [c["call"] for c in calls]
    assert (Path(env["OUT"]) / "results.tgz").is_file()


def test_the_pack_keeps_within_its_limit_leaving_out_big_files_then_all_but_records(tmp_path, monkeypatch):
    work, dest = tmp_path / "work", tmp_path / "out"
    logdir = work / "runs" / "gpu_run" / "ID"
    for d in (work / "bench" / "results", logdir, work / "runs" / "default-ID", dest):
        d.mkdir(parents=True, exist_ok=True)
    old = work / "bench" / "results" / "old.md"
    old.write_text("committed")
    os.utime(old, (1, 1))
    started = time.time() - 5
    (logdir / "summary.txt").write_text("summary")
    (work / "runs" / "default-ID" / "metrics.jsonl").write_text("{}\n")
    (work / "runs" / "default-ID" / "model.pt").write_bytes(b"w" * 100)  # not a record: stays behind
    (work / "bench" / "results" / "curve.png").write_bytes(os.urandom(3000))
    (work / "bench" / "results" / "big.bin").write_bytes(os.urandom(5000))

    def members() -> set[str]:
        with tarfile.open(dest / "results.tgz") as tar:
            return set(tar.getnames())
    size, notes = T.pack_results(work, logdir, started, dest)
    assert members() == {"runs/gpu_run/ID/summary.txt", "runs/default-ID/metrics.jsonl", "bench/results/curve.png",
                         "bench/results/big.bin"} and not notes and size == (dest / "results.tgz").stat().st_size
    monkeypatch.setattr(T, "MAX_TGZ_BYTES", 6000)
    monkeypatch.setattr(T, "BIG_FILE_BYTES", 4000)
    T.pack_results(work, logdir, started, dest)
    assert "bench/results/big.bin" not in members() and "bench/results/curve.png" in members()
    monkeypatch.setattr(T, "MAX_TGZ_BYTES", 2000)
    _, notes = T.pack_results(work, logdir, started, dest)
    assert members() == {"runs/gpu_run/ID/summary.txt", "runs/default-ID/metrics.jsonl"}
    assert any("kept only records and logs" in n for n in notes) and not list(dest.glob("*.tmp"))


# ----------------------------------------------------------------------------------------------
# Steps end at their limit with their children; a SIGTERM to the runbook ends the step in flight with its group
# ----------------------------------------------------------------------------------------------
def test_a_step_past_its_limit_gets_term_then_kill_with_its_whole_group(tmp_path):
    from bench.harness import run_in_group

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    pids = tmp_path / "pids"
    t0 = time.monotonic()
    rc = run_in_group([sys.executable, str(script), str(pids)], tmp_path / "log", timeout_s=1.5, grace_s=1.0,
                      env=dict(os.environ), check=False)
    assert rc == 124 and time.monotonic() - t0 < 30
    assert _all_gone([int(x) for x in pids.read_text().split()])
    assert run_in_group(["sh", "-c", "exit 3"], tmp_path / "log", timeout_s=30, env=dict(os.environ),
                        check=False) == 3
    assert run_in_group(["sh", "-c", "kill -9 $$"], tmp_path / "log", timeout_s=30, env=dict(os.environ),
                        check=False) == 137


def test_sigterm_to_the_runbooks_group_ends_the_step_and_its_children_and_packs(tmp_path):
    repo, env = fake_repo(tmp_path)
    pids = tmp_path / "pids"
    env |= {"FAKE_SLEEP": "1", "FAKE_PIDS": str(pids), "PYTHONPATH": str(ROOT)}
    runner = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from bench import runbook;"
                               f" sys.exit(runbook.main(['train'], root=Path({str(repo)!r})))"],
                              env={k: v for k, v in os.environ.items() if k not in CLEAN} | env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline and runner.poll() is None, runner.communicate()[0]
            time.sleep(0.1)
        step = [int(x) for x in pids.read_text().split()]
        os.killpg(runner.pid, signal.SIGTERM)  # the device tool's end of a call: the runbook's group
        out, _ = runner.communicate(timeout=60)
        assert runner.returncode == 143, out[-3000:]
        assert _all_gone(step), f"left running after the runbook stopped: {[p for p in step if _alive(p)]}"
        assert "STOPPED by SIGTERM" in out and "packed" in out
        with tarfile.open(Path(env["OUT"]) / "results.tgz") as tar:
            assert any(n.endswith("/train.log") for n in tar.getnames())
        assert "STOPPED (signal to the runbook)" in (Path(env["OUT"]) / "summary.txt").read_text()
        assert not list(Path(env["TMPDIR"]).iterdir())  # the scratch folder is gone
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
        for p in [int(x) for x in pids.read_text().split()] if pids.exists() else []:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


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


# ----------------------------------------------------------------------------------------------
# No step can lose the packet: streamed outcomes under a KILL, the size check of what comes back
# ----------------------------------------------------------------------------------------------
def test_finished_test_outcomes_survive_a_kill(tmp_path):
    """A hang inside a CUDA call cannot be interrupted by a signal handler, and the runbook's KILL loses the JUnit
    file: the outcomes file holds each finished test's outcome the moment it finished."""
    (tmp_path / "test_slow_probe.py").write_text(SLOW_TESTS.replace("def test_three", "def test_zero_fails():\n"
                                                                     "    assert 1 == 2\n\n\ndef test_three"))
    outcomes = tmp_path / "outcomes.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_stop",
                             f"--outcomes={outcomes}", f"--junitxml={tmp_path / 'junit.xml'}", "--rootdir",
                             str(tmp_path), "test_slow_probe.py::test_one", "test_slow_probe.py::test_zero_fails",
                             "test_slow_probe.py::test_two"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "STARTED").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.kill()  # SIGKILL: no handler runs, no summary, no JUnit
    proc.wait(timeout=30)
    assert not (tmp_path / "junit.xml").exists()
    rows = [json.loads(x) for x in outcomes.read_text().splitlines()]
    assert [(r["nodeid"].split("::")[1], r["outcome"]) for r in rows] == [("test_one", "passed"),
                                                                         ("test_zero_fails", "failed")]
    assert "assert 1 == 2" in rows[1]["message"]
    from bench.pytest_stop import count

    assert count(str(outcomes)) == {"passed": 1, "failed": 1}


def test_check_out_names_what_a_device_call_would_not_bring_back(tmp_path):
    from bench.packets import check_out  # the command line's name for it

    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    (out / "results.tgz").write_bytes(b"x")
    assert check_out(out) == []
    (out / "a" / "b" / "c" / "deep.txt").write_text("x")  # three folders down
    (out / "bad name.txt").write_text("x")
    with open(out / "big.bin", "wb") as fh:
        fh.truncate(16 * 1024 * 1024 + 1)
    for i in range(7):
        (out / f"f{i}").write_text("x")
    problems = "\n".join(check_out(out))
    assert "deep.txt: more than 2 folders down" in problems
    assert "bad name.txt: a name with characters" in problems
    assert "big.bin: 16777217 bytes" in problems
    assert "11 files, over 8" in problems


# ----------------------------------------------------------------------------------------------
# What has been shown: `next`, landing a call's results
# ----------------------------------------------------------------------------------------------
def test_next_names_the_first_packet_without_a_landed_result_for_the_current_code(tmp_path):
    from bench import packets as P

    records = tmp_path / "packets.jsonl"
    assert T.next_packet(T.read_records(records)).name == "packet1"
    p1 = {"packet": "packet1", "code": P.code_hash(P.BY_NAME["packet1"]), "complete": True}
    records.write_text(json.dumps(p1) + "\n")
    assert T.next_packet(T.read_records(records)).name == "packet2"
    # an incomplete packet (a step timed out), or one measured on other code, does not count
    records.write_text(json.dumps({**p1, "complete": False}) + "\n" + json.dumps({**p1, "code": "0" * 16}) + "\n")
    assert T.next_packet(T.read_records(records)).name == "packet1"
    out = gpu_run("next")
    assert out.startswith("packet") and "code " in out


def test_the_code_hash_follows_the_files_a_packet_measures(tmp_path):
    from bench import packets as P

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "kernels", root / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "bench").mkdir()
    (root / "bench" / "kernels.py").write_text("x = 1\n")
    p3 = P.BY_NAME["packet3"]
    before = P.code_hash(p3, root)
    (root / "kernels" / "__pycache__").mkdir(exist_ok=True)
    (root / "kernels" / "__pycache__" / "x.py").write_text("cache")
    assert P.code_hash(p3, root) == before  # caches are not code
    (root / "bench" / "kernels.py").write_text("x = 2\n")
    assert P.code_hash(p3, root) != before


def test_a_damaged_packet_record_is_one_line_naming_it(tmp_path, capsys):
    from bench import packets as P

    records = tmp_path / "packets.jsonl"
    records.write_text('{"packet": "packet1"}\n{"broken\n')
    assert P.main(["next", "--records", str(records)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{records}:2" in err and "not valid JSON" in err


def test_land_puts_a_calls_results_under_bench_results_and_appends_the_record(tmp_path):
    import io
    import tarfile

    from bench import packets as P

    call = tmp_path / "device" / "7"
    call.mkdir(parents=True)
    rec = {"packet": "packet1", "code": "c0ffee", "complete": True, "date": "2026-11-27", "gpu_slug": "h200",
           "sha": "abcdef1234"}
    with tarfile.open(call / "results.tgz", "w:gz") as tar:
        for name, data in (("bench/results/packet-record.json", json.dumps(rec)),
                           ("bench/results/quality-h200.md", "# q"), ("runs/default-x/metrics.jsonl", "{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data.encode())
            tar.addfile(info, io.BytesIO(data.encode()))
    (call / "summary.txt").write_text("summary")
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    dest = P.land(call, root=root)
    assert dest == root / "bench/results/gpu-2026-11-27-h200-abcdef1-packet1"
    assert (dest / "bench/results/quality-h200.md").read_text() == "# q" and (dest / "summary.txt").is_file()
    assert (dest / "runs/default-x/metrics.jsonl").is_file()
    # (a member outside the folder, a link, a device, an oversized archive: tests/security/test_packets.py)
    [line] = (root / "bench/results/packets.jsonl").read_text().splitlines()
    assert json.loads(line) == {**rec, "results": "bench/results/gpu-2026-11-27-h200-abcdef1-packet1"}
    with pytest.raises(ValueError, match="exists"):  # never over a landed folder
        P.land(call, root=root)


# ----------------------------------------------------------------------------------------------
# The quality step's numbers and its check of the compiled graphs; packet 2's comparison
# ----------------------------------------------------------------------------------------------
def _run_folder(path: Path, epochs: list[dict], test_bleu: float | None = None, name: str = "r") -> Path:
    path.mkdir(parents=True)
    rows = [{"kind": "epoch", **e} for e in epochs]
    if test_bleu is not None:
        rows.append({"kind": "test", "test_bleu": test_bleu, "eval_seconds": 1.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "provenance.json").write_text(json.dumps({"gpu": "NVIDIA H200", "git_sha": "abc",
                                                      "config": {"run": {"name": name, "epochs": 3}}}))
    return path


def _epoch(n: int, wall: float, bleu: float, graphs: int | None = 5, breaks: int | None = 0) -> dict:
    return {"epoch": n, "step": 100 * n, "wall_seconds": wall, "epoch_seconds": 10.0, "eval_seconds": 1.0,
            "bleu": bleu, "tokens_per_second": 1000.0 * n, "compiled_graphs": graphs, "graph_breaks": breaks,
            "first_step_seconds": 30.0, "peak_memory_gb": 2.0 + n}


@pytest.mark.parametrize("graphs, breaks, ok", [((5, 5, 5), (0, 0, 0), True), ((5, 5, 6), (0, 0, 0), False),
                                                ((5, 5, 5), (0, 0, 1), False), ((None,) * 3, (None,) * 3, True)])
def test_quality_fails_on_a_recompile_after_warm_up_or_a_graph_break(tmp_path, graphs, breaks, ok):
    run = _run_folder(tmp_path / "run", [_epoch(i + 1, 40.0 + 12 * i, 10.0 * i, g, b)
                                         for i, (g, b) in enumerate(zip(graphs, breaks))], test_bleu=9.0)
    samples = tmp_path / "gpu.csv"  # nvidia-smi's timestamp, utilization, memory every 500 ms from the start
    samples.write_text("".join(f"2026/11/27 10:{i // 120:02d}:{i // 2 % 60:02d}.{500 * (i % 2):03d}, "
                               f"{90 if i >= 80 else 5}, 100\n" for i in range(130)))
    out = subprocess.run([sys.executable, "-m", "bench.quality", "--run", str(run), "--out", str(tmp_path / "o"),
                          "--gpu-samples", str(samples), "--require-stable-graphs"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode == 0) == ok, out.stdout[-2000:] + out.stderr[-2000:]
    numbers = json.loads((tmp_path / "o" / "quality-h200.json").read_text())
    assert numbers["compile_s"] == 30.0 and numbers["steps_per_s"] == pytest.approx(200 / 20.0)
    assert numbers["tokens_per_s"] == 3000.0 and numbers["peak_memory_gb"] == 5.0 and numbers["test_bleu"] == 9.0
    assert numbers["time_to_bleu_s"]["20"] == 64.0
    # the samples between the first epoch's end (40 s) and the last's (64 s): 90 % busy from 40 s on
    assert numbers["gpu_busy_share"] == pytest.approx(0.9) and numbers["gpu_samples"] == 49
    if graphs[0] is not None:
        assert numbers["recompiles_after_warmup"] == graphs[-1] - graphs[0]


def test_compare_puts_two_runs_on_one_wall_clock(tmp_path):
    a = _run_folder(tmp_path / "a", [_epoch(1, 60.0, 5.0), _epoch(2, 70.0, 21.0), _epoch(3, 80.0, 29.0)], 20.0, "fast")
    b = _run_folder(tmp_path / "b", [_epoch(1, 65.0, 0.1), _epoch(2, 85.0, 22.0)], 1.0, "hf")
    out = subprocess.run([sys.executable, "-m", "bench.quality", "--compare", str(a), str(b), "--out",
                          str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "o" / "compare-h200.md").read_text()
    assert "| >= 20 | 70 s (epoch 2) | 85 s (epoch 2) |" in md and "| >= 28 | 80 s (epoch 3) | not reached |" in md
    # equal wall times up to the shorter run's last evaluation (80 s): both runs' best BLEU by then
    assert "| 65.0 | 5 | 0.1 |" in md and "| 70.0 | 21 | 0.1 |" in md and "| 80.0 | 29 | 0.1 |" in md
    assert "| 85.0 |" not in md


# ----------------------------------------------------------------------------------------------
# Packet 1's numbers (issues 42 and 43): the step, the wall split, BLEU 10 and 15; null where not recorded
# ----------------------------------------------------------------------------------------------
def _done(split: dict) -> dict:
    return {"kind": "done", "epoch": 3, "step": 300, "stop_reason": "done", "time_split": split}


@pytest.mark.parametrize("recorded", [True, False])
def test_packet1_records_the_step_and_the_wall_split_and_null_for_what_the_run_did_not_record(tmp_path, recorded):

    epochs = [_epoch(1, 40.0, 8.0), _epoch(2, 52.0, 12.0), _epoch(3, 64.0, 16.0)]
    for i, e in enumerate(epochs):
        e["mfu"] = 0.1 + 0.05 * i
        if recorded:
            e.update(step_ms=20.0 - i, host_ms_per_step=5.0 + i, graphs_per_step=1)
    run = _run_folder(tmp_path / "run", epochs, test_bleu=9.0)
    split = {"setup": 14.0, "compile": 52.5, "train": 50.6, "eval": 18.3, "checkpoints": 18.6}
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(_done(split)) + "\n")
    out = subprocess.run([sys.executable, "-m", "bench.quality", "--run", str(run), "--out", str(tmp_path / "o"),
                          "--add-thresholds", "10,15"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    q = tmp_path / "o" / "quality-h200.json"
    numbers = json.loads(q.read_text())
    # the split as the run's done record has it (train/objective.py WallSplit)
    assert (numbers["setup_s"], numbers["compile_s"], numbers["train_s"], numbers["eval_s"],
            numbers["checkpoint_s"]) == (14.0, 52.5, 50.6, 18.3, 18.6)
    # BLEU 10 and 15 beside the run's own thresholds (the default 20, 28, ...): the first epoch at or above each
    assert numbers["time_to_bleu_s"]["10"] == 52.0 and numbers["time_to_bleu_s"]["15"] == 64.0
    assert numbers["time_to_bleu_s"]["20"] is None
    assert numbers["mfu"] == pytest.approx(0.175)  # the steady epochs' (2 and 3) median
    if recorded:
        assert numbers["step_ms"] == 18.5 and numbers["host_ms_per_step"] == 6.5 and numbers["graphs_per_step"] == 1
    else:  # the steady epochs' wall per optimizer step; nothing invented for what only the run can measure
        assert numbers["step_ms"] == pytest.approx(1000 * 20.0 / 200)
        assert numbers["host_ms_per_step"] is None and numbers["graphs_per_step"] is None
    rec = T.make_record("packet1", [{"name": "train", "status": "ok", "seconds": 1}], quality=q)
    assert set(T.NUMBER_KEYS) <= set(rec["numbers"]) and rec["numbers"]["compile_warm_s"] is None
    assert rec["numbers"]["gpu_busy"] is None  # no samples: not measured
    assert "10" in rec["numbers"]["time_to_bleu_s"]


def test_a_cut_run_has_no_split_and_says_null(tmp_path):
    from bench.quality import done_split

    run = _run_folder(tmp_path / "run", [_epoch(1, 40.0, 8.0)])
    assert done_split(run) == dict.fromkeys(("setup_s", "compile_s", "train_s", "eval_s", "checkpoint_s"))


def test_the_compile_warm_packet_records_the_cold_and_the_warm_compile(tmp_path):

    runs = {}
    for kind, compile_s in (("cold", 52.5), ("warm", 6.0)):
        runs[kind] = _run_folder(tmp_path / kind, [_epoch(1, 40.0, 1.0)])
        with open(runs[kind] / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(_done({"setup": 9.0, "compile": compile_s, "train": 3.0, "eval": 4.0,
                                       "checkpoints": 1.0})) + "\n")
    rec = T.make_record("compile-warm", [{"name": "train-cold", "status": "ok", "seconds": 90}],
                        cold_run=runs["cold"], warm_run=runs["warm"])
    assert rec["numbers"]["compile_s"] == 52.5 and rec["numbers"]["compile_warm_s"] == 6.0
    assert rec["numbers"]["step_ms"] is None  # not measured by this packet
    # the plan says why the warm compile is a packet of its own: packet 1 has no second left for a warm rerun
    assert "the compile-warm packet measures it" in gpu_run("plan")
    cold, warm = show("train-cold", "compile-warm"), show("train-warm", "compile-warm")
    assert cold[cold.index("--run.name") + 1].startswith("cold-") and warm[warm.index("--run.name") + 1].startswith("warm-")
    assert cold[cold.index("--run.max_steps") + 1] == warm[warm.index("--run.max_steps") + 1]  # the same job


def test_the_queued_packets_name_their_commands():
    eole = show("peers-eole", "peers-eole")
    assert eole[eole.index("-m") + 1:eole.index("-m") + 4] == ["bench.peers", "--peer", "eole"]
    assert int(eole[eole.index("--max-wall-seconds") + 1]) < 200  # inside its step's limit, with room to score
    from bench import packets as P

    seen = set()
    for name, settings in T.BATCH_SWEEP:
        words = show("batch-sweep", f"batch-sweep-{name}")
        assert "bench.batch_sweep" in words and words[words.index("--settings") + 1] == settings
        from bench.batch_sweep import parse_settings

        parsed = parse_settings(settings)
        assert len({s.tokens for s in parsed}) == 1 and len({(s.lr, s.warmup) for s in parsed}) >= 2
        seen.add(parsed[0].tokens)
        budget = float(words[words.index("--budget-s") + 1]) + float(words[words.index("--grace-s") + 1])
        assert budget * len(parsed) <= P.BY_NAME[f"batch-sweep-{name}"].steps[0].limit
    assert seen == {4096, 8192, 16384, 32768}
