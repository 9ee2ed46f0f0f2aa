"""Decompression and size bombs (issue 35): what a file declares is bounded before anything is allocated. A checkpoint's
records must be stored, not compressed, and no larger than the file together; a parquet file declares at most one
row per byte (and a bounded inflation); a ``.npy`` header must describe exactly the bytes of its file; a damaged
shared-cache entry is healed (or, in a cache this process may not write, refused in one line), never a crash on
every later run; a stdin line to ``translate`` is capped."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from data import files as F
from tests.security.conftest import LEGACY_CKPT, capped


# ----------------------------------------------------------------------------------------------
# checkpoints: a DEFLATE-compressed record
# ----------------------------------------------------------------------------------------------
def _deflated(tmp_path: Path, inflated: int) -> Path:
    """The legacy checkpoint with its largest tensor record replaced by ``inflated`` zero bytes, DEFLATE-compressed
    (torch's reader inflates such a record whole before anything checks it)."""
    src = zipfile.ZipFile(LEGACY_CKPT)
    biggest = max((i for i in src.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    out = tmp_path / "bomb.pt"
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            if info.filename != biggest.filename:
                z.writestr(info.filename, src.read(info.filename), compress_type=zipfile.ZIP_STORED)
                continue
            with z.open(info.filename, "w", force_zip64=True) as w:  # streamed: the test never holds it either
                block = b"\0" * 2**24
                for _ in range(inflated // len(block)):
                    w.write(block)
    return out


_LOAD = """
import resource, sys
from train.runs.checkpoint import load_checkpoint
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
before = peak()
try:
    load_checkpoint(sys.argv[1])
except Exception as e:
    print("REFUSED", " ".join(str(e).split()))
print("PEAK_MB", peak() - before)
"""


def test_a_compressed_checkpoint_record_is_refused_before_it_inflates(tmp_path):
    bomb = _deflated(tmp_path, 512 * 2**20)
    assert bomb.stat().st_size < 2 * 2**20  # ~1 MB that inflates to 512 MB
    r = capped(["-c", _LOAD, str(bomb)])
    assert "REFUSED" in r.stdout and "is compressed" in r.stdout and str(bomb) in r.stdout, r.stdout + r.stderr[-2000:]
    grew = int(r.stdout.split("PEAK_MB")[1])
    assert grew < 256, f"the peak memory grew by {grew} MB while loading: the record was inflated before it was refused"


def test_translate_refuses_a_checkpoint_bomb_in_one_line(tmp_path):
    bomb = _deflated(tmp_path, 32 * 2**20)
    r = capped(["-m", "train.translate", "--ckpt", str(bomb), "--device", "cpu", "hello"])
    assert r.returncode == 2 and "compressed" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_records_larger_than_the_file_are_refused(tmp_path):
    from data.files import check_stored_zip

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a/data.pkl", b"x" * 100)
    raw = bytearray(buf.getvalue())
    # forge the central directory's uncompressed and compressed sizes of the record (stored): 2**31 each
    cd = raw.rindex(b"PK\x01\x02")
    raw[cd + 20:cd + 28] = (2**31).to_bytes(4, "little") * 2
    path = tmp_path / "forged.pt"
    path.write_bytes(bytes(raw))
    with open(path, "rb") as f, pytest.raises(F.BadFileError):
        check_stored_zip(f, path, "checkpoint")


# ----------------------------------------------------------------------------------------------
# parquet: millions of run-length-encoded rows in a few KB
# ----------------------------------------------------------------------------------------------
def test_a_parquet_file_declaring_more_rows_than_bytes_is_refused_before_reading(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from data.clean import DataInputError
    from data.sources import plan_chunks

    n = 2_000_000
    table = pa.table({"translation": pa.array([{"en": "a", "it": "b"}]).take(pa.array(np.zeros(n, np.int32)))})
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, path, compression="zstd", row_group_size=n)
    assert path.stat().st_size < 64 * 1024  # ~600 MB of Python rows in a few KB
    with pytest.raises(DataInputError, match="declares 2,000,000 rows") as e:
        plan_chunks((str(path),))
    assert str(path) in str(e.value)
    ok = tmp_path / "ok.parquet"  # an honest file still reads
    pq.write_table(pa.table({"translation": [{"en": f"row {i}", "it": f"riga {i}"} for i in range(500)]}), ok)
    plan_chunks((str(ok),))


# ----------------------------------------------------------------------------------------------
# .npy headers in a shared cache
# ----------------------------------------------------------------------------------------------
def _header(shape, descr="<i8") -> bytes:
    b = io.BytesIO()
    np.lib.format.write_array_header_1_0(b, {"descr": descr, "fortran_order": False, "shape": shape})
    return b.getvalue()


@pytest.mark.parametrize("shape, descr", [((2**63, 2**63), "<i8"), ((2**40,), "<i8"), ((3,), "|O")],
                         ids=["overflow", "larger-than-the-file", "objects"])
def test_a_forged_npy_header_is_refused_by_the_reader(tmp_path, shape, descr):
    from data.files import load_npy

    path = tmp_path / "a.npy"
    path.write_bytes(_header(shape, descr) + b"\0" * 64)
    for mmap in (True, False):
        with pytest.raises(F.BadFileError, match="not a .npy array fastmt wrote"):
            load_npy(path, "cache array", mmap=mmap)


@pytest.mark.parametrize("dtype", [">i8", ">f4", "<U4", "|S8", "|V8", [("a", "<i4"), ("b", "<i4")], "<M8[s]",
                                   "<c16", "|O"],
                         ids=["big-endian", "big-endian-float", "unicode", "bytes", "void", "structured",
                              "datetime", "complex", "objects"])
def test_an_npy_array_of_a_dtype_fastmt_never_writes_is_refused(tmp_path, dtype):
    """Issue 45: only plain numbers in this machine's byte order; the file otherwise exact (its size matches the
    header), so only the dtype can refuse it."""
    from data.files import load_npy

    path = tmp_path / "a.npy"
    np.save(path, np.zeros(3, dtype=np.dtype(dtype)))
    for mmap in (True, False):
        with pytest.raises(F.BadFileError, match=f"{path}: not a .npy array fastmt wrote") as e:
            load_npy(path, "cache array", mmap=mmap)
        assert "\n" not in str(e.value)
    np.save(path, np.arange(3, dtype=np.dtype(np.int64).newbyteorder("=")))  # the same file, native: read
    assert load_npy(path, "cache array").tolist() == [0, 1, 2]


def test_a_forged_npy_header_in_the_cache_is_healed_not_a_crash_on_every_run(tmp_path):
    from data import build_data
    from tests.security.test_cache import _cfg

    cfg = _cfg(tmp_path)
    n = len(build_data(cfg, log=lambda *a: None).splits["train"])
    (entry,) = Path(cfg.cache_dir).glob("corpus-*")
    (entry / "train_src_ids.npy").write_bytes(_header((2**63, 2**63)) + b"\0" * 64)  # 128 bytes
    runs = []
    for _ in range(2):  # this run heals it; the next one finds the rebuilt entry
        logs = []
        assert len(build_data(_cfg(tmp_path), log=logs.append).splits["train"]) == n
        runs.append(logs)
    assert any("unusable" in m and "train_src_ids.npy" in m for m in runs[0])
    assert not any("unusable" in m for m in runs[1])


def test_a_damaged_entry_in_a_cache_this_user_cannot_write_is_one_line(tmp_path, tmpfs):
    import shutil

    from data import build_data
    from data.files import FileRefusedError
    from tests.security.test_cache import _cfg

    cfg = _cfg(tmp_path)
    build_data(cfg, log=lambda *a: None)
    fs = tmpfs("20m")
    shutil.copytree(cfg.cache_dir, fs.path / "cache")
    (entry,) = (fs.path / "cache").glob("corpus-*")
    (entry / "train_src_ids.npy").write_bytes(_header((2**63, 2**63)) + b"\0" * 64)
    fs.read_only()
    for _ in range(2):
        with pytest.raises(FileRefusedError, match="damaged entry") as e:
            build_data(_cfg(tmp_path, cache_dir=str(fs.path / "cache")), log=lambda *a: None)
        assert "\n" not in str(e.value) and "--data.cache_dir" in str(e.value)


# ----------------------------------------------------------------------------------------------
# translate: stdin lines are capped
# ----------------------------------------------------------------------------------------------
def test_a_stdin_line_over_the_cap_is_answered_empty_and_never_buffered(tmp_path):
    from train.cli.translate import MAX_LINE_BYTES

    data = tmp_path / "in.txt"
    with open(data, "wb") as f:
        f.write(b"a" * (3 * MAX_LINE_BYTES) + b"\nthe cat\n")
    with open(data, "rb") as stdin:
        r = capped(["-m", "train.translate", "--ckpt", str(LEGACY_CKPT), "--device", "cpu"], stdin=stdin)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.split("\n")
    assert out[0] == "" and out[1] != "" and len(out) == 3, r.stdout[:200]
    assert "input line 1 is longer than" in r.stderr


def test_translate_drops_a_3_gb_line_as_it_comes():
    """``translate`` fed 3 GB of zeros without a newline, then a sentence: the long line's bytes are dropped as they
    come (it is answered by an empty line) and the sentence is translated, within a 4 GB address space (before the
    cap the line was buffered whole: a MemoryError)."""
    import subprocess

    feed = subprocess.Popen(["sh", "-c", "head -c 3000000000 /dev/zero; printf '\\nthe cat\\n'"],
                            stdout=subprocess.PIPE)
    try:
        r = capped(["-m", "train.translate", "--ckpt", str(LEGACY_CKPT), "--device", "cpu"], stdin=feed.stdout)
    finally:
        feed.kill()
        feed.wait()
    assert r.returncode == 0 and "MemoryError" not in r.stderr, r.stderr[-2000:]
    out = r.stdout.split("\n")
    assert out[0] == "" and out[1] and len(out) == 3 and "input line 1 is longer than" in r.stderr


def test_a_sparse_gigabyte_record_is_refused_by_its_size_never_read(tmp_path):
    from data.files import FileRefusedError, read_json
    from train.runs.folder import RunFolderError, folder_state

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "run.json", "wb") as f:  # a sparse 1 GB marker: costs nothing on disk, refused by its size
        f.truncate(2**30)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "epoch"}) + "\n")
    with pytest.raises(FileRefusedError, match="at most"):
        read_json(run / "run.json", "run marker", inside=run)
    with open(run / "provenance.json", "w") as f:
        json.dump({"config": {}, "git_sha": None, "torch": "2"}, f)
    with pytest.raises(RunFolderError, match="at most"):  # a run whose marker cannot be read: refused, not adopted
        folder_state(run)
