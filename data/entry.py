"""What a cache entry is: its inputs (the files or Hub dataset, cut into chunks when built), its keys, and how a built
entry is opened (the warm path: memory maps and a few small JSON files, nothing corpus-sized).

An entry is a folder ``corpus-<key>/`` of .npy arrays per split (``{split}_{src,tgt}_{ids,off}.npy`` and
``{split}_rows.npy``), the valid/test texts (``{split}_text.json``) and ``meta.json`` (counts, the cleaning
report, the split record). `data.build` makes one; `load_entry` opens and validates one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from . import cache as C
from .files import TEXTS_MAX, check_key, load_npy
from .sources import Chunk, SourceFile, hub_chunks, plan_chunks, training_files
from .split import HELDOUT_MAX_GROUP
from .tokenizer import Tokenizer, spm_settings

CACHE_FORMAT = 4  # bump when the entry layout or the meaning of a key changes
# 4: meta.json holds each count once: the record's "sizes" and "rows_before_length_filter" (copies of "counts"
#    and "train_before_length_filter") are derived on load (`split_record`)
# The tokenizer's own format, hashed into its key in place of CACHE_FORMAT: an entry layout change rebuilds the
# entry but must keep every tokenizer key (a checkpoint names its tokenizer by key; a new key would refuse the
# resume of every earlier run). Bump only when a SentencePiece model trained from the same settings would differ.
TOKENIZER_FORMAT = 3
SPLITS = ("train", "valid", "test")


def build_workers(cfg) -> int:
    """``cfg.build_workers``, or (0) the cores this process may use."""
    if cfg.build_workers:
        return cfg.build_workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------
# What a build reads, and its keys
# ----------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """The files (or Hub dataset) of the training corpus and of your own valid/test files; `chunks` cuts them
    when a build first asks (a warm start reads nothing of the files: cutting a 10 GB file into chunks reads a
    block at each cut, 0.2 s for 40 M pairs on a cold page cache)."""

    label: str  # split_record["source"]
    files: list[SourceFile]
    plan: Callable[[], list[Chunk]] = field(repr=False)  # the chunks, cut when first needed
    paths: tuple[str, ...]  # local files (empty for the Hub)
    hub_fingerprint: str | None = None
    evals: dict[str, tuple[str, ...]] = field(default_factory=dict)  # "valid"/"test" -> your files

    @cached_property
    def chunks(self) -> list[Chunk]:
        return self.plan()

    def identity(self) -> dict:
        """What a warm start compares: each file's identity (stat only), or the Hub dataset's fingerprint."""
        ident = {"train": [C.file_identity(p) for p in self.paths] or self.hub_fingerprint}
        for s, files in self.evals.items():
            ident[s] = [C.file_identity(p) for p in files]
        return ident

    def content(self) -> dict:
        """The inputs' bytes, hashed (read once; only when the identity is new)."""
        out = {"train": C.content_hash(self.paths) if self.paths else self.hub_fingerprint}
        for s, files in self.evals.items():
            out[s] = C.content_hash(files)
        return out


def chunk_bytes(files, workers: int) -> int | None:
    """Chunks of equal size, at least 4 per worker and a multiple of the workers (no worker idles through the
    last chunk of a pass), each between 1 MiB and `sources.CHUNK_BYTES`."""
    from . import sources

    try:
        total = sum(os.path.getsize(f) for f in files)
    except OSError:
        return None  # plan_chunks names the missing file
    workers = max(1, workers)
    n = max(4 * workers, -(-total // sources.CHUNK_BYTES))
    n = -(-n // workers) * workers
    return int(min(sources.CHUNK_BYTES, max(1 << 20, -(-total // n))))


def inputs(cfg) -> Inputs:
    files, label = training_files(cfg)
    if files:
        env = cfg.files_from_env()
        src_files, _ = plan_chunks(files, 1 << 62, from_env=env)  # existence and formats now; one chunk per file
        size = chunk_bytes(files, build_workers(cfg))
        out = Inputs(label, src_files, lambda: plan_chunks(files, size, from_env=env)[1], tuple(files))
    else:
        src_files, chunks, fp = hub_chunks(cfg.dataset, cfg.dataset_config, cfg.hf_split)
        out = Inputs(label, src_files, lambda: chunks, (), hub_fingerprint=fp)
    for s in ("valid", "test"):
        ev = getattr(cfg, f"{s}_files")
        if ev:
            plan_chunks(ev, name=f"data.{s}_files")  # existence and formats, before anything is built
            out.evals[s] = tuple(ev)
    return out


def settings(cfg, tokenizer: Tokenizer | None) -> dict:
    """Everything besides the inputs that changes an entry: split, cleaning and tokenizer settings."""
    if tokenizer is not None:
        tok = {"given": tokenizer.key or C.digest(tokenizer.model_bytes().hex())}
    else:
        tok = spm_settings(cfg)
    return {
        "format": CACHE_FORMAT,
        "langs": [cfg.src_lang, cfg.tgt_lang],
        "split": {"valid_size": cfg.valid_size, "test_size": cfg.test_size, "seed": cfg.split_seed,
                  "grouping": cfg.split_grouping, "max_group": HELDOUT_MAX_GROUP,
                  "evals": sorted(s for s in ("valid", "test") if getattr(cfg, f"{s}_files"))},
        "tokenizer": tok,
        "length": {"max_len": cfg.max_len, "max_len_ratio": cfg.max_len_ratio},
    }


def tokenizer_key(content: dict, sets: dict) -> str:
    """The SentencePiece model's key: inputs + split + tokenizer settings (not the length limits, so a new
    ``max_len`` re-encodes but never retrains the tokenizer; not the entry layout: ``TOKENIZER_FORMAT``)."""
    return C.digest({"content": content, **{k: v for k, v in sets.items() if k != "length"},
                     "format": TOKENIZER_FORMAT})


# ----------------------------------------------------------------------------------------------
# Loading a built entry (the warm path)
# ----------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """A loaded corpus entry: per split the arrays (memory maps) and the valid/test texts, and meta.json."""

    path: Path
    meta: dict
    arrays: dict[str, dict[str, np.ndarray]]
    texts: dict[str, tuple[list[str], list[str]] | None]


_ARRAYS = ("src_ids", "src_off", "tgt_ids", "tgt_off", "rows")


def split_record(meta: dict) -> dict:
    """An entry's split record as a run reports it: meta.json's ``record`` with the two values meta.json holds
    once elsewhere put back in their place (before ``"asked"``): ``rows_before_length_filter`` (train: the
    ``train_before_length_filter`` count; valid/test are never length-filtered: their ``counts``) and
    ``sizes`` (the ``counts``)."""
    rec, counts = meta["record"], meta["counts"]
    derived = {"rows_before_length_filter": {"train": meta["train_before_length_filter"], "valid": counts["valid"],
                                             "test": counts["test"]},
               "sizes": dict(counts)}
    keys = list(rec)
    at = keys.index("asked") if "asked" in keys else len(keys)
    return {**{k: rec[k] for k in keys[:at]}, **derived, **{k: rec[k] for k in keys[at:]}}


def _open(path: Path, shape: tuple, dtype: str, cache: Path) -> np.ndarray:
    # the header checked against the file before anything is mapped (a FIFO, a link, a forged shape: refused)
    a = load_npy(path, "cache array", inside=cache, mmap=bool(shape[0]))  # an empty array cannot be mapped
    if a.shape != shape or a.dtype != np.dtype(dtype):
        raise ValueError(f"{path.name} holds {a.dtype}{a.shape}, expected {dtype}{shape}")
    return a


_SCAN = 1 << 22  # elements per block of a content scan (a 32 MB int64 block at most: no corpus-sized copy)


def _texts(t, n: int, name: str) -> tuple[list[str], list[str]]:
    """A ``{split}_text.json`` record as two lists of ``n`` strings, or ValueError naming what is wrong."""
    if not isinstance(t, dict) or not all(isinstance(t.get(side), list) for side in ("src", "tgt")):
        raise ValueError(f"{name} is not {{'src': [...], 'tgt': [...]}}")
    for side in ("src", "tgt"):
        if len(t[side]) != n:
            raise ValueError(f"{name} holds {len(t[side])} {side} rows, expected {n}")
        bad = next((k for k, x in enumerate(t[side]) if not isinstance(x, str)), None)
        if bad is not None:
            raise ValueError(f"{name}: {side} row {bad} is a {type(t[side][bad]).__name__}, not a string")
    return t["src"], t["tgt"]


def damage(entry: Entry, vocab_size: int, max_len: int) -> str | None:
    """What is wrong with the contents of a loaded entry's arrays, or None: every token id in ``[0, vocab_size)``,
    offsets rising from 0 to the token count, no row longer than ``max_len - 1`` subwords (what a build keeps: the
    train rows length-filtered, the valid/test token arrays cut), row numbers not negative. Checked once when the
    entry is opened (after its tokenizer gives ``vocab_size``), in blocks of `_SCAN` elements over the memory maps:
    a damaged entry is then rebuilt, never a traceback (or a config advice) at the first batch that meets it."""
    for s in SPLITS:
        a = entry.arrays[s]
        for side in ("src", "tgt"):
            ids, off = a[f"{side}_ids"], a[f"{side}_off"]
            if np.iinfo(ids.dtype).min < 0 or np.iinfo(ids.dtype).max >= vocab_size:
                for lo in range(0, len(ids), _SCAN):
                    block = ids[lo:lo + _SCAN]
                    low, high = int(block.min()), int(block.max())
                    if low < 0 or high >= vocab_size:
                        return (f"{s}_{side}_ids holds token id {low if low < 0 else high}, outside the "
                                f"tokenizer's vocabulary of {vocab_size}")
            for lo in range(0, max(len(off) - 1, 0), _SCAN):
                lens = np.diff(off[lo:lo + _SCAN + 1])
                if len(lens) and int(lens.min()) < 0:
                    return f"{s}_{side}_off falls at row {lo + int(np.argmax(lens < 0))}: offsets must rise"
                if len(lens) and int(lens.max()) > max_len - 1:
                    return (f"{s}_{side}_off gives row {lo + int(np.argmax(lens > max_len - 1))} "
                            f"{int(lens.max())} tokens, more than the {max_len - 1} a build with max_len={max_len} keeps")
        rows = a["rows"]
        for lo in range(0, len(rows), _SCAN):
            if int(rows[lo:lo + _SCAN].min()) < 0:
                return f"{s}_rows holds a negative row number"
    return None


def load_entry(cache: Path, key: str, log=print) -> Entry | None:
    """The entry ``corpus-<key>`` if it is there and valid; a broken one is removed with a warning (None).
    Checked here: meta.json (format, key, integer id dtype, counts), each array's header (dtype, shape, native
    byte order), offsets from 0 to the token count, the valid/test texts (``n`` strings a side). The contents that
    need the tokenizer (ids < vocabulary) and a scan (rising offsets, row lengths): `damage`."""
    path = Path(cache) / f"corpus-{check_key(key, 'corpus key')}"
    if not path.is_dir():
        return None
    try:
        meta = C.read_json(path / "meta.json")
        if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
            raise ValueError(f"meta.json is for {str(meta.get('key'))[:60]!r}, format {meta.get('format')!r}")
        check_key(meta.get("tokenizer_key"), "meta.json's tokenizer_key")  # becomes spm-<key>/: checked here
        arrays, texts = {}, {}
        for s in SPLITS:
            n, tok = meta["counts"][s], meta["tokens"][s]
            if not all(type(v) is int and v >= 0 for v in (n, tok["src"], tok["tgt"])):
                raise ValueError(f"meta.json's {s} counts {str(n)[:20]}/{str(tok)[:40]} are not whole numbers")
            ids_t = meta["id_dtype"]
            if not isinstance(ids_t, str) or np.dtype(ids_t).kind not in "ui":
                raise ValueError(f"meta.json's id_dtype {str(ids_t)[:40]!r} is not an integer dtype")
            shapes = {"src_ids": ((tok["src"],), ids_t), "tgt_ids": ((tok["tgt"],), ids_t),
                      "src_off": ((n + 1,), "int64"), "tgt_off": ((n + 1,), "int64"), "rows": ((n,), "int64")}
            arrays[s] = {a: _open(path / f"{s}_{a}.npy", *shapes[a], Path(cache)) for a in _ARRAYS}
            for side in ("src", "tgt"):
                off = arrays[s][f"{side}_off"]
                if off[0] != 0 or off[-1] != tok[side]:
                    raise ValueError(f"{s}_{side}_off does not end at the token count")
            if s == "train":
                texts[s] = None
            else:
                texts[s] = _texts(C.read_json(path / f"{s}_text.json", TEXTS_MAX), n, f"{s}_text.json")
        return Entry(path, meta, arrays, texts)
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        C.discard(path, f"{type(e).__name__}: {str(e)[:300]}", log, cache)
        return None


