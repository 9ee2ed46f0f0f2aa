"""The data cache at scale: the warm-start key (identity, then content), memory maps shared by workers, the
sampled tokenizer's determinism, concurrent builders, healing of damaged entries, interrupted builds, modes."""

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data.sources
from data import build_data
from data.pipeline import _IndexDataset, _PlanSampler
from tests.data.helpers import cfg_for, make_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]
QUIET = dict(log=lambda *_: None)


def _arrays(b) -> dict:
    """Every split's token arrays, texts and rows as plain python (to compare two bundles)."""
    out = {}
    for name, sp in b.splits.items():
        out[name] = [np.asarray(a).tolist() for a in (sp.src_ids, sp.src_offsets, sp.tgt_ids, sp.tgt_offsets, sp.rows)]
        out[name] += [sp.src_text, sp.tgt_text]
    return out


def _vocab(tok) -> list:
    """The model's pieces and scores (its serialized bytes also hold the temp path it was trained in)."""
    return [(tok.sp.id_to_piece(i), tok.sp.get_score(i)) for i in range(tok.vocab_size)]


def _built(logs) -> int:
    return sum(line.startswith("[data] built ") for line in logs)


# ----------------------------------------------------------------------------------------------
# The key: warm start from file identity, content hash when it misses, edits always seen
# ----------------------------------------------------------------------------------------------
def test_warm_start_reads_no_corpus_and_touch_reuses_by_content(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, make_rows(300))
    cfg = cfg_for(tmp_path, str(path))
    cold = build_data(cfg, **QUIET)
    assert cold.splits["train"].src_text is None and isinstance(cold.splits["train"].src_ids, np.memmap)

    def refuse(*a, **k):
        raise AssertionError("the warm path read the corpus")

    with monkeypatch.context() as m:  # a warm start stats the files: no chunk read, no content hash
        m.setattr(data.sources, "read_chunk", refuse)
        m.setattr("data.build_scan.read_chunk", refuse)
        m.setattr("data.cache.content_hash", refuse)
        logs = []
        warm = build_data(cfg, log=logs.append)
    assert any("cache hit" in line for line in logs) and _arrays(warm) == _arrays(cold)
    os.utime(path)  # touched: identity differs, content equal -> reused, not rebuilt
    logs = []
    again = build_data(cfg, log=logs.append)
    assert _built(logs) == 0 and any("not in content" in line for line in logs)
    assert _arrays(again) == _arrays(cold)


def test_edit_in_place_same_size_and_mtime_is_detected(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = make_rows(300)
    write_jsonl(path, rows)
    cfg = cfg_for(tmp_path, str(path), split_grouping="source")  # the split depends on sources only
    before = build_data(cfg, **QUIET)
    r = int(before.splits["valid"].rows[0])  # a valid pair (texts loaded); its target is edited
    st = path.stat()
    old = rows[r]["translation"]["it"]
    new = "".join(c.upper() if c.islower() else c for c in old)  # same length, other text
    assert new != old and len(new.encode()) == len(old.encode())
    path.write_text(path.read_text().replace(json.dumps(old), json.dumps(new), 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before: only ctime moved
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    after = build_data(cfg, **QUIET)
    assert after.split_record["fingerprint"] != before.split_record["fingerprint"]
    assert after.splits["valid"].tgt_text[0] == new and before.splits["valid"].tgt_text[0] == old


def test_same_basename_other_folder_and_append_are_other_data(tmp_path):
    a, b = tmp_path / "x" / "d.jsonl", tmp_path / "y" / "d.jsonl"
    a.parent.mkdir()
    b.parent.mkdir()
    write_jsonl(a, make_rows(200, seed=1))
    write_jsonl(b, make_rows(200, seed=2))
    ba = build_data(cfg_for(tmp_path, str(a)), **QUIET)
    bb = build_data(cfg_for(tmp_path, str(b)), **QUIET)  # same cache, same basename, same size class
    assert ba.split_record["fingerprint"] != bb.split_record["fingerprint"]
    assert ba.splits["valid"].src_text != bb.splits["valid"].src_text
    with open(a, "a") as f:  # append rows
        f.write("".join(json.dumps(r) + "\n" for r in make_rows(50, seed=3)))
    logs = []
    grown = build_data(cfg_for(tmp_path, str(a)), log=logs.append)
    assert _built(logs) == 1 and grown.report.rows == 250 and sum(len(s) for s in grown.splits.values()) == 250


# ----------------------------------------------------------------------------------------------
# Memory maps shared by DataLoader workers
# ----------------------------------------------------------------------------------------------
class _Probe:
    """A collate that also reports, from inside the worker, whether it reads the cache file's mapping."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, idx):
        ids = self.collate.src_ids
        maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
        mapped = isinstance(ids, np.memmap) and str(ids.filename) in maps
        return self.collate(idx), os.getpid(), mapped


@pytest.mark.parametrize("mode", ["token_bucket", "packed"])
def test_workers_map_the_cached_arrays_not_copies(tmp_path, mode):
    b = build_data(cfg_for(tmp_path, write_jsonl(tmp_path / "d.jsonl", make_rows(400))), **QUIET)
    collate = b.collator("train", mode)
    blob = pickle.dumps(collate)  # what a spawn/forkserver worker receives: a reference, not the corpus
    assert len(blob) < 2048 < b.splits["train"].src_ids.nbytes + b.splits["train"].src_offsets.nbytes
    back = pickle.loads(blob)
    assert isinstance(back.src_ids, np.memmap) and str(back.src_ids.filename) == str(b.splits["train"].src_ids.filename)
    plan = b.plan("train", batching=mode)
    loader = torch.utils.data.DataLoader(_IndexDataset(len(b.splits["train"])), batch_sampler=_PlanSampler(plan, 0),
                                         collate_fn=_Probe(collate), num_workers=1)
    got = list(loader)
    assert {pid for _, pid, _ in got} != {os.getpid()} and all(mapped for _, _, mapped in got)
    for (batch, _, _), idx in zip(got, plan):
        ref = collate(idx.tolist())
        assert torch.equal(batch.src, ref.src) and torch.equal(batch.tgt_out, ref.tgt_out)


# ----------------------------------------------------------------------------------------------
# The sampled tokenizer: seeded, independent of workers, chunking and cache folder
# ----------------------------------------------------------------------------------------------
def test_sampled_tokenizer_and_arrays_independent_of_workers_and_chunks(tmp_path, monkeypatch):
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(600))
    kw = dict(spm_sample_pairs=150, vocab_size=350)
    one = build_data(cfg_for(tmp_path / "a", files, build_workers=1, **kw), **QUIET)
    monkeypatch.setattr(data.sources, "CHUNK_BYTES", 4096)  # ~20 chunks, run by 2 forked workers
    logs = []
    two = build_data(cfg_for(tmp_path / "b", files, build_workers=2, **kw), log=logs.append)
    assert any("chunks with 2 processes" in line for line in logs)
    assert any("sample of 150 train pairs" in line for line in logs)
    assert _vocab(one.tokenizer) == _vocab(two.tokenizer)
    assert _arrays(one) == _arrays(two) and one.split_record["fingerprint"] == two.split_record["fingerprint"]
    other = build_data(cfg_for(tmp_path / "c", files, build_workers=1, split_seed=1, **kw), **QUIET)
    assert _vocab(other.tokenizer) != _vocab(one.tokenizer)  # another seed: another sample



def test_a_sample_that_covers_the_train_split_is_training_on_everything(tmp_path):
    """``spm_sample_pairs`` >= the train pairs (the default 100,000 on OPUS Books' 32k pairs) learns the same
    vocabulary as ``0`` (every pair): sampling only changes corpora larger than the sample."""
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(600))
    every = build_data(cfg_for(tmp_path / "a", files, spm_sample_pairs=0, vocab_size=350), **QUIET)
    covering = build_data(cfg_for(tmp_path / "b", files, spm_sample_pairs=100_000, vocab_size=350), **QUIET)
    fewer = build_data(cfg_for(tmp_path / "c", files, spm_sample_pairs=100, vocab_size=350), **QUIET)
    assert _vocab(every.tokenizer) == _vocab(covering.tokenizer) != _vocab(fewer.tokenizer)

def test_given_tokenizer_is_used_and_keyed(tmp_path):
    files = write_jsonl(tmp_path / "d.jsonl", make_rows(300))
    base = build_data(cfg_for(tmp_path / "a", files), **QUIET)
    other = build_data(cfg_for(tmp_path / "b", files, vocab_size=320), **QUIET).tokenizer
    cache = tmp_path / "c"
    b = build_data(cfg_for(cache, files), tokenizer=base.tokenizer, **QUIET)
    assert b.tokenizer is base.tokenizer and not list((cache / "cache").glob("spm-*"))  # nothing trained
    assert b.split_record["tokenizer_key"] == base.tokenizer.key and _arrays(b) == _arrays(base)
    c = build_data(cfg_for(cache, files), tokenizer=other, **QUIET)
    sp = c.splits["valid"]
    assert [x.tolist() for x in other.encode(sp.src_text[:5])] == [
        sp.src_ids[sp.src_offsets[i] : sp.src_offsets[i + 1]].tolist() for i in range(5)]
    assert len(list((cache / "cache").glob("corpus-*"))) == 2


# ----------------------------------------------------------------------------------------------
# Processes: concurrent builders, a build killed mid-way, file modes
# ----------------------------------------------------------------------------------------------
_CHILD = """
import os, sys, time
import data.build
import data.sources
if os.environ.get("HANG_MARK"):  # stop inside the encoding (the workers', or this process's): a build in progress
    def _hang(job, _encode=data.build.encode_chunk):
        open(os.environ["HANG_MARK"], "a").close()
        while not os.path.exists(os.environ["HANG_MARK"] + ".go"):  # released by the test, or killed
            time.sleep(0.01)
        return _encode(job)
    data.build.encode_chunk = _hang
from data.config import toy
from data import build_data
extra = {}
if len(sys.argv) > 3:  # several build workers over small chunks
    data.sources.CHUNK_BYTES, extra = int(sys.argv[3]), {"build_workers": 2}
cfg = toy(data_files=(sys.argv[1],), cache_dir=sys.argv[2], vocab_size=2000, max_len=128, max_tokens=512, **extra)
b = build_data(cfg, log=lambda m: print(m, flush=True))
print("SIZES", b.split_record["sizes"], b.split_record["fingerprint"], flush=True)
"""


def _child(corpus, cache, umask=None, chunk_bytes=None, hang_mark=None):
    """A process building ``corpus``'s entry in ``cache``; ``hang_mark``: it stops for good in the middle of the
    encoding, after creating that file, until a file of that name + ".go" exists (so a test can catch a build
    that is surely in progress, whatever the machine's speed)."""
    pre = (lambda: os.umask(umask)) if umask is not None else None
    more = [str(chunk_bytes)] if chunk_bytes else []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HANG_MARK", None)
    if hang_mark is not None:
        env["HANG_MARK"] = str(hang_mark)
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(corpus), str(cache), *more], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=pre, env=env)


def _wait_for_mark(mark: Path, proc, timeout=120.0) -> float:
    """Wait until ``proc`` (started with ``hang_mark=mark``) stops inside its encoding; returns the start time."""
    t0 = time.monotonic()
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < timeout, "the build never reached its encoding"
        time.sleep(0.01)
    return t0


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """8,000 rows: a cold build long enough (~1 s) to be caught in the middle."""
    return write_jsonl(tmp_path_factory.mktemp("big") / "d.jsonl", make_rows(8000, seed=7))


def test_concurrent_builders_one_builds_the_other_waits_and_maps(tmp_path, big_corpus):
    cache, mark = tmp_path / "cache", tmp_path / "encoding"
    a = _child(big_corpus, cache, hang_mark=mark)
    _wait_for_mark(mark, a)  # a holds the entry's lock, in the middle of its build
    b = _child(big_corpus, cache)
    seen = []
    for line in b.stdout:  # b reaches the lock and waits for a
        seen.append(line)
        if "waiting for process" in line:
            break
    Path(str(mark) + ".go").touch()  # a finishes its build
    out_a, out_b = a.communicate(timeout=300)[0], "".join(seen) + b.communicate(timeout=300)[0]
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b
    assert out_a.count("[data] built ") == 1 and out_b.count("[data] built ") == 0, out_a + out_b
    assert f"waiting for process {a.pid}" in out_b
    sizes = [line for out in (out_a, out_b) for line in out.splitlines() if line.startswith("SIZES")]
    assert len(sizes) == 2 and sizes[0] == sizes[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_build_killed_midway_is_cleaned_at_next_start(tmp_path, big_corpus, workers):
    """kill -9 mid-build (in-process, or with 2 forked build workers): the workers die with the parent, the
    lock is free, and the next start removes the temp entry and builds."""
    cache = tmp_path / "cache"
    mark = tmp_path / "encoding"
    a = _child(big_corpus, cache, chunk_bytes=65536 if workers == 2 else None, hang_mark=mark)
    t0 = _wait_for_mark(mark, a)  # whatever the machine's speed: the build stops inside its encoding
    if workers == 2:  # both forked build workers are up (each stops in its first encoding job)
        while len(subprocess.run(["pgrep", "-P", str(a.pid)], capture_output=True, text=True).stdout.split()) < 2:
            assert time.monotonic() - t0 < 120, "the build workers never started"
            time.sleep(0.01)
    kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(a.pid)], capture_output=True, text=True).stdout.split()]
    assert len(kids) == (2 if workers == 2 else 0) or workers == 1
    a.send_signal(signal.SIGKILL)
    a.wait()
    t0 = time.monotonic()
    try:
        while any(Path(f"/proc/{k}").exists() and Path(f"/proc/{k}/stat").read_text().split()[2] != "Z" for k in kids):
            assert time.monotonic() - t0 < 10, "build workers outlived their killed parent"
            time.sleep(0.05)
    finally:
        for k in kids:  # never leave them behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".")]
    assert leftovers  # the killed build left its temp entry
    b = _child(big_corpus, cache)
    out = b.communicate(timeout=300)[0]
    assert b.returncode == 0 and "interrupted builds" in out and "waiting" not in out, out
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_cache_files_and_folders_honour_the_umask(tmp_path, mask):
    cache = tmp_path / "cache"
    corpus = write_jsonl(tmp_path / "d.jsonl", make_rows(200))
    p = _child(corpus, cache, umask=mask)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    modes = {str(q.relative_to(cache)): q.stat().st_mode & 0o777 for q in cache.rglob("*")}
    assert any(k.endswith("spm.model") for k in modes) and any(k.endswith(".npy") for k in modes)
    wrong = {k: oct(m) for k, m in modes.items()
             if m != ((0o777 if (cache / k).is_dir() else 0o666) & ~mask)}
    assert not wrong


# ----------------------------------------------------------------------------------------------
# Healing: a damaged entry is removed with one warning and rebuilt to the same data
# ----------------------------------------------------------------------------------------------
DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "empty": lambda b: b"",
    "garbage": lambda b: bytes((x * 7 + 13) % 256 for x in range(max(len(b), 64))),
}


@pytest.mark.parametrize("target,how", [
    ("*.model", "truncated"), ("*.model", "empty"), ("*.model", "garbage"),
    ("settings.json", "garbage"),
    ("*.np[yz]", "truncated"), ("*.np[yz]", "garbage"),
    ("meta.json", "empty"),
    ("valid_text.json", "garbage"),
    ("index/*.json", "garbage"),
])
def test_damaged_cache_entry_heals(tmp_path, target, how):
    cfg = cfg_for(tmp_path, write_jsonl(tmp_path / "d.jsonl", make_rows(300)))
    ref = build_data(cfg, **QUIET)
    want, want_vocab = _arrays(ref), _vocab(ref.tokenizer)  # read now: ref maps the files about to be damaged
    cache = Path(cfg.cache_dir)
    hits = sorted(p for p in cache.rglob(target.split("/")[-1]) if p.is_file() and "toy" not in p.parts
                  and (target.count("/") == 0 or p.parent.name == target.split("/")[0]))
    assert hits, f"no cache file matches {target}"
    victim = hits[0]
    victim.write_bytes(DAMAGE[how](victim.read_bytes()))
    logs = []
    healed = build_data(cfg, log=logs.append)
    warnings = [line for line in logs if "unusable" in line]
    assert len(warnings) == 1 and "\n" not in warnings[0], logs
    assert _arrays(healed) == want and _vocab(healed.tokenizer) == want_vocab
    assert build_data(cfg, **QUIET).split_record == healed.split_record  # and it stays healed


def _worker_dispositions(_):
    return [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)]


def test_build_workers_leave_stop_signals_to_the_main_process():
    """A signal to the whole group (SLURM, ``timeout``, Ctrl-C) reaches the build workers too: they ignore it,
    as DataLoader workers do, so the main process stops the build (its tasks end, nothing dies mid-write)
    instead of a worker dying and the build failing as "a worker died"."""
    from data.workers import BuildRunner

    run = BuildRunner(2)
    try:
        got = run.map(_worker_dispositions, [0, 1])
    finally:
        run.close()
    assert got == [[signal.SIG_IGN] * 3] * 2


def test_changing_max_len_re_encodes_but_keeps_the_tokenizer(tmp_path):
    """README: "Changing max_len or max_len_ratio re-encodes but keeps the tokenizer"."""
    corpus = write_jsonl(tmp_path / "d.jsonl", make_rows(300))
    logs_a, logs_b = [], []
    a = build_data(cfg_for(tmp_path, [corpus], max_len=64), log=logs_a.append)
    b = build_data(cfg_for(tmp_path, [corpus], max_len=48, max_len_ratio=2.5), log=logs_b.append)
    assert a.split_record["cache"] != b.split_record["cache"]  # a second entry: re-encoded
    assert a.split_record["tokenizer_key"] == b.split_record["tokenizer_key"]
    assert any("trained SentencePiece" in m for m in logs_a)
    assert not any("trained SentencePiece" in m for m in logs_b), logs_b


# ----------------------------------------------------------------------------------------------
# Contents (issue 45 class 5): an entry whose arrays or texts are damaged in content, not in form, is rebuilt
# ----------------------------------------------------------------------------------------------
def _rewrite(path: Path, a: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, a)


def _meta(entry: Path, **changes) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    (entry / "meta.json").write_text(json.dumps({**meta, **changes}))


def _id_past_vocab(entry: Path, vocab: int) -> None:
    a = np.load(entry / "train_src_ids.npy")
    a[len(a) // 2] = vocab  # one id, one past the last piece
    _rewrite(entry / "train_src_ids.npy", a)


def _negative_id(entry: Path, vocab: int) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    for s in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            a = np.load(entry / f"{s}_{side}_ids.npy").astype(np.int32)
            if s == "valid" and side == "tgt":
                a[0] = -1
            _rewrite(entry / f"{s}_{side}_ids.npy", a)
    _meta(entry, id_dtype="int32", **{k: meta[k] for k in ("counts",)})


def _float_ids(entry: Path, vocab: int) -> None:
    for s in ("train", "valid", "test"):
        for side in ("src", "tgt"):
            p = entry / f"{s}_{side}_ids.npy"
            _rewrite(p, np.load(p).astype(np.float32))
    _meta(entry, id_dtype="float32")


def _offsets_fall(entry: Path, vocab: int) -> None:
    off = np.load(entry / "train_tgt_off.npy")
    off[2], off[3] = off[3], off[2]  # the same ends, two rows out of order: a negative and a long row
    _rewrite(entry / "train_tgt_off.npy", off)


def _row_too_long(entry: Path, vocab: int) -> None:
    off = np.load(entry / "train_src_off.npy")
    off[1:-1] = off[-1]  # rising, but row 0 holds every token: longer than any row a build keeps
    _rewrite(entry / "train_src_off.npy", off)


def _text_not_string(entry: Path, vocab: int) -> None:
    t = json.loads((entry / "valid_text.json").read_text())
    t["src"][3] = 5
    (entry / "valid_text.json").write_text(json.dumps(t))


def _text_not_a_list(entry: Path, vocab: int) -> None:
    t = json.loads((entry / "test_text.json").read_text())
    (entry / "test_text.json").write_text(json.dumps({"src": "x" * len(t["src"]), "tgt": t["tgt"]}))


def _big_endian(entry: Path, vocab: int) -> None:
    p = entry / "train_rows.npy"
    _rewrite(p, np.load(p).astype(">i8"))


def _float_count(entry: Path, vocab: int) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    _meta(entry, counts={**meta["counts"], "valid": float(meta["counts"]["valid"])})


@pytest.mark.parametrize("damage", [_id_past_vocab, _negative_id, _float_ids, _offsets_fall, _row_too_long,
                                    _text_not_string, _text_not_a_list, _big_endian, _float_count],
                         ids=lambda f: f.__name__.strip("_"))
def test_an_entry_damaged_in_content_is_rebuilt(tmp_path, damage):
    cfg = cfg_for(tmp_path, write_jsonl(tmp_path / "d.jsonl", make_rows(300)))
    ref = build_data(cfg, **QUIET)
    want, vocab = _arrays(ref), ref.tokenizer.vocab_size
    (entry,) = Path(cfg.cache_dir).glob("corpus-*")
    del ref  # its maps of the files about to be rewritten
    damage(entry, vocab)
    logs = []
    healed = build_data(cfg, log=logs.append)
    warnings = [line for line in logs if "unusable" in line]
    assert len(warnings) == 1 and "\n" not in warnings[0] and str(entry) in warnings[0], logs
    assert _arrays(healed) == want
    logs = []
    build_data(cfg, log=logs.append)  # and it stays healed: opened, checked, no warning
    assert not [line for line in logs if "unusable" in line] and _built(logs) == 0
