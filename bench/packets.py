"""The GPU runbook's command line, and the landing of a device call's results.

  python3 -m bench.packets run PACKET ...  run a packet (one device call) on the device machine: bench/runbook.py
                                           (= `bash bench/gpu_run.sh PACKET`; also run plan|next|show STEP [PACKET])
  python3 -m bench.packets plan            the session's arithmetic against its 900 s
  python3 -m bench.packets next            the first packet with no result for the current code
  python3 -m bench.packets hash PACKET     the hash of the code PACKET measures
  python3 -m bench.packets land DIR        a device call's results (results.tgz, summary.txt) into bench/results/
  python3 -m bench.packets check-out DIR   is DIR within what a device call brings back (8 files, 16 MiB each)
  python3 -m bench.packets last-run PACKET the run folder of PACKET's newest landed record (packet 2's compare)

The packets' table, their records and ``next`` are bench/packet_table.py's.

``land`` trusts nothing it reads: the names a record puts in a path (``date``, ``gpu_slug``, ``sha``,
``packet``) match one pattern (``SAFE_NAME``), every destination is checked to lie inside bench/results/, the
archive is read through the checked reader (``data.files.open_read``: no link followed, a regular file, its size
capped) with caps on its members (count, each, in all), regular files only, and ``summary.txt`` is never read
through a link. Anything else is one line and exit 2, before anything lands.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

from bench import packet_table as T

# the names this module always offered (bench/aot.py, the tests)
BY_NAME, check_out, code_hash, kernel_test_files = T.BY_NAME, T.check_out, T.code_hash, T.kernel_test_files

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
            raise T.PacketError(f"{self.where}: unpacks to more than {self.limit // 2**20} MiB: not a runbook's results "
                              f"(what it packs is at most 15 MiB compressed); nothing was landed")
        return data


def _member_path(m: tarfile.TarInfo, tgz: Path) -> tuple[str, ...] | None:
    """The member's path components (None for a folder entry); `T.PacketError` for anything but a regular file
    at a relative path of safe names."""
    kind = ("a folder" if m.isdir() else "a symbolic link" if m.issym() else "a hard link" if m.islnk() else
            "a device" if m.ischr() or m.isblk() else "a FIFO" if m.isfifo() else "a sparse file" if m.issparse()
            else None if m.isreg() else f"of type {m.type!r}")
    name = m.name.removesuffix("/") if m.isdir() else m.name
    parts = tuple(name.split("/"))
    if name.startswith("/") or not all(T.SAFE_NAME.fullmatch(x) for x in parts) or len(parts) > MEMBER_DEPTH + 1:
        raise T.PacketError(f"{tgz}: member {m.name[:100]!r} is not a relative path of names (letters, digits, '.', "
                          f"'_', '-'; no '..', no absolute path, at most {MEMBER_DEPTH} folders down): not a "
                          f"runbook's results; nothing was landed")
    if kind == "a folder":
        return None
    if kind is not None:
        raise T.PacketError(f"{tgz}: member {m.name[:100]!r} is {kind}: a runbook's results hold regular files only; "
                          f"nothing was landed")
    if m.size > MEMBER_MAX:
        raise T.PacketError(f"{tgz}: member {m.name[:100]!r} is {m.size:,} bytes unpacked, over {MEMBER_MAX // 2**20} "
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
                raise T.PacketError(f"{tgz}: not a gzip archive (the runbook packs results.tgz with tar -czf): give the "
                                  f"folder a device call's files are at")
            f.seek(0)
            with gzip.GzipFile(fileobj=f, mode="rb") as gz, \
                    tarfile.open(fileobj=_Capped(gz, UNPACKED_MAX + 2**20, where), mode="r|") as tar:
                total = 0
                for m in tar:
                    if len(names) >= MEMBERS_MAX:
                        raise T.PacketError(f"{tgz}: more than {MEMBERS_MAX} members: not a runbook's results; "
                                          f"nothing was landed")
                    parts = _member_path(m, tgz)
                    if parts is None:
                        continue
                    total += m.size
                    if total > UNPACKED_MAX:
                        raise T.PacketError(f"{tgz}: its members unpack to more than {UNPACKED_MAX // 2**20} MiB: not a "
                                          f"runbook's results; nothing was landed")
                    folder = stage
                    for part in parts[:-1]:
                        folder = folder / part
                        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                            raise T.PacketError(f"{tgz}: member {m.name[:100]!r} goes below a file of the archive; "
                                              f"nothing was landed")
                        folder.mkdir(exist_ok=True)
                    src = tar.extractfile(m)
                    try:
                        fd = os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                    except FileExistsError:
                        raise T.PacketError(f"{tgz}: member {m.name[:100]!r} is in the archive twice; nothing was "
                                          f"landed") from None
                    with os.fdopen(fd, "wb") as out:
                        left = m.size
                        while left > 0:
                            chunk = src.read(min(left, 2**20))
                            if not chunk:
                                raise T.PacketError(f"{tgz}: member {m.name[:100]!r} is cut short: a truncated "
                                                  f"archive; nothing was landed")
                            out.write(chunk)
                            left -= len(chunk)
                    names.append("/".join(parts))
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise T.PacketError(f"{tgz}: not a readable tar.gz ({type(e).__name__}: {' '.join(str(e).split())[:120]}): a "
                          f"truncated or foreign archive; land the device call's results.tgz as it came back"
                          ) from None
    return names


def land(call_dir: Path, root: Path = T.ROOT, records: Path | None = None) -> Path:
    """Unpack a device call's ``results.tgz`` (and ``summary.txt``) into ``bench/results/gpu-<date>-<gpu>-<sha>-
    <packet>/`` and append its packet records (``packet-record.json`` files in it) to ``bench/results/packets.jsonl``.
    Returns the folder. Nothing outside ``bench/results/`` is written; an existing folder is never overwritten;
    anything refused (see the module's docstring) is refused before anything lands."""
    from data.files import append_text, check_inside, open_read, parse_json, read_text, umask

    tgz = call_dir / "results.tgz"
    if not call_dir.is_dir():
        raise T.PacketError(f"{call_dir}: not a folder: give the folder a device call's files are at")
    if not os.path.lexists(tgz):
        raise T.PacketError(f"{tgz}: no results.tgz in {call_dir} (give the folder the device call's files are at)")
    results = root / "bench" / "results"
    if results.is_symlink() or not results.is_dir():
        raise T.PacketError(f"{results}: not the repository's own folder (missing, or a symbolic link): results land "
                          f"only in a real bench/results/")
    rec_path = records or (root / T.RECORDS)
    T._check_records_file(rec_path)  # a folder or FIFO there is refused before anything lands
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
            problem = T.record_problem(rec)
            if problem:
                raise T.PacketError(f"{tgz}: {name}: {problem}: not a runbook's record; nothing was landed")
            for key in ("date", "gpu_slug", "sha"):
                if key in rec and rec[key] is not None:
                    T.safe_name(rec[key], key, f"{tgz}: {name}")
            recs.append(rec)
        head = recs[0] if recs else {}
        slug = "-".join(("gpu", head.get("date") or time.strftime("%Y-%m-%d"), head.get("gpu_slug") or "gpu",
                         (head.get("sha") or "unknown")[:7], head.get("packet", "steps")))
        T.safe_name(slug, "folder name", str(tgz))
        dest = check_inside(results, results / slug, "land results in")
        if os.path.lexists(dest):
            raise T.PacketError(f"{dest} exists: land each call once (remove it first to land again)")
        if summary_bytes is not None:
            if os.path.lexists(stage / "summary.txt"):
                raise T.PacketError(f"{tgz}: holds a summary.txt of its own beside {summary}; nothing was landed")
            fd = os.open(stage / "summary.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(summary_bytes)
        os.chmod(stage, 0o755 & ~umask())
        os.rename(stage, dest)  # one step: the folder is there whole, or not at all
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for r in recs:
        append_text(rec_path, json.dumps({**r, "results": dest.relative_to(root).as_posix()}, sort_keys=True) + "\n",
                    "packet records")
    return dest


# -- command line -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # the runbook parses its own words (packets, steps, show, plan, next)
        from bench.runbook import main as run

        return run(argv[1:])
    p = argparse.ArgumentParser(prog="python3 -m bench.packets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run", help="run a packet or step on the device machine (run --help)")
    sub.add_parser("plan")
    nx = sub.add_parser("next")
    nx.add_argument("--records", type=Path, default=T.ROOT / T.RECORDS)
    hs = sub.add_parser("hash")
    hs.add_argument("packet", choices=sorted(BY_NAME))
    ld = sub.add_parser("land")
    ld.add_argument("dir", type=Path)
    co = sub.add_parser("check-out")
    co.add_argument("dir", type=Path)
    lr = sub.add_parser("last-run")
    lr.add_argument("packet")
    lr.add_argument("--records", type=Path, default=T.ROOT / T.RECORDS)
    a = p.parse_args(argv)
    try:
        return _run(a)
    except (OSError, ValueError) as e:  # a damaged record or file: one line naming it (data.files' errors do)
        print(f"bench.packets {a.cmd}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.cmd == "plan":
        print("\n".join(T.plan_lines()))
    elif a.cmd == "hash":
        print(code_hash(BY_NAME[a.packet]))
    elif a.cmd == "next":
        print(T.next_line(a.records))
    elif a.cmd == "land":
        print(land(a.dir, root=T.ROOT))
    elif a.cmd == "last-run":
        run = T.last_run(T.read_records(a.records, warn=False), a.packet)
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
