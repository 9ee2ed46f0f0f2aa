"""The split phase of the cold build (`data.build`): streaming passes in the main process over the chunks'
hash files (`data.build_scan`). One collects the candidate group keys and the corpus fingerprint, a few scan the
rows that share the candidates' hashes (only the held-out groups are ever formed, `data.split.heldout_groups`),
one writes each chunk's labels (``a-<i>-lab.npy``: train, valid, test, or removed: in your valid/test files),
counts the overlap before (the row-level split of 8c2d91d) and after, and draws the tokenizer's sample. State: the
held-out rows and candidates, and the sample, never a value per row of the corpus.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from . import cache as C
from .build_scan import eval_leak, load_scratch, save_scratch
from .split import KeySet, SmallestKeys, heldout_groups, in_sorted, mix64, row_level_heldout, sorted_unique

SPLIT_CODE = {"train": 0, "valid": 1, "test": 2}  # a row's label in ``a-<i>-lab.npy`` (-1: removed)
_SAMPLE_SEED = 0x5EED  # xor-ed into split_seed: the tokenizer sample's order of pairs


class Hashes:
    """The per-row hashes of pass A, chunk by chunk from the scratch files: ``(i, h, free)`` with ``h`` (3, n_i)
    uint64 (normalised source, normalised target, pair) and ``free`` the rows not removed for your valid/test
    files (None: every row)."""

    def __init__(self, tmp: Path, first: np.ndarray, eval_keys):
        self.tmp, self.first, self.eval_keys = tmp, first, eval_keys

    def __iter__(self):
        for i in range(len(self.first) - 1):
            h = load_scratch(self.tmp, f"a-{i}-h.npy")
            leak = eval_leak(h, self.eval_keys)
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


def split_corpus(cfg, hashes: Hashes, n: int, n_test: int, n_valid: int, eval_hashes: dict, sample_k: int | None) -> dict:
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
            labels[rows[(rows >= lo) & (rows < hi)] - lo] = SPLIT_CODE[s]
        save_scratch(hashes.tmp, f"a-{i}-lab.npy", labels)
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
