"""The cold build of a corpus entry (`data.entry`), streaming, parallel and in memory that does not grow with
the corpus.

This module runs the phases in order (`build_entry`); each phase has its own module. Passes (each a task per
input chunk of ~8 MB, `data.sources.plan_chunks`, run by ``build_workers`` forked processes,
`data.workers.BuildRunner`, results merged in input order, so the output never depends on the worker count):
  A  `data.build_scan`: read, clean, normalise and hash every row: per row a 64-bit hash of the normalised
     source and target (the split's groups) and of the exact pair (the fingerprint, the tokenizer sample). The
     cleaned texts and the hashes go to scratch files per chunk (``a-<i>*``): nothing corpus-sized stays in
     memory.
  -  `data.build_split`: the split (`data.split.heldout_groups`): streaming passes in this process over the
     chunks' hash files: one collects the candidate group keys and the fingerprint, a few ``scan`` the rows
     that share the candidates' hashes (only the held-out groups are ever formed), one writes each chunk's
     labels (train, valid, test, or removed: in your valid/test files) and counts the overlap before (the
     row-level split of 8c2d91d) and after, and draws the tokenizer's sample. State: the held-out rows and
     candidates, and the sample, never a value per row of the corpus.
  -  `data.build_tokenizer`: SentencePiece trained on a seeded sample of ``spm_sample_pairs`` train pairs (the
     pairs with the smallest seeded pair hash, ties to the earlier row: the same sample for any chunking), or
     the given tokenizer.
  B  `data.build_encode`: encode each chunk (`data.encode.WordEncoder`: each distinct word once, in parallel
     over the workers); train pairs are length-filtered, valid/test pairs are kept whole (token arrays cut to
     ``max_len``, counted); the train parts are copied into one memory-mappable array per side.
Peak memory: one chunk per worker (and its word cache), plus in this process one chunk's hashes, the held-out
rows and the tokenizer's sample; the row-level split of the overlap record holds 4 bytes a row for a moment.
The time of each phase is logged and kept in meta.json's ``build`` (bench/results/data-scale-cpu.md).

The entry is a folder of .npy arrays (opened with ``mmap_mode="r"`` by `data.entry.load_entry`: a warm
start maps them and reads nothing corpus-sized; DataLoader workers share the pages), texts and meta.json.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from . import cache as C
from .build_encode import (
    LEN_CAP,
    assemble_train,
    encode_chunk,
    encode_eval,
    forget_tokenizers,
    merge_held,
    save_held,
)
from .build_scan import read_eval_files, scan_chunk, text_hashes
from .build_split import Hashes, split_corpus
from .build_tokenizer import train_or_load_tokenizer
from .clean import CleanReport, DataInputError
from .entry import CACHE_FORMAT, Entry, Inputs, build_workers, load_entry
from .sources import where
from .split import HELDOUT_MAX_GROUP, NORMALISATION, KeySet
from .tokenizer import Tokenizer
from .workers import BuildRunner

PHASES = ("read", "clean", "hash", "scratch", "group", "tokenizer", "encode", "write")


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
    run = BuildRunner(build_workers(cfg))
    clock = _Clock()
    try:
        evals = {s: read_eval_files(files, s, cfg.src_lang, cfg.tgt_lang) for s, files in inp.evals.items()}
        eval_hashes = {s: (text_hashes(es), text_hashes(et)) for s, (es, et) in evals.items()}
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
        for c, sc in zip(inp.chunks, run.imap(scan_chunk, jobs)):
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
        hashes = Hashes(tmp, first, eval_keys)
        sample_k = cfg.spm_sample_pairs if tokenizer is None else None  # a given tokenizer: no sample
        split = split_corpus(cfg, hashes, n, n_test, n_valid, eval_hashes, sample_k)
        clock.lap("group")
        # ---- tokenizer
        if tokenizer is not None:
            model_file = tmp / "given-spm.model"
            model_file.write_bytes(tokenizer.model_bytes())
            tok, bpe = tokenizer, False  # a model from elsewhere: encoded sentence by sentence
        else:
            tok = train_or_load_tokenizer(cfg, cache, tok_key, sets["tokenizer"], split["sample"], first, run, tmp, log)
            model_file, bpe = Path(tok.model_file), sets["tokenizer"]["model_type"] == "bpe"
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "int32"
        clock.lap("tokenizer")
        # ---- pass B
        jobs = [(i, str(tmp), str(model_file), bpe, cfg.max_len, cfg.max_len_ratio, dtype)
                for i in range(len(inp.chunks))]
        hist = np.zeros(LEN_CAP + 1, dtype=np.int64)
        parts, held_parts, checks_failed = [], {"valid": [], "test": []}, 0
        for i, e in enumerate(run.imap(encode_chunk, jobs)):
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
        assemble_train(tmp, parts, first, dtype, counts, tokens)
        truncated = {}
        for s in ("valid", "test"):
            if s in evals:
                held = encode_eval(tok, evals[s], cfg.max_len)
            else:
                held = merge_held(held_parts[s], first)
            truncated[s] = held.pop("truncated")
            save_held(tmp, s, held, dtype, counts, tokens)
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
        forget_tokenizers()  # in-process runs: a later build may retrain a model at the same path
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
