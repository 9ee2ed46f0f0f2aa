"""`build_data(cfg) -> DataBundle`: inputs -> cached (or built) corpus entry -> memory-mapped splits -> loaders.

The cache (`data.cache`, under ``cfg.cache_dir``) holds the cleaned, leakage-free split (`data.split`) and
encoded corpus as .npy arrays (`data.build`), keyed by the inputs and every setting. A warm start stats the
input files, reads one small JSON and maps the arrays: it reads nothing corpus-sized and its time and memory
do not grow with the corpus. A cold build streams through the files in chunks with ``build_workers``
processes. Concurrent builds of one entry (DDP ranks, two runs) take turns on a file lock: the first builds,
the others map its result. Nothing is tokenized after this: the loader's collate pads slices of the arrays.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from . import build as B
from . import cache as C
from . import entry as E
from . import files as F
from .batching import BatchSpec, PackLayout, pack_layout_from_totals, plan_batches
from .clean import CleanReport, DataInputError
from .config import DataConfig
from .tokenizer import Tokenizer
from .workers import ignore_stop_signals

SPLITS = ("train", "valid", "test")
PLANS_KEPT = 4  # batch plans memoised per bundle (num_batches and loader of one epoch share one)
# modes whose batch count is the same every epoch: the epoch's shuffle only reorders pairs within equal padded
# shapes (token buckets: the cuts follow the shapes' order, which no shuffle changes) or fixed-size chunks
EPOCH_FREE_COUNT = ("fixed", "dynamic", "sorted", "token_bucket")


@dataclass
class EncodedSplit:
    """One split: its token arrays (subwords only, no specials; memory maps of the cache for a built
    corpus) and, for valid/test, its texts. Train texts are never loaded (``None``)."""

    src_text: list[str] | None  # valid/test: the whole source texts (what is translated); train: None
    tgt_text: list[str] | None  # valid/test: the whole references (what BLEU scores against); train: None
    src_ids: np.ndarray  # (N_src_tokens,) uint16 (vocab <= 65536) or int32, concatenated
    src_offsets: np.ndarray  # (n+1,) int64
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray
    rows: np.ndarray  # (n,) int64 index of each pair in the cleaned corpus (your valid/test files: row index)

    @cached_property
    def src_lengths(self) -> np.ndarray:  # (n,) int32 tokens incl. EOS
        return (np.diff(self.src_offsets) + 1).astype(np.int32)

    @cached_property
    def tgt_lengths(self) -> np.ndarray:  # (n,) int32 tokens incl. BOS
        return (np.diff(self.tgt_offsets) + 1).astype(np.int32)

    def token_totals(self) -> tuple[int, int]:
        """(src tokens incl. EOS, tgt tokens incl. BOS) of the split, read in O(1) from the offsets."""
        n = len(self)
        return int(self.src_offsets[-1]) + n, int(self.tgt_offsets[-1]) + n

    def __len__(self) -> int:
        return len(self.src_offsets) - 1


class _IndexDataset:
    """Map-style dataset over a split: fetching a batch returns its indices; the collate does the work."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:  # batched fetch (torch >= 2.1)
        return indices


class _PlanSampler:
    """Batch sampler over a precomputed plan, starting at ``start_batch``. It runs in the main process, so
    a persistent loader is pointed at the next epoch's plan with ``set_plan`` (the workers only collate)."""

    def __init__(self, batches: list[np.ndarray], start_batch: int):
        self.set_plan(batches, start_batch)

    def set_plan(self, batches: list[np.ndarray], start_batch: int) -> None:
        self.batches, self.start = batches, start_batch

    def __iter__(self):
        for b in self.batches[self.start :]:
            yield b.tolist()

    def __len__(self) -> int:
        return len(self.batches) - self.start


class DataBundle:
    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        splits: dict[str, EncodedSplit],
        report: CleanReport,
        split_record: dict,
        log=print,
    ):
        self.cfg, self.tokenizer, self.splits, self.report, self.split_record = (
            cfg,
            tokenizer,
            splits,
            report,
            split_record,
        )
        self.log = log
        self._layout, self._layout_key = None, None  # packed layout, memoised on (max_tokens, max_len)
        self._loaders: dict[tuple, object] = {}  # persistent DataLoaders (worker processes kept across epochs)
        self._plans: dict[tuple, list[np.ndarray]] = {}  # the last `PLANS_KEPT` plans, oldest first
        self._ahead: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # packed plans counted, not yet loaded
        self._taken: set[tuple] = set()  # plans handed to a loader
        self._counts: dict[tuple, int] = {}  # batch counts of the EPOCH_FREE_COUNT modes, planned once

    def pack_layout(self) -> PackLayout:
        """The packed layout of this run: from the train split's token totals + (max_tokens, max_len), so every
        rank, epoch and split (valid/test too) uses the same capacities and slots."""
        c, tr = self.cfg, self.splits["train"]
        key = (c.max_tokens, c.max_len)
        if self._layout_key != key:
            if len(tr) == 0:
                raise ValueError(
                    "batching='packed' derives its capacities from the train split, which is empty"
                )
            self._layout, self._layout_key = pack_layout_from_totals(len(tr), *tr.token_totals(), *key), key
        return self._layout

    def spec(self, batching: str | None = None) -> BatchSpec:
        c = self.cfg
        mode = batching or c.batching
        pack = self.pack_layout() if mode == "packed" else None
        return BatchSpec(mode, c.batch_size, c.max_tokens, c.seq_len, c.pad_multiple, pack)

    def plan(
        self,
        split: str,
        *,
        epoch: int = 0,
        batching: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool | None = None,
    ) -> list[np.ndarray]:
        if split not in self.splits:
            raise ValueError(f"split={split!r}; choose one of {tuple(self.splits)}")
        sp, spec = self.splits[split], self.spec(batching)
        shuffle = split == "train" if shuffle is None else shuffle
        key = (split, spec, self.cfg.seed, epoch, shuffle, rank, world_size)
        if key not in self._plans:
            ahead = self._ahead.pop(key, None)
            self._plans[key] = _unpack_plan(*ahead) if ahead is not None else plan_batches(
                sp.src_lengths,
                sp.tgt_lengths,
                spec,
                seed=self.cfg.seed,
                epoch=epoch,
                shuffle=shuffle,
                rank=rank,
                world_size=world_size,
            )
            while len(self._plans) > PLANS_KEPT:
                old = next(iter(self._plans))
                batches = self._plans.pop(old)
                if old[1].mode not in EPOCH_FREE_COUNT and old not in self._taken:
                    self._ahead[old] = _pack_plan(batches)  # counted ahead (the schedule): loaded later
        return self._plans[key]

    def num_batches(
        self, split: str, epoch: int = 0, batching: str | None = None, rank: int = 0, world_size: int = 1
    ) -> int:
        mode = batching or self.cfg.batching
        if mode not in EPOCH_FREE_COUNT:  # packed: the count follows the epoch's order (a plan per epoch)
            return len(self.plan(split, epoch=epoch, batching=batching, rank=rank, world_size=world_size))
        key = (split, self.spec(batching), rank, world_size)
        if key not in self._counts:  # the same for every epoch: planned once (the schedule counts all epochs)
            self._counts[key] = len(self.plan(split, epoch=epoch, batching=batching, rank=rank, world_size=world_size))
        return self._counts[key]

    def _took(self, split: str, epoch: int, batching: str | None, rank: int, world_size: int,
              shuffle: bool | None) -> None:
        """A loader took this plan: it is not kept ahead again, nor are this split's plans of earlier epochs
        (a run goes forward; a resumed run counted the epochs it had already trained)."""
        shuffle = split == "train" if shuffle is None else shuffle
        self._taken.add((split, self.spec(batching), self.cfg.seed, epoch, shuffle, rank, world_size))
        for k in [k for k in self._ahead if k[0] == split and k[3] < epoch]:
            del self._ahead[k]

    def collator(self, split: str, batching: str | None = None):
        from .collate import Collator, PackedCollator

        sp, spec = self.splits[split], self.spec(batching)
        if spec.mode == "packed":
            return PackedCollator(sp.src_ids, sp.src_offsets, sp.tgt_ids, sp.tgt_offsets, layout=spec.pack)
        seq_len = None
        if spec.mode == "fixed":
            over = int(((sp.src_lengths > spec.seq_len) | (sp.tgt_lengths > spec.seq_len)).sum())
            if over and self.cfg.overlong != "truncate":  # "error", and any value but the one that truncates
                raise ValueError(
                    f"{over} {split} pairs are longer than seq_len={spec.seq_len} (fixed batching); "
                    f"raise seq_len to >= max_len={self.cfg.max_len}, or set overlong='truncate'"
                )
            if over:
                self.log(
                    f"[data] warning: truncating {over} {split} pairs to seq_len={spec.seq_len} (overlong='truncate')"
                )
            seq_len = spec.seq_len
        return Collator(
            sp.src_ids,
            sp.src_offsets,
            sp.tgt_ids,
            sp.tgt_offsets,
            pad_multiple=spec.pad_multiple,
            seq_len=seq_len,
        )

    def loader(
        self,
        split: str,
        *,
        epoch: int = 0,
        batching: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool | None = None,
        start_batch: int = 0,
    ):
        """A torch DataLoader over this rank's batches of ``split`` for ``epoch``; skips ``start_batch`` batches.

        With worker processes the loader is built once per (split, batching, rank, shuffle) and reused with the
        next plan, so its workers persist across epochs. It owns a seeded generator: creating an iterator never
        draws from the global torch RNG (a resumed run's dropout stream then matches the uninterrupted one).
        """
        import torch
        from torch.utils.data import DataLoader

        batches = self.plan(
            split, epoch=epoch, batching=batching, rank=rank, world_size=world_size, shuffle=shuffle
        )
        self._took(split, epoch, batching, rank, world_size, shuffle)
        if not 0 <= start_batch <= len(batches):
            raise ValueError(
                f"start_batch={start_batch} outside [0, {len(batches)}] for {split} epoch {epoch}"
            )
        c = self.cfg
        workers = c.num_workers
        key = (split, batching or c.batching, rank, world_size, shuffle)
        if workers > 0 and key in self._loaders:
            loader = self._loaders[key]
            loader.batch_sampler.set_plan(batches, start_batch)
            return loader
        loader = DataLoader(
            _IndexDataset(len(self.splits[split])),
            batch_sampler=_PlanSampler(batches, start_batch),
            collate_fn=self.collator(split, batching),
            num_workers=workers,
            pin_memory=c.pin_memory and torch.cuda.is_available(),
            prefetch_factor=c.prefetch_factor if workers > 0 else None,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(c.seed),
            worker_init_fn=ignore_stop_signals,  # data/workers.py: a stop signal never kills a worker
        )
        if workers > 0:
            self._loaders[key] = loader
        return loader

    def __repr__(self) -> str:
        sizes = {k: len(v) for k, v in self.splits.items()}
        return (
            f"DataBundle(splits={sizes}, vocab={self.tokenizer.vocab_size}, batching={self.cfg.batching!r})"
        )


def _pack_plan(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A plan kept ahead compactly: its indices back to back (int32 below 2**31 pairs: ~4 bytes a pair) and
    each batch's end. Packed plans of every epoch are counted before training (the schedule's length) and
    would otherwise be planned again when their epoch comes (the `PLANS_KEPT` most recent are kept whole)."""
    flat = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    small = len(flat) == 0 or int(flat.max()) < 2**31
    ends = np.cumsum([len(b) for b in batches], dtype=np.int64)
    return flat.astype(np.int32) if small else flat, ends


def _unpack_plan(flat: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """`_pack_plan` undone: the same int64 batches."""
    return np.split(flat.astype(np.int64), ends[:-1]) if len(ends) else []


def _split(entry: E.Entry, s: str) -> EncodedSplit:
    a, texts = entry.arrays[s], entry.texts[s]
    return EncodedSplit(
        None if texts is None else texts[0],
        None if texts is None else texts[1],
        a["src_ids"],
        a["src_off"],
        a["tgt_ids"],
        a["tgt_off"],
        a["rows"],
    )


def _resolve(cfg: DataConfig, inp: E.Inputs, sets: dict, cache: Path, tokenizer: Tokenizer | None, log) -> E.Entry:
    """The entry for these inputs and settings: from the identity index (stat only), else by content hash
    (a ``touch`` or a copy of known data), else built. Builders of one key take turns on its lock."""
    seen = inp.identity()
    ident = C.digest({"settings": sets, "inputs": seen})
    can_write = C.writable(cache)
    index = (C.subfolder(cache, "index") if can_write else cache / "index") / f"{ident}.json"

    def indexed() -> E.Entry | None:
        if not index.is_file():
            return None
        try:  # a key read from a file: only the hex form digest() writes becomes a path (else: damaged)
            key = F.check_key(C.read_json(index)["corpus"], "the index's corpus key")
        except (OSError, ValueError, KeyError, TypeError) as e:
            C.discard(index, f"{type(e).__name__}: {str(e)[:80]}", log, cache)
            return None
        return E.load_entry(cache, key, log)

    entry = indexed()
    if entry is not None:
        log(f"[data] cache hit: {entry.path} (inputs unchanged on disk; tokenizer spm-{entry.meta['tokenizer_key']})")
        return entry
    if not can_write:  # a shared read-only cache: a content match is still used, nothing is built or recorded
        key = C.digest({"settings": sets, "content": inp.content()})
        entry = E.load_entry(cache, key, log)
        if entry is None:
            raise F.FileRefusedError(
                f"the data cache --data.cache_dir {cache} cannot be written by this process ({C.why_read_only(cache)}) "
                f"and holds no entry for these data files and settings. Fix: give --data.cache_dir a "
                f"writable folder (or ask its owner to build this entry)")
        log(f"[data] cache hit (read-only cache, matched by content): {entry.path}")
        return entry
    with C.locked(cache, ident, log):
        entry = indexed()  # another process may have finished it while we waited
        if entry is not None:
            return entry
        t0 = time.perf_counter()
        content = inp.content()
        key = C.digest({"settings": sets, "content": content})
        with C.locked(cache, key, log):
            entry = E.load_entry(cache, key, log)
            if entry is None:
                tok_key = E.tokenizer_key(content, sets)
                entry = B.build_entry(cfg, inp, key, tok_key, sets, cache, tokenizer, log)
            else:
                log(f"[data] inputs changed on disk but not in content ({time.perf_counter() - t0:.1f} s to hash): "
                    f"re-using {entry.path}")
        if inp.identity() != seen:  # a file changed while it was read: what was read is not what is there
            log(f"[data] warning: the data files changed while they were read; this run uses what was read, and "
                f"the cache entry is dropped ({entry.path}): the next start reads them again")
            C.remove(entry.path, cache)  # this run's memory maps stay valid
        else:
            C.write_json(index, {"corpus": key, "inputs": seen})
    return entry


def _tokenizer_of(entry: E.Entry, cfg: DataConfig, cache: Path, sets: dict, tokenizer: Tokenizer | None) -> Tokenizer:
    """The given tokenizer, or the entry's ``spm-<key>`` model (its settings.json checked against ours)."""
    if tokenizer is not None:
        return tokenizer
    key = F.check_key(entry.meta["tokenizer_key"], "meta.json's tokenizer_key")
    if C.read_json(cache / f"spm-{key}" / "settings.json") != sets["tokenizer"]:
        raise ValueError("settings.json differs from the settings")
    return Tokenizer(cache / f"spm-{key}" / "spm.model", key, cfg.spm_threads or E.build_workers(cfg), inside=cache)


@contextlib.contextmanager
def _spm_write_errors(cache_dir: str):
    """SentencePiece reports a failed write of its model as ``RuntimeError ... WriteLine`` / ``Write``: with
    a full or read-only cache that is the file system's refusal, said in one line like an OSError."""
    try:
        yield
    except RuntimeError as e:
        if "Write" not in str(e):
            raise
        import errno
        import os

        code = errno.ENOSPC if C.writable(Path(cache_dir)) else errno.EROFS
        raise F.FileRefusedError(F.os_error_line(OSError(code, os.strerror(code)), "the data cache --data.cache_dir",
                                                 cache_dir, "give --data.cache_dir a writable folder with room for "
                                                 "the corpus")) from e


def build_data(cfg: DataConfig, log=print, tokenizer: Tokenizer | None = None) -> DataBundle:
    """Clean, split (leakage-free), tokenize and encode ``cfg``'s corpus, or map it from the cache; every
    input row trains, is held out, or is counted in ``bundle.report``. Raises `DataInputError` when nothing
    could train (empty file, no usable rows, every pair over the length limits) or a setting cannot work.

    ``tokenizer``: encode with this `Tokenizer` (e.g. a checkpoint's, for fine-tuning) instead of training
    SentencePiece; its key is part of the cache key. Writes nothing outside ``cfg.cache_dir``.
    """
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"build_data takes a data.DataConfig, got {type(cfg).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a data.tokenizer.Tokenizer, got {type(tokenizer).__name__}")
    t0 = time.perf_counter()
    # an OSError of the cache (read-only, full, permission denied, a name the file system refuses): one line
    with F.explain_os_errors("the data cache --data.cache_dir", cfg.cache_dir,
                             "give --data.cache_dir a writable folder with room for the corpus"), \
            _spm_write_errors(cfg.cache_dir):
        if Path(cfg.cache_dir).exists() and not Path(cfg.cache_dir).is_dir():
            raise DataInputError(f"data.cache_dir={cfg.cache_dir} is not a folder; give a folder (it is created if "
                                 f"missing)")
        cache = C.mkdirs(Path(cfg.cache_dir))
        if C.writable(cache):
            C.clean_stale_temps(cache, log)
        inp = E.inputs(cfg)
        sets = E.settings(cfg, tokenizer)
        entry = _resolve(cfg, inp, sets, cache, tokenizer, log)
        try:
            tok = _tokenizer_of(entry, cfg, cache, sets, tokenizer)
        except (OSError, RuntimeError, ValueError, TypeError) as e:  # the model is gone or damaged: rebuild both
            C.discard(cache / f"spm-{entry.meta['tokenizer_key']}", f"{type(e).__name__}: {str(e)[:80]}", log, cache)
            C.remove(entry.path, cache)
            entry = _resolve(cfg, inp, sets, cache, tokenizer, log)
            tok = _tokenizer_of(entry, cfg, cache, sets, tokenizer)
        why = E.damage(entry, tok.vocab_size, cfg.max_len)  # contents, once per open: a damaged entry is rebuilt
        if why is not None:
            C.discard(entry.path, why, log, cache)
            entry = _resolve(cfg, inp, sets, cache, tokenizer, log)
            tok = _tokenizer_of(entry, cfg, cache, sets, tokenizer)
            why = E.damage(entry, tok.vocab_size, cfg.max_len)
            if why is not None:  # what this build just wrote: a bug, never a loop
                raise RuntimeError(f"the data build of {entry.path} wrote a damaged entry: {why}")
    meta = B.as_read_by(entry.meta, inp)  # a reused entry: this run's file names, not its builder's
    report = CleanReport.from_dict(meta["report"])
    split_record = {**E.split_record(meta), "tokenizer_key": tok.key, "vocab_size": tok.vocab_size,
                    "cache": str(entry.path)}
    report.overlap, report.truncated = split_record["overlap"], split_record["truncated"]
    splits = {s: _split(entry, s) for s in SPLITS}
    if any(report.dropped.values()):
        log(
            f"[data] warning: {report.rows - report.kept:,} of {report.rows:,} input rows dropped "
            "(reasons and examples in the cleaning report below)"
        )
    d, n_train = report.dropped_by_split.get("train", {}), meta["train_before_length_filter"]
    if d.get("too_long", 0) > 0.1 * n_train:
        log(
            f"[data] warning: max_len={cfg.max_len} drops {d['too_long']:,} of {n_train:,} training pairs as "
            f"too_long; {meta['length_hint']}"
        )
    trunc = split_record["truncated"]
    if any(trunc.values()):
        log(f"[data] valid/test pairs longer than max_len={cfg.max_len} are kept whole (texts) with token arrays "
            f"cut to max_len: {trunc['valid']:,} valid, {trunc['test']:,} test")
    for s in ("valid", "test"):  # held-out groups ran out: say so (the split is still leakage-free)
        spec, got = getattr(cfg, f"{s}_size"), split_record["sizes"][s]
        asked = split_record["asked"][s]
        if not split_record["eval_files"].get(s) and got < asked:
            log(f"[data] warning: the {s} split has {got:,} rows where data.{s}_size={spec} asked for {asked:,}: the "
                f"other pairs share a normalised source or target with groups of more than "
                f"{split_record['heldout_max_group']} rows, which always train; give --data.{s}_files for a {s} set")
    bundle = DataBundle(cfg, tok, splits, report, split_record, log)
    if len(splits["train"]):  # the packed layout is fixed by corpus + config: recorded with the run
        split_record["packing"] = bundle.pack_layout().as_dict()
    ov = split_record["overlap"]
    log("[data] " + str(report).replace("\n", "\n[data] "))
    log(
        f"[data] split {json.dumps(split_record['sizes'])} (seed {cfg.split_seed}, groups by normalised "
        f"{cfg.split_grouping.replace('_', ' + ')}; valid/test sources also in train: "
        f"{ov['before']['valid']['source']}/{ov['before']['test']['source']} before -> "
        f"{ov['after']['valid']['source']}/{ov['after']['test']['source']}); vocab {tok.vocab_size}; "
        f"ready in {time.perf_counter() - t0:.1f} s"
    )
    return bundle
