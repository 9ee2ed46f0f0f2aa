"""The GPU runbook's packets: what a session lent a GPU runs, in what order, and what each has already shown.

A session that is lent a GPU has 15 minutes of device time in all (every start, call, idle wait and the
give-back count), at most 10 minutes a call, and no machine starts with under 4 minutes left. So the runbook
is cut into *packets*: one device call each, each at most 5 minutes of command time and useful on its own.

- ``packet1`` is the first call of every session: `make train`'s job truly cold (empty Triton and Inductor
  caches) ending by itself with its test and plot, its time-to-BLEU record, then the kernel tests on the
  device (the training path's kernels first). Start-up + packet 1 + a rerun of packet 1 fit a session.
- ``packet2`` only when packet 1 came back clean: the Hugging Face baseline on the same split under the
  same wall budget, compared with packet 1's run.
- then the queue, in priority order; ``next`` names the first packet with no committed result for the
  code it measures (``bench/results/packets.jsonl``: one record per landed packet, with the hash of the
  files it exercises, ``code_hash``).

This module is the one table (``PACKETS``) that ``bench/gpu_run.sh`` runs, ``plan`` prints and the tests
check; stdlib only (the GPU image's python3 runs it before the carried wheels are installed).

  python3 -m bench.packets plan            the session's arithmetic against its 900 s
  python3 -m bench.packets next            the first packet with no result for the current code
  python3 -m bench.packets table           the packets' steps, limits and arguments, for gpu_run.sh
  python3 -m bench.packets hash PACKET     the hash of the code PACKET measures
  python3 -m bench.packets land DIR        a device call's results (results.tgz, summary.txt) into bench/results/
  python3 -m bench.packets check-out DIR   is DIR within what a device call brings back (8 files, 16 MiB each)
  python3 -m bench.packets last-run PACKET the run folder of PACKET's newest landed record (packet 2's compare)

``land`` trusts nothing it reads: the names a record puts in a path (``date``, ``gpu_slug``, ``sha``,
``packet``) match one pattern (``SAFE_NAME``), every destination is checked to lie inside bench/results/, the
archive is read through the checked reader (``data.files.open_read``: no link followed, a regular file, its size
capped) with caps on its members (count, each, in all), regular files only, and ``summary.txt`` is never read
through a link. Anything else is one line and exit 2, before anything lands.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = Path("bench/results/packets.jsonl")  # relative to the repository root

# the lease (the device tool's README, 2026-11-27): seconds of device time a session has in all; a fresh
# machine's start and the transfers (estimated: 30 s measured on an H200 that day, 1-2 min documented); the
# idle wait after a call before the machine goes back; the least time left under which no machine starts
SESSION_S = 900
STARTUP_S = 90
IDLE_S = 30
MIN_START_S = 240
PACKET_MAX_S = 300  # a packet's command time, at most (the 5 minutes)
SECOND_MAX_S = 240  # packet 2's
SETUP_S = 25  # carried wheels, data, device facts (~10 s measured on the H200)
PACK_S = 15  # the final pack and the check of what comes back

# `make train`'s step keeps this much of its limit for the final evaluation, the test split, the `done`
# record and the plot (the H200 run at a 145 s budget ended 13 s after it)
TRAIN_RESERVE_S = 35

KERNEL_SCOPE = ("kernels", "tests/kernels")

# the kernel-test step's files, in the order a training run meets their kernels (a step cut at its deadline has
# run the first ones): the packed attention of the `fast` preset (forward/backward, causal and cross), the fused
# LayerNorm(+residual)(+GELU) incl. mixed dtypes, the dispatcher, the padded tiling, then Lion (the default recipe
# is AdamW). Any other tests/kernels file runs after them unless it is CPU work (CPU_ONLY_KERNEL_TESTS: stubbed
# launches, the interpreter's emulation, sm_90 code generation checked on the CPU), which a GPU slot never pays.
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


# issue 42's batch sweep: per batch (tokens a step) two learning-rate / warm-up settings (the lr scaled ~sqrt of the
# batch from the `fast` preset's 5e-4 at 4k, the warm-up shortened as the steps get fewer). One packet per batch:
# two runs of 105 s (+15 s grace) fill a 255 s step; eight runs cannot share one 300 s packet (a cold compile alone
# took 52 s on the H200)
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

# a step named on its own (bash bench/gpu_run.sh STEP): its default limit
STEP_LIMITS = {"train": 175, "quality": 10, "aot": 5, "kernel-test": 250, "peers": 190, "compare": 10,
               "train-cold": 130, "train-warm": 100, "peers-eole": 200, "batch-sweep": 255,
               "bench-kernels": 255, "frontier": 255, "profile": 200, "ladder": 255, "sweep": 255,
               "kernel-test-slow": 255, "inference": 255}

# a warm rerun of the job: its setup, warm compile, a few steps and its final test (issue 43's goal is <= 8 s of
# overhead warm; 60 s is what fits today's 18 s evaluation and 14 s setup with room)
WARM_RERUN_S = 60


SOURCE_MAX = 16 * 2**20  # a source file code_hash reads (the largest in the tree is ~40 KB)


def code_hash(packet: Packet, root: Path = ROOT) -> str:
    """sha256 (16 hex digits) of the source files a packet measures: every .py / .sh file under its scope
    (paths relative to ``root``, sorted), names and contents. The same on the device copy (no .git there)
    and here: it walks the tree, skipping caches."""
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
# the one pattern of a name taken from a record or an archive into a path (a date, a GPU slug, a sha, a packet,
# each component of an archive member): letters, digits, '.', '_', '-', starting with a letter or digit (so
# never '..', '.', a hidden name or an empty one), at most 128 characters
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
    """The landed packet records (``bench/results/packets.jsonl``); a line that is not JSON stops here, naming it
    (the file is committed: fix it rather than guess); a record ``next`` cannot count (a ``packet`` that is not a
    name) is skipped with a warning line naming it."""
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
    return None


# -- what comes back from a device call ----------------------------------------------------------------------
OUT_MAX_FILES = 8
OUT_MAX_FILE_BYTES = 16 * 1024 * 1024
OUT_MAX_TOTAL_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_out(folder: Path) -> list[str]:
    """What in ``folder`` would not come back from a device call (the device tool's limits: at most 8 files,
    16 MiB each, 64 MiB together, no more than 2 folders down, names of letters, digits, '.', '_', '-').
    A missing ``folder``, or one that is not a folder, is a problem of its own (nothing would come back)."""
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


# -- landing a call's results ---------------------------------------------------------------------------------
# what an archive may hold: what the runbook packs is at most 15 MiB compressed of records, logs, metrics and plots
ARCHIVE_MAX = 64 * 2**20  # results.tgz itself (the device brings back 16 MiB a file)
MEMBERS_MAX = 1000  # members
MEMBER_MAX = 32 * 2**20  # one member, unpacked
UNPACKED_MAX = 128 * 2**20  # all members together, unpacked
MEMBER_DEPTH = 8  # folders down
SUMMARY_MAX = 16 * 2**20


class _Capped:
    """A reader of the unpacked tar stream that refuses to go past ``limit`` bytes (the headers, pax records and
    padding counted too: a bomb stops here, whatever its headers say)."""

    def __init__(self, raw, limit: int, where: str):
        self.raw, self.limit, self.where, self.seen = raw, limit, where, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(self.limit + 1 - self.seen if n is None or n < 0 else min(n, self.limit + 1 - self.seen))
        self.seen += len(data)
        if self.seen > self.limit:
            raise PacketError(f"{self.where}: unpacks to more than {self.limit // 2**20} MiB: not a runbook's results "
                              f"(what it packs is at most 15 MiB compressed); nothing was landed")
        return data


def _member_path(m: tarfile.TarInfo, tgz: Path) -> tuple[str, ...] | None:
    """The member's path components (None for a folder entry); `PacketError` for anything but a regular file
    at a relative path of safe names."""
    kind = ("a folder" if m.isdir() else "a symbolic link" if m.issym() else "a hard link" if m.islnk() else
            "a device" if m.ischr() or m.isblk() else "a FIFO" if m.isfifo() else "a sparse file" if m.issparse()
            else None if m.isreg() else f"of type {m.type!r}")
    name = m.name.removesuffix("/") if m.isdir() else m.name
    parts = tuple(name.split("/"))
    if name.startswith("/") or not all(SAFE_NAME.fullmatch(x) for x in parts) or len(parts) > MEMBER_DEPTH + 1:
        raise PacketError(f"{tgz}: member {m.name[:100]!r} is not a relative path of names (letters, digits, '.', "
                          f"'_', '-'; no '..', no absolute path, at most {MEMBER_DEPTH} folders down): not a "
                          f"runbook's results; nothing was landed")
    if kind == "a folder":
        return None
    if kind is not None:
        raise PacketError(f"{tgz}: member {m.name[:100]!r} is {kind}: a runbook's results hold regular files only; "
                          f"nothing was landed")
    if m.size > MEMBER_MAX:
        raise PacketError(f"{tgz}: member {m.name[:100]!r} is {m.size:,} bytes unpacked, over {MEMBER_MAX // 2**20} "
                          f"MiB: not a runbook's results; nothing was landed")
    return parts


def _unpack(tgz: Path, call_dir: Path, stage: Path) -> list[str]:
    """Unpack ``tgz`` (read through the checked reader) into the empty folder ``stage``: regular files only, each
    created anew (``O_EXCL | O_NOFOLLOW``) below it. Returns the members' paths."""
    from data.files import open_read

    where = str(tgz)
    names: list[str] = []
    try:
        with open_read(tgz, "results archive", limit=ARCHIVE_MAX, inside=call_dir) as f:
            if f.read(2) != b"\x1f\x8b":
                raise PacketError(f"{tgz}: not a gzip archive (the runbook packs results.tgz with tar -czf): give the "
                                  f"folder a device call's files are at")
            f.seek(0)
            with gzip.GzipFile(fileobj=f, mode="rb") as gz, \
                    tarfile.open(fileobj=_Capped(gz, UNPACKED_MAX + 2**20, where), mode="r|") as tar:
                total = 0
                for m in tar:
                    if len(names) >= MEMBERS_MAX:
                        raise PacketError(f"{tgz}: more than {MEMBERS_MAX} members: not a runbook's results; "
                                          f"nothing was landed")
                    parts = _member_path(m, tgz)
                    if parts is None:
                        continue
                    total += m.size
                    if total > UNPACKED_MAX:
                        raise PacketError(f"{tgz}: its members unpack to more than {UNPACKED_MAX // 2**20} MiB: not a "
                                          f"runbook's results; nothing was landed")
                    folder = stage
                    for part in parts[:-1]:
                        folder = folder / part
                        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                            raise PacketError(f"{tgz}: member {m.name[:100]!r} goes below a file of the archive; "
                                              f"nothing was landed")
                        folder.mkdir(exist_ok=True)
                    src = tar.extractfile(m)
                    try:
                        fd = os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                    except FileExistsError:
                        raise PacketError(f"{tgz}: member {m.name[:100]!r} is in the archive twice; nothing was "
                                          f"landed") from None
                    with os.fdopen(fd, "wb") as out:
                        left = m.size
                        while left > 0:
                            chunk = src.read(min(left, 2**20))
                            if not chunk:
                                raise PacketError(f"{tgz}: member {m.name[:100]!r} is cut short: a truncated "
                                                  f"archive; nothing was landed")
                            out.write(chunk)
                            left -= len(chunk)
                    names.append("/".join(parts))
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise PacketError(f"{tgz}: not a readable tar.gz ({type(e).__name__}: {' '.join(str(e).split())[:120]}): a "
                          f"truncated or foreign archive; land the device call's results.tgz as it came back"
                          ) from None
    return names


def land(call_dir: Path, root: Path = ROOT, records: Path | None = None) -> Path:
    """Unpack a device call's ``results.tgz`` (and ``summary.txt``) into ``bench/results/gpu-<date>-<gpu>-<sha>-
    <packet>/`` and append its packet records (``packet-record.json`` files in it) to ``bench/results/packets.jsonl``.
    Returns the folder. Nothing outside ``bench/results/`` is written; an existing folder is never overwritten;
    anything refused (see the module's docstring) is refused before anything lands."""
    from data.files import append_text, check_inside, open_read, parse_json, read_text

    tgz = call_dir / "results.tgz"
    if not call_dir.is_dir():
        raise PacketError(f"{call_dir}: not a folder: give the folder a device call's files are at")
    if not os.path.lexists(tgz):
        raise PacketError(f"{tgz}: no results.tgz in {call_dir} (give the folder the device call's files are at)")
    results = root / "bench" / "results"
    if results.is_symlink() or not results.is_dir():
        raise PacketError(f"{results}: not the repository's own folder (missing, or a symbolic link): results land "
                          f"only in a real bench/results/")
    rec_path = records or (root / RECORDS)
    _check_records_file(rec_path)  # a folder or FIFO there is refused before anything lands
    summary = call_dir / "summary.txt"
    summary_bytes = None
    if os.path.lexists(summary):  # never read through a link (the call's folder is the user's; its files are not)
        with open_read(summary, "summary", limit=SUMMARY_MAX, inside=call_dir) as f:
            summary_bytes = f.read(SUMMARY_MAX + 1)
    stage = Path(tempfile.mkdtemp(prefix=".landing-", dir=results))
    try:
        names = _unpack(tgz, call_dir, stage)
        recs = []
        for name in sorted(n for n in names if n.split("/")[-1] == "packet-record.json"):
            rec = parse_json(read_text(stage / name, "packet record", inside=stage), f"{tgz}: {name}", "packet record")
            problem = record_problem(rec)
            if problem:
                raise PacketError(f"{tgz}: {name}: {problem}: not a runbook's record; nothing was landed")
            for key in ("date", "gpu_slug", "sha"):
                if key in rec and rec[key] is not None:
                    safe_name(rec[key], key, f"{tgz}: {name}")
            recs.append(rec)
        head = recs[0] if recs else {}
        slug = "-".join(("gpu", head.get("date") or time.strftime("%Y-%m-%d"), head.get("gpu_slug") or "gpu",
                         (head.get("sha") or "unknown")[:7], head.get("packet", "steps")))
        safe_name(slug, "folder name", str(tgz))
        dest = check_inside(results, results / slug, "land results in")
        if os.path.lexists(dest):
            raise PacketError(f"{dest} exists: land each call once (remove it first to land again)")
        if summary_bytes is not None:
            if os.path.lexists(stage / "summary.txt"):
                raise PacketError(f"{tgz}: holds a summary.txt of its own beside {summary}; nothing was landed")
            fd = os.open(stage / "summary.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(summary_bytes)
        os.chmod(stage, 0o755 & ~_umask())
        os.rename(stage, dest)  # one step: the folder is there whole, or not at all
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for r in recs:
        append_text(rec_path, json.dumps({**r, "results": dest.relative_to(root).as_posix()}, sort_keys=True) + "\n",
                    "packet records")
    return dest


def _umask() -> int:
    from data.files import umask

    return umask()


# -- a packet's record ---------------------------------------------------------------------------------------------
def ran_to_the_end(status: str) -> bool:
    """A step that passed or failed ran to its end; one that timed out or was skipped leaves its packet
    incomplete (the statuses bench/gpu_run.sh writes: "ok", "FAILED (rc N)", "TIMEOUT after ...", "skipped ...")."""
    return status == "ok" or status.startswith("FAILED")


# the numbers every training packet's record carries (``numbers``), None where the run did not record one: the
# step (issue 42 item 4) and the wall split, cold and warm (issue 43 item 6)
NUMBER_KEYS = ("step_ms", "host_ms_per_step", "mfu", "gpu_busy", "graphs_per_step",
               "setup_s", "compile_s", "train_s", "eval_s", "checkpoint_s", "compile_warm_s")


def make_record(packet: str, steps: list[dict], *, quality: Path | None = None, outcomes: Path | None = None,
                caches: str = "", root: Path = ROOT, cold_run: Path | None = None, warm_run: Path | None = None
                ) -> dict:
    """What a packet showed, for ``bench/results/packets.jsonl``: the packet, the hash of the code it measured,
    whether every step ran to its end, each step's status and seconds, the device and versions, the git sha,
    the training run's numbers (``quality``: bench.quality's json) and the kernel tests' outcome counts
    (``outcomes``: bench.pytest_stop's file). ``cold_run``/``warm_run``: the compile-warm packet's two runs (their
    wall splits; ``compile_warm_s`` is the warm run's compile)."""
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
           "sha": os.environ.get("FASTMT_GIT_SHA") or "unknown", "caches": caches or None}
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


# -- command line -------------------------------------------------------------------------------------------------
def table_lines() -> list[str]:
    """``PACKET name setup pack`` and ``STEP packet step limit args...`` lines (args shell-quoted), then
    ``LIMIT step limit`` for steps named on their own: what bench/gpu_run.sh reads."""
    out = []
    for p in PACKETS:
        out.append(f"PACKET {p.name} {SETUP_S} {PACK_S} {p.command_s}")
        out += [f"STEP {p.name} {s.name} {s.limit} {shlex.join(s.args)}".rstrip() for s in p.steps]
    out += [f"LIMIT {k} {v}" for k, v in STEP_LIMITS.items()]
    out.append("KTEST " + " ".join(kernel_test_files()))
    out.append("KFIRST " + " ".join(KERNEL_TESTS_FIRST))
    out.append(f"RESERVE train {TRAIN_RESERVE_S}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.packets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan")
    sub.add_parser("table")
    nx = sub.add_parser("next")
    nx.add_argument("--records", type=Path, default=ROOT / RECORDS)
    hs = sub.add_parser("hash")
    hs.add_argument("packet", choices=sorted(BY_NAME))
    ld = sub.add_parser("land")
    ld.add_argument("dir", type=Path)
    co = sub.add_parser("check-out")
    co.add_argument("dir", type=Path)
    lr = sub.add_parser("last-run")
    lr.add_argument("packet")
    lr.add_argument("--records", type=Path, default=ROOT / RECORDS)
    rc = sub.add_parser("record")
    rc.add_argument("--packet", required=True)
    rc.add_argument("--step", action="append", default=[], metavar="NAME=STATUS=SECONDS")
    rc.add_argument("--quality", type=Path)
    rc.add_argument("--outcomes", type=Path)
    rc.add_argument("--caches", default="")
    rc.add_argument("--cold-run", type=Path)
    rc.add_argument("--warm-run", type=Path)
    rc.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        return _run(a)
    except (OSError, ValueError) as e:  # a damaged record or file: one line naming it (data.files' errors do)
        print(f"bench.packets {a.cmd}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "plan":
        print("\n".join(plan_lines()))
    elif a.cmd == "table":
        print("\n".join(table_lines()))
    elif a.cmd == "hash":
        print(code_hash(BY_NAME[a.packet]))
    elif a.cmd == "next":
        nxt = next_packet(read_records(a.records), ROOT)
        if nxt is None:
            print("every packet has a landed result for the current code")
        else:
            print(f"{nxt.name}: {nxt.what} ({nxt.command_s} s; code {code_hash(nxt)})")
    elif a.cmd == "record":
        steps = []
        for item in a.step:
            name, status, seconds = item.split("=", 2)
            steps.append({"name": name, "status": status.replace("_", " "), "seconds": int(seconds)})
        rec = make_record(a.packet, steps, quality=a.quality, outcomes=a.outcomes, caches=a.caches,
                          cold_run=a.cold_run, warm_run=a.warm_run)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
        print(f"packet record: {a.out} (complete {rec['complete']}, clean {rec['clean']})")
    elif a.cmd == "land":
        print(land(a.dir, root=ROOT))
    elif a.cmd == "last-run":
        run = last_run(read_records(a.records, warn=False), a.packet)
        if run is None:
            return 1
        print(run)
    elif a.cmd == "check-out":
        problems = check_out(a.dir)
        for line in problems:
            print(f"{a.dir}: {line}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
