"""`build_data(cfg) -> DataBundle`: load -> clean -> seeded split -> SentencePiece -> cached arrays -> loaders.

Caches under ``cfg.cache_dir`` (both keyed by the data fingerprint, the split and the tokenizer settings):
  spm-<key>/spm.model     the tokenizer, trained on the train split only
  enc-<key>.npz           the whole corpus encoded once: per split one concatenated int32 token array and
                          int64 offsets per side (no specials), plus the split's row indices
Nothing is tokenized after this: the loader's collate pads slices of these arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batching import BatchSpec, PackLayout, pack_layout, plan_batches
from .clean import CleanReport, DataInputError, clean_text, length_examples, length_mask
from .config import DataConfig
from .sources import load_raw
from .tokenizer import Tokenizer, spm_settings, tokenizer_key, train_or_load
from .workers import ignore_stop_signals

SPLITS = ("train", "valid", "test")


@dataclass
class EncodedSplit:
    """One split: texts plus its slice of the cached token arrays (subwords only, no specials)."""

    src_text: list[str]
    tgt_text: list[str]
    src_ids: np.ndarray  # (N_src_tokens,) int32, concatenated
    src_offsets: np.ndarray  # (n+1,) int64
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray
    rows: np.ndarray  # (n,) int64 index of each pair in the cleaned corpus

    @property
    def src_lengths(self) -> np.ndarray:  # (n,) int32 tokens incl. EOS
        return (np.diff(self.src_offsets) + 1).astype(np.int32)

    @property
    def tgt_lengths(self) -> np.ndarray:  # (n,) int32 tokens incl. BOS
        return (np.diff(self.tgt_offsets) + 1).astype(np.int32)

    def __len__(self) -> int:
        return len(self.src_text)

    def select(self, keep: np.ndarray) -> EncodedSplit:
        """Subset by a boolean mask, re-packing the token arrays."""
        idx = np.flatnonzero(keep)
        src_ids, src_off = _gather(self.src_ids, self.src_offsets, idx)
        tgt_ids, tgt_off = _gather(self.tgt_ids, self.tgt_offsets, idx)
        return EncodedSplit(
            [self.src_text[i] for i in idx],
            [self.tgt_text[i] for i in idx],
            src_ids,
            src_off,
            tgt_ids,
            tgt_off,
            self.rows[idx],
        )


def _gather(flat: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lens = offsets[idx + 1] - offsets[idx]
    new_off = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    pos = np.repeat(offsets[idx] - new_off[:-1], lens) + np.arange(int(new_off[-1]))
    return flat[pos], new_off


def fingerprint(src: list[str], tgt: list[str], src_lang: str, tgt_lang: str) -> str:
    """sha256 over the cleaned pairs, in order."""
    h = hashlib.sha256(f"{src_lang}\t{tgt_lang}\n".encode())
    for s, t in zip(src, tgt):
        h.update(s.encode())
        h.update(b"\t")
        h.update(t.encode())
        h.update(b"\n")
    return h.hexdigest()[:20]


def _size(spec: int | float, n: int) -> int:
    return int(round(spec * n)) if isinstance(spec, float) else int(spec)


def split_indices(
    n: int, valid_size: int | float, test_size: int | float, seed: int
) -> dict[str, np.ndarray]:
    """Seeded permutation cut into test, valid, train (sorted indices within each split)."""
    n_valid, n_test = _size(valid_size, n), _size(test_size, n)
    if n and n_valid + n_test >= n:
        raise ValueError(
            f"valid_size={valid_size} ({n_valid}) + test_size={test_size} ({n_test}) leave no training rows "
            f"out of {n} clean rows; lower them (floats are fractions)"
        )
    perm = np.random.default_rng(seed).permutation(n)
    return {
        "test": np.sort(perm[:n_test]),
        "valid": np.sort(perm[n_test : n_test + n_valid]),
        "train": np.sort(perm[n_test + n_valid :]),
    }


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

    def pack_layout(self) -> PackLayout:
        """The packed layout of this run: from the train split's lengths + (max_tokens, max_len), so every
        rank, epoch and split (valid/test too) uses the same capacities and slots."""
        c, tr = self.cfg, self.splits["train"]
        key = (c.max_tokens, c.max_len)
        if self._layout_key != key:
            if len(tr) == 0:
                raise ValueError(
                    "batching='packed' derives its capacities from the train split, which is empty"
                )
            self._layout, self._layout_key = pack_layout(tr.src_lengths, tr.tgt_lengths, *key), key
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
        return plan_batches(
            sp.src_lengths,
            sp.tgt_lengths,
            spec,
            seed=self.cfg.seed,
            epoch=epoch,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
        )

    def num_batches(
        self, split: str, epoch: int = 0, batching: str | None = None, rank: int = 0, world_size: int = 1
    ) -> int:
        return len(self.plan(split, epoch=epoch, batching=batching, rank=rank, world_size=world_size))

    def collator(self, split: str, batching: str | None = None):
        from .collate import Collator, PackedCollator

        sp, spec = self.splits[split], self.spec(batching)
        if spec.mode == "packed":
            return PackedCollator(sp.src_ids, sp.src_offsets, sp.tgt_ids, sp.tgt_offsets, layout=spec.pack)
        seq_len = None
        if spec.mode == "fixed":
            over = int(((sp.src_lengths > spec.seq_len) | (sp.tgt_lengths > spec.seq_len)).sum())
            if over and self.cfg.overlong == "error":
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


def _encode_or_load(
    tok: Tokenizer, src: list[str], tgt: list[str], idx: dict[str, np.ndarray], path: Path, log
) -> dict:
    if path.is_file():
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        if all(np.array_equal(arrays[f"{s}_rows"], idx[s]) for s in SPLITS):
            return arrays
        log(f"[data] {path.name} does not match the split; re-encoding")
    t0 = time.perf_counter()
    arrays = {}
    for s in SPLITS:
        rows = idx[s]
        arrays[f"{s}_src_ids"], arrays[f"{s}_src_off"] = tok.encode_flat([src[i] for i in rows])
        arrays[f"{s}_tgt_ids"], arrays[f"{s}_tgt_off"] = tok.encode_flat([tgt[i] for i in rows])
        arrays[f"{s}_rows"] = rows
    fd, tmp = tempfile.mkstemp(prefix=".enc-", suffix=".npz", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    n_tok = sum(int(v[-1]) for k, v in arrays.items() if k.endswith("_off"))
    log(
        f"[data] encoded {len(src):,} pairs ({n_tok:,} subwords) in {time.perf_counter() - t0:.1f} s -> {path}"
    )
    return arrays


def _check_usable(raw, kept: np.ndarray, report: CleanReport) -> None:
    """Fail in one sentence, naming the file, when a file (or the whole source) yields no clean row."""
    shown = "\n  ".join(str(report).splitlines())
    if raw.files:
        for f, k in zip(raw.files, raw.kept_per_file(kept)):
            if f.read == 0:
                raise DataInputError(f"{f.path} is empty: nothing to train on; cleaning report:\n  {shown}")
            if k == 0:
                raise DataInputError(
                    f"{f.path}: none of its {f.read:,} {f.unit}{'s' * (f.read != 1)} is a usable pair (reasons and "
                    f"examples below); cleaning report:\n  {shown}"
                )
    elif len(kept) == 0:
        raise DataInputError(f"{raw.source}: no usable pairs; cleaning report:\n  {shown}")


def _length_hint(before: EncodedSplit, dropped: dict[str, int]) -> str:
    """Token-length percentiles of a split before the length filter, and the setting that keeps it."""
    longer = np.maximum(before.src_lengths, before.tgt_lengths)
    pct = "  ".join(f"p{q} {int(np.percentile(longer, q))}" for q in (50, 90, 99, 100))
    keep99 = -(-int(np.percentile(longer, 99)) // 8) * 8
    fix = (
        f"data.max_len={keep99} keeps ~99 % (it needs data.max_tokens >= {2 * keep99})"
        if dropped["too_long"] >= dropped["length_ratio"]
        else "raise data.max_len_ratio"
    )
    return f"longer side in tokens (incl. EOS/BOS): {pct}; {fix}"


def build_data(cfg: DataConfig, log=print) -> DataBundle:
    """Load, clean, split, tokenize and encode ``cfg``'s corpus (cached); every dropped row is counted in
    ``bundle.report``. Raises `DataInputError` when nothing could train (empty file, no usable rows, every
    pair over the length limits)."""
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"build_data takes a data.DataConfig, got {type(cfg).__name__}")
    t0 = time.perf_counter()
    raw = load_raw(cfg)
    report = raw.report
    src, tgt, kept = clean_text(raw.translation, cfg.src_lang, cfg.tgt_lang, report, raw.where)
    del raw.translation
    _check_usable(raw, kept, report)
    if any(report.dropped.values()):
        log(
            f"[data] warning: {report.rows - report.kept:,} of {report.rows:,} input rows dropped "
            "(reasons and examples in the cleaning report below)"
        )
    fp = fingerprint(src, tgt, cfg.src_lang, cfg.tgt_lang)
    idx = split_indices(len(src), cfg.valid_size, cfg.test_size, cfg.split_seed)
    split_digest = hashlib.sha256(b"".join(idx[s].tobytes() for s in SPLITS)).hexdigest()[:20]

    settings = spm_settings(cfg)
    key = tokenizer_key(fp, split_digest, settings)
    cache = Path(cfg.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    tok, trained = train_or_load(
        [src[i] for i in idx["train"]] + [tgt[i] for i in idx["train"]], cfg, key, settings, log
    )
    if not trained:
        log(f"[data] tokenizer cache hit: {tok.model_file}")
    arrays = _encode_or_load(tok, src, tgt, idx, cache / f"enc-{key}.npz", log)

    splits = {}
    for s in SPLITS:
        rows = arrays[f"{s}_rows"]
        sp = EncodedSplit(
            [src[i] for i in rows],
            [tgt[i] for i in rows],
            arrays[f"{s}_src_ids"],
            arrays[f"{s}_src_off"],
            arrays[f"{s}_tgt_ids"],
            arrays[f"{s}_tgt_off"],
            rows,
        )
        keep, dropped = length_mask(sp.src_lengths, sp.tgt_lengths, cfg.max_len, cfg.max_len_ratio)
        for reason, k in dropped.items():
            report.dropped[reason] += k
        for i, reason, detail in length_examples(
            sp.src_lengths, sp.tgt_lengths, cfg.max_len, cfg.max_len_ratio
        ):
            report.note(reason, raw.where(int(kept[rows[i]])), detail)
        report.dropped_by_split[s] = dropped
        if s == "train":
            train_before = sp
        splits[s] = sp if keep.all() else sp.select(keep)
    d, n_train = report.dropped_by_split["train"], len(train_before)
    if len(splits["train"]) == 0:
        raise DataInputError(
            f"every one of the {n_train:,} training pairs is over the length limits "
            f"({d['too_long']:,} too_long with max_len={cfg.max_len}, {d['length_ratio']:,} length_ratio "
            f"with max_len_ratio={cfg.max_len_ratio:g}); {_length_hint(train_before, d)}"
        )
    if d["too_long"] > 0.1 * n_train:
        log(
            f"[data] warning: max_len={cfg.max_len} drops {d['too_long']:,} of {n_train:,} training pairs as "
            f"too_long; {_length_hint(train_before, d)}"
        )
    del train_before
    split_record = {
        "source": raw.source,
        "fingerprint": fp,
        "split_digest": split_digest,
        "split_seed": cfg.split_seed,
        "valid_size": cfg.valid_size,
        "test_size": cfg.test_size,
        "rows_before_length_filter": {s: int(len(idx[s])) for s in SPLITS},
        "sizes": {s: len(splits[s]) for s in SPLITS},
        "tokenizer_key": key,
        "vocab_size": tok.vocab_size,
    }
    bundle = DataBundle(cfg, tok, splits, report, split_record, log)
    if len(splits["train"]):  # the packed layout is fixed by corpus + config: recorded with the run
        split_record["packing"] = bundle.pack_layout().as_dict()
    log("[data] " + str(report).replace("\n", "\n[data] "))
    log(
        f"[data] split {json.dumps(split_record['sizes'])} (seed {cfg.split_seed}, fingerprint {fp}); "
        f"vocab {tok.vocab_size}; ready in {time.perf_counter() - t0:.1f} s"
    )
    return bundle
