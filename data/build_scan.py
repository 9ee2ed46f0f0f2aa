"""Pass A of the cold build (`data.build`): read, clean, normalise and hash every row of one input chunk, and
the scratch files that carry a chunk's cleaned texts and hashes to the later phases; your own valid/test files,
read whole and strictly.

A chunk's files in the build's temp folder: ``a-<i>.txt`` (every cleaned source, then every target, UTF-8 back to
back), ``a-<i>-off.npy`` (the (2n+1,) byte offsets of the texts), ``a-<i>-pos.npy`` (the rows' positions in the
input file) and ``a-<i>-h.npy`` (the (3, n) hashes: normalised source, normalised target, exact pair). Scratch
files are read back only when this user wrote them (`data.files`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from .clean import DataInputError, clean_row
from .files import load_npy, open_own
from .sources import read_chunk, read_local, where
from .split import KeySet, hash64, hash64_bytes, normalise, normalise_bytes


# ----------------------------------------------------------------------------------------------
# Scratch files of a build (its own temp folder; read back only when this user wrote them)
# ----------------------------------------------------------------------------------------------
def scratch_path(tmp, name: str) -> str:
    """A scratch file's path, a plain str: a Path would intern every (unique) file name for the process's life."""
    return os.path.join(tmp, name)


def save_scratch(tmp, name: str, a: np.ndarray) -> None:
    np.save(scratch_path(tmp, name), a)


def load_scratch(tmp, name: str) -> np.ndarray:
    """A scratch array `save_scratch` wrote, through the one reader (read back only when this user wrote it)."""
    return load_npy(scratch_path(tmp, name), "scratch array", own=True, mmap=False)


def eval_leak(h: np.ndarray, eval_keys: tuple[KeySet, KeySet] | None) -> np.ndarray | None:
    """Rows (of one chunk's hashes ``h``) whose normalised source, or target, is in your valid/test files (None:
    no such files). ``eval_keys``: the files' source and target hashes (targets empty with split_grouping
    source)."""
    if eval_keys is None:
        return None
    return eval_keys[0].contains(h[0]) | eval_keys[1].contains(h[1])


# ----------------------------------------------------------------------------------------------
# Pass A: the task per chunk (module level: it runs in forked processes)
# ----------------------------------------------------------------------------------------------
def scan_chunk(job) -> dict:
    """Pass A on one chunk: parse, clean, hash; cleaned texts, positions and hashes to ``tmp/a-<i>*``
    (`save_texts`). Returns the counts, the rejects and the seconds of each step."""
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
    leak = eval_leak(h, eval_keys)
    t3 = time.perf_counter()
    save_texts(tmp, i, b_src + b_tgt, pos)
    save_scratch(tmp, f"a-{i}-h.npy", h)
    t4 = time.perf_counter()
    return {"read": n_read, "tally": tally, "kept": len(pos),
            "leaked": 0 if leak is None else int(leak.sum()),
            "seconds": {"read": t1 - t0, "clean": t2 - t1, "hash": t3 - t2, "scratch": t4 - t3}}


def save_texts(tmp, i: int, enc: list[bytes], pos: list[int]) -> None:
    """A chunk's cleaned texts as UTF-8 back to back (``a-<i>.txt``: every source, then every target) with the
    (2n+1,) byte offsets of each text and the rows' positions: the tokenizer's sample reads only its rows, pass
    B reads the chunk once (`load_blob`) and decodes only the words it has not seen."""
    off = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc)), out=off[1:])
    with open(scratch_path(tmp, f"a-{i}.txt"), "wb") as f:
        f.write(b"".join(enc))
    save_scratch(tmp, f"a-{i}-off.npy", off)
    save_scratch(tmp, f"a-{i}-pos.npy", np.asarray(pos, dtype=np.int64))


def load_blob(tmp, i: int) -> tuple[bytes, np.ndarray]:
    """Chunk i's texts as `save_texts` wrote them: the UTF-8 blob and the (2n+1,) offsets (read back only when
    this user wrote them)."""
    off = load_scratch(tmp, f"a-{i}-off.npy")
    with open_own(scratch_path(tmp, f"a-{i}.txt")) as f:
        return f.read(), off


def load_texts(tmp, i: int, rows) -> tuple[list[str], list[str]]:
    """(sources, targets) of chunk i's rows ``rows`` (local indices): only their bytes are read."""
    off = load_scratch(tmp, f"a-{i}-off.npy")
    n = (len(off) - 1) // 2
    rows = np.asarray(rows, dtype=np.int64)
    with open_own(scratch_path(tmp, f"a-{i}.txt")) as f:
        fd = f.fileno()
        return tuple([os.pread(fd, int(b - a), int(a)).decode() for a, b in zip(off[r].tolist(), off[r + 1].tolist())]
                     for r in (rows, n + rows))


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


def text_hashes(texts: list[str]) -> np.ndarray:
    """The 64-bit hashes of the normalised texts (the keys the split groups by)."""
    return np.fromiter((hash64(normalise(x)) for x in texts), np.uint64, len(texts))
