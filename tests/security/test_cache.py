"""The data cache from someone else (issue 27 rows 2, 3, 7; issue 30 row 4): a poisoned index or meta file
never makes fastmt delete outside the cache, no lock or record write follows a planted link, a read-only
cache is used without writing, and a cache the OS refuses (full, read-only, not a folder, a name too long)
is one line naming ``--data.cache_dir`` with exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data import build_data
from data import cache as C
from data.files import FileRefusedError, remove_inside
from tests.security.conftest import victim
from tests.utils import toy_data

REPO = Path(__file__).resolve().parents[2]


def _quiet(*_a):
    pass


def _cfg(tmp: Path, **changes):
    return toy_data(tmp, **{"toy_rows": 300, "vocab_size": 300, "valid_size": 20, "test_size": 20, **changes})


@pytest.fixture
def built(tmp_path):
    """A toy cache built once: (config, bundle)."""
    cfg = _cfg(tmp_path)
    return cfg, build_data(cfg, log=_quiet)


# ----------------------------------------------------------------------------------------------
# row 2: keys read from files never become paths outside the cache
# ----------------------------------------------------------------------------------------------
WORK = "a week of work"


def _project(tmp_path: Path) -> Path:
    """A user's folder beside the cache, ``project/work.txt``: what a key read from a cache file must never reach
    (the poisoned keys below name it as ``x/../../project``)."""
    target = tmp_path / "project"
    target.mkdir()
    (target / "work.txt").write_text(WORK)
    return target


def test_row2_a_poisoned_index_key_deletes_nothing_outside_the_cache(built, tmp_path):
    cfg, bundle = built
    cache = Path(cfg.cache_dir)
    target = _project(tmp_path)
    (cache / "corpus-x").mkdir()
    (index,) = (cache / "index").glob("*.json")
    index.write_text(json.dumps({"corpus": "x/../../project"}))  # cache/corpus-x/../../project = tmp/project
    logs = []
    again = build_data(cfg, log=logs.append)
    assert (target / "work.txt").read_text() == WORK
    assert len(again.splits["train"]) == len(bundle.splits["train"])
    assert any("is not a cache key" in m for m in logs)  # reported as a damaged entry


def test_row2_a_poisoned_tokenizer_key_in_meta_deletes_nothing_outside_the_cache(built, tmp_path):
    cfg, bundle = built
    cache = Path(cfg.cache_dir)
    target = _project(tmp_path)
    (cache / "spm-x").mkdir()
    (meta_path,) = cache.glob("corpus-*/meta.json")
    meta = json.loads(meta_path.read_text())
    meta["tokenizer_key"] = "x/../../project"
    meta_path.write_text(json.dumps(meta))
    again = build_data(cfg, log=_quiet)
    assert (target / "work.txt").read_text() == WORK
    assert again.tokenizer.vocab_size == bundle.tokenizer.vocab_size


def test_containment_helper_refuses_paths_outside_the_folder(tmp_path):
    root = tmp_path / "cache"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("x")
    (root / "link").symlink_to(outside)  # a folder link planted inside the cache
    for bad in (root / ".." / "outside", root / "link" / "f", root, root / "sub" / ".." / ".."):
        with pytest.raises(FileRefusedError, match="not inside"):
            remove_inside(root, bad)
    remove_inside(root, root / "link")  # the link itself is inside: removed, its target untouched
    assert not (root / "link").is_symlink() and (outside / "f").read_text() == "x"


# ----------------------------------------------------------------------------------------------
# row 3: no lock or record write follows a planted link
# ----------------------------------------------------------------------------------------------
def test_row3_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path):
    cache = tmp_path / "cache"
    (cache / "locks").mkdir(parents=True)
    v = victim(tmp_path)
    key = "0123456789abcdef0123"
    (cache / "locks" / f"{key}.lock").symlink_to(v)
    with pytest.raises(FileRefusedError, match="symbolic link"):
        with C.locked(cache, key, _quiet):
            pass
    assert v.read_text() == "precious\n"


def test_row3_a_planted_temp_link_never_receives_a_record(tmp_path):
    cache = tmp_path / "cache"
    (cache / "index").mkdir(parents=True)
    v = victim(tmp_path)
    index = cache / "index" / "0123456789abcdef0123.json"
    for name in (f".tmp-{index.stem}-{os.getpid()}.json", f".tmp-{index.stem}-{os.getpid()}"):  # old, new names
        (cache / "index" / name).symlink_to(v)
    C.write_json(index, {"corpus": "0" * 20})
    assert v.read_text() == "precious\n" and json.loads(index.read_text()) == {"corpus": "0" * 20}
    assert not index.is_symlink() and index.stat().st_mode & 0o777 == 0o666 & ~C.umask()


# ----------------------------------------------------------------------------------------------
# row 7 and the OSError mechanism: real small and read-only file systems
# ----------------------------------------------------------------------------------------------
def test_row7_a_read_only_cache_is_used_without_writing(built, tmp_path, tmpfs):
    cfg, bundle = built
    fs = tmpfs("20m")
    shutil.copytree(cfg.cache_dir, fs.path / "cache")  # a shared copy: the inputs' paths differ (index miss)
    fs.read_only()
    ro = _cfg(tmp_path, cache_dir=str(fs.path / "cache"))
    logs = []
    again = build_data(ro, log=logs.append)
    assert len(again.splits["train"]) == len(bundle.splits["train"]) and any("read-only" in m for m in logs)
    miss = _cfg(tmp_path, cache_dir=str(fs.path / "cache"), valid_size=21)  # nothing built for these settings
    with pytest.raises(FileRefusedError) as e:
        build_data(miss, log=_quiet)
    msg = str(e.value)
    assert "--data.cache_dir" in msg and str(fs.path / "cache") in msg and "\n" not in msg


def _train_cli(tmp_path: Path, cache: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", "--preset", "tiny", "--data.dataset", "toy",
                           "--data.toy_rows", "300", "--data.vocab_size", "300", "--data.valid_size", "20",
                           "--data.test_size", "20", "--data.cache_dir", cache,
                           "--run.out_dir", str(tmp_path / "runs"), "--epochs", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_issue30_a_full_cache_is_one_line_with_exit_2(tmp_path, tmpfs):
    fs = tmpfs("300k")
    r = _train_cli(tmp_path, str(fs.path / "cache"))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--data.cache_dir" in errors[0] and "no space" in errors[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run folder left


def test_issue30_a_read_only_empty_cache_is_one_line_with_exit_2(tmp_path, tmpfs):
    fs = tmpfs("1m")
    (fs.path / "cache").mkdir()
    fs.read_only()
    r = _train_cli(tmp_path, str(fs.path / "cache"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--data.cache_dir" in r.stderr and "read-only" in r.stderr


@pytest.mark.parametrize("where", ["under-a-file", "name-too-long"])
def test_issue30_a_cache_path_the_os_refuses_is_one_line(tmp_path, where):
    (tmp_path / "file").write_text("x")
    cache = tmp_path / "file" / "cache" if where == "under-a-file" else tmp_path / ("c" * 300)
    with pytest.raises(FileRefusedError) as e:
        build_data(_cfg(tmp_path, cache_dir=str(cache)), log=_quiet)
    assert "--data.cache_dir" in str(e.value) and "\n" not in str(e.value)


_READER = """
import sys
from data import build_data
from data.config import toy
cfg = toy(cache_dir=sys.argv[1], data_files=(sys.argv[2],), vocab_size=300, valid_size=20, test_size=20)
try:
    print("OK", len(build_data(cfg, log=lambda *a: None).splits["train"]))
except Exception as e:
    print(type(e).__name__, " ".join(str(e).split()))
"""


def test_row7_another_user_reads_a_shared_cache_it_cannot_write(shared_tmp):
    """The cache belongs to root (0755); uid 65534 reads it after the data file was touched (an index miss,
    a content match): no lock file is created, nothing written, the entry used."""
    from tests.security.conftest import run_as_nobody

    if os.geteuid() != 0:
        pytest.skip("needs root to run the reader as another uid")
    from data.config import toy
    from data.toy import write_toy_corpus

    corpus = write_toy_corpus(shared_tmp / "corpus.jsonl", 300)
    cache = shared_tmp / "cache"
    cfg = toy(cache_dir=str(cache), data_files=(str(corpus),), vocab_size=300, valid_size=20, test_size=20)
    n = len(build_data(cfg, log=_quiet).splits["train"])
    os.utime(corpus)  # a touch: the identity index misses, the content still matches
    for p in shared_tmp.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    before = sorted(str(p) for p in cache.rglob("*"))
    r = run_as_nobody(shared_tmp, _READER, str(cache), str(corpus))
    assert r.stdout.strip() == f"OK {n}", r.stdout + r.stderr[-2000:]
    assert sorted(str(p) for p in cache.rglob("*")) == before


@pytest.mark.parametrize("name", ["meta.json", "train_src_ids.npy", "valid_text.json"])
def test_a_fifo_or_device_link_planted_in_an_entry_is_healed_without_hanging(built, name):
    """A reader of a FIFO waits forever for a writer, one of /dev/zero fills the memory: both are refused by
    name and the entry is rebuilt."""
    cfg, bundle = built
    (entry,) = Path(cfg.cache_dir).glob("corpus-*")
    (entry / name).unlink()
    if name.endswith(".json") and name.startswith("valid"):
        (entry / name).symlink_to("/dev/zero")
    else:
        os.mkfifo(entry / name)
    logs = []
    again = build_data(cfg, log=logs.append)
    assert len(again.splits["train"]) == len(bundle.splits["train"])
    assert any("unusable (FileRefusedError" in m for m in logs)
