"""The cold build of a corpus entry (`data.entry`), streaming and parallel.

Passes (each a task per input chunk of ~8 MB, `data.sources.plan_chunks`, run by ``build_workers`` forked
processes, results merged in input order, so the output never depends on the worker count):
  A  read, clean, normalise and hash every row: per row a 64-bit hash of the normalised source and target
     (the split's groups) and of the exact pair (the fingerprint, the tokenizer sample); the cleaned texts go
     to a temp file per chunk, so nothing corpus-sized stays in memory.
  -  split (`data.split`, vectorised over the per-row hashes), train pairs found in your own valid/test
     files removed; the overlap before (the row-level split of 8c2d91d) and after is counted.
  -  SentencePiece trained on a seeded sample of ``spm_sample_pairs`` train pairs (the pairs with the
     smallest seeded pair hash: the same sample for any chunking), or the given tokenizer.
  B  encode each chunk; train pairs are length-filtered, valid/test pairs are kept whole (token arrays cut
     to ``max_len``, counted); the train parts are copied into one memory-mappable array per side.
Peak memory: one chunk per worker, plus in the main process the per-row hashes and the split's sorts
(~130 bytes a row measured between 1 M and 5 M pairs; bench/results/data-scale-cpu.md): texts never pile up.

The entry is a folder of .npy arrays (opened with ``mmap_mode="r"`` by `data.entry.load_entry`: a warm
start maps them and reads nothing corpus-sized; DataLoader workers share the pages), texts and meta.json.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np

from . import cache as C
from .clean import CleanReport, DataInputError, Tally, clean_row, length_examples, length_mask
from .entry import CACHE_FORMAT, Entry, Inputs, build_workers, load_entry
from .files import load_npy, open_own
from .sources import read_chunk, read_local, where
from .split import (
    HELDOUT_MAX_GROUP,
    NORMALISATION,
    assign,
    group_keys,
    hash64,
    in_sorted,
    mix64,
    normalise,
    row_level_split,
    sorted_unique,
)
from .tokenizer import Tokenizer, train_spm
from .workers import ignore_stop_signals

_SPLIT_CODE = {"train": 0, "valid": 1, "test": 2}
_LEN_CAP = 4096  # train length histograms (for the length hints) clip here


# ----------------------------------------------------------------------------------------------
# Worker tasks (module level: they run in forked processes)
# ----------------------------------------------------------------------------------------------
def _scan(job) -> dict:
    """Pass A on one chunk: parse, clean, hash; cleaned texts + positions to ``tmp/a-<i>.*`` (`_save_texts`)."""
    i, chunk, src_lang, tgt_lang, tmp = job
    rows = read_chunk(chunk, src_lang, tgt_lang)
    tally, src, tgt, pos = rows.rejects, [], [], []
    for p, row in zip(rows.positions, rows.translation):
        got = clean_row(row, src_lang, tgt_lang)
        if got[0] is None:
            tally.add(got[1], p, got[2])
            continue
        src.append(got[0])
        tgt.append(got[1])
        pos.append(p)
    n = len(src)
    h_src = np.fromiter((hash64(normalise(s)) for s in src), np.uint64, n)
    h_tgt = np.fromiter((hash64(normalise(t)) for t in tgt), np.uint64, n)
    h_pair = np.fromiter((hash64(f"{s}\t{t}") for s, t in zip(src, tgt)), np.uint64, n)
    _save_texts(Path(tmp), i, src, tgt, pos)
    return {"read": rows.read, "tally": tally, "h_src": h_src, "h_tgt": h_tgt, "h_pair": h_pair}


def _save_texts(tmp: Path, i: int, src: list[str], tgt: list[str], pos: list[int]) -> None:
    """A chunk's cleaned texts as UTF-8 back to back (``a-<i>.txt``: every source, then every target) with the
    (2n+1,) byte offsets of each text and the rows' positions: the tokenizer's sample decodes only its rows,
    pass B decodes each text once."""
    enc = [x.encode() for x in src] + [x.encode() for x in tgt]
    off = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc)), out=off[1:])
    with open(tmp / f"a-{i}.txt", "wb") as f:
        f.write(b"".join(enc))
    np.save(tmp / f"a-{i}-off.npy", off)
    np.save(tmp / f"a-{i}-pos.npy", np.asarray(pos, dtype=np.int64))


def _load_texts(tmp: Path, i: int, rows=None) -> tuple[list[str], list[str]]:
    """(sources, targets) of chunk i's rows ``rows`` (local indices; None: all), from `_save_texts`' files
    (read back only when this user wrote them)."""
    off = load_npy(tmp / f"a-{i}-off.npy", "scratch array", own=True, mmap=False)
    n = (len(off) - 1) // 2
    with open_own(tmp / f"a-{i}.txt") as f:
        blob = f.read()
    if rows is None:
        o = off.tolist()
        texts = [blob[a:b].decode() for a, b in zip(o[:-1], o[1:])]
        return texts[:n], texts[n:]
    rows = np.asarray(rows, dtype=np.int64)
    side = [[blob[a:b].decode() for a, b in zip(off[r].tolist(), off[r + 1].tolist())] for r in (rows, n + rows)]
    return side[0], side[1]


def _sample(job) -> tuple[list[str], list[str]]:
    """The sampled rows (local indices) of one chunk's cleaned texts."""
    i, tmp, local = job
    return _load_texts(Path(tmp), i, local)


_TOKENIZERS: dict[str, Tokenizer] = {}  # per worker process: loaded once per model file


def _worker_tokenizer(model_file: str) -> Tokenizer:
    if model_file not in _TOKENIZERS:
        _TOKENIZERS[model_file] = Tokenizer(model_file, num_threads=1)
    return _TOKENIZERS[model_file]


def _flat(ids: list[list[int]], keep, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ids and int32 lengths of the rows ``keep`` of ``ids``."""
    sel = [ids[k] for k in keep]
    lens = np.fromiter(map(len, sel), np.int32, len(sel))
    return np.fromiter(itertools.chain.from_iterable(sel), dtype, int(lens.sum())), lens


def _encode(job) -> dict:
    """Pass B on one chunk: encode; train rows length-filtered into part files; valid/test rows returned
    whole (texts) with token arrays cut to ``max_len``."""
    i, tmp, labels, model_file, max_len, max_ratio, dtype = job
    src, tgt = _load_texts(Path(tmp), i)
    pos = load_npy(Path(tmp) / f"a-{i}-pos.npy", "scratch array", own=True, mmap=False).tolist()
    for name in (f"a-{i}.txt", f"a-{i}-off.npy", f"a-{i}-pos.npy"):
        os.unlink(Path(tmp) / name)
    sp = _worker_tokenizer(model_file).sp
    ids_s = sp.encode(src, out_type=int, num_threads=1)
    ids_t = sp.encode(tgt, out_type=int, num_threads=1)
    ls = np.fromiter(map(len, ids_s), np.int64, len(src)) + 1  # incl. EOS / BOS
    lt = np.fromiter(map(len, ids_t), np.int64, len(tgt)) + 1
    train = np.flatnonzero(labels == 0)
    ok, dropped = length_mask(ls[train], lt[train], max_len, max_ratio)
    tally = Tally()
    for k, reason, detail in length_examples(ls[train], lt[train], max_len, max_ratio):
        tally.add(reason, pos[train[k]], detail)
    tally.counts.update(dropped)  # every drop counted, the first MAX_EXAMPLES shown
    hi = np.maximum(ls[train], lt[train])
    for k in np.flatnonzero(labels == -1):  # removed: in your valid/test files
        tally.add("in_eval_files", pos[k], f"source {src[k][:50]!r}")
    keep = train[ok]
    part = {}
    part["src_ids"], part["src_len"] = _flat(ids_s, keep, dtype)
    part["tgt_ids"], part["tgt_len"] = _flat(ids_t, keep, dtype)
    part["rows"] = keep.astype(np.int64)
    for name, a in part.items():
        np.save(Path(tmp) / f"b-{i}-{name}.npy", a)
    held = {}
    cut = max_len - 1  # subwords that fit with EOS / BOS
    for s in ("valid", "test"):
        idx = np.flatnonzero(labels == _SPLIT_CODE[s])
        held[s] = {"src": [src[k] for k in idx], "tgt": [tgt[k] for k in idx],
                   "src_ids": [ids_s[k][:cut] for k in idx], "tgt_ids": [ids_t[k][:cut] for k in idx],
                   "local": idx, "truncated": int(((ls[idx] > max_len) | (lt[idx] > max_len)).sum())}
    return {"tally": tally, "n_train": len(keep), "tokens": (int(part["src_len"].sum()), int(part["tgt_len"].sum())),
            "held": held, "longer": np.bincount(np.minimum(hi, _LEN_CAP), minlength=_LEN_CAP + 1)}


def _worker_init(parent: int) -> None:
    """A build worker: leaves Ctrl-C, SIGTERM and SIGUSR1 to the main process (which stops the build as it stops a
    run; no worker tracebacks, no worker killed mid-task by a signal to the whole group),
    dies with it (Linux: parent-death signal; a worker forked from a parent killed by -9 would otherwise
    live on), and drops its copies of the parent's lock fds."""
    ignore_stop_signals(0)
    C.forget_locks()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


START_METHOD = "fork"  # of the build workers ("spawn" works too: a Hub dataset is loaded again in each worker)


class _Runner:
    """Runs a task over jobs in input order: in this process (one worker or one job) or in forked workers."""

    def __init__(self, workers: int):
        self.workers, self.pool = workers, None

    def map(self, fn, jobs: list) -> list:
        if self.workers <= 1 or len(jobs) <= 1:
            return [fn(j) for j in jobs]
        if self.pool is None:
            method = START_METHOD if START_METHOD in multiprocessing.get_all_start_methods() else None
            ctx = multiprocessing.get_context(method)
            self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init,
                                               initargs=(os.getpid(),))
        try:
            return list(self.pool.map(fn, jobs))
        except cf.process.BrokenProcessPool:
            raise RuntimeError("a data build worker process died (killed by a signal or out of memory); "
                               "run again: the build restarts from the beginning") from None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# Your own valid/test files: read whole and strictly
# ----------------------------------------------------------------------------------------------
def read_eval_files(files: tuple[str, ...], split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str]]:
    """Every row of ``files`` in order (ends stripped; empty sides kept), read by `data.sources.read_local` as
    `load_local` reads. A row that cannot be read is a `DataInputError` naming file:line: an evaluation set is
    used whole or not at all."""
    src_files, chunks = read_local(files, src_lang, tgt_lang, name=f"data.{split}_files")
    src, tgt, bad, nbad = [], [], [], 0
    for _, f, base, rows in chunks:
        for reason, pos, detail in rows.rejects.examples:
            bad.append(f"{where(f, base + pos)}: {reason}: {detail}")
        nbad += rows.rejects.total
        for pos, row in zip(rows.positions, rows.translation):
            got = clean_row(row, src_lang, tgt_lang, keep_empty=True)
            if got[0] is None:
                nbad += 1
                bad.append(f"{where(f, base + pos)}: {got[1]}: {got[2]}")
                continue
            src.append(got[0])
            tgt.append(got[1])
    empty = [f.path for f in src_files if f.read == 0]
    if empty:
        raise DataInputError(f"data.{split}_files: {empty[0]} is empty; give a file with {split} pairs")
    if nbad:
        raise DataInputError(
            f"data.{split}_files: {nbad} row{'s' * (nbad != 1)} cannot be read, and a {split} set is used whole "
            f"(fix or delete them): " + "; ".join(bad[:3]))
    return src, tgt


# ----------------------------------------------------------------------------------------------
# The cold build
# ----------------------------------------------------------------------------------------------
def _per_file_check(inp: Inputs, reads: list[int], kept: list[int], report: CleanReport) -> None:
    """Fail in one sentence, naming the file, when a file (or the whole source) yields no clean row."""
    shown = "\n  ".join(str(report).splitlines())
    for f, r, k in zip(inp.files, reads, kept):
        if r == 0 and f.fmt != "hub":
            raise DataInputError(f"{f.path} is empty: nothing to train on; cleaning report:\n  {shown}")
        if k == 0:
            raise DataInputError(
                f"{f.path}: none of its {r:,} {f.unit}{'s' * (r != 1)} is a usable pair (reasons and "
                f"examples below); cleaning report:\n  {shown}")


def _size(spec: int | float, n: int) -> int:
    return int(round(spec * n)) if isinstance(spec, float) else int(spec)


def length_hint(hist: np.ndarray, dropped: dict[str, int]) -> str:
    """Token-length percentiles (longer side, incl. EOS/BOS) from a histogram, and the setting that keeps them."""
    cdf = np.cumsum(hist) / max(1, hist.sum())
    pct = {q: int(np.searchsorted(cdf, q / 100 - 1e-12)) for q in (50, 90, 99, 100)}
    keep99 = -(-pct[99] // 8) * 8
    fix = (f"data.max_len={keep99} keeps ~99 % (it needs data.max_tokens >= {2 * keep99})"
           if dropped["too_long"] >= dropped["length_ratio"] else "raise data.max_len_ratio")
    return "longer side in tokens (incl. EOS/BOS): " + "  ".join(f"p{q} {v}" for q, v in pct.items()) + f"; {fix}"


def build_entry(cfg, inp: Inputs, key: str, tok_key: str, sets: dict, cache: Path, tokenizer: Tokenizer | None,
                log=print) -> Entry:
    """Build ``corpus-<key>`` (and ``spm-<tok_key>`` unless a tokenizer is given); the caller holds the lock."""
    t0 = time.perf_counter()
    tmp = C.temp_dir(cache, key)
    run = _Runner(build_workers(cfg))
    try:
        evals = {s: read_eval_files(files, s, cfg.src_lang, cfg.tgt_lang) for s, files in inp.evals.items()}
        phases, t_phase = {}, time.perf_counter()

        def phase(name: str) -> None:
            nonlocal t_phase
            phases[name] = time.perf_counter() - t_phase
            t_phase = time.perf_counter()

        # ---- pass A
        scans = run.map(_scan, [(i, c, cfg.src_lang, cfg.tgt_lang, str(tmp)) for i, c in enumerate(inp.chunks)])
        report = CleanReport()
        lines_before = [0] * len(inp.files)
        bases = []
        for c, sc in zip(inp.chunks, scans):
            f = inp.files[c.file]
            bases.append(lines_before[c.file] + 1 if f.unit == "line" else c.base)
            lines_before[c.file] += sc["read"]
            report.rows += sc["read"]
            report.merge(sc["tally"], lambda pos, f=f, b=bases[-1]: where(f, b + pos))
        kept_chunk = np.array([len(sc["h_src"]) for sc in scans], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(kept_chunk)])  # clean-row index of each chunk's first row
        reads = [sum(sc["read"] for c, sc in zip(inp.chunks, scans) if c.file == k) for k in range(len(inp.files))]
        kept = [int(sum(len(sc["h_src"]) for c, sc in zip(inp.chunks, scans) if c.file == k)) for k in range(len(inp.files))]
        _per_file_check(inp, reads, kept, report)
        h_src = np.concatenate([sc.pop("h_src") for sc in scans])
        h_tgt = np.concatenate([sc.pop("h_tgt") for sc in scans])
        h_pair = np.concatenate([sc.pop("h_pair") for sc in scans])
        n = len(h_src)
        fingerprint = C.digest([cfg.src_lang, cfg.tgt_lang, hashlib.sha256(h_pair.tobytes()).hexdigest()])
        phase("read+clean+hash")
        # ---- split
        labels = np.zeros(n, dtype=np.int8)
        leak = np.zeros(n, dtype=bool)
        eval_hashes = {s: (_text_hashes(es), _text_hashes(et)) for s, (es, et) in evals.items()}
        for e_src, e_tgt in eval_hashes.values():
            leak |= in_sorted(h_src, sorted_unique(e_src))
            if cfg.split_grouping == "source_target":
                leak |= in_sorted(h_tgt, sorted_unique(e_tgt))
        n_free = int((~leak).sum())
        if n == 0 or n_free == 0:
            raise DataInputError(
                f"all {n:,} clean training pairs share a normalised source or target with data.valid_files / "
                f"data.test_files: nothing is left to train on; give training files that are not your evaluation data")
        n_test = 0 if "test" in evals else _size(cfg.test_size, n_free)
        n_valid = 0 if "valid" in evals else _size(cfg.valid_size, n_free)
        if n_free and n_valid + n_test >= n_free:
            raise DataInputError(
                f"valid_size={cfg.valid_size} ({n_valid}) + test_size={cfg.test_size} ({n_test}) leave no training "
                f"rows out of {n_free} clean rows; lower them (floats are fractions)")
        if leak.any():
            free = np.flatnonzero(~leak)
            keys = group_keys(h_src[free], h_tgt[free], cfg.split_grouping)
            labels[free] = assign(keys, n_test, n_valid, cfg.split_seed)
        else:  # no copies of the hashes (the split's memory peak)
            keys = group_keys(h_src, h_tgt, cfg.split_grouping)
            labels[:] = assign(keys, n_test, n_valid, cfg.split_seed)
        labels[leak] = -1  # removed: their source/target is in your valid/test files
        olap = _overlaps(cfg, eval_hashes, labels, h_src, h_tgt, n_test, n_valid)
        del keys
        phase("split")
        # ---- tokenizer
        if tokenizer is not None:
            model_file = tmp / "given-spm.model"
            model_file.write_bytes(tokenizer.model_bytes())
            tok = tokenizer
        else:
            tok = _tokenizer(cfg, cache, tok_key, sets["tokenizer"], labels, h_pair, first, run, tmp, log)
            model_file = Path(tok.model_file)
        del h_pair
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "int32"
        phase("tokenizer")
        # ---- pass B
        jobs = [(i, str(tmp), labels[first[i]:first[i + 1]], str(model_file), cfg.max_len, cfg.max_len_ratio, dtype)
                for i in range(len(inp.chunks))]
        encoded = run.map(_encode, jobs)
        hist = np.zeros(_LEN_CAP + 1, dtype=np.int64)
        for i, e in enumerate(encoded):
            f = inp.files[inp.chunks[i].file]
            report.merge(e["tally"], lambda pos, f=f, b=bases[i]: where(f, b + pos))
            hist += e.pop("longer")
        dropped = {r: report.dropped[r] for r in ("too_long", "length_ratio")}
        report.dropped_by_split = {"train": dropped, "valid": {"too_long": 0, "length_ratio": 0},
                                   "test": {"too_long": 0, "length_ratio": 0}}
        n_train_before = int((labels == 0).sum())
        n_train = sum(e["n_train"] for e in encoded)
        if n_train == 0:
            raise DataInputError(
                f"every one of the {n_train_before:,} training pairs is over the length limits "
                f"({dropped['too_long']:,} too_long with max_len={cfg.max_len}, {dropped['length_ratio']:,} "
                f"length_ratio with max_len_ratio={cfg.max_len_ratio:g}); {length_hint(hist, dropped)}")
        counts, tokens = {}, {}
        phase("encode")
        _assemble_train(tmp, encoded, first, dtype, counts, tokens)
        truncated = {}
        for s in ("valid", "test"):
            if s in evals:
                held = _encode_eval(tok, evals[s], cfg.max_len)
            else:
                held = _merge_held([e["held"][s] for e in encoded], first)
            truncated[s] = held.pop("truncated")
            _save_held(tmp, s, held, dtype, counts, tokens)
        meta = {
            "format": CACHE_FORMAT, "key": key, "tokenizer_key": tok_key if tokenizer is None else sets["tokenizer"]["given"],
            "id_dtype": dtype, "counts": counts, "tokens": tokens, "report": report.as_dict(),
            "length_hint": length_hint(hist, dropped) if n_train_before else "",
            "train_before_length_filter": n_train_before,
            "record": {
                "source": inp.label, "paths": list(inp.paths), "fingerprint": fingerprint,
                "split_digest": C.digest(hashlib.sha256(labels.tobytes()).hexdigest()),
                "split_seed": cfg.split_seed, "valid_size": cfg.valid_size, "test_size": cfg.test_size,
                "grouping": cfg.split_grouping, "normalisation": NORMALISATION, "heldout_max_group": HELDOUT_MAX_GROUP,
                "eval_files": {s: list(f) for s, f in inp.evals.items()},
                "removed_for_eval_files": int(leak.sum()),
                "overlap": olap, "truncated": truncated,  # then "rows_before_length_filter" and "sizes", derived
                "asked": {"valid": n_valid, "test": n_test},  # rows the settings asked for (of the clean rows)
                "spm_sample_pairs": None if tokenizer is not None else cfg.spm_sample_pairs,
            },
        }
        C.write_json(tmp / "meta.json", meta)
        final = cache / f"corpus-{key}"
        C.publish(tmp, final)
        phase("write")
        n_tok = sum(v["src"] + v["tgt"] for v in tokens.values())
        procs = min(run.workers, len(inp.chunks))
        how = f"{procs} processes" if procs > 1 else "this process"
        log(f"[data] built {n:,} clean pairs ({n_tok:,} subwords) in {len(inp.chunks)} chunk"
            f"{'s' * (len(inp.chunks) != 1)} with {how} in {time.perf_counter() - t0:.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + f") -> {final}")
    finally:
        run.close()
        _TOKENIZERS.clear()  # in-process runs: a later build may retrain a model at the same path
        C.remove(tmp)
    entry = load_entry(cache, key, log)
    if entry is None:
        raise RuntimeError(f"the data cache entry {cache / f'corpus-{key}'} did not load right after its build")
    return entry


def _tokenizer(cfg, cache: Path, tok_key: str, spm_set: dict, labels, h_pair, first, run: _Runner, tmp: Path,
               log) -> Tokenizer:
    """The cached ``spm-<tok_key>`` model, or one trained on the seeded sample of train pairs."""
    out = cache / f"spm-{tok_key}"
    threads = cfg.spm_threads or build_workers(cfg)
    with C.locked(cache, tok_key, log, "this tokenizer"):
        if out.is_dir():
            try:
                if C.read_json(out / "settings.json") != spm_set:
                    raise ValueError("settings.json differs from the settings")
                return Tokenizer(out / "spm.model", tok_key, threads, inside=cache)
            except (OSError, ValueError, RuntimeError, TypeError) as e:
                C.discard(out, f"{type(e).__name__}: {str(e)[:120]}", log)
        train = np.flatnonzero(labels == 0)
        k = cfg.spm_sample_pairs or len(train)
        if k < len(train):
            sk = mix64(h_pair[train], cfg.split_seed ^ 0x5EED)
            pick = np.sort(train[np.argpartition(sk, k - 1)[:k]])
        else:
            pick = train
        chunk_of = np.searchsorted(first, pick, side="right") - 1
        jobs = [(i, str(tmp), pick[chunk_of == i] - first[i]) for i in range(len(first) - 1)]
        parts = run.map(_sample, jobs)
        texts = [t for s, _ in parts for t in s] + [t for _, t in parts for t in t]
        spm_tmp = C.temp_dir(cache, tok_key)
        try:
            train_spm(texts, spm_set, spm_tmp, threads, cfg)
            C.write_json(spm_tmp / "settings.json", spm_set)
            C.publish(spm_tmp, out)
        finally:
            C.remove(spm_tmp)
        tok = Tokenizer(out / "spm.model", tok_key, threads, inside=cache)
        log(f"[data] trained SentencePiece {spm_set['model_type']} vocab {tok.vocab_size} on a seeded sample of "
            f"{len(pick):,} train pairs ({len(texts):,} sentences) -> {out / 'spm.model'}")
        return tok


def _text_hashes(texts: list[str]) -> np.ndarray:
    """The 64-bit hashes of the normalised texts (the keys the split groups by)."""
    return np.fromiter((hash64(normalise(x)) for x in texts), np.uint64, len(texts))


def _overlaps(cfg, eval_hashes: dict, labels, h_src, h_tgt, n_test: int, n_valid: int) -> dict:
    """Valid/test rows whose normalised source/target occurs in train: "after" this split, and "before":
    the row-level split of 8c2d91d (same sizes and seed) for a split taken from the corpus, or the whole
    corpus (before the in_eval_files removal) for your own files."""
    def hits(held, train_hashes) -> int:
        # searches the train hashes in the (small) sorted held-out set instead of sorting train: one pass, no sort
        found = train_hashes[in_sorted(train_hashes, sorted_unique(held))]
        return int(in_sorted(held, sorted_unique(found)).sum())

    def count(s_held, t_held, train) -> dict:
        return {"rows": len(s_held), "source": hits(s_held, h_src[train]), "target": hits(t_held, h_tgt[train])}

    row_level = row_level_split(len(labels), n_test, n_valid, cfg.split_seed)
    out = {"before": {}, "after": {}}
    for s, code in (("valid", 1), ("test", 2)):
        if s in eval_hashes:
            hs, ht = eval_hashes[s]
            out["before"][s] = count(hs, ht, slice(None))
        else:
            hs, ht = h_src[labels == code], h_tgt[labels == code]
            out["before"][s] = count(h_src[row_level == code], h_tgt[row_level == code], row_level == 0)
        out["after"][s] = count(hs, ht, labels == 0)
    return out


def _assemble_train(tmp: Path, encoded: list[dict], first, dtype: str, counts: dict, tokens: dict) -> None:
    """Append the train parts (in chunk order) to one array file per side, plus offsets and clean-row
    indices: written through plain file writes, one part in memory at a time (a memory map of the whole
    arrays would count every written page in this process's resident memory: ~90 bytes a pair)."""
    n = sum(e["n_train"] for e in encoded)
    tot = {"src": sum(e["tokens"][0] for e in encoded), "tgt": sum(e["tokens"][1] for e in encoded)}
    shapes = {"src_ids": (dtype, tot["src"]), "tgt_ids": (dtype, tot["tgt"]), "src_off": (np.int64, n + 1),
              "tgt_off": (np.int64, n + 1), "rows": (np.int64, n)}
    out, header = {}, {}
    with contextlib.ExitStack() as stack:
        for name, (dt, size) in shapes.items():
            out[name] = stack.enter_context(open(tmp / f"train_{name}.npy", "wb"))
            np.lib.format.write_array_header_1_0(out[name], {
                "descr": np.lib.format.dtype_to_descr(np.dtype(dt)), "fortran_order": False, "shape": (size,)})
            header[name] = out[name].tell()
        r = {"src": 0, "tgt": 0}
        for side in ("src", "tgt"):
            np.zeros(1, np.int64).tofile(out[f"{side}_off"])
        for i in range(len(encoded)):
            for side in ("src", "tgt"):
                ids, lens = (load_npy(tmp / f"b-{i}-{side}_{a}.npy", "scratch array", own=True, mmap=False)
                             for a in ("ids", "len"))
                ids.astype(dtype, copy=False).tofile(out[f"{side}_ids"])
                (r[side] + np.cumsum(lens, dtype=np.int64)).tofile(out[f"{side}_off"])
                r[side] += len(ids)
            (first[i] + load_npy(tmp / f"b-{i}-rows.npy", "scratch array", own=True, mmap=False)).astype(np.int64, copy=False).tofile(out["rows"])
            for name in ("src_ids", "src_len", "tgt_ids", "tgt_len", "rows"):
                os.unlink(tmp / f"b-{i}-{name}.npy")
        for name, (dt, size) in shapes.items():  # the header promised exactly what was written
            wrote = out[name].tell() - header[name]
            if wrote != size * np.dtype(dt).itemsize:
                raise RuntimeError(f"train_{name}.npy: wrote {wrote} bytes of data, the header says "
                                   f"{size} x {np.dtype(dt)}")
    counts["train"], tokens["train"] = n, tot


def _merge_held(parts: list[dict], first) -> dict:
    out = {"src": [], "tgt": [], "src_ids": [], "tgt_ids": [], "rows": [], "truncated": 0}
    for i, p in enumerate(parts):
        for k in ("src", "tgt", "src_ids", "tgt_ids"):
            out[k] += p[k]
        out["rows"] += (first[i] + p["local"]).tolist()
        out["truncated"] += p["truncated"]
    return out


def _encode_eval(tok: Tokenizer, texts: tuple[list[str], list[str]], max_len: int) -> dict:
    src, tgt = texts
    ids_s = [x.tolist() for x in tok.encode(src)]
    ids_t = [x.tolist() for x in tok.encode(tgt)]
    over = sum(len(a) + 1 > max_len or len(b) + 1 > max_len for a, b in zip(ids_s, ids_t))
    return {"src": src, "tgt": tgt, "src_ids": [x[: max_len - 1] for x in ids_s],
            "tgt_ids": [x[: max_len - 1] for x in ids_t], "rows": list(range(len(src))), "truncated": over}


def _save_held(tmp: Path, s: str, held: dict, dtype: str, counts: dict, tokens: dict) -> None:
    n = len(held["src"])
    tokens[s] = {}
    for side in ("src", "tgt"):
        lens = np.fromiter(map(len, held[f"{side}_ids"]), np.int64, n)
        off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=off[1:])
        np.save(tmp / f"{s}_{side}_off.npy", off)
        np.save(tmp / f"{s}_{side}_ids.npy",
                np.fromiter(itertools.chain.from_iterable(held[f"{side}_ids"]), dtype, int(off[-1])))
        tokens[s][side] = int(off[-1])
    np.save(tmp / f"{s}_rows.npy", np.asarray(held["rows"], dtype=np.int64))
    C.write_json(tmp / f"{s}_text.json", {"src": held["src"], "tgt": held["tgt"]})
    counts[s] = n


def as_read_by(meta: dict, inp: Inputs) -> dict:
    """``meta`` of an entry as this run read it. An entry is found by its content, so a run may reuse one that
    another run built from files of the same bytes under other names (a copy, a move): its source, file lists
    and the cleaning report's ``file:line`` examples then name *this* run's files, file i for file i (the
    content hash covers the files in order, each with its size). The entry's own meta.json is left as built."""
    rec = meta["record"]
    old = rec.get("paths")
    if old is None and rec.get("source", "").startswith("files:"):  # an entry built before "paths" was recorded
        old = rec["source"][len("files:"):].split(",")
    pairs = list(zip(old, inp.paths)) if old is not None and len(old) == len(inp.paths) else []
    for s, files in inp.evals.items():
        before = (rec.get("eval_files") or {}).get(s) or []
        if len(before) == len(files):
            pairs += zip(before, files)
    renamed = {a: b for a, b in pairs if a != b}
    if not renamed and rec.get("source") == inp.label:
        return meta
    olds = sorted(renamed, key=len, reverse=True)

    def name(text: str) -> str:  # "path:line", "path[i]", "path row n": the path as this run gave it
        for a in olds:
            if text.startswith(a) and text[len(a):len(a) + 1] in (":", "[", " "):
                return renamed[a] + text[len(a):]
        return text

    report = {**meta["report"], "examples": {k: [name(e) for e in v]
                                             for k, v in (meta["report"].get("examples") or {}).items()}}
    record = {**rec, "source": inp.label, "paths": list(inp.paths),
              "eval_files": {s: list(f) for s, f in inp.evals.items()}}
    if renamed:
        record["cache_built_from"] = rec.get("source")  # the entry's builder read the same bytes under these names
    return {**meta, "report": report, "record": record}

