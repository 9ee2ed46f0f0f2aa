"""Leakage-free splits: pairs that share a normalised source (and, by default, a normalised target) form one
group, and a whole group goes to one split, so no valid/test source (or target) occurs in train.

Normalisation (`normalise`): Unicode NFKC, then ``str.casefold``, then runs of whitespace collapsed to one
space and the ends stripped. "The Cat  sat." and "the cat sat." are one group; so are full-width and ASCII
letters. Punctuation and accents are kept ("cafe" and "café" differ).

Assignment, deterministic in ``split_seed`` and streaming-friendly: each row carries a 64-bit hash of its
normalised source and target (computed where the row is read); a group's key is the smallest source hash of
its members, and ``mix64(key, seed)`` orders the groups. Test takes groups in that order until it holds at
least ``test_size`` rows, then valid takes the next groups until it holds ``valid_size``; the rest trains.
Groups of more than ``HELDOUT_MAX_GROUP`` rows are never held out (a sentence with dozens of translations
would otherwise fill a test set); a held-out split can exceed its size by less than that cap.
Appending rows to a corpus never moves an earlier train row into valid/test unless an appended row links
it to a held-out group (a shared normalised source or target): the held-out sets are the groups with the
smallest keys, and more rows only lower the cut. Earlier valid/test rows may move to train.

At scale (`heldout_groups`): only the held-out groups are ever formed. The groups come in ``mix64(key)`` order
and a key is a source hash, so the groups that can come first have their key among the unique source hashes
with the smallest ``mix64`` (`SmallestKeys`, one streaming pass). Each candidate's group is grown from the rows
that share its hashes (`heldout_groups`' ``scan``: a streaming pass over the per-row hashes on disk, at most
``max_group + 1`` rows kept per hash) until it is closed or known to be over ``max_group``; the candidates
whose own hash is their group's key, in ``mix64`` order, are exactly the first groups of `assign`'s order, so
the same rows are held out (tested against `group_keys` + `assign`). Memory follows the held-out sizes, not
the corpus; groups never held out (the whole train split) are never built.
"""

from __future__ import annotations

import hashlib
import unicodedata

import numpy as np

from .config import SPLIT_GROUPINGS

NORMALISATION = "NFKC + casefold + whitespace collapsed"
HELDOUT_MAX_GROUP = 32  # groups with more rows always train (see the module docstring)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def normalise(text: str) -> str:
    """NFKC, casefold, whitespace runs collapsed to one space, ends stripped (ASCII takes a fast path)."""
    if text.isascii():
        return " ".join(text.lower().split())
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def hash64(text: str) -> int:
    """A stable 64-bit hash of ``text`` (blake2b, not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


_BLAKE8 = hashlib.blake2b(digest_size=8)  # copied per text: cheaper than building one from its arguments


def hash64_bytes(items) -> np.ndarray:
    """`hash64` of many texts already encoded as UTF-8 bytes, as one uint64 array (the digests joined and read as
    little-endian words: no Python int per text)."""
    def one(x: bytes, copy=_BLAKE8.copy) -> bytes:
        h = copy()
        h.update(x)
        return h.digest()

    return np.frombuffer(b"".join([one(x) for x in items]), dtype="<u8").astype(np.uint64)


_OTHER_WHITESPACE = "\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what str.split() also cuts at, in ASCII


def normalise_bytes(texts: list[str]) -> list[bytes]:
    """``[normalise(t).encode() for t in texts]``. When every text is ASCII with no whitespace but single inner
    spaces (a chunk of English, often), the normal forms are the lower cases, taken in one piece: ``str.lower``
    of ASCII texts joined by NULs is their lower cases joined by NULs."""
    blob = "\x00".join(texts)
    if (blob.isascii() and blob.count("\x00") == len(texts) - 1 and "  " not in blob
            and not any(c in blob for c in _OTHER_WHITESPACE)
            and not blob.startswith(" ") and not blob.endswith(" ") and "\x00 " not in blob and " \x00" not in blob):
        return blob.lower().encode().split(b"\x00") if texts else []
    return [normalise(t).encode() for t in texts]


def mix64(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of ``x`` xor a seed-derived constant: a seeded, uniform order of 64-bit keys (vectorised)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) ^ (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _dense(h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order that sorts ``h``, per row the dense id of its value in sorted order, start of each id's run
    in that order): one sort."""
    index = np.int32 if len(h) < 2**31 else np.int64  # half the memory of the index arrays (5 M rows: 250 MB)
    order = np.argsort(h, kind="stable")
    sh = h[order]
    new = np.empty(len(h), dtype=bool)
    new[0] = True
    np.not_equal(sh[1:], sh[:-1], out=new[1:])
    del sh
    ids = np.empty(len(h), dtype=index)
    ids[order] = np.cumsum(new, dtype=index) - 1
    return order.astype(index), ids, np.flatnonzero(new)


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` by one sort (numpy 2.3's ``np.unique`` took ~2 s for 1 M uint64 here, a sort 0.1 s)."""
    s = np.sort(np.asarray(a))
    return s[np.r_[True, s[1:] != s[:-1]]] if len(s) else s


def in_sorted(values: np.ndarray, sorted_unique: np.ndarray) -> np.ndarray:
    """``np.isin(values, sorted_unique)`` for a sorted unique array (a binary search per value)."""
    values, sorted_unique = np.asarray(values), np.asarray(sorted_unique)
    if len(sorted_unique) == 0:
        return np.zeros(len(values), dtype=bool)
    if values.dtype == sorted_unique.dtype == np.uint64 and len(values) > 64 * len(sorted_unique):
        # many values, few keys (train hashes against a held-out set): a table of the keys' low bits rules out
        # almost every value with one gather; only the rest is searched (1.2 M values, 1,000 keys: ~8x faster)
        bits = min(24, max(10, int(len(sorted_unique)).bit_length() + 6))
        mask = np.uint64((1 << bits) - 1)
        table = np.zeros(1 << bits, dtype=bool)
        table[(sorted_unique & mask).astype(np.intp)] = True
        out = table[(values & mask).astype(np.intp)]
        maybe = np.flatnonzero(out)
        i = np.minimum(np.searchsorted(sorted_unique, values[maybe]), len(sorted_unique) - 1)
        out[maybe] = sorted_unique[i] == values[maybe]
        return out
    i = np.minimum(np.searchsorted(sorted_unique, values), len(sorted_unique) - 1)
    return sorted_unique[i] == values


def group_keys(h_src: np.ndarray, h_tgt: np.ndarray, grouping: str) -> np.ndarray:
    """Per row, the key of its group: the smallest source hash among the rows linked to it by a shared
    normalised source (``grouping="source"``: the row's own source hash) or, with "source_target", by a chain
    of shared sources or targets (connected components: min-label propagation with pointer jumping)."""
    if grouping not in SPLIT_GROUPINGS:  # the config checks it: this is a caller around that check
        raise ValueError(f"split_grouping={grouping!r} is not one of {SPLIT_GROUPINGS}")
    h_src = np.asarray(h_src, dtype=np.uint64)
    if grouping == "source" or len(h_src) == 0:
        return h_src.copy()
    by_s, s_id, s_starts = _dense(h_src)  # dense ids in hash order, and the rows sorted by them
    by_t, t_id, t_starts = _dense(np.asarray(h_tgt, dtype=np.uint64))
    src_keys = h_src[by_s][s_starts]
    label = np.arange(len(src_keys), dtype=s_id.dtype)  # per source id: the smallest source id linked to it
    while True:
        row = label[s_id]
        row = np.minimum(row, np.minimum.reduceat(row[by_t], t_starts)[t_id])  # across shared targets
        new = np.minimum(label, np.minimum.reduceat(row[by_s], s_starts))  # back onto the sources
        while not np.array_equal(jumped := new[new], new):  # pointer jumping: a label's label is linked too
            new = jumped
        if np.array_equal(new, label):
            break
        label = new
    return src_keys[label[s_id]]  # dense ids follow hash order: the smallest id has the smallest hash


def assign(keys: np.ndarray, n_test: int, n_valid: int, seed: int,
           max_group: int = HELDOUT_MAX_GROUP) -> np.ndarray:
    """Per row 0 = train, 1 = valid, 2 = test: groups (equal ``keys``) in ``mix64(key, seed)`` order fill test
    to >= ``n_test`` rows, then valid to >= ``n_valid``; groups over ``max_group`` rows always train."""
    keys = np.asarray(keys, dtype=np.uint64)
    out = np.zeros(len(keys), dtype=np.int8)
    if len(keys) == 0 or n_test + n_valid == 0:
        return out
    by_key, inv, starts = _dense(keys)
    uniq = keys[by_key][starts]
    counts = np.diff(np.r_[starts, len(keys)])
    order = np.argsort(mix64(uniq, seed), kind="stable")
    order = order[counts[order] <= max_group]
    csum = np.cumsum(counts[order])
    n_t = int(np.searchsorted(csum, n_test, side="left")) + 1 if n_test else 0  # groups until >= n_test rows
    n_t = min(n_t, len(order))
    got = int(csum[n_t - 1]) if n_t else 0
    n_v = int(np.searchsorted(csum, got + n_valid, side="left")) + 1 if n_valid else n_t
    n_v = min(max(n_v, n_t), len(order))
    label = np.zeros(len(uniq), dtype=np.int8)
    label[order[:n_t]] = 2
    label[order[n_t:n_v]] = 1
    out[:] = label[inv]
    return out


def row_level_heldout(n: int, n_test: int, n_valid: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(test rows, valid rows), each sorted, of the split 8c2d91d made (a seeded permutation of rows, no
    grouping): the "before" of the overlap record. ``Generator.permutation(n)`` is ``shuffle(arange(n))``, and
    the shuffle draws the same numbers for any item size: shuffling int32 gives the same rows in half the
    memory (4 bytes a row, for a moment)."""
    perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.default_rng(seed).shuffle(perm)
    test, valid = np.sort(perm[:n_test]).astype(np.int64), np.sort(perm[n_test : n_test + n_valid]).astype(np.int64)
    del perm
    return test, valid


# ----------------------------------------------------------------------------------------------
# The held-out groups of a corpus too large for `group_keys` in memory
# ----------------------------------------------------------------------------------------------
class KeySet:
    """A sorted set of 64-bit keys and a fast membership test (`in_sorted` with its low-bit table built once,
    for the many streaming passes that test every row against the same keys)."""

    def __init__(self, keys: np.ndarray):
        self.keys = sorted_unique(np.asarray(keys, dtype=np.uint64))
        bits = min(24, max(10, int(len(self.keys)).bit_length() + 6))
        self.mask = np.uint64((1 << bits) - 1)
        self.table = np.zeros(1 << bits, dtype=bool)
        self.table[(self.keys & self.mask).astype(np.intp)] = True

    def __len__(self) -> int:
        return len(self.keys)

    def contains(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.uint64)
        if len(self.keys) == 0:
            return np.zeros(len(values), dtype=bool)
        out = self.table[(values & self.mask).astype(np.intp)]
        maybe = np.flatnonzero(out)
        if len(maybe):
            i = np.minimum(np.searchsorted(self.keys, values[maybe]), len(self.keys) - 1)
            out[maybe] = self.keys[i] == values[maybe]
        return out

    def index(self, values: np.ndarray) -> np.ndarray:
        """Positions in `keys` of ``values`` (each one a member)."""
        return np.searchsorted(self.keys, np.asarray(values, dtype=np.uint64))


class SmallestKeys:
    """The ``k`` distinct 64-bit values with the smallest ``mix64(value, seed)`` among all values `add` ed (a
    streaming pass; memory ~16 bytes x k). ``complete``: fewer than ``k`` distinct values were seen, so every
    one of them is kept."""

    def __init__(self, k: int, seed: int):
        self.k, self.seed = max(1, int(k)), seed
        self.m = np.zeros(0, dtype=np.uint64)  # mix64 of the kept values, ascending
        self.h = np.zeros(0, dtype=np.uint64)

    def add(self, values: np.ndarray) -> None:
        h = np.asarray(values, dtype=np.uint64)
        m = mix64(h, self.seed)
        if len(self.m) == self.k:
            keep = m <= self.m[-1]
            m, h = m[keep], h[keep]
        if len(m) == 0:
            return
        m, h = np.concatenate([self.m, m]), np.concatenate([self.h, h])
        order = np.argsort(m, kind="stable")
        m, h = m[order], h[order]
        first = np.r_[True, m[1:] != m[:-1]]  # mix64 is a bijection: equal m, equal value
        self.m, self.h = m[first][: self.k], h[first][: self.k]

    @property
    def complete(self) -> bool:
        return len(self.m) < self.k


def heldout_groups(scan, cands: SmallestKeys, n_test: int, n_valid: int, grouping: str,
                   max_group: int = HELDOUT_MAX_GROUP) -> dict | None:
    """`assign`'s test and valid rows without the corpus' groups in memory: ``{"test": (rows, h_src, h_tgt),
    "valid": (...)}`` (row numbers ascending, with their hashes), or None when the candidates ``cands`` (the
    source hashes of the free rows with the smallest ``mix64``) end before the held-out sizes are reached (the
    caller asks again with more). ``scan(src_keys, tgt_keys, cap)`` returns ``(rows, h_src, h_tgt)`` of the free
    rows whose source hash is in the `KeySet` ``src_keys`` or whose target hash is in ``tgt_keys``, at most
    ``cap`` rows per key and side (a key with more is in a group over ``max_group`` anyway)."""
    empty, none = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    if n_test + n_valid == 0:
        return {"test": (none, empty, empty), "valid": (none, empty, empty)}
    if len(cands.h) == 0:  # no free row at all
        return {"test": (none, empty, empty), "valid": (none, empty, empty)}
    rows, hs, ht = none, empty, empty
    asked_s, asked_t = empty, empty
    new_s, new_t = sorted_unique(cands.h), empty
    while len(new_s) or len(new_t):
        r, s, t = scan(KeySet(new_s), KeySet(new_t), max_group + 1)
        rows, at = np.unique(np.concatenate([rows, r]), return_index=True)
        hs, ht = np.concatenate([hs, s])[at], np.concatenate([ht, t])[at]
        asked_s = sorted_unique(np.concatenate([asked_s, new_s]))
        asked_t = sorted_unique(np.concatenate([asked_t, new_t]))
        keys = group_keys(hs, ht, grouping)  # the groups of the rows found so far
        _, inv, size = np.unique(keys, return_inverse=True, return_counts=True)
        small = size[inv] <= max_group
        if grouping == "source":  # a source hash's rows are its group: closed by the first scan
            break
        # a small group is whole once every hash of its rows has been scanned for (each one's rows all came back)
        new_s = sorted_unique(hs[small][~in_sorted(hs[small], asked_s)])
        new_t = sorted_unique(ht[small][~in_sorted(ht[small], asked_t)])
    # the groups whose key is a candidate, in mix64 order: the first groups of `assign`'s order
    ok = sorted_unique(keys[small])
    ok = ok[in_sorted(ok, sorted_unique(cands.h))]
    rank = np.empty(len(ok), dtype=np.int64)
    rank[np.argsort(mix64(ok, cands.seed), kind="stable")] = np.arange(len(ok))
    member = small & in_sorted(keys, ok)
    row_rank = rank[np.searchsorted(ok, keys[member])]
    csum = np.cumsum(np.bincount(row_rank, minlength=len(ok)))
    total = int(csum[-1]) if len(csum) else 0
    if not cands.complete and total < n_test:
        return None
    n_t = min(int(np.searchsorted(csum, n_test, side="left")) + 1 if n_test else 0, len(ok))
    got = int(csum[n_t - 1]) if n_t else 0
    if not cands.complete and total < got + n_valid:
        return None
    n_v = int(np.searchsorted(csum, got + n_valid, side="left")) + 1 if n_valid else n_t
    n_v = min(max(n_v, n_t), len(ok))
    code = np.zeros(len(rows), dtype=np.int8)
    code[member] = np.where(row_rank < n_t, 2, np.where(row_rank < n_v, 1, 0))
    return {s: (rows[code == c], hs[code == c], ht[code == c]) for s, c in (("test", 2), ("valid", 1))}
