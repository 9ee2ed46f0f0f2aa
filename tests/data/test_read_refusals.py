"""Issue 45: the one reader's refusals and the lines a hostile or merely unusual input gets.

- `data.files.open_read` never lets a raw ``OSError`` out (a folder of the path swapped for a file mid-read gave
  ``NotADirectoryError``/EINVAL tracebacks): one `ReadRefusedError` line, still an ``OSError`` with its errno;
  a missing file stays ``FileNotFoundError``.
- A byte-order mark opening any line of a JSON-lines file (files joined with ``cat``) is not a torn record.
- A cold build under a file-size limit (``ulimit -f`` / ``prlimit --fsize``): one line with exit 2, not the
  ``OSError: File too large`` traceback of a build worker.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from data import files as F
from data.sources import load_local
from tests.data.helpers import make_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]
BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("inside", [False, True], ids=["user-path", "inside-owned-folder"])
def test_a_file_where_a_folder_should_be_is_one_refusal_not_a_raw_os_error(tmp_path, inside):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where the folder was")
    path = tmp_path / "run" / "checkpoints" / "best.pt"
    with pytest.raises(F.ReadRefusedError) as e:
        F.open_read(path, "checkpoint", inside=tmp_path / "run" if inside else None)
    assert isinstance(e.value, F.FileRefusedError) and isinstance(e.value, OSError)
    assert e.value.errno == errno.ENOTDIR
    assert str(path) in str(e.value) and "\n" not in str(e.value) and "Errno" not in str(e.value)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTDIR, errno.EIO, errno.EACCES, errno.EMFILE])
def test_every_os_error_of_opening_is_its_own_refusal(tmp_path, monkeypatch, code):
    path = tmp_path / "record.json"
    path.write_text("{}")
    real = os.open

    def refuse(p, *a, **k):
        if os.fspath(p) in (str(path), path.name):
            raise OSError(code, os.strerror(code), os.fspath(p))
        return real(p, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    for inside in (None, tmp_path):
        with pytest.raises(F.ReadRefusedError) as e:
            F.read_json(path, "run record", inside=inside)
        assert e.value.errno == code and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_file_is_still_file_not_found(tmp_path):
    for inside in (None, tmp_path):
        with pytest.raises(FileNotFoundError):
            F.open_read(tmp_path / "gone.json", "run record", inside=inside)


def test_a_byte_order_mark_opening_any_line_of_json_lines_is_not_a_torn_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(BOM + b'{"step": 1}\n' + BOM + b'{"step": 2}\r\n{"step": 3}\n' + BOM + b"\n")
    got = [rec for _, rec in F.read_json_lines(path, "metrics file", inside=tmp_path)]
    assert got == [{"step": 1}, {"step": 2}, {"step": 3}, None]  # the last line: a mark alone is blank


def test_a_byte_order_mark_on_a_later_line_of_a_data_file_keeps_the_row(tmp_path):
    rows = make_rows(6)
    a, b = write_jsonl(tmp_path / "a.jsonl", rows[:3]), write_jsonl(tmp_path / "b.jsonl", rows[3:])
    joined = tmp_path / "joined.jsonl"  # `cat a b` of two files an editor saved with a mark
    joined.write_bytes(BOM + Path(a).read_bytes() + BOM + Path(b).read_bytes())
    raw = load_local((str(joined),), "en", "it")
    assert raw.translation == [r["translation"] for r in rows] and not any(raw.report.dropped.values())
    tsv = tmp_path / "joined.tsv"
    tsv.write_bytes(BOM + b"one\tuno\n" + BOM + b"two\tdue\n")
    assert load_local((str(tsv),), "en", "it").translation == [{"en": "one", "it": "uno"}, {"en": "two", "it": "due"}]


def test_a_cold_build_under_a_file_size_limit_is_one_line(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", make_rows(20000))
    assert os.path.getsize(data) > 4 * 600 * 1024  # the build's scratch files pass the limit below

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (600 * 1024, resource.RLIM_INFINITY))

    r = subprocess.run([sys.executable, "-m", "train.stats", "--preset", "tiny", "--data.data_files", data,
                        "--data.build_workers", "2", "--data.cache_dir", str(tmp_path / "cache")],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       preexec_fn=limit, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if "error:" in x]
    assert "file-size limit" in line and "614,400 bytes" in line and "ulimit -f" in line
    assert not [p for p in (tmp_path / "cache").rglob(".tmp-*")]  # the interrupted build left nothing behind


_PEAK = """
import resource, sys
def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
size = int(sys.argv[2])
from data.files import TEXTS_MAX, read_bytes
resource.setrlimit(resource.RLIMIT_AS, (vm() + size * 3 // 2 + (8 << 20),) * 2)  # room for 1.5x the file, not 2x
print(len(read_bytes(sys.argv[1], "test set", limit=TEXTS_MAX)))
"""


def test_read_bytes_holds_one_copy_of_the_file(tmp_path):
    """Issue 45 class 9: ``read_bytes`` needed twice the file (a growing buffer, then its copy); one buffer now."""
    path = tmp_path / "src.txt"
    size = 64 << 20
    path.write_bytes((b"the cat sleeps on the small blue book.\n" * (size // 39 + 1))[:size])
    r = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(size)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == str(size), r.stderr[-2000:]


def test_out_of_memory_in_a_decoding_command_is_one_line(capsys):
    import argparse

    from train.cli.decoding import run_command

    def run(_args):
        raise MemoryError

    code = run_command(run, argparse.Namespace(src="big.txt", ref=["ref.txt"], debug=False))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: out of memory")
    assert "big.txt, ref.txt" in err and "ulimit -v" in err
