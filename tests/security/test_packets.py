"""`python -m bench.packets land` and the GPU runbook's OUT, tried as a hostile archive or a careless user would
(issue 45 classes 1 and 6): nothing lands outside bench/results/, names from a record are checked against one
pattern, the archive is read with member caps and regular files only, no link is followed, a damaged archive or
records file is one line (exit 2) and nothing lands; an OUT the runbook cannot write is refused before any step."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench import packets as P

ROOT = Path(__file__).resolve().parents[2]
RECORD = {"packet": "packet1", "code": "c0ffee", "complete": True, "date": "2026-11-27", "gpu_slug": "h200",
          "sha": "abcdef1234"}


def _tgz(path: Path, members: list[tuple[str, bytes | str] | tarfile.TarInfo]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m)
                continue
            name, data = m
            data = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _call(tmp_path: Path, members=None, record: dict | None = None, summary: str | None = "summary") -> Path:
    call = tmp_path / "device" / "7"
    call.mkdir(parents=True)
    members = members if members is not None else [
        ("bench/results/packet-record.json", json.dumps(record or RECORD)), ("bench/results/quality-h200.md", "# q")]
    _tgz(call / "results.tgz", members)
    if summary is not None:
        (call / "summary.txt").write_text(summary)
    return call


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    return root


def _tree(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*")}


def _refused(tmp_path: Path, call: Path, root: Path, *words: str) -> str:
    """``land(call)`` into ``root``: refused (a ValueError: the command's one line and exit 2) naming each of
    ``words``, nothing new anywhere under tmp_path."""
    before = _tree(tmp_path)
    with pytest.raises(ValueError) as e:
        P.land(call, root=root)
    err = str(e.value)
    assert "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    assert _tree(tmp_path) == before, sorted(_tree(tmp_path) - before)  # nothing landed, nothing left behind
    return err


def _cli_land(tmp_path: Path, call: Path) -> subprocess.CompletedProcess:
    """``python -m bench.packets land CALL`` from a copy of bench/ (its bench/results/ is the copy's)."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "bench", root / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    (root / "bench" / "results").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # data/ from the checkout, bench/ from the copy (the cwd)
    return subprocess.run([sys.executable, "-m", "bench.packets", "land", str(call)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------------------------
# names from the record
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value", [("date", "../../../outside"), ("date", "2026/../../x"),
                                        ("packet", "../../outside"), ("gpu_slug", "../x"), ("sha", "/tmp/abs"),
                                        ("date", ".."), ("date", "a b"), ("date", 7), ("packet", ["a"]),
                                        ("packet", {"x": 1}), ("code", ["h"])])
def test_a_record_whose_names_would_leave_bench_results_is_refused_before_anything_lands(tmp_path, key,
                                                                                            value):
    root = _repo(tmp_path)
    call = _call(tmp_path, record={**RECORD, key: value})
    _refused(tmp_path, call, root, str(call / "results.tgz"))
    assert not (root / "bench/results/packets.jsonl").exists()


def test_a_landed_record_with_a_list_as_packet_is_skipped_by_next_with_a_warning(tmp_path, capsys):
    records = tmp_path / "packets.jsonl"
    p1 = {"packet": "packet1", "code": P.code_hash(P.BY_NAME["packet1"]), "complete": True}
    records.write_text(json.dumps({"packet": ["a"], "complete": True}) + "\n" + json.dumps(p1) + "\n")
    assert P.main(["next", "--records", str(records)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("packet2"), out  # the good record still counts
    assert err.count("\n") == 1 and f"{records}:1" in err and "skipped" in err, err


# ----------------------------------------------------------------------------------------------
# the archive: regular files, relative safe paths, caps; a damaged one is one line
# ----------------------------------------------------------------------------------------------
def _info(name: str, kind: bytes, **kw) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize("member, word", [
    (("../escape.txt", "x"), "../escape.txt"),
    (("/tmp/abs.txt", "x"), "/tmp/abs.txt"),
    (("bench/../../escape.txt", "x"), "escape.txt"),
    (_info("bench/results/link", tarfile.SYMTYPE, linkname="/etc/passwd"), "symbolic link"),
    (_info("bench/results/hard", tarfile.LNKTYPE, linkname="bench/results/quality-h200.md"), "hard link"),
    (_info("bench/results/dev", tarfile.CHRTYPE, devmajor=1, devminor=5), "device"),
    (_info("bench/results/fifo", tarfile.FIFOTYPE), "FIFO"),
])
def test_an_archive_member_that_is_not_a_plain_relative_file_is_refused(tmp_path, member, word):
    root = _repo(tmp_path)
    call = _call(tmp_path, [("bench/results/packet-record.json", json.dumps(RECORD)), member])
    _refused(tmp_path, call, root, word)
    assert not (tmp_path / "escape.txt").exists()


@pytest.mark.parametrize("cap, value, word", [("MEMBER_MAX", 800, "bytes unpacked"),
                                              ("UNPACKED_MAX", 1500, "unpack to more than"),
                                              ("MEMBERS_MAX", 3, "more than 3 members")])
def test_an_archive_over_its_caps_is_refused(tmp_path, monkeypatch, cap, value, word):
    monkeypatch.setattr(P, cap, value)
    root = _repo(tmp_path)
    call = _call(tmp_path, [("bench/results/packet-record.json", json.dumps(RECORD)),
                            *((f"bench/results/f{i}.log", "z" * 900) for i in range(4))])
    _refused(tmp_path, call, root, word)


def test_a_bomb_stops_at_the_unpacked_cap_whatever_its_headers_say(tmp_path, monkeypatch):
    """A member whose header says 100 bytes followed by megabytes of padding-like garbage, and a pax header of
    2 MiB: the unpacked stream is capped, not the headers' word."""
    monkeypatch.setattr(P, "UNPACKED_MAX", 1000)
    root = _repo(tmp_path)
    call = tmp_path / "device" / "7"
    call.mkdir(parents=True)
    with tarfile.open(call / "results.tgz", "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("bench/results/a.txt")
        info.pax_headers = {"comment": "x" * (2 * 2**20)}
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    _refused(tmp_path, call, root, "unpacks to more than")


@pytest.mark.parametrize("content", [b"not a tar at all", b"\x1f\x8b\x08\x00garbage", "truncated", "plain-tar", b""])
def test_a_damaged_or_foreign_archive_is_one_line(tmp_path, content):
    root = _repo(tmp_path)
    call = _call(tmp_path)
    tgz = call / "results.tgz"
    if content == "truncated":
        tgz.write_bytes(tgz.read_bytes()[: len(tgz.read_bytes()) // 2])
    elif content == "plain-tar":
        with tarfile.open(tgz, "w") as tar:
            tar.addfile(tarfile.TarInfo("x"), io.BytesIO(b""))
    else:
        tgz.write_bytes(content)
    _refused(tmp_path, call, root, str(tgz))


# ----------------------------------------------------------------------------------------------
# links: never followed
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["summary.txt", "results.tgz"])
def test_a_link_in_the_calls_folder_is_never_followed(tmp_path, which):
    root = _repo(tmp_path)
    secret = tmp_path / "private.txt"
    secret.write_text("PRIVATE KEY MATERIAL")
    call = _call(tmp_path)
    target = call / which
    if which == "results.tgz":
        real = tmp_path / "elsewhere.tgz"
        target.rename(real)
        target.symlink_to(real)
    else:
        target.unlink()
        target.symlink_to(secret)
    _refused(tmp_path, call, root, "symbolic link")
    assert not any("PRIVATE KEY" in p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_bench_results_as_a_link_is_refused(tmp_path):
    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "bench" / "results").symlink_to(elsewhere)
    _refused(tmp_path, _call(tmp_path), root, "symbolic link")
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_fifo_or_a_folder_as_the_records_file_is_one_line(tmp_path, capsys, kind):
    records = tmp_path / "packets.jsonl"
    os.mkfifo(records) if kind == "fifo" else records.mkdir()
    assert P.main(["next", "--records", str(records)]) == 2  # not "no records"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(records) in err and ("FIFO" if kind == "fifo" else "folder") in err, err
    root = _repo(tmp_path)
    rec = root / "bench/results/packets.jsonl"
    os.mkfifo(rec) if kind == "fifo" else rec.mkdir()
    _refused(tmp_path, _call(tmp_path), root, "packets.jsonl")


@pytest.mark.parametrize("kind", ["not-a-tar", "date-outside"])
def test_the_command_refuses_in_one_line_with_exit_2(tmp_path, kind):
    call = _call(tmp_path, record={**RECORD, "date": "../../../../outside"} if kind == "date-outside" else None)
    if kind == "not-a-tar":
        (call / "results.tgz").write_bytes(b"<html>502 Bad Gateway</html>")
    r = _cli_land(tmp_path, call)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert str(call / "results.tgz") in r.stderr
    assert not (tmp_path / "outside").exists() and not list(tmp_path.glob("**/outside"))
    assert {p.name for p in (tmp_path / "repo/bench/results").iterdir()} == set()


def test_a_good_call_still_lands_with_its_summary_and_record(tmp_path):
    root = _repo(tmp_path)
    call = _call(tmp_path)
    P.land(call, root=root)
    dest = root / "bench/results/gpu-2026-11-27-h200-abcdef1-packet1"
    assert (dest / "summary.txt").read_text() == "summary"
    assert (dest / "bench/results/quality-h200.md").read_text() == "# q"
    assert not [p for p in (root / "bench/results").iterdir() if p.name.startswith(".landing")]
    [line] = (root / "bench/results/packets.jsonl").read_text().splitlines()
    assert json.loads(line)["results"] == "bench/results/gpu-2026-11-27-h200-abcdef1-packet1"


# ----------------------------------------------------------------------------------------------
# the runbook's OUT (class 6)
# ----------------------------------------------------------------------------------------------
def _runbook(tmp_path: Path, out: Path) -> tuple[int, str, str]:
    """The runbook's quality step (``python -m bench.packets run quality``) in a fake checkout, OUT=``out``."""
    from tests.bench.test_gpu_run import fake_repo, runbook

    repo, env = fake_repo(tmp_path, "ok")
    return runbook("quality", root=repo, **(env | {"OUT": str(out)}))


@pytest.mark.parametrize("kind", ["file", "dangling-link", "under-a-file", "read-only"])
def test_an_unusable_out_is_refused_before_any_step(tmp_path, tmpfs, kind):
    if kind == "file":
        out = tmp_path / "out"
        out.write_text("a file")
    elif kind == "dangling-link":
        out = tmp_path / "out"
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "under-a-file":
        (tmp_path / "f").write_text("a file")
        out = tmp_path / "f" / "out"
    else:
        fs = tmpfs("64k", "ro")
        fs.read_only()
        out = fs.path
    rc, stdout, stderr = _runbook(tmp_path, out)
    assert rc == 2, stdout[-2000:] + stderr[-2000:]
    assert stderr.count("\n") == 1 and f"OUT={out}" in stderr, stderr
    assert "START" not in stdout and "packed" not in stdout  # no step ran, nothing claims to be packed
    assert not (tmp_path / "fake.log").exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_check_out_of_a_missing_folder_or_a_file_fails_in_one_line(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("x")
    r = subprocess.run([sys.executable, "-m", "bench.packets", "check-out", str(target)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and (r.stdout + r.stderr).count("\n") == 1 and str(target) in r.stdout, r
