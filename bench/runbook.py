"""The GPU runbook: runs a packet of bench/packet_table.py's one table (one device call) on a bare device machine
(the image's python3 with torch and triton, no network); bench/README.md ("A 15-minute GPU session") has the rest.

  python3 -m bench.packets run packet1|packet2|PACKET|STEP ...   (= bash bench/gpu_run.sh ...)
  python3 -m bench.packets run plan|next|show STEP [PACKET]     the session's arithmetic; the packet to run; a command
  GPU_RUN_REHEARSAL=1 ... run packet1     the rehearsal on a CPU machine: every step in its smoke form (CI runs it)

Each step runs under its limit in its own process session (bench.harness.run_in_group: TERM to its group 10 s
before the limit, KILL at it); no step starts past the deadline (GPU_RUN_DEADLINE_S; default: the command time)
and each leaves a minimum share to the steps after it. Training starts from empty Triton and Inductor caches in
this run's scratch folder, nvidia-smi sampling beside it. After every step $OUT/results.tgz and summary.txt are
packed again (``packet_table.pack_results``); a SIGTERM stops the step in flight with its group, then packs. An
OUT it cannot write, or one holding an earlier run's results, is refused before any step (exit 2); without OUT:
runs/gpu_run/<id>.out/. Exit 0 when every step is ok, else 1. Environment: PYTHON (the steps' interpreter);
LIMIT_<STEP> (seconds); the steps' extra words (packet_table.EXTRA); FASTMT_GIT_SHA (a copy without .git).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import packet_table as T


class UsageError(ValueError):
    """Bad words, variables or OUT: one line, exit 2, before any step."""


class Terminated(BaseException):
    """SIGTERM to the runbook: the step in flight is stopped with its group, what finished is packed."""


def _words(environ: dict, var: str) -> list[str]:
    try:
        return shlex.split(environ.get(var) or "")
    except ValueError:
        raise UsageError(f"{var}={environ[var]} is not valid shell words (an unclosed quote?): fix its quoting"
                         ) from None


def text_of(path: Path, what: str = "log") -> str:
    """A file the runbook or its steps wrote, through the safe-file layer; what cannot be read is said."""
    from data.files import LOG_MAX, read_bytes

    try:
        return read_bytes(path, what, limit=LOG_MAX).decode(errors="replace")
    except (OSError, ValueError) as e:
        return f"<{what} {path} unreadable: {' '.join(str(e).split())[:200]}>\n"


def mentions(flag: str, words: list[str]) -> bool:
    return any(w == flag or w.startswith(flag + "=") for w in words)


class Runbook:
    """One invocation: its words, environment, folders, each step's status and seconds."""

    def __init__(self, environ: dict, root: Path = T.ROOT):
        self.environ, self.root, self.t0 = environ, root, time.monotonic()
        self.rehearsal = environ.get("GPU_RUN_REHEARSAL", "0") not in ("", "0")
        # a rehearsal runs on a CPU, slower than the GPU every limit was sized for: its limits are scaled
        self.scale = int(environ.get("GPU_RUN_REHEARSAL_SCALE") or 4) if self.rehearsal else 1
        self.py = environ.get("PYTHON") or sys.executable
        self.run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.env = dict(environ)  # the steps' environment (setup adds to it)
        self.work, self.scratch, self.summary, self.started = root, None, None, 0.0
        self.logdir = root / "runs" / "gpu_run" / self.run_id
        self.items: list[tuple[str | None, str]] = []  # (packet or None, step) in order
        self.packets, self.data_files, self.pack_notes = [], [], []  # packets named; .data files; what pack left out
        self.status, self.secs = {}, {}  # each step's (key's) status and seconds
        self.caches, self.has_timeout, self.sampler, self.current = "", False, None, None
        self.packed_bytes, self.pack_failed = 0, None

    def limit_of(self, step: str, packet: str | None = None) -> int:
        """LIMIT_<STEP>, else the packet's limit for it, else the step's own (both scaled in a rehearsal)."""
        var = "LIMIT_" + step.replace("-", "_").upper()
        if self.environ.get(var):
            if not self.environ[var].isdigit() or int(self.environ[var]) < 1:
                raise UsageError(f"{var}={self.environ[var]} is not a number of seconds: give a whole number")
            return int(self.environ[var])
        own = [s.limit for s in T.BY_NAME[packet].steps if s.name == step] if packet else []
        return (own[0] if own else T.STEP_LIMITS[step]) * self.scale

    def key(self, packet: str | None, step: str) -> str:
        return f"{packet}:{step}" if packet else step

    def log(self, msg: str) -> None:
        line = f"[gpu_run +{int(time.monotonic() - self.t0)}s] {msg}"
        print(line, flush=True)
        if self.summary is not None:
            self.note(line)

    def read_data_files(self) -> list[str]:
        """The carried .data/FILES into ``data_files``; a warning for each listed file that is missing."""
        listing = self.root / ".data" / "FILES"
        names = [n.strip() for n in (text_of(listing, ".data/FILES").splitlines() if listing.is_file() else []) if n.strip()]
        self.data_files = [str(self.root / ".data" / n) for n in names if (self.root / ".data" / n).is_file()]
        return [f"WARNING: .data/{n} is listed but missing" for n in names if not (self.root / ".data" / n).is_file()]

    def capture(self, cmd: list[str], log: str = "setup.log", env: dict | None = None) -> tuple[int, str]:
        """A setup command's exit status and output (kept in ``log``), under the deadline runner."""
        from bench.harness import run_in_group

        try:
            rc = run_in_group(cmd, self.logdir / log, timeout_s=120, env=env or self.env, cwd=self.root, check=False)
        except OSError as e:  # the interpreter or tool is missing
            return 127, f"{cmd[0]}: {e.strerror}"
        return rc, text_of(self.logdir / log)

    def note(self, text: str) -> None:
        with open(self.summary, "a") as f:
            f.write(text if text.endswith("\n") or not text else text + "\n")

    def pip(self, wheels: list[str], target: Path, log: str) -> tuple[int, str]:
        return self.capture([self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], log)

    def step_command(self, step: str, packet: str | None, limit: int) -> list[str]:
        own = list(next((s.args for s in T.BY_NAME[packet].steps if s.name == step), ())) if packet else []
        extra = _words(self.environ, T.EXTRA[step]) if step in T.EXTRA else []
        data = ["--data-files", *self.data_files] if self.data_files else []
        out = ["--out", str(self.work / "bench" / "results")] if self.rehearsal else []
        runs, smoke, py, rh = str(self.work / "runs"), [], self.py, self.rehearsal
        if step in ("kernel-test", "kernel-test-slow"):  # never a bare pytest: it would collect the whole tree
            files = T.kernel_test_files(self.root)
            if not files:
                return ["sh", "-c", 'echo "gpu_run: bench.packets found no tests/kernels files"; exit 2']
            if step == "kernel-test":  # the GPU kernel tests but the slow grids, the LayerNorm N=1 cases first
                sel = [*(f"--first={p}" for p in T.KERNEL_TESTS_FIRST), *files, "-m", "not slow"]
                smoke = ["-k", "validation or dispatch"] if rh else []
            else:  # the full CUDA grids (every dtype x width x flag, every shape)
                sel, smoke = [*files, "-m", "slow"], ["--collect-only"] if rh else []
            return self.pytest_command(limit, step, [*sel, *own, *smoke, *extra])
        if step == "bench-kernels":  # the budget leaves room for the worker's grace period and the outputs
            smoke = ["--smoke", "--only", "layernorm", *out] if rh else []
            own = own if mentions("--groups", own + extra) else ["--groups", "corpus,ln", *own]
            budget = limit - 75 if limit > 150 else limit // 2
            return [py, "-m", "bench.kernels", "--budget-s", str(budget), *data, *own, *smoke, *extra]
        if step in ("train", "train-cold", "train-warm"):  # what `make train` runs on CUDA, from cold caches
            smoke = [*T.TRAIN_SMOKE, "--run.out_dir", runs] if rh else []
            name = {"train-cold": "cold", "train-warm": "warm"}.get(step, "default") + "-" + self.run_id
            mine = []  # fastmt refuses a flag given twice: TRAIN_ARGS's own --run.max_wall_seconds, --preset... win
            if not mentions("--preset", extra + smoke) and not mentions("--config", extra):
                mine.append("--auto")
            if not mentions("--run.progress", extra):
                mine += ["--run.progress", "false"]
            if not mentions("--run.max_wall_seconds", extra):  # time for its test split, done record and plot
                wall = limit - T.TRAIN_RESERVE_S if limit > 2 * T.TRAIN_RESERVE_S else limit // 2
                mine += ["--run.max_wall_seconds", str(wall)]
            if not mentions("--data-files", extra) and not mentions("--data.dataset", extra + smoke):
                mine += data
            return [py, "-m", "train", *mine, "--run.name", name, *own, *smoke, *extra]
        if step == "quality":  # this invocation's own run (a run name is never reused)
            return [py, "-m", "bench.quality", "--run", f"{runs}/default-{self.run_id}", "--gpu-samples",
                    str(self.logdir / "train-gpu.csv"), "--require-stable-graphs", *own, *out]
        if step == "aot":
            return ["true"]  # done by run_step (it fills this run's Triton cache)
        if step in ("peers", "peers-eole"):  # the HF baseline under packet 1's training wall budget; eole its own
            smoke = list(T.PEERS_SMOKE) if rh else []
            mine = [] if mentions("--preset", extra + smoke) else ["--preset", "fast"]
            if not mentions("--data-files", extra) and not mentions("--data.dataset", extra + smoke):
                mine += data
            if step == "peers":
                budget = self.limit_of("train", "packet1") - T.TRAIN_RESERVE_S
                return [py, "-m", "bench.peers", *mine, "--max-wall-seconds", str(budget), "--name",
                        f"hf-{self.run_id}", "--out-dir", runs, *own, *smoke, *extra]
            head = [py]  # eole's wheels (make gpu-wheels GPU_WHEELS_PEERS=1), installed for this step only
            if list((self.root / ".whl" / "peers").glob("*.whl")):
                path = f"{self.scratch or '<scratch>'}/site-peers"
                head = ["env", f"PYTHONPATH={path}" + (f":{self.env['PYTHONPATH']}" if self.env.get("PYTHONPATH")
                                                        else ""), py]
            return [*head, "-m", "bench.peers", "--peer", "eole", *mine, "--max-wall-seconds",
                    str(limit - 40 if limit > 60 else limit // 2), "--name", f"eole-{self.run_id}", "--out-dir",
                    runs, *own, *smoke, *extra]
        if step == "batch-sweep":  # issue 42: tokens a step x lr/warm-up, seconds to valid BLEU 15 and 20
            return [py, "-m", "bench.batch_sweep", *data, "--work-dir", runs, "--out",
                    str(self.work / "bench" / "results"), *own, *(["--smoke"] if rh else []), *extra]
        if step == "compare":  # packet 1's run on this machine, else the newest landed one, against the HF run
            a = self.latest_run("default") or self.landed_packet1_run()
            return [py, "-m", "bench.quality", "--compare", str(a or "<no packet1 run: run packet1 first>"),
                    f"{runs}/hf-{self.run_id}", *out]
        if step in ("frontier", "sweep"):  # the sweep's first evaluation (graph captures, tuning) must fit the grace
            smoke = ["--smoke", "--budget-s", "3", "--work-dir", runs, *out] if rh else []
            if step == "sweep" and not mentions("--settings", own + extra):
                own = ["--settings", "adamw-base,adamw-8e-4,adamw-3e-4", *own]
            return [py, "-m", f"bench.{step}", *data, *own, *smoke, *extra]
        if step in ("profile", "ladder"):  # profile after `train`: its compile is the warm-cache compile
            smoke = ["--smoke", *out] if rh else []
            mine = [] if step == "profile" else ["--budget-s", str(limit - 30 if limit > 60 else limit // 2),
                                                  "--cap-s", "30", "--steps", "10", "--warmup", "3"]
            return [py, "-m", f"bench.{step}", *data, *mine, *own, *smoke, *extra]
        assert step == "inference", step
        smoke = ["--sentences", "16", "--train-steps", "20"] if rh else []
        return [py, "-m", "bench.inference", "--out", str(self.work / "bench" / "results"), *own, *smoke, *extra]

    def pytest_command(self, limit: int, name: str, selection: list[str]) -> list[str]:
        """pytest that ends, with its summary, in time (bench/pytest_stop.py): no test starts past the limit
        less a quarter of it (at least 8 s, at most T.PYTEST_RESERVE_S); a hung test ends the session
        (pytest-timeout)."""
        margin = min(max(limit // 4, 8), T.PYTEST_RESERVE_S)
        cmd = ["env", "FASTMT_AUTOTUNE=0", self.py, "-m", "pytest", "-q", "-p", "bench.pytest_stop",
               f"--stop-after-s={limit - margin}", f"--outcomes={self.logdir / name}.outcomes.jsonl"]
        if self.has_timeout:
            cmd += [f"--timeout={min(limit // 2, 120)}", "--timeout-method=thread"]
        return [*cmd, "-rfE", "--durations=15", f"--junitxml={self.logdir / name}.xml", *selection]

    def latest_run(self, prefix: str) -> Path | None:
        runs = [m.parent for m in (self.work / "runs").glob(f"{prefix}-*/metrics.jsonl") if m.is_file()]
        return max(runs, key=lambda p: p.stat().st_mtime, default=None)

    def landed_packet1_run(self) -> Path | None:
        try:
            return T.last_run(T.read_records(self.root / T.RECORDS, warn=False), "packet1", self.root)
        except (OSError, ValueError):
            return None

    # -- setup -------------------------------------------------------------------------------------------------
    def check_out_folder(self) -> Path:
        dest = Path(self.environ.get("OUT") or self.root / "runs" / "gpu_run" / f"{self.run_id}.out")

        def refused(why: str) -> UsageError:
            return UsageError(f"OUT={dest} {why}: nothing would come back; give OUT a folder this user can write")
        if dest.is_symlink() and not dest.exists():
            raise refused(f"is a symbolic link to nothing (to {os.readlink(dest)})")
        if dest.exists() and not dest.is_dir():
            raise refused("is not a folder")
        try:
            dest.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".gpu_run-probe.", dir=dest)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise refused(f"cannot be created or written ({e.strerror})") from None
        used = [n for n in ("results.tgz", "summary.txt") if os.path.lexists(dest / n)]
        if used:
            raise UsageError(f"OUT={dest} already holds {' and '.join(used)} of an earlier run: give an empty folder "
                             f"(nothing of the earlier run is overwritten)")
        return dest

    def setup(self) -> None:
        r, env = self.root, self.env
        self.log(f"run: {' '.join(self.key(p, s) for p, s in self.items)} | deadline {self.deadline}s | logs "
                 f"{self.logdir} | results -> {self.dest}"
                 + (f" | REHEARSAL on {os.uname().nodename}: smoke forms, {self.py}" if self.rehearsal else ""))
        env.update(PYTHONUNBUFFERED="1", MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HOME=str(self.scratch / "hf-home"))
        if env.pop("PYTHONPATH", None):
            self.log(f"PYTHONPATH={self.environ['PYTHONPATH']} from the environment is dropped (only this run's)")
        wheels = sorted(str(w.relative_to(r)) for w in (r / ".whl").glob("*.whl"))
        if wheels:
            site = self.scratch / "site"
            rc, text = self.pip(wheels, site, "setup-pip.log")
            if rc == 0:
                env["PYTHONPATH"] = str(site)
                self.log(f"installed {len(wheels)} carried wheels into {site} (PYTHONPATH): "
                         f"{' '.join(Path(w).name for w in wheels)}")
            else:
                self.log(f"WARNING: installing .whl/*.whl failed (setup-pip.log; PYTHONPATH left unset): "
                         f"{' '.join(text.strip().splitlines()[-2:])}")
        else:
            self.log("WARNING: no .whl/*.whl: run 'make gpu-wheels' on a CPU machine and carry .whl (datasets, "
                     "lion-pytorch are missing here)")
        for warning in self.read_data_files():
            self.log(warning)
        if self.data_files:
            if (r / ".data" / "SHA256SUMS").is_file():
                rc, text = self.capture(["sh", "-c", "cd .data && sha256sum --quiet -c SHA256SUMS"])
                self.note(text)
                if rc:
                    self.log("WARNING: .data checksums differ")
            if self.rehearsal:  # the rehearsal's smoke forms train on the generated toy corpus, never on both
                self.data_files = []
                self.log("data: .data/ is here but the rehearsal uses the generated toy corpus")
            else:
                env["FASTMT_DATA_FILES"] = os.pathsep.join(self.data_files)  # as data/config.py reads it
                size = sum(os.path.getsize(f) for f in self.data_files) / 2**20
                self.log(f"data: FASTMT_DATA_FILES={env['FASTMT_DATA_FILES']} ({size:.1f} MiB)")
        elif self.rehearsal:
            self.log("data: none (rehearsal: the steps' smoke forms use the generated toy corpus)")
        else:
            self.log("WARNING: no .data/FILES: training and the benchmarks have no local data and no network")
        if not env.get("FASTMT_GIT_SHA"):
            rc, text = self.capture(["git", "rev-parse", "HEAD"])
            env["FASTMT_GIT_SHA"] = text.strip() if rc == 0 and text.strip() else "unknown"
        rc, text = self.capture(["git", "status", "--porcelain", "--untracked-files=no"])
        self.log(f"git: {env['FASTMT_GIT_SHA']}" + (" (uncommitted changes)" if rc == 0 and text.strip() else ""))
        # cold caches: Triton's and Inductor's in this run's own scratch folder, empty (a warm machine's rerun too)
        for var, name in (("TRITON_CACHE_DIR", "triton-cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor-cache")):
            (self.scratch / name).mkdir()
            env[var] = str(self.scratch / name)
        self.caches = "cold"
        if any(s in T.TRAINS for _, s in self.items):
            self.log("caches: Triton and Inductor empty for the training (the AOT cache is unpacked by the aot step)")
        else:
            self.unpack_aot()
        self.has_timeout = self.capture([self.py, "-c", "import pytest_timeout"])[0] == 0
        if not self.has_timeout:
            self.log("WARNING: pytest-timeout is missing: no per-test timeout (the steps' deadlines still hold)")
        text = self.capture([self.py, "-m", "bench.env_report"], "setup-env.log")[1]  # nvidia-smi, versions, wheels
        self.note(text)
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(("name, driver_version", "torch ", "python ", "carried wheels", "module ")) \
                    or "REQUIREMENT" in line:
                print("\n".join(f"  {x}" for x in lines[i:i + (2 if line.startswith("name,") else 1)]))

    def triton_entries(self) -> int:  # the kernels in this run's Triton cache
        folder = Path(self.env.get("TRITON_CACHE_DIR") or "/nonexistent")
        return sum(1 for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else 0

    def unpack_aot(self) -> None:
        """Our Triton kernels compiled ahead of time for sm_90 (bench/aot.py): a warm cache if the keys match."""
        if "aot" in self.caches:
            return
        tgz, cache = self.root / ".whl" / "triton-aot-sm90.tgz", self.env["TRITON_CACHE_DIR"]
        if not tgz.is_file():
            return self.log("triton cache: no .whl/triton-aot-sm90.tgz (make gpu-wheels builds it): every kernel compiles")
        self.capture(["tar", "-xzf", str(tgz), "-C", cache], "setup-aot.log")
        env = {k: v for k, v in self.env.items() if k != "TRITON_INTERPRET"}
        _, check = self.capture([self.py, "-m", "bench.aot", "--check", f"{cache}/AOT-KEYS.json"], "aot-check.log", env)
        self.log(f"triton cache: {self.triton_entries()} kernels compiled ahead of time in {cache}; "
                 f"{(check.strip().splitlines() or [''])[-1]}")
        self.caches += " aot"

    # -- the steps ---------------------------------------------------------------------------------------------
    def run_step(self, packet: str | None, step: str, later: int) -> None:
        """Run one step under min(its limit, what is left less ``later``: the minimum shares of the steps after)."""
        from bench.harness import run_in_group  # imports torch: not for plan, next and show

        key = self.current = self.key(packet, step)
        limit, remaining = self.limit_of(step, packet), self.deadline - int(time.monotonic() - self.t0) - T.PACK_S
        if remaining < T.MIN_STEP_S:
            self.status[key], self.secs[key] = f"skipped ({remaining}s left before the deadline)", 0
            self.log(f"SKIP {key}: {remaining}s left before the deadline")
            return
        limit, t0 = max(min(limit, remaining - later), T.MIN_STEP_S), time.monotonic()
        if step == "aot":
            self.unpack_aot()
            self.status[key], self.secs[key] = "ok", int(time.monotonic() - t0)
            return
        peers = sorted(str(w) for w in (self.root / ".whl" / "peers").glob("*.whl"))
        if step == "peers-eole" and peers:
            rc, _ = self.pip(peers, self.scratch / "site-peers", "setup-pip-peers.log")
            self.log(f"installed {len(peers)} wheels of .whl/peers into {self.scratch}/site-peers for {key}" if rc == 0
                     else "WARNING: installing .whl/peers/*.whl failed (setup-pip-peers.log)")
        cmd = self.step_command(step, packet, limit)
        self.log(f"START {key} (limit {limit}s): {shlex.join(cmd)}")
        cached, log = self.triton_entries(), self.logdir / f"{step}.log"
        kill_after = 10 if limit > 40 else 3  # TERM first: pytest writes its summary, contestants' groups die
        try:
            if step in T.TRAINS:
                self.start_sampler(self.logdir / f"{step}-gpu.csv")
            rc = run_in_group(cmd, log, timeout_s=limit - kill_after, grace_s=kill_after, env=self.env,
                              cwd=self.root, check=False)
        except OSError as e:  # the interpreter or program is missing
            with open(log, "a") as f:
                f.write(f"gpu_run: {cmd[0]}: {e.strerror}\n")
            rc = 127
        finally:
            self.stop_sampler()
            self.secs[key] = int(time.monotonic() - t0)
        self.current = None
        self.log(f"{key} compiled {self.triton_entries() - cached} Triton kernels here (ours and Inductor's)")
        self.status[key] = ("ok" if rc == 0 else f"TIMEOUT after {limit}s (rc {rc})" if rc in (124, 137)
                            else f"FAILED (rc {rc})")
        outcomes = self.logdir / f"{step}.outcomes.jsonl"
        if outcomes.is_file():
            from bench.pytest_stop import count

            counts = ", ".join(f"{v} {k}" for k, v in sorted(count(str(outcomes)).items())) or "no finished test"
            self.log(f"{key} outcomes (streamed, kept whatever stopped the step): {counts}")
        self.log(f"END {key}: {self.status[key]} in {self.secs[key]}s -> {log.relative_to(self.work)}")
        print("\n".join(f"    {x}" for x in text_of(log).splitlines()[-12:]), flush=True)

    def start_sampler(self, path: Path) -> None:
        """nvidia-smi's utilization every 500 ms into ``path``, beside the step (nothing without nvidia-smi)."""
        if shutil.which("nvidia-smi", path=self.env.get("PATH")):
            with open(path, "w") as f:
                self.sampler = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used",
                     "--format=csv,noheader,nounits", "-lms", "500"], stdout=f, stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL, start_new_session=True)

    def stop_sampler(self) -> None:
        if self.sampler is not None:
            from bench.harness import kill_group

            kill_group(self.sampler.pid, grace_s=0.0)
            self.sampler.wait()
            self.sampler = None

    # -- what comes back ---------------------------------------------------------------------------------------
    def pack(self) -> None:
        try:
            self.packed_bytes, self.pack_notes = T.pack_results(self.work, self.logdir, self.started, self.dest)
            shutil.copyfile(self.summary, self.dest / "summary.txt")
            self.pack_failed = None
        except OSError as e:
            self.pack_failed = f"{e.filename or self.dest}: {e.strerror or e}"

    def record(self, packet: str) -> None:
        """bench/results/packet-record.json (the last packet's)."""
        steps = [{"name": s, "status": self.status.get(self.key(p, s), "not run"),
                  "seconds": self.secs.get(self.key(p, s), 0)} for p, s in self.items if p == packet]
        results, runs = self.work / "bench" / "results", self.work / "runs"
        quality = max((q for q in results.glob("quality-*.json") if q.stat().st_mtime > self.started),
                      key=lambda q: q.stat().st_mtime, default=None) if packet == "packet1" else None
        outcomes = self.logdir / "kernel-test.outcomes.jsonl"
        cold, warm = runs / f"cold-{self.run_id}", runs / f"warm-{self.run_id}"
        out = results / "packet-record.json"
        try:
            rec = T.make_record(packet, steps, quality=quality, outcomes=outcomes if outcomes.is_file() else None,
                                caches=self.caches, root=self.root, sha=self.env.get("FASTMT_GIT_SHA"),
                                cold_run=cold if (cold / "metrics.jsonl").is_file() else None,
                                warm_run=warm if (warm / "metrics.jsonl").is_file() else None)
            out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
            self.note(f"packet record: {out} (complete {rec['complete']}, clean {rec['clean']})")
        except (OSError, ValueError) as e:
            self.log(f"WARNING: the packet record could not be written: {' '.join(str(e).split())[:300]}")

    def finish(self) -> None:
        for p in self.packets:
            self.record(p)
        text = ["", "==== steps"]
        for p, s in self.items:
            k = self.key(p, s)
            text.append(f"  {k:<24} {self.status.get(k, 'not run'):<40} {self.secs.get(k, 0):>6}s")
        record = self.work / "bench" / "results" / "packet-record.json"
        if record.is_file():
            text += ["", "==== packet record (every number; bench/results/packet-record.json)",
                     text_of(record, "packet record").rstrip("\n")]
        for _, s in self.items:
            log = self.logdir / f"{s}.log"
            if log.is_file():
                lines = text_of(log).splitlines()
                mark = [i for i, x in enumerate(lines) if "== bench.kernels summary" in x]
                text += ["", f"==== tail of {s}.log", *(lines[mark[0]:][-60:] if mark else lines[-30:])]
        self.note("\n".join([*text, "", *self.pack_notes]))
        self.pack()
        problems = T.check_out(self.dest)
        if problems:
            self.log(f"WARNING: what comes back is over the device's limits: {'; '.join(problems)}")
        if self.pack_failed is None:
            self.log(f"packed {self.dest}/results.tgz ({self.packed_bytes // 1024} KB) and {self.dest}/summary.txt")
            try:
                shutil.copyfile(self.summary, self.dest / "summary.txt")
            except OSError as e:
                self.pack_failed = f"{self.dest}/summary.txt: {e.strerror}"
        lines = text_of(self.summary, "summary").splitlines()
        start = max((i for i, x in enumerate(lines) if x == "==== steps"), default=len(lines))
        print("\n".join(lines[start:][-120:]))

    # -- one invocation ----------------------------------------------------------------------------------------
    def parse(self, words: list[str]) -> tuple[str, list[str]]:
        """("plan" | "next" | "show" | "run", the show's [STEP, PACKET or None]); the steps into ``items``."""
        show: list = []
        steps = "; steps: " + " ".join(sorted(T.STEP_LIMITS))
        while words:
            arg = words.pop(0)
            if arg in ("plan", "next"):
                return arg, []
            if arg == "show":
                step = words.pop(0) if words else ""
                if step not in T.STEP_LIMITS:
                    raise UsageError(f"show STEP [PACKET]: STEP one of {steps[9:]} (got '{step}')")
                show = [step, words.pop(0) if words and words[0] in T.BY_NAME else None]
            elif arg in T.BY_NAME:
                self.packets.append(arg)
                self.items += [(arg, s.name) for s in T.BY_NAME[arg].steps]
            elif arg in T.STEP_LIMITS:
                self.items.append((None, arg))
            else:
                raise UsageError(f"unknown packet or step '{arg}' (packets: {' '.join(T.BY_NAME)}{steps}); "
                                 f"`run plan` lists them")
        for var in sorted(set(T.EXTRA.values())):  # before anything runs: an open quote would lose its words
            _words(self.environ, var)
        if show:
            return "show", show
        if not self.items:
            raise UsageError("name a packet (every session starts with packet1; 'run next' says which) or a step")
        return "run", []

    def main(self, words: list[str]) -> int:
        mode, show = self.parse(words)
        if mode in ("plan", "next"):
            print("\n".join(T.plan_lines()) if mode == "plan" else T.next_line(self.root / T.RECORDS, self.root))
            return 0
        if mode == "show":  # the command as the step would run it (its default limit, no setup)
            self.read_data_files()
            self.has_timeout = subprocess.run([self.py, "-c", "import pytest_timeout"], capture_output=True,
                                              cwd=self.root, env=self.env).returncode == 0
            print("\n".join(self.step_command(show[0], show[1], self.limit_of(show[0], show[1]))))
            return 0
        limits = [self.limit_of(s, p) for p, s in self.items]  # a bad LIMIT_* is refused here, before any step
        deadline = self.environ.get("GPU_RUN_DEADLINE_S") or str(T.SETUP_S + sum(limits) + T.PACK_S)
        if not deadline.isdigit():
            raise UsageError(f"GPU_RUN_DEADLINE_S={deadline} is not a number of seconds: give a whole number")
        self.deadline, self.dest = int(deadline), self.check_out_folder()
        self.scratch = Path(tempfile.mkdtemp(prefix="fastmt-gpu-run.", dir=self.environ.get("TMPDIR") or "/tmp"))
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            return self._run(limits)
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.stop_sampler()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _run(self, limits: list[int]) -> int:
        if self.rehearsal:  # runs/ and bench/results/ of the rehearsal in scratch: the checkout stays as it is
            self.work = self.scratch / "work"
        while True:  # this run's own log folder, even when two runs start within a second
            self.logdir = self.work / "runs" / "gpu_run" / self.run_id
            try:
                self.logdir.mkdir(parents=True)
                break
            except FileExistsError:
                self.run_id += "x"
        (self.work / "bench" / "results").mkdir(parents=True, exist_ok=True)
        self.summary = self.logdir / "summary.txt"
        self.summary.touch()
        self.started = self.summary.stat().st_mtime  # what this run writes under bench/results is newer
        code = 0
        try:
            self.setup()
            self.pack()
            for i, (packet, step) in enumerate(self.items):
                later = sum(min(x, T.LATER_SHARE_S) for x in limits[i + 1:])
                self.run_step(packet, step, later)
                self.pack()
        except (Terminated, KeyboardInterrupt) as e:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the runbook at once
            code = 143 if isinstance(e, Terminated) else 130
            if self.current:
                self.status[self.current] = "STOPPED (signal to the runbook)"
            self.log(f"STOPPED by {'SIGTERM' if code == 143 else 'an interrupt'}: the step in flight ended with its "
                     f"process group; packing what finished")
        self.finish()
        if self.pack_failed is not None:
            print(f"gpu_run: could not write {self.dest}/results.tgz or summary.txt: {self.pack_failed}", file=sys.stderr)
            return 2
        return code or (0 if all(self.status.get(self.key(p, s)) == "ok" for p, s in self.items) else 1)


def _terminated(signum, _frame):
    raise Terminated(f"signal {signum}")


def main(argv: list[str] | None = None, environ: dict | None = None, root: Path = T.ROOT) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] in ("-h", "--help"):
        print(__doc__.split("\n\nEach step")[0], file=sys.stdout if words else sys.stderr)
        return 0 if words else 2
    try:
        return Runbook(dict(os.environ if environ is None else environ), root).main(words)
    except UsageError as e:
        print(f"gpu_run: {e}", file=sys.stderr)
        return 2
