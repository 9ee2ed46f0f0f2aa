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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
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
CPU_ONLY_KERNEL_TESTS = ("test_launch.py", "test_lowp_emulation.py", "test_lion_codegen.py",
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


PACKETS: tuple[Packet, ...] = (
    Packet("packet1", "make train cold to BLEU, its record, the kernel tests on the device (training path first)",
           (Step("train", 175), Step("quality", 10), Step("aot", 5), Step("kernel-test", 70)),
           (*TRAIN_SCOPE, "tests/kernels", "bench/quality.py")),
    Packet("packet2", "the Hugging Face baseline, same split, same wall budget as packet 1's training",
           (Step("peers", 190), Step("compare", 10)),
           ("data", "train/evaluation", "bench/peers.py", "bench/packets.py")),
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
               "bench-kernels": 255, "frontier": 255, "profile": 200, "ladder": 255, "sweep": 255,
               "kernel-test-slow": 255, "inference": 255}


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
            "A session: status first (can_start_another); run packet1 on landed main (`bash bench/gpu_run.sh "
            "packet1`, carry .whl and .data, timeout_s 360); if its summary shows a setup or step failure, fix "
            "and rerun it once; if it came back clean and >= "
            f"{p2.command_s + MIN_START_S // 4} s are left, run packet2 on the warm machine; then give_back. "
            "Later sessions: `python3 -m bench.packets next` names the packet to run."]
    return out


# -- records and `next` ---------------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict]:
    """The landed packet records (``bench/results/packets.jsonl``); a line that is not a JSON record stops here,
    naming it (the file is committed: fix it rather than guess)."""
    from data.files import LOG_MAX, parse_json, read_text

    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(read_text(path, "packet records", limit=LOG_MAX).splitlines(), 1):
        if not line.strip():
            continue
        rec = parse_json(line, f"{path}:{n}", "packet record")
        if not isinstance(rec, dict):
            raise SystemExit(f"{path}:{n}: not a JSON object; fix or remove that line")
        out.append(rec)
    return out


def next_packet(records: list[dict], root: Path = ROOT) -> Packet | None:
    """The first packet with no complete landed record for the code it measures now."""
    done = {(r.get("packet"), r.get("code")) for r in records if r.get("complete")}
    return next((p for p in PACKETS if (p.name, code_hash(p, root)) not in done), None)


# -- what comes back from a device call ----------------------------------------------------------------------
OUT_MAX_FILES = 8
OUT_MAX_FILE_BYTES = 16 * 1024 * 1024
OUT_MAX_TOTAL_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_out(folder: Path) -> list[str]:
    """What in ``folder`` would not come back from a device call (the device tool's limits: at most 8 files,
    16 MiB each, 64 MiB together, no more than 2 folders down, names of letters, digits, '.', '_', '-')."""
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
def _safe_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Regular files with relative paths that stay below the extraction folder (the archive is foreign)."""
    keep, skipped = [], []
    for m in tar.getmembers():
        parts = Path(m.name).parts
        if m.isfile() and parts and not Path(m.name).is_absolute() and ".." not in parts:
            keep.append(m)
        elif not m.isdir():
            skipped.append(m.name)
    if skipped:
        print(f"{tar.name}: left out {len(skipped)} member(s) that are not plain files below the folder: "
              f"{', '.join(map(repr, skipped[:5]))}", file=sys.stderr)
    return keep


def land(call_dir: Path, root: Path = ROOT, records: Path | None = None) -> Path:
    """Unpack a device call's ``results.tgz`` (and ``summary.txt``) into ``bench/results/gpu-<date>-<gpu>-<sha>-
    <packet>/`` and append its packet records (``packet-record.json`` files in it) to ``bench/results/packets.jsonl``.
    Returns the folder. Nothing outside ``bench/results/`` is written; an existing folder is never overwritten."""
    tgz = call_dir / "results.tgz"
    if not tgz.is_file():
        raise SystemExit(f"{tgz}: no results.tgz in {call_dir} (give the folder the device call's files are at)")
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tgz) as tar:
        tar.extractall(tmp, members=_safe_members(tar), filter="data")
        from data.files import read_json

        found = sorted(Path(tmp).rglob("packet-record.json"))
        recs = [read_json(p, "packet record", inside=tmp) for p in found]
        if any(not isinstance(r, dict) for r in recs):
            raise SystemExit(f"{tgz}: a packet-record.json in it is not a JSON object: not a runbook's results")
        head = recs[0] if recs else {}
        slug = "-".join(str(x) for x in ("gpu", head.get("date", time.strftime("%Y-%m-%d")), head.get("gpu_slug", "gpu"),
                                          str(head.get("sha", "unknown"))[:7], head.get("packet", "steps")))
        dest = root / "bench" / "results" / slug
        if dest.exists():
            raise SystemExit(f"{dest} exists: land each call once (remove it first to land again)")
        dest.mkdir(parents=True)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                target = dest / f.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
    if (call_dir / "summary.txt").is_file():
        shutil.copyfile(call_dir / "summary.txt", dest / "summary.txt")
    rec_path = records or (root / RECORDS)
    with open(rec_path, "a", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps({**r, "results": dest.relative_to(root).as_posix()}, sort_keys=True) + "\n")
    return dest


# -- a packet's record ---------------------------------------------------------------------------------------------
def ran_to_the_end(status: str) -> bool:
    """A step that passed or failed ran to its end; one that timed out or was skipped leaves its packet
    incomplete (the statuses bench/gpu_run.sh writes: "ok", "FAILED (rc N)", "TIMEOUT after ...", "skipped ...")."""
    return status == "ok" or status.startswith("FAILED")


def make_record(packet: str, steps: list[dict], *, quality: Path | None = None, outcomes: Path | None = None,
                caches: str = "", root: Path = ROOT) -> dict:
    """What a packet showed, for ``bench/results/packets.jsonl``: the packet, the hash of the code it measured,
    whether every step ran to its end, each step's status and seconds, the device and versions, the git sha,
    the training run's numbers (``quality``: bench.quality's json) and the kernel tests' outcome counts
    (``outcomes``: bench.pytest_stop's file)."""
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
    if quality is not None and quality.is_file():
        from data.files import read_json

        rec["numbers"] = read_json(quality, "quality record")
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
    rc = sub.add_parser("record")
    rc.add_argument("--packet", required=True)
    rc.add_argument("--step", action="append", default=[], metavar="NAME=STATUS=SECONDS")
    rc.add_argument("--quality", type=Path)
    rc.add_argument("--outcomes", type=Path)
    rc.add_argument("--caches", default="")
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
        nxt = next_packet(read_records(a.records))
        if nxt is None:
            print("every packet has a landed result for the current code")
        else:
            print(f"{nxt.name}: {nxt.what} ({nxt.command_s} s; code {code_hash(nxt)})")
    elif a.cmd == "record":
        steps = []
        for item in a.step:
            name, status, seconds = item.split("=", 2)
            steps.append({"name": name, "status": status.replace("_", " "), "seconds": int(seconds)})
        rec = make_record(a.packet, steps, quality=a.quality, outcomes=a.outcomes, caches=a.caches)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
        print(f"packet record: {a.out} (complete {rec['complete']}, clean {rec['clean']})")
    elif a.cmd == "land":
        print(land(a.dir))
    elif a.cmd == "check-out":
        problems = check_out(a.dir)
        for line in problems:
            print(f"{a.dir}: {line}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
