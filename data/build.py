"""The cold build of a corpus entry (`data.entry`), streaming, parallel and in memory that does not grow with
the corpus.

Passes (each a task per input chunk of ~8 MB, `data.sources.plan_chunks`, run by ``build_workers`` forked
processes, results merged in input order, so the output never depends on the worker count):
  A  read, clean, normalise and hash every row: per row a 64-bit hash of the normalised source and target
     (the split's groups) and of the exact pair (the fingerprint, the tokenizer sample). The cleaned texts and
     the hashes go to scratch files per chunk (``a-<i>*``): nothing corpus-sized stays in memory.
  -  the split (`data.split.heldout_groups`): streaming passes in this process over the chunks' hash files:
     one collects the candidate group keys and the fingerprint, a few ``scan`` the rows that share the
     candidates' hashes (only the held-out groups are ever formed), one writes each chunk's labels (train,
     valid, test, or removed: in your valid/test files) and counts the overlap before (the row-level split of
     8c2d91d) and after, and draws the tokenizer's sample. State: the held-out rows and candidates, and the
     sample, never a value per row of the corpus.
  -  SentencePiece trained on a seeded sample of ``spm_sample_pairs`` train pairs (the pairs with the
     smallest seeded pair hash, ties to the earlier row: the same sample for any chunking), or the given
     tokenizer.
  B  encode each chunk (`data.encode.WordEncoder`: each distinct word once, in parallel over the workers);
     train pairs are length-filtered, valid/test pairs are kept whole (token arrays cut to ``max_len``,
     counted); the train parts are copied into one memory-mappable array per side.
Peak memory: one chunk per worker (and its word cache), plus in this process one chunk's hashes, the held-out
rows and the tokenizer's sample; the row-level split of the overlap record holds 4 bytes a row for a moment.
The time of each phase is logged and kept in meta.json's ``build`` (bench/results/data-scale-cpu.md).

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
from .clean import MAX_EXAMPLES, CleanReport, DataInputError, Tally, clean_row, length_examples, length_mask
from .encode import WordEncoder, string_array
from .entry import CACHE_FORMAT, Entry, Inputs, build_workers, load_entry
from .files import load_npy, open_own
from .sources import read_chunk, read_local, where
from .split import (
    HELDOUT_MAX_GROUP,
    NORMALISATION,
    KeySet,
    SmallestKeys,
    hash64,
    hash64_bytes,
    heldout_groups,
    in_sorted,
    mix64,
    normalise,
    normalise_bytes,
    row_level_heldout,
    sorted_unique,
)
from .tokenizer import Tokenizer, train_spm
from .workers import ignore_stop_signals

_SPLIT_CODE = {"train": 0, "valid": 1, "test": 2}
_LEN_CAP = 4096  # train length histograms (for the length hints) clip here
_SAMPLE_SEED = 0x5EED  # xor-ed into split_seed: the tokenizer sample's order of pairs
PHASES = ("read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write")


# ----------------------------------------------------------------------------------------------
# Scratch files of a build (its own temp folder; read back only when this user wrote them)
# ----------------------------------------------------------------------------------------------
def _scratch(tmp, name: str) -> str:
    """A scratch file's path, a plain str: a Path would intern every (unique) file name for the process's life."""
    return os.path.join(tmp, name)


def _save(tmp, name: str, a: np.ndarray) -> None:
    np.save(_scratch(tmp, name), a)


def _load(tmp, name: str) -> np.ndarray:
    """A scratch array `_save` wrote, through the one reader (read back only when this user wrote it)."""
    return load_npy(_scratch(tmp, name), "scratch array", own=True, mmap=False)


def _eval_leak(h: np.ndarray, eval_keys: tuple[KeySet, KeySet] | None) -> np.ndarray | None:
    """Rows (of one chunk's hashes ``h``) whose normalised source, or target, is in your valid/test files (None:
    no such files). ``eval_keys``: the files' source and target hashes (targets empty with split_grouping
    source)."""
    if eval_keys is None:
        return None
    return eval_keys[0].contains(h[0]) | eval_keys[1].contains(h[1])


# ----------------------------------------------------------------------------------------------
# Worker tasks (module level: they run in forked processes)
# ----------------------------------------------------------------------------------------------
def _scan(job) -> dict:
    """Pass A on one chunk: parse, clean, hash; cleaned texts, positions and hashes to ``tmp/a-<i>*``
    (`_save_texts`). Returns the counts, the rejects and the seconds of each step."""
    i, chunk, src_lang, tgt_lang, tmp, eval_keys = job
    t0 = time.perf_counter()
    rows = read_chunk(chunk, src_lang, tgt_lang)
    t1 = time.perf_counter()
    tally, src, tgt, pos, n_read = rows.rejects, [], [], [], rows.read
    for p, row in zip(rows.positions, rows.translation):
        got = clean_row(row, src_lang, tgt_lang)
        if got[0] is None:
            tally.add(got[1], p, got[2])
            continue
        src.append(got[0])
        tgt.append(got[1])
        pos.append(p)
    del rows
    t2 = time.perf_counter()
    b_src, b_tgt = [x.encode() for x in src], [x.encode() for x in tgt]  # clean texts: no lone surrogates
    h = np.stack([hash64_bytes(normalise_bytes(src)), hash64_bytes(normalise_bytes(tgt)),
                  hash64_bytes([s + b"\t" + t for s, t in zip(b_src, b_tgt)])]) if src else np.zeros((3, 0), np.uint64)
    leak = _eval_leak(h, eval_keys)
    t3 = time.perf_counter()
    _save_texts(tmp, i, b_src + b_tgt, pos)
    _save(tmp, f"a-{i}-h.npy", h)
    t4 = time.perf_counter()
    return {"read": n_read, "tally": tally, "kept": len(pos),
            "leaked": 0 if leak is None else int(leak.sum()),
            "seconds": {"read": t1 - t0, "clean": t2 - t1, "hash": t3 - t2, "scratch": t4 - t3}}


def _save_texts(tmp, i: int, enc: list[bytes], pos: list[int]) -> None:
    """A chunk's cleaned texts as UTF-8 back to back (``a-<i>.txt``: every source, then every target) with the
    (2n+1,) byte offsets of each text and the rows' positions: the tokenizer's sample reads only its rows, pass
    B reads the chunk once (`_load_blob`) and decodes only the words it has not seen."""
    off = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc)), out=off[1:])
    with open(_scratch(tmp, f"a-{i}.txt"), "wb") as f:
        f.write(b"".join(enc))
    _save(tmp, f"a-{i}-off.npy", off)
    _save(tmp, f"a-{i}-pos.npy", np.asarray(pos, dtype=np.int64))


def _load_blob(tmp, i: int) -> tuple[bytes, np.ndarray]:
    """Chunk i's texts as `_save_texts` wrote them: the UTF-8 blob and the (2n+1,) offsets (read back only when
    this user wrote them)."""
    off = _load(tmp, f"a-{i}-off.npy")
    with open_own(_scratch(tmp, f"a-{i}.txt")) as f:
        return f.read(), off


def _load_texts(tmp, i: int, rows) -> tuple[list[str], list[str]]:
    """(sources, targets) of chunk i's rows ``rows`` (local indices): only their bytes are read."""
    off = _load(tmp, f"a-{i}-off.npy")
    n = (len(off) - 1) // 2
    rows = np.asarray(rows, dtype=np.int64)
    with open_own(_scratch(tmp, f"a-{i}.txt")) as f:
        fd = f.fileno()
        return tuple([os.pread(fd, int(b - a), int(a)).decode() for a, b in zip(off[r].tolist(), off[r + 1].tolist())]
                     for r in (rows, n + rows))


def _sample(job) -> tuple[list[str], list[str]]:
    """The sampled rows (local indices) of one chunk's cleaned texts."""
    i, tmp, local = job
    return _load_texts(tmp, i, local)


_TOKENIZERS: dict[str, tuple[Tokenizer, WordEncoder]] = {}  # per worker process: loaded once per model file


def _worker_tokenizer(model_file: str, bpe: bool) -> tuple[Tokenizer, WordEncoder]:
    if model_file not in _TOKENIZERS:
        tok = Tokenizer(model_file, num_threads=1)
        _TOKENIZERS[model_file] = tok, WordEncoder(tok.sp, bpe)
    return _TOKENIZERS[model_file]


def _rows_of(ids: np.ndarray, off: np.ndarray, keep: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The ids of the texts ``keep`` (``ids`` back to back, text k at ``off[k]:off[k+1]``) back to back, and
    their int32 lengths."""
    lens = (off[keep + 1] - off[keep]).astype(np.int64)
    ends = np.cumsum(lens)
    at = np.repeat(off[keep] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
    return ids[at].astype(dtype), lens.astype(np.int32)


def _encode(job) -> dict:
    """Pass B on one chunk: encode; train rows length-filtered into part files; valid/test rows returned
    whole (texts) with token arrays cut to ``max_len``."""
    i, tmp, model_file, bpe, max_len, max_ratio, dtype = job
    t0 = time.perf_counter()
    blob, off = _load_blob(tmp, i)
    n = (len(off) - 1) // 2
    pos = _load(tmp, f"a-{i}-pos.npy").tolist()
    labels = _load(tmp, f"a-{i}-lab.npy")
    for name in (f"a-{i}.txt", f"a-{i}-off.npy", f"a-{i}-pos.npy", f"a-{i}-h.npy", f"a-{i}-lab.npy"):
        os.unlink(_scratch(tmp, name))

    def text(k: int) -> str:  # text k of the chunk (sources 0..n-1, then targets)
        return blob[off[k]:off[k + 1]].decode()

    t1 = time.perf_counter()
    _, words = _worker_tokenizer(model_file, bpe)
    ids_s, len_s = words.encode(string_array(blob, off[: n + 1]))
    ids_t, len_t = words.encode(string_array(blob, off[n:]))
    t2 = time.perf_counter()
    off_s, off_t = np.concatenate([[0], np.cumsum(len_s)]), np.concatenate([[0], np.cumsum(len_t)])
    ls, lt = len_s + 1, len_t + 1  # incl. EOS / BOS
    train = np.flatnonzero(labels == 0)
    ok, dropped = length_mask(ls[train], lt[train], max_len, max_ratio)
    tally = Tally()
    for k, reason, detail in length_examples(ls[train], lt[train], max_len, max_ratio):
        tally.add(reason, pos[train[k]], detail)
    tally.counts.update(dropped)  # every drop counted, the first MAX_EXAMPLES shown
    hi = np.maximum(ls[train], lt[train])
    leaked = np.flatnonzero(labels == -1)  # removed: in your valid/test files
    for k in leaked[:MAX_EXAMPLES].tolist():
        tally.add("in_eval_files", pos[k], f"source {text(k)[:50]!r}")
    if len(leaked) > MAX_EXAMPLES:
        tally.counts["in_eval_files"] = len(leaked)
    keep = train[ok]
    part = {}
    part["src_ids"], part["src_len"] = _rows_of(ids_s, off_s, keep, dtype)
    part["tgt_ids"], part["tgt_len"] = _rows_of(ids_t, off_t, keep, dtype)
    part["rows"] = keep.astype(np.int64)
    for name, a in part.items():
        _save(tmp, f"b-{i}-{name}.npy", a)
    held = {}
    cut = max_len - 1  # subwords that fit with EOS / BOS
    for s in ("valid", "test"):
        idx = np.flatnonzero(labels == _SPLIT_CODE[s]).tolist()
        if not idx:  # most chunks: nothing held out (the main process keeps only the chunks that hold some)
            continue
        held[s] = {"src": [text(k) for k in idx], "tgt": [text(n + k) for k in idx],
                   "src_ids": [ids_s[off_s[k]:min(off_s[k + 1], off_s[k] + cut)].tolist() for k in idx],
                   "tgt_ids": [ids_t[off_t[k]:min(off_t[k + 1], off_t[k] + cut)].tolist() for k in idx],
                   "local": np.asarray(idx, dtype=np.int64),
                   "truncated": int(sum(ls[k] > max_len or lt[k] > max_len for k in idx))}
    t3 = time.perf_counter()
    return {"tally": tally, "n_train": len(keep), "tokens": (int(part["src_len"].sum()), int(part["tgt_len"].sum())),
            "held": held, "longer": np.bincount(np.minimum(hi, _LEN_CAP)), "word_check_failed": words.disagreed,
            "seconds": {"scratch": t1 - t0, "encode": t2 - t1, "write": t3 - t2}}


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
    """Runs a task over jobs, results in input order: in this process (one worker or one job) or in forked
    workers. `imap` yields each result as its turn comes, so nothing waits for a whole pass in memory."""

    def __init__(self, workers: int):
        self.workers, self.pool = workers, None

    def imap(self, fn, jobs: list):
        if self.workers <= 1 or len(jobs) <= 1:
            yield from map(fn, jobs)
            return
        if self.pool is None:
            method = START_METHOD if START_METHOD in multiprocessing.get_all_start_methods() else None
            ctx = multiprocessing.get_context(method)
            self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init,
                                               initargs=(os.getpid(),))
        try:
            yield from self.pool.map(fn, jobs)
        except cf.process.BrokenProcessPool:
            raise RuntimeError("a data build worker process died (killed by a signal or out of memory); "
                               "run again: the build restarts from the beginning") from None

    def map(self, fn, jobs: list) -> list:
        return list(self.imap(fn, jobs))

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
    clock = _Clock()
    try:
        evals = {s: read_eval_files(files, s, cfg.src_lang, cfg.tgt_lang) for s, files in inp.evals.items()}
        eval_hashes = {s: (_text_hashes(es), _text_hashes(et)) for s, (es, et) in evals.items()}
        eval_keys = None
        if eval_hashes:
            both = cfg.split_grouping == "source_target"
            eval_keys = (KeySet(np.concatenate([h[0] for h in eval_hashes.values()])),
                         KeySet(np.concatenate([h[1] for h in eval_hashes.values()]) if both else np.zeros(0)))
        clock.lap("read")
        # ---- pass A
        jobs = [(i, c, cfg.src_lang, cfg.tgt_lang, str(tmp), eval_keys) for i, c in enumerate(inp.chunks)]
        report = CleanReport()
        lines_before, reads, kept = [0] * len(inp.files), [0] * len(inp.files), [0] * len(inp.files)
        bases, kept_chunk, n_leaked = [], [], 0
        for c, sc in zip(inp.chunks, run.imap(_scan, jobs)):
            f = inp.files[c.file]
            bases.append(lines_before[c.file] + 1 if f.unit == "line" else c.base)
            lines_before[c.file] += sc["read"]
            reads[c.file] += sc["read"]
            kept[c.file] += sc["kept"]
            report.rows += sc["read"]
            report.merge(sc["tally"], lambda pos, f=f, b=bases[-1]: where(f, b + pos))
            kept_chunk.append(sc["kept"])
            n_leaked += sc["leaked"]
            clock.work(sc["seconds"])
        clock.share(("read", "clean", "hash", "scratch"))
        _per_file_check(inp, reads, kept, report)
        first = np.concatenate([[0], np.cumsum(kept_chunk, dtype=np.int64)])  # clean-row index of each chunk's first row
        n = int(first[-1])
        n_free = n - n_leaked
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
        # ---- the split
        hashes = _Hashes(tmp, first, eval_keys)
        sample_k = cfg.spm_sample_pairs if tokenizer is None else None  # a given tokenizer: no sample
        split = _split(cfg, hashes, n, n_test, n_valid, eval_hashes, sample_k)
        clock.lap("group")
        # ---- tokenizer
        if tokenizer is not None:
            model_file = tmp / "given-spm.model"
            model_file.write_bytes(tokenizer.model_bytes())
            tok, bpe = tokenizer, False  # a model from elsewhere: encoded sentence by sentence
        else:
            tok = _tokenizer(cfg, cache, tok_key, sets["tokenizer"], split["sample"], first, run, tmp, log)
            model_file, bpe = Path(tok.model_file), sets["tokenizer"]["model_type"] == "bpe"
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "int32"
        clock.lap("tokenizer")
        # ---- pass B
        jobs = [(i, str(tmp), str(model_file), bpe, cfg.max_len, cfg.max_len_ratio, dtype)
                for i in range(len(inp.chunks))]
        hist = np.zeros(_LEN_CAP + 1, dtype=np.int64)
        parts, held_parts, checks_failed = [], {"valid": [], "test": []}, 0
        for i, e in enumerate(run.imap(_encode, jobs)):
            f = inp.files[inp.chunks[i].file]
            report.merge(e["tally"], lambda pos, f=f, b=bases[i]: where(f, b + pos))
            hist[: len(e["longer"])] += e["longer"]
            parts.append((e["n_train"], e["tokens"]))
            for s, part in e["held"].items():
                held_parts[s].append((i, part))
            checks_failed += e["word_check_failed"]
            clock.work(e["seconds"])
        if checks_failed:
            log(f"[data] warning: encoding word by word disagreed with SentencePiece on a checked sentence in "
                f"{checks_failed} chunk{'s' * (checks_failed != 1)}; those were encoded sentence by sentence")
        clock.share(("scratch", "encode", "write"), into={"scratch": "encode"})
        dropped = {r: report.dropped[r] for r in ("too_long", "length_ratio")}
        report.dropped_by_split = {"train": dropped, "valid": {"too_long": 0, "length_ratio": 0},
                                   "test": {"too_long": 0, "length_ratio": 0}}
        n_train_before = split["n_train"]
        n_train = sum(p[0] for p in parts)
        if n_train == 0:
            raise DataInputError(
                f"every one of the {n_train_before:,} training pairs is over the length limits "
                f"({dropped['too_long']:,} too_long with max_len={cfg.max_len}, {dropped['length_ratio']:,} "
                f"length_ratio with max_len_ratio={cfg.max_len_ratio:g}); {length_hint(hist, dropped)}")
        counts, tokens = {}, {}
        _assemble_train(tmp, parts, first, dtype, counts, tokens)
        truncated = {}
        for s in ("valid", "test"):
            if s in evals:
                held = _encode_eval(tok, evals[s], cfg.max_len)
            else:
                held = _merge_held(held_parts[s], first)
            truncated[s] = held.pop("truncated")
            _save_held(tmp, s, held, dtype, counts, tokens)
        meta = {
            "format": CACHE_FORMAT, "key": key, "tokenizer_key": tok_key if tokenizer is None else sets["tokenizer"]["given"],
            "id_dtype": dtype, "counts": counts, "tokens": tokens, "report": report.as_dict(),
            "length_hint": length_hint(hist, dropped) if n_train_before else "",
            "train_before_length_filter": n_train_before,
            "record": {
                "source": inp.label, "paths": list(inp.paths), "fingerprint": split["fingerprint"],
                "split_digest": split["digest"],
                "split_seed": cfg.split_seed, "valid_size": cfg.valid_size, "test_size": cfg.test_size,
                "grouping": cfg.split_grouping, "normalisation": NORMALISATION, "heldout_max_group": HELDOUT_MAX_GROUP,
                "eval_files": {s: list(f) for s, f in inp.evals.items()},
                "removed_for_eval_files": n_leaked,
                "overlap": split["overlap"], "truncated": truncated,  # then "rows_before_length_filter" and "sizes", derived
                "asked": {"valid": n_valid, "test": n_test},  # rows the settings asked for (of the clean rows)
                "spm_sample_pairs": None if tokenizer is not None else cfg.spm_sample_pairs,
            },
        }
        clock.lap("write")
        meta["build"] = {"seconds": round(time.perf_counter() - t0, 3), "phases": clock.rounded(),
                         "workers": run.workers, "chunks": len(inp.chunks)}
        C.write_json(tmp / "meta.json", meta)
        final = cache / f"corpus-{key}"
        C.publish(tmp, final)
        n_tok = sum(v["src"] + v["tgt"] for v in tokens.values())
        procs = min(run.workers, len(inp.chunks))
        how = f"{procs} processes" if procs > 1 else "this process"
        log(f"[data] built {n:,} clean pairs ({n_tok:,} subwords) in {len(inp.chunks)} chunk"
            f"{'s' * (len(inp.chunks) != 1)} with {how} in {time.perf_counter() - t0:.1f} s ("
            + ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases.items()) + f") -> {final}")
    finally:
        run.close()
        _TOKENIZERS.clear()  # in-process runs: a later build may retrain a model at the same path
        C.remove(tmp)
    entry = load_entry(cache, key, log)
    if entry is None:
        raise RuntimeError(f"the data cache entry {cache / f'corpus-{key}'} did not load right after its build")
    return entry


class _Clock:
    """Seconds per phase of a build. `lap` gives the time since the last lap to one phase; the parallel passes
    give theirs to their steps in proportion to the seconds the workers spent in each (`work`, `share`)."""

    def __init__(self):
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.t = time.perf_counter()
        self.worked: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self.t
        self.t = now

    def work(self, seconds: dict) -> None:
        for k, v in seconds.items():
            self.worked[k] = self.worked.get(k, 0.0) + v

    def share(self, steps: tuple[str, ...], into: dict | None = None) -> None:
        now = time.perf_counter()
        wall, total = now - self.t, sum(self.worked.get(k, 0.0) for k in steps) or 1.0
        for k in steps:
            self.phases[(into or {}).get(k, k)] += wall * self.worked.get(k, 0.0) / total
        self.t, self.worked = now, {}

    def rounded(self) -> dict:
        return {k: round(v, 3) for k, v in self.phases.items()}


class _Hashes:
    """The per-row hashes of pass A, chunk by chunk from the scratch files: ``(i, h, free)`` with ``h`` (3, n_i)
    uint64 (normalised source, normalised target, pair) and ``free`` the rows not removed for your valid/test
    files (None: every row)."""

    def __init__(self, tmp: Path, first: np.ndarray, eval_keys):
        self.tmp, self.first, self.eval_keys = tmp, first, eval_keys

    def __iter__(self):
        for i in range(len(self.first) - 1):
            h = _load(self.tmp, f"a-{i}-h.npy")
            leak = _eval_leak(h, self.eval_keys)
            yield i, h, None if leak is None else ~leak

    def scan(self, src_keys: KeySet, tgt_keys: KeySet, cap: int):
        """`data.split.heldout_groups`' scan: the free rows whose source hash is in ``src_keys`` or target hash in
        ``tgt_keys``, the first ``cap`` rows per key and side (row order)."""
        seen = [np.zeros(len(src_keys), np.int64), np.zeros(len(tgt_keys), np.int64)]
        rows, hs, ht = [], [], []
        for i, h, free in self:
            keep = np.zeros(h.shape[1], dtype=bool)
            for side, keys in ((0, src_keys), (1, tgt_keys)):
                if not len(keys):
                    continue
                hit = keys.contains(h[side])
                if free is not None:
                    hit &= free
                at = np.flatnonzero(hit)
                if not len(at):
                    continue
                k = keys.index(h[side][at])
                order = np.argsort(k, kind="stable")
                ks = k[order]
                starts = np.r_[0, np.flatnonzero(ks[1:] != ks[:-1]) + 1]
                rank = np.arange(len(ks)) - np.repeat(starts, np.diff(np.r_[starts, len(ks)]))
                ok = seen[side][ks] + rank < cap
                keep[at[order[ok]]] = True
                np.add.at(seen[side], ks, 1)
            local = np.flatnonzero(keep)
            rows.append(self.first[i] + local)
            hs.append(h[0][local])
            ht.append(h[1][local])
        cat = np.concatenate
        return cat(rows) if rows else np.zeros(0, np.int64), cat(hs) if hs else np.zeros(0, np.uint64), \
            cat(ht) if ht else np.zeros(0, np.uint64)


class _Overlap:
    """How many held-out rows have a normalised source (target) that some train row also has: the held-out
    rows' hashes are kept, the train rows stream by chunk (`see`)."""

    def __init__(self, h_src: np.ndarray, h_tgt: np.ndarray):
        self.held = (np.asarray(h_src, dtype=np.uint64), np.asarray(h_tgt, dtype=np.uint64))
        self.keys = (KeySet(self.held[0]), KeySet(self.held[1]))
        self.found: tuple[list, list] = ([], [])

    def see(self, h_src: np.ndarray, h_tgt: np.ndarray) -> None:
        for side, h in enumerate((h_src, h_tgt)):
            hit = h[self.keys[side].contains(h)]
            if len(hit):
                self.found[side].append(sorted_unique(hit))

    def result(self) -> dict:
        def hits(side: int) -> int:
            found = sorted_unique(np.concatenate(self.found[side])) if self.found[side] else np.zeros(0, np.uint64)
            return int(in_sorted(self.held[side], found).sum())

        return {"rows": len(self.held[0]), "source": hits(0), "target": hits(1)}


class _Sample:
    """The ``k`` train rows with the smallest seeded pair hash (ties: the earlier row), from rows streamed in
    row order (``k`` 0: every row; None: none)."""

    def __init__(self, k: int | None, seed: int):
        self.k, self.seed = k, seed ^ _SAMPLE_SEED
        self.key, self.rows = np.zeros(0, np.uint64), np.zeros(0, np.int64)  # kept, ascending by (key, row)
        self.buf: list[tuple[np.ndarray, np.ndarray]] = []
        self.n_buf = 0

    def add(self, h_pair: np.ndarray, rows: np.ndarray) -> None:
        if self.k is None:
            return
        if not self.k:
            self.buf.append((np.zeros(0, np.uint64), rows))
            return
        key = mix64(h_pair, self.seed)
        if len(self.key) == self.k:
            less = key < self.key[-1]  # an equal key is a later row: it loses the tie
            key, rows = key[less], rows[less]
        if len(key):
            self.buf.append((key, rows))
            self.n_buf += len(key)
            if self.n_buf >= self.k:
                self._merge()

    def _merge(self) -> None:
        key = np.concatenate([self.key] + [b[0] for b in self.buf])
        rows = np.concatenate([self.rows] + [b[1] for b in self.buf])
        order = np.lexsort((rows, key))[: self.k]
        self.key, self.rows, self.buf, self.n_buf = key[order], rows[order], [], 0

    def picked(self) -> np.ndarray:
        """The sampled rows, ascending."""
        if not self.k:  # every train row (0), or none (None)
            return np.concatenate([b[1] for b in self.buf]) if self.buf else np.zeros(0, np.int64)
        self._merge()
        return np.sort(self.rows)


def _split(cfg, hashes: _Hashes, n: int, n_test: int, n_valid: int, eval_hashes: dict, sample_k: int | None) -> dict:
    """The split from the hash files: writes each chunk's labels (``a-<i>-lab.npy``: 0 train, 1 valid, 2 test,
    -1 removed for your valid/test files) and returns the corpus fingerprint, the split digest, the train count
    before the length filter, the overlap record and the tokenizer's sample (rows)."""
    seed, grouping = cfg.split_seed, cfg.split_grouping
    rl = dict(zip(("test", "valid"), row_level_heldout(n, n_test, n_valid, seed))) if n_test + n_valid else {}
    k = 2 * (n_test + n_valid) + 1024
    held = None
    while held is None:
        # pass 1: the candidate group keys (and, once, the fingerprint and the row-level split's held-out hashes)
        cands = SmallestKeys(k, seed)
        fp = hashlib.sha256()
        rl_h = {s: ([], []) for s in rl}
        for i, h, free in hashes:
            cands.add(h[0] if free is None else h[0][free])
            fp.update(h[2].tobytes())
            lo, hi = hashes.first[i], hashes.first[i + 1]
            for s, rows in rl.items():
                local = rows[(rows >= lo) & (rows < hi)] - lo
                rl_h[s][0].append(h[0][local])
                rl_h[s][1].append(h[1][local])
        held = heldout_groups(hashes.scan, cands, n_test, n_valid, grouping)
        k *= 4  # rare: the candidates held fewer rows than asked (many groups over HELDOUT_MAX_GROUP)
    # pass 3: labels, split digest, overlaps, the tokenizer's sample
    before, after = {}, {}
    for s in ("valid", "test"):
        if s in eval_hashes:
            before[s] = _Overlap(*eval_hashes[s])
            after[s] = _Overlap(*eval_hashes[s])
        else:
            before[s] = _Overlap(*(np.concatenate(x) for x in rl_h[s])) if s in rl else _Overlap([], [])
            after[s] = _Overlap(held[s][1], held[s][2])
    rl_all = np.sort(np.concatenate(list(rl.values()))) if rl else np.zeros(0, np.int64)
    digest, sample, n_train = hashlib.sha256(), _Sample(sample_k, seed), 0
    for i, h, free in hashes:
        lo, hi = hashes.first[i], hashes.first[i + 1]
        labels = np.zeros(hi - lo, dtype=np.int8)
        if free is not None:
            labels[~free] = -1
        for s in ("valid", "test"):
            rows = held[s][0]
            labels[rows[(rows >= lo) & (rows < hi)] - lo] = _SPLIT_CODE[s]
        _save(hashes.tmp, f"a-{i}-lab.npy", labels)
        digest.update(labels.tobytes())
        train = np.flatnonzero(labels == 0)
        n_train += len(train)
        rl_train = np.ones(hi - lo, dtype=bool)  # the row-level split's train rows: every row it did not hold out
        rl_train[rl_all[(rl_all >= lo) & (rl_all < hi)] - lo] = False
        for s in ("valid", "test"):
            if s in eval_hashes:  # your own files: "before" is the whole corpus, "after" this train split
                before[s].see(h[0], h[1])
            else:
                before[s].see(h[0][rl_train], h[1][rl_train])
            after[s].see(h[0][train], h[1][train])
        sample.add(h[2][train], lo + train)
    return {"fingerprint": C.digest([cfg.src_lang, cfg.tgt_lang, fp.hexdigest()]),
            "digest": C.digest(digest.hexdigest()), "n_train": n_train, "sample": sample.picked(),
            "overlap": {"before": {s: before[s].result() for s in ("valid", "test")},
                        "after": {s: after[s].result() for s in ("valid", "test")}}}


def _tokenizer(cfg, cache: Path, tok_key: str, spm_set: dict, pick: np.ndarray, first, run: _Runner, tmp: Path,
               log) -> Tokenizer:
    """The cached ``spm-<tok_key>`` model, or one trained on the sampled train pairs ``pick`` (clean-row indices)."""
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
        chunk_of = np.searchsorted(first, pick, side="right") - 1
        jobs = [(i, str(tmp), pick[chunk_of == i] - first[i]) for i in range(len(first) - 1)]
        srcs, tgts = [], []
        for s, t in run.imap(_sample, jobs):
            srcs += s
            tgts += t
        texts = srcs + tgts
        del srcs, tgts
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


def _assemble_train(tmp: Path, parts: list[tuple[int, tuple[int, int]]], first, dtype: str, counts: dict,
                    tokens: dict) -> None:
    """Append the train parts (in chunk order; ``parts``: each one's pairs and (src, tgt) subwords) to one array
    file per side, plus offsets and clean-row indices: written through plain file writes, one part in memory at
    a time (a memory map of the whole arrays would count every written page in this process's resident memory:
    ~90 bytes a pair)."""
    n = sum(p[0] for p in parts)
    tot = {"src": sum(p[1][0] for p in parts), "tgt": sum(p[1][1] for p in parts)}
    shapes = {"src_ids": (dtype, tot["src"]), "tgt_ids": (dtype, tot["tgt"]), "src_off": (np.int64, n + 1),
              "tgt_off": (np.int64, n + 1), "rows": (np.int64, n)}
    out, header = {}, {}
    with contextlib.ExitStack() as stack:
        for name, (dt, size) in shapes.items():
            out[name] = stack.enter_context(open(_scratch(tmp, f"train_{name}.npy"), "wb"))
            np.lib.format.write_array_header_1_0(out[name], {
                "descr": np.lib.format.dtype_to_descr(np.dtype(dt)), "fortran_order": False, "shape": (size,)})
            header[name] = out[name].tell()
        r = {"src": 0, "tgt": 0}
        for side in ("src", "tgt"):
            np.zeros(1, np.int64).tofile(out[f"{side}_off"])
        for i in range(len(parts)):
            for side in ("src", "tgt"):
                ids, lens = _load(tmp, f"b-{i}-{side}_ids.npy"), _load(tmp, f"b-{i}-{side}_len.npy")
                ids.astype(dtype, copy=False).tofile(out[f"{side}_ids"])
                (r[side] + np.cumsum(lens, dtype=np.int64)).tofile(out[f"{side}_off"])
                r[side] += len(ids)
            (first[i] + _load(tmp, f"b-{i}-rows.npy")).astype(np.int64, copy=False).tofile(out["rows"])
            for name in ("src_ids", "src_len", "tgt_ids", "tgt_len", "rows"):
                os.unlink(_scratch(tmp, f"b-{i}-{name}.npy"))
        for name, (dt, size) in shapes.items():  # the header promised exactly what was written
            wrote = out[name].tell() - header[name]
            if wrote != size * np.dtype(dt).itemsize:
                raise RuntimeError(f"train_{name}.npy: wrote {wrote} bytes of data, the header says "
                                   f"{size} x {np.dtype(dt)}")
    counts["train"], tokens["train"] = n, tot


def _merge_held(parts: list[tuple[int, dict]], first) -> dict:
    """The held-out rows of one split from the chunks that hold some: ``(chunk, its part)`` in chunk order."""
    out = {"src": [], "tgt": [], "src_ids": [], "tgt_ids": [], "rows": [], "truncated": 0}
    for i, p in parts:
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

