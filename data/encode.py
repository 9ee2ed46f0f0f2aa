"""Encoding a build chunk's texts with SentencePiece, one distinct word at a time (the cold build's pass B).

A BPE model trained with ``split_by_whitespace`` (SentencePiece's default, and fastmt's) has no piece with the
word boundary ``▁`` inside it, so no merge crosses a space: a sentence's ids are the ids of its space-separated
words, each encoded alone, back to back (``encode("a b") == encode("a") + encode("b")``; checked for every
Unicode code point before and after a space, and on real sentences: tests/data/test_encode.py). Natural text
repeats its words (Zipf), so `WordEncoder` encodes each distinct word once per chunk through a cache of the
words seen before, and assembles the sentences with numpy gathers: ~5-10x fewer SentencePiece calls than
encoding every sentence, and no Python list per token.

The cut at spaces is pyarrow's (``split_pattern`` is ``str.split(" ")``; pyarrow comes with ``datasets``).
Each chunk is also checked: a fixed sample of its sentences is encoded whole by SentencePiece and compared; a
difference makes that chunk (and every later one in this process) go through ``sp.encode`` sentence by
sentence, and is reported. A unigram model (Viterbi over the whole sentence, float ties) or a model whose
pieces hold an inner ``▁`` is always encoded sentence by sentence.
"""

from __future__ import annotations

import itertools

import numpy as np

WORD_CAP = 1 << 18  # distinct words cached per process (~30 MB); the cache starts again when full
CHAR_CAP = 1 << 23  # ... or when its words hold this many characters (a corpus of long tokens: URLs, base64)
CHECKED = 64  # sentences per chunk also encoded whole and compared


def word_local(sp) -> bool:
    """True when no piece of the model ``sp`` holds the word boundary after its first character."""
    return all("\u2581" not in sp.id_to_piece(i)[1:] for i in range(sp.get_piece_size()))


class WordEncoder:
    """``encode(texts) -> (ids, lengths)``: every text's subword ids back to back (int32) and each text's count
    (int64), equal to ``sp.encode(texts)``. ``fast``: the word path is used (a BPE model without inner
    boundaries); ``disagreed``: a chunk's check found a difference (every later chunk then goes sentence by
    sentence)."""

    def __init__(self, sp, bpe: bool, cap: int = WORD_CAP, char_cap: int = CHAR_CAP):
        self.sp, self.cap, self.char_cap = sp, cap, char_cap
        self.fast = bpe and word_local(sp)
        self.disagreed = False
        self._reset()

    def _reset(self) -> None:
        self.ids: dict[str, int] = {}
        self.chars = 0
        self.start = np.zeros(1024, dtype=np.int64)
        self.len = np.zeros(1024, dtype=np.int64)
        self.flat = np.zeros(8192, dtype=np.int32)
        self.used = 0

    def _add(self, words: list[str]) -> np.ndarray:
        """Encode ``words`` (not cached yet) and cache them; returns their word ids."""
        enc = self.sp.encode(words, out_type=int, num_threads=1)
        lens = np.fromiter(map(len, enc), np.int64, len(enc))
        n0, n1, tot = len(self.ids), len(self.ids) + len(words), int(lens.sum())
        if n1 > len(self.start):
            size = max(n1, 2 * len(self.start))
            self.start, self.len = np.resize(self.start, size), np.resize(self.len, size)
        if self.used + tot > len(self.flat):
            self.flat = np.resize(self.flat, max(self.used + tot, 2 * len(self.flat)))
        self.flat[self.used:self.used + tot] = np.fromiter(itertools.chain.from_iterable(enc), np.int32, tot)
        self.start[n0:n1] = self.used + np.cumsum(lens) - lens
        self.len[n0:n1] = lens
        self.used += tot
        self.ids.update(zip(words, range(n0, n1)))
        self.chars += sum(map(len, words))
        return np.arange(n0, n1, dtype=np.int64)

    def encode(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """``texts``: a list of str, or a pyarrow (large) string array (pass B's scratch blob, no copy)."""
        import pyarrow as pa

        if not isinstance(texts, pa.Array):
            texts = pa.array(texts, type=pa.large_string())
        if not len(texts):
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        if self.fast and not self.disagreed:
            ids, lens = self._by_words(texts)
            if self._agrees(texts, ids, lens):
                return ids, lens
            self.disagreed = True
        return self._by_sentences(texts.to_pylist())

    def _by_sentences(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.sp.encode(texts, out_type=int, num_threads=1)
        lens = np.fromiter(map(len, enc), np.int64, len(enc))
        return np.fromiter(itertools.chain.from_iterable(enc), np.int32, int(lens.sum())), lens

    def _by_words(self, texts) -> tuple[np.ndarray, np.ndarray]:
        import pyarrow.compute as pc

        words = pc.split_pattern(texts, " ")  # str.split(" "): >= 1 word per text
        first = _numpy(words.offsets)[:-1]
        coded = pc.dictionary_encode(words.values)
        distinct = coded.dictionary.to_pylist()
        if len(self.ids) + len(distinct) > self.cap or self.chars > self.char_cap:
            self._reset()
        get = self.ids.get
        wid = np.fromiter(map(get, distinct, itertools.repeat(-1)), np.int64, len(distinct))
        new = np.flatnonzero(wid < 0)
        if len(new):
            wid[new] = self._add([distinct[i] for i in new.tolist()])
        w = wid[_numpy(coded.indices)]
        n_tok = self.len[w]
        ends = np.cumsum(n_tok)
        ids = self.flat[np.repeat(self.start[w] - (ends - n_tok), n_tok) + np.arange(int(ends[-1]))]
        return ids, np.add.reduceat(n_tok, first)

    def _agrees(self, texts, ids: np.ndarray, lens: np.ndarray) -> bool:
        """A fixed sample of the chunk (evenly spaced, the first and last text included) encoded whole."""
        pick = np.unique(np.linspace(0, len(texts) - 1, min(CHECKED, len(texts))).astype(np.int64)).tolist()
        off = np.concatenate([[0], np.cumsum(lens)])
        whole = self.sp.encode([texts[i].as_py() for i in pick], out_type=int, num_threads=1)
        return all(ids[off[i]:off[i + 1]].tolist() == w for i, w in zip(pick, whole))


def _numpy(arr) -> np.ndarray:
    """A pyarrow int32/int64 array without nulls, as a numpy view (``to_numpy`` would import pandas)."""
    dtype = {"int32": np.int32, "int64": np.int64}[str(arr.type)]
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=arr.offset + len(arr))[arr.offset:]


def string_array(blob: bytes, offsets: np.ndarray):
    """The texts ``blob[offsets[k]:offsets[k + 1]]`` (UTF-8 this process wrote) as a pyarrow large string array,
    without copying or decoding them."""
    import pyarrow as pa

    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    return pa.LargeStringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(blob))
