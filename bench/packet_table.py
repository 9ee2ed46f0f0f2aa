"""The GPU runbook's one table: its packets (one device call each, at most 5 minutes of command time, useful
on its own), every constant of a run, and the landed records (``bench/results/packets.jsonl``) that ``next``
reads to name the first packet with no result for the code it measures now (``code_hash``). bench/runbook.py
runs it; its command line is ``python3 -m bench.packets``; bench/README.md ("A 15-minute GPU session").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = Path("bench/results/packets.jsonl")  # relative to the repository root

# the lease (the device tool's README, 2026-11-27)
SESSION_S = 900  # device time a session has in all
STARTUP_S = 90  # a fresh machine's start and the transfers (30 s measured on an H200, 1-2 min documented)
IDLE_S = 30  # the idle wait after a call before the machine goes back
MIN_START_S = 240  # no machine starts with less left
PACKET_MAX_S = 300  # a packet's command time, at most (the 5 minutes)
SECOND_MAX_S = 240  # packet 2's
SETUP_S = 25  # carried wheels, data, device facts (~10 s measured on the H200)
PACK_S = 15  # the final pack and the check of what comes back

TRAIN_RESERVE_S = 35  # of a training step's limit, kept for its test split, record and plot (H200: 13 s used)

KERNEL_SCOPE = ("kernels", "tests/kernels")

# the kernel-test step's files in the order a training run meets their kernels (a step cut at its deadline has
# run the first ones); any other tests/kernels file runs after them unless it is CPU_ONLY_KERNEL_TESTS
KERNEL_TEST_FILES = ("test_packed_attention.py", "test_layernorm.py", "test_attention.py",
                     "test_sequence_attention.py", "test_lion.py")
# the tests that run before every other one of the step (bench.pytest_stop's --first, node-id patterns): the
# LayerNorm N=1 cases, which the H200 got wrong (issue 43: an fma contracted in the backward kernel)
KERNEL_TESTS_FIRST = ("tests/kernels/test_layernorm.py::*-N1-*",
                      "tests/kernels/test_layernorm.py::test_fuzz_against_reference")
CPU_ONLY_KERNEL_TESTS = ("test_launch.py", "test_lowp_emulation.py", "test_lion_codegen.py", "test_tuning.py",
                         "test_layernorm_codegen.py", "test_attention_codegen.py")


def kernel_test_files(root: Path = ROOT) -> list[str]:
    """The kernel-test step's files (paths from the repository root), in order."""
    folder = root / "tests" / "kernels"
    rest = sorted(p.name for p in folder.glob("test_*.py")
                  if p.name not in KERNEL_TEST_FILES and p.name not in CPU_ONLY_KERNEL_TESTS)
    return [f"tests/kernels/{n}" for n in (*KERNEL_TEST_FILES, *rest) if (folder / n).is_file()]


TRAIN_SCOPE = ("kernels", "models", "train", "data")


@dataclass(frozen=True)
class Step:
    name: str
    limit: int  # seconds
    args: tuple[str, ...] = ()  # the step's own arguments in this packet (the *_ARGS variables add to them)


@dataclass(frozen=True)
class Packet:
    name: str
    what: str
    steps: tuple[Step, ...]
    scope: tuple[str, ...]  # files and folders whose code the packet measures (code_hash)

    @property
    def command_s(self) -> int:
        """The packet's command time: setup, its steps' limits, the pack."""
        return SETUP_S + sum(s.limit for s in self.steps) + PACK_S


# issue 42's batch sweep: per batch two lr/warm-up settings (lr ~sqrt of the batch from 5e-4 at 4k); one
# packet per batch: two runs of 105 s (+15 s grace) fill a 255 s step (a cold compile took 52 s on an H200)
BATCH_SWEEP = (("4k", "4096:5e-4:250,4096:1e-3:400"), ("8k", "8192:7e-4:150,8192:1.4e-3:250"),
               ("16k", "16384:1e-3:100,16384:2e-3:150"), ("32k", "32768:1.4e-3:60,32768:2.8e-3:100"))

PACKETS: tuple[Packet, ...] = (
    Packet("packet1", "make train cold to BLEU, its record, the kernel tests on the device (LayerNorm N=1 first)",
           (Step("train", 175), Step("quality", 10, ("--add-thresholds", "10,15")), Step("aot", 5),
            Step("kernel-test", 70)),
           (*TRAIN_SCOPE, "tests/kernels", "bench/quality.py")),
    Packet("packet2", "the Hugging Face baseline, same split, same wall budget as packet 1's training",
           (Step("peers", 190), Step("compare", 10)),
           ("data", "train/evaluation", "bench/peers.py", "bench/packets.py")),
    # issue 43's warm compile: packet 1 has no second left for a warm rerun (see plan_lines), so the same job runs
    # twice here, in one call (the caches of the first run kept for the second): a short cold run, then warm
    Packet("compile-warm", "the job's compile cold then warm: a short run of make train's job twice, caches kept",
           (Step("train-cold", 130, ("--run.max_steps", "200")), Step("train-warm", 100, ("--run.max_steps", "200"))),
           TRAIN_SCOPE),
    # issue 44: eole beside fastmt, its own recipe, within 240 s (the command is bench.peers --peer eole)
    Packet("peers-eole", "eole (the OpenNMT-py successor) on fastmt's split with its own recipe, within 240 s",
           (Step("peers-eole", 200),), ("data", "train/evaluation", "bench/peers.py")),
    *(Packet(f"batch-sweep-{k}", f"the batch sweep at {k} tokens a step: 2 lr/warm-up settings x 105 s, seconds to "
                                 f"valid BLEU 15 and 20 (issue 42)",
             (Step("batch-sweep", 255, ("--settings", settings, "--budget-s", "105", "--grace-s", "15")),),
             (*TRAIN_SCOPE, "bench/batch_sweep.py")) for k, settings in BATCH_SWEEP),
    Packet("packet3", "kernel headline: packed attention 4k fwd+bwd vs Flex/FA2 varlen/SDPA, LayerNorm vs compile",
           (Step("bench-kernels", 255, ("--groups", "corpus,ln", "--corpus-tokens", "4096", "--modes", "fwd+bwd")),),
           ("kernels", "bench/kernels.py", "bench/cases.py", "bench/registry.py", "bench/attention.py",
            "bench/layernorm.py", "bench/runner.py", "bench/timing.py", "bench/harness.py")),
    # the HF baseline needs ~200-260 s to reach BLEU 28 (H100, 2026-11-23; on the H200 it had 0.11 at 145 s):
    # packet 2 compares it at packet 1's budget, this packet gives it the longest budget one call holds
    Packet("packet4", "the frontier, HF baseline alone for 235 s: its time to BLEU 20 and 28",
           (Step("frontier", 255, ("--contestants", "hf", "--budget-s", "235", "--grace-s", "15")),),
           ("data", "train/evaluation", "bench/peers.py", "bench/frontier.py")),
    Packet("packet5", "the frontier: the seeds' recipe and the s18 preset, 105 s each",
           (Step("frontier", 255, ("--contestants", "seeds,s18", "--budget-s", "105", "--grace-s", "20")),),
           (*TRAIN_SCOPE, "bench/frontier.py")),
    Packet("packet6", "the profile of the compiled step: GPU busy, kernels per step, graph breaks",
           (Step("profile", 200),), (*TRAIN_SCOPE, "bench/profile.py")),
    Packet("packet7", "the speedup ladder, each trick's share against the seed-style baseline",
           (Step("ladder", 255),), (*TRAIN_SCOPE, "bench/ladder.py")),
    Packet("packet8", "the AdamW sweep (3 settings x 65 s)",
           (Step("sweep", 255, ("--settings", "adamw-base,adamw-8e-4,adamw-3e-4", "--budget-s", "65",
                                "--grace-s", "15")),), (*TRAIN_SCOPE, "bench/sweep.py")),
    Packet("packet9", "the Lion sweep (3 settings x 65 s)",
           (Step("sweep", 255, ("--settings", "lion-1e-4,lion-1.5e-4,lion-wd0.3", "--budget-s", "65",
                                "--grace-s", "15")),), (*TRAIN_SCOPE, "bench/sweep.py")),
    Packet("packet10", "the slow CUDA grids of the kernel tests", (Step("kernel-test-slow", 255),), KERNEL_SCOPE),
    Packet("packet11", "GPU inference: fastmt's decoding with CUDA graphs",
           (Step("inference", 255, ("--engines", "fastmt", "--device", "cuda")),),
           ("models", "train/evaluation", "train/export", "bench/inference.py")),
)
BY_NAME = {p.name: p for p in PACKETS}

# a step named on its own (`run STEP`): its limit in the first packet that has it, but the kernel tests, which get
# a whole packet's time on their own (packet 1 gives them what is left after the training)
STEP_LIMITS = {**{s.name: s.limit for p in reversed(PACKETS) for s in p.steps}, "kernel-test": 250}

# -- how the runbook (bench/runbook.py) runs the steps ---------------------------------------------------------
PYTEST_RESERVE_S = 40  # at most this much of a pytest step's limit is kept for the test in flight and the summary
LATER_SHARE_S = 30  # a step leaves at least min(this, their limit) to each step after it
MIN_STEP_S = 15  # no step starts with less left; no step gets a shorter limit
MAX_TGZ_BYTES = 15 * 2**20
BIG_FILE_BYTES = 2 * 2**20
# each step's pass-through variable: its words are added last (TRAIN_ARGS's flags replace the step's own)
EXTRA = {"kernel-test": "KERNEL_TEST_ARGS", "kernel-test-slow": "KERNEL_TEST_ARGS", "train": "TRAIN_ARGS",
         "train-cold": "TRAIN_ARGS", "train-warm": "TRAIN_ARGS", "bench-kernels": "BENCH_KERNELS_ARGS",
         "peers": "PEERS_ARGS", "peers-eole": "PEERS_ARGS", "batch-sweep": "BATCH_SWEEP_ARGS",
         "profile": "PROFILE_ARGS", "frontier": "FRONTIER_ARGS", "ladder": "LADDER_ARGS", "sweep": "SWEEP_ARGS",
         "inference": "INFERENCE_ARGS"}
TRAINS = ("train", "train-cold", "train-warm", "peers", "peers-eole", "batch-sweep")  # cold caches, the sampler
PEERS_SMOKE = ("--preset", "tiny", "--data.dataset", "toy", "--data.toy_rows", "1200", "--data.valid_size", "100",
               "--data.test_size", "100", "--max-steps", "4", "--batch-size", "16", "--eval.max_sentences", "20")
# the `fast` preset's structure (packed streams, regional compile, reduce-overhead, bf16) at a tiny size, compiled
# by Inductor on the CPU: a recompile after warm-up or a graph break fails `quality`
TRAIN_SMOKE = ("--preset", "fast", "--run.device", "cpu", "--run.compile", "true", "--model.d_model", "64",
               "--model.n_heads", "4", "--model.d_ff", "128", "--model.enc_layers", "2", "--model.dec_layers", "2",
               "--data.dataset", "toy", "--data.toy_rows", "1200", "--data.valid_size", "40", "--data.test_size",
               "20", "--data.vocab_size", "500", "--data.max_tokens", "1024", "--data.num_workers", "0",
               "--run.epochs", "2", "--run.max_batches_per_epoch", "4", "--eval.max_sentences", "10",
               "--eval.batch_size", "16")


# a warm rerun of the job: setup, warm compile, a few steps, its test (today's 18 s evaluation, 14 s setup)
WARM_RERUN_S = 60
SOURCE_MAX = 16 * 2**20  # a source file code_hash reads (the largest in the tree is ~40 KB)


def code_hash(packet: Packet, root: Path = ROOT) -> str:
    """sha256 (16 hex digits) of the names and contents of every .py / .sh file under a packet's scope: it
    walks the tree (no .git on the device copy), skipping caches."""
    h = hashlib.sha256()
    files: list[Path] = []
    for entry in packet.scope:
        p = root / entry
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in p.rglob("*") if f.suffix in (".py", ".sh") and f.is_file()
                      and "__pycache__" not in f.parts]
    from data.files import read_bytes

    for f in sorted(set(files), key=lambda f: f.relative_to(root).as_posix()):
        data = read_bytes(f, "source file", limit=SOURCE_MAX, inside=root)
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:16]


# -- plan --------------------------------------------------------------------------------------------------
def plan_lines() -> list[str]:
    """The plan as ``plan`` prints it (tests parse these lines)."""
    out = [f"gpu_run plan for one session of {SESSION_S} s of device time (H100 or H200 alike): every start "
           f"(~{STARTUP_S} s), call, idle wait ({IDLE_S} s) and the give-back count; no machine starts under "
           f"{MIN_START_S} s left.",
           "Each packet is one device call: setup, its steps (each under its own limit), the pack.", ""]
    for p in PACKETS:
        parts = [f"setup {SETUP_S}", *(f"{s.name} {s.limit}" for s in p.steps), f"pack {PACK_S}"]
        out.append(f"{p.name}: {p.command_s} s = {' + '.join(parts)}  -- {p.what}")
    p1, p2 = BY_NAME["packet1"], BY_NAME["packet2"]
    rerun = STARTUP_S + p1.command_s + p1.command_s + IDLE_S
    second = STARTUP_S + p1.command_s + p2.command_s + IDLE_S
    out += ["",
            f"session: start-up {STARTUP_S} + packet1 {p1.command_s} + packet1 again {p1.command_s} + idle {IDLE_S} "
            f"= {rerun} s of {SESSION_S}",
            f"session: start-up {STARTUP_S} + packet1 {p1.command_s} + packet2 {p2.command_s} + idle {IDLE_S} "
            f"= {second} s of {SESSION_S} (packet2 only when packet1 came back clean)",
            "",
            f"compile_warm_s: packet1 leaves {PACKET_MAX_S - p1.command_s} s of its {PACKET_MAX_S} s; a warm rerun of "
            f"the job needs ~{WARM_RERUN_S} s (setup, warm compile, steps, its test): "
            + ("it runs inside packet1" if PACKET_MAX_S - p1.command_s >= WARM_RERUN_S else
               "the compile-warm packet measures it (packet1 records compile_warm_s null)"),
            "",
            "A session: status first (can_start_another); run packet1 on landed main (`bash bench/gpu_run.sh "
            "packet1`, carry .whl and .data, timeout_s 360); if its summary shows a setup or step failure, fix "
            "and rerun it once; if it came back clean and >= "
            f"{p2.command_s + MIN_START_S // 4} s are left, run packet2 on the warm machine; then give_back. "
            "Later sessions: `python3 -m bench.packets next` names the packet to run."]
    return out


# -- records and `next` ---------------------------------------------------------------------------------------
# the one pattern of a name taken from a record or an archive into a path: never '..', '.', hidden or empty
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class PacketError(ValueError):
    """A record, archive or folder ``bench.packets`` refuses: one line naming it and the fix (exit 2)."""


def safe_name(value, what: str, where: str) -> str:
    """``value`` if it is a string matching `SAFE_NAME`; else `PacketError` naming it."""
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value):
        raise PacketError(f"{where}: {what} {json.dumps(value)[:80]} is not a name (letters, digits, '.', '_', '-', "
                          f"starting with a letter or digit): not a runbook's record; nothing was landed")
    return value


def record_problem(rec) -> str | None:
    """Why ``rec`` is not a packet record ``next`` can count (None: it is one)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not isinstance(rec.get("packet"), str) or not SAFE_NAME.fullmatch(rec["packet"]):
        return f"packet {json.dumps(rec.get('packet'))[:60]} is not a packet name"
    if rec.get("code") is not None and not isinstance(rec.get("code"), str):
        return f"code {json.dumps(rec.get('code'))[:60]} is not a hash"
    return None


def _check_records_file(path: Path) -> bool:
    """Does ``path`` exist (False: no records yet)? A folder, FIFO, device or link there is refused in one line."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
        raise PacketError(f"packet records {path} is {kind}: it must be the committed JSON-lines file (restore it "
                          f"with git checkout, or remove it to start the records afresh)")
    return True


def read_records(path: Path, warn: bool = True) -> list[dict]:
    """The landed packet records; a line that is not JSON stops here, naming it (the file is committed: fix it
    rather than guess); a record ``next`` cannot count is skipped with a warning line naming it."""
    from data.files import LOG_MAX, parse_json, read_text

    if not _check_records_file(path):
        return []
    out = []
    for n, line in enumerate(read_text(path, "packet records", limit=LOG_MAX, inside=path.parent).splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_json(line, f"{path}:{n}", "packet record")
        if not isinstance(rec, dict):
            raise PacketError(f"{path}:{n}: not a JSON object; fix or remove that line")
        problem = record_problem(rec)
        if problem:
            if warn:
                print(f"bench.packets: {path}:{n}: skipped: {problem}; fix or remove that line", file=sys.stderr)
            continue
        out.append(rec)
    return out


def next_packet(records: list[dict], root: Path = ROOT) -> Packet | None:
    """The first packet with no complete landed record for the code it measures now."""
    done = {(r.get("packet"), r.get("code")) for r in records if r.get("complete") and not record_problem(r)}
    return next((p for p in PACKETS if (p.name, code_hash(p, root)) not in done), None)


def next_line(records: Path, root: Path = ROOT) -> str:
    nxt = next_packet(read_records(records), root)
    if nxt is None:
        return "every packet has a landed result for the current code"
    return f"{nxt.name}: {nxt.what} ({nxt.command_s} s; code {code_hash(nxt, root)})"


def last_run(records: list[dict], packet: str, root: Path = ROOT, prefix: str = "default") -> Path | None:
    """The training run folder (``runs/<prefix>-*/`` with a metrics.jsonl) of ``packet``'s newest landed record,
    its ``results`` checked to be a folder right below bench/results/ (a record is never trusted with a path)."""
    results = root / "bench" / "results"
    for rec in reversed(records):
        where = rec.get("results")
        if rec.get("packet") != packet or not isinstance(where, str):
            continue
        parts = where.split("/")
        if parts[:2] != ["bench", "results"] or len(parts) != 3 or not SAFE_NAME.fullmatch(parts[2]):
            continue
        folder = results / parts[2]
        if folder.is_symlink() or not folder.is_dir():
            continue
        runs = sorted(m.parent for m in (folder / "runs").glob(f"{prefix}-*/metrics.jsonl")
                      if not m.parent.is_symlink() and not m.is_symlink() and m.is_file())
        if runs:
            return runs[-1]


# -- what comes back from a device call ----------------------------------------------------------------------
OUT_MAX_FILES = 8
OUT_MAX_FILE_BYTES = 16 * 1024 * 1024
OUT_MAX_TOTAL_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_out(folder: Path) -> list[str]:
    """What in ``folder`` would not come back from a device call (the device tool's limits)."""
    if not folder.exists():
        return ["does not exist (nothing would come back: OUT must be a folder the runbook can write)"]
    if not folder.is_dir():
        return ["is not a folder (nothing would come back: OUT must be a folder the runbook can write)"]
    problems, files = [], []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(not _NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_', '-'")
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{rel}: not a plain file or folder")
        elif path.is_file():
            files.append(path)
            if len(rel.parts) > 3:
                problems.append(f"{rel}: more than 2 folders down")
            if path.stat().st_size > OUT_MAX_FILE_BYTES:
                problems.append(f"{rel}: {path.stat().st_size} bytes, over {OUT_MAX_FILE_BYTES}")
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files, over {OUT_MAX_FILES}")
    total = sum(f.stat().st_size for f in files)
    if total > OUT_MAX_TOTAL_BYTES:
        problems.append(f"{total} bytes in all, over {OUT_MAX_TOTAL_BYTES}")
    return problems


def pack_results(work: Path, logdir: Path, started: float, dest: Path) -> tuple[int, list[str]]:
    """``dest/results.tgz`` of what a runbook's run wrote under ``work`` (the files under bench/results/ newer than
    ``started``, its logs ``logdir``, runs/*/metrics.jsonl, provenance.json and *.png newer than ``started``), at
    most MAX_TGZ_BYTES: past it files over BIG_FILE_BYTES are left out, then all but records and logs. Written
    whole or not at all (``.tmp``, then renamed). Returns its size and what was left out; OSError if unwritable."""
    def ours(p: Path, newer: bool = True) -> bool:
        return p.is_file() and not p.is_symlink() and (not newer or p.stat().st_mtime > started)
    names = {p for p in (work / "bench" / "results").rglob("*") if ours(p)}
    names |= {p for p in logdir.rglob("*") if ours(p, newer=False)}
    names |= {p for p in (work / "runs").glob("*/*") if p.parent.name != "gpu_run" and ours(p) and
              (p.name in ("metrics.jsonl", "provenance.json") or p.suffix == ".png")}
    files, notes, tmp = sorted(p.relative_to(work).as_posix() for p in names), [], dest / "results.tgz.tmp"

    def tar(chosen: list[str]) -> int:
        with tarfile.open(tmp, "w:gz", compresslevel=6) as out:
            for f in chosen:
                try:
                    out.add(work / f, arcname=f, recursive=False)
                except FileNotFoundError:  # gone since it was listed
                    notes.append(f"tar: {f}: vanished before it was packed")
        return tmp.stat().st_size
    size = tar(files)
    if size > MAX_TGZ_BYTES:
        big = [f for f in files if (work / f).stat().st_size > BIG_FILE_BYTES]
        notes += [f"left out of results.tgz (over {BIG_FILE_BYTES >> 20} MiB): {f}" for f in big]
        size = tar([f for f in files if f not in big])
    if size > MAX_TGZ_BYTES:  # still too big: the records and the summary, nothing else
        notes.append(f"results.tgz kept only records and logs: {size} bytes was over {MAX_TGZ_BYTES}")
        size = tar([f for f in files if f.endswith((".md", ".json", ".jsonl", ".csv", "summary.txt", ".xml"))])
    os.replace(tmp, dest / "results.tgz")
    return size, notes


# -- a packet's record --------------------------------------------------------------------------------------------
def ran_to_the_end(status: str) -> bool:
    """A step that passed or failed ran to its end; one timed out, skipped or stopped leaves it incomplete."""
    return status == "ok" or status.startswith("FAILED")


# the numbers every training packet's record carries (``numbers``), None where the run did not record one: the
# step (issue 42 item 4) and the wall split, cold and warm (issue 43 item 6)
NUMBER_KEYS = ("step_ms", "host_ms_per_step", "mfu", "gpu_busy", "graphs_per_step",
               "setup_s", "compile_s", "train_s", "eval_s", "checkpoint_s", "compile_warm_s")


def make_record(packet: str, steps: list[dict], *, quality: Path | None = None, outcomes: Path | None = None,
                caches: str = "", root: Path = ROOT, cold_run: Path | None = None, warm_run: Path | None = None,
                sha: str | None = None) -> dict:
    """What a packet showed, for ``bench/results/packets.jsonl``: ``quality`` is bench.quality's json,
    ``outcomes`` bench.pytest_stop's file, ``cold_run``/``warm_run`` the compile-warm packet's two runs."""
    from bench.pytest_stop import count

    facts: dict = {}
    try:
        import torch
        import triton

        facts = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    except Exception as e:  # noqa: BLE001 - the record says what it could not read
        facts = {"gpu": "unknown", "versions_error": repr(e)[:200]}
    from bench.harness import _nvidia_driver, gpu_slug

    rec = {"packet": packet, "code": code_hash(BY_NAME[packet], root) if packet in BY_NAME else None,
           "complete": bool(steps) and all(ran_to_the_end(str(s.get("status"))) for s in steps),
           "clean": bool(steps) and all(s.get("status") == "ok" for s in steps),
           "steps": steps, "date": time.strftime("%Y-%m-%d"), **facts, "gpu_slug": gpu_slug(facts.get("gpu") or "gpu"),
           "driver": _nvidia_driver() if facts.get("gpu") not in (None, "cpu", "unknown") else None,
           "sha": sha or os.environ.get("FASTMT_GIT_SHA") or "unknown", "caches": caches or None}
    numbers: dict | None = None
    if quality is not None and quality.is_file():
        from data.files import read_json

        numbers = read_json(quality, "quality record")
        if not isinstance(numbers, dict):
            raise PacketError(f"quality record {quality}: not a JSON object")
    if cold_run is not None or warm_run is not None:
        from bench.quality import done_split

        numbers = numbers or {}
        if cold_run is not None:
            numbers.update({k: v for k, v in done_split(cold_run).items() if v is not None})
        if warm_run is not None:
            numbers["compile_warm_s"] = done_split(warm_run)["compile_s"]
            numbers["setup_warm_s"] = done_split(warm_run)["setup_s"]
    if numbers is not None or packet in ("packet1", "compile-warm"):
        rec["numbers"] = {**dict.fromkeys(NUMBER_KEYS), **(numbers or {})}
    if outcomes is not None:
        rec["kernel_tests"] = count(str(outcomes))
    return rec
