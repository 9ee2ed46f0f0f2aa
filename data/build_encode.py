"""Pass B of the cold build (`data.build`): encode each chunk (`data.encode.WordEncoder`: each distinct word
once, in the build workers); train pairs are length-filtered into part files (``b-<i>-*``), valid/test pairs are
kept whole (token arrays cut to ``max_len``, counted); then the caching: the train parts copied into one
memory-mappable array per side, and the held-out splits written, as the entry's .npy arrays and texts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

import numpy as np

from . import cache as C
from .build_scan import load_blob, load_scratch, save_scratch, scratch_path
from .build_split import SPLIT_CODE
from .clean import MAX_EXAMPLES, Tally, length_examples, length_mask
from .encode import WordEncoder, string_array
from .tokenizer import Tokenizer

LEN_CAP = 4096  # train length histograms (for the length hints) clip here
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


def encode_chunk(job) -> dict:
    """Pass B on one chunk: encode; train rows length-filtered into part files; valid/test rows returned
    whole (texts) with token arrays cut to ``max_len``."""
    i, tmp, model_file, bpe, max_len, max_ratio, dtype = job
    t0 = time.perf_counter()
    blob, off = load_blob(tmp, i)
    n = (len(off) - 1) // 2
    pos = load_scratch(tmp, f"a-{i}-pos.npy").tolist()
    labels = load_scratch(tmp, f"a-{i}-lab.npy")
    for name in (f"a-{i}.txt", f"a-{i}-off.npy", f"a-{i}-pos.npy", f"a-{i}-h.npy", f"a-{i}-lab.npy"):
        os.unlink(scratch_path(tmp, name))

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
        save_scratch(tmp, f"b-{i}-{name}.npy", a)
    held = {}
    cut = max_len - 1  # subwords that fit with EOS / BOS
    for s in ("valid", "test"):
        idx = np.flatnonzero(labels == SPLIT_CODE[s]).tolist()
        if not idx:  # most chunks: nothing held out (the main process keeps only the chunks that hold some)
            continue
        held[s] = {"src": [text(k) for k in idx], "tgt": [text(n + k) for k in idx],
                   "src_ids": [ids_s[off_s[k]:min(off_s[k + 1], off_s[k] + cut)].tolist() for k in idx],
                   "tgt_ids": [ids_t[off_t[k]:min(off_t[k + 1], off_t[k] + cut)].tolist() for k in idx],
                   "local": np.asarray(idx, dtype=np.int64),
                   "truncated": int(sum(ls[k] > max_len or lt[k] > max_len for k in idx))}
    t3 = time.perf_counter()
    return {"tally": tally, "n_train": len(keep), "tokens": (int(part["src_len"].sum()), int(part["tgt_len"].sum())),
            "held": held, "longer": np.bincount(np.minimum(hi, LEN_CAP)), "word_check_failed": words.disagreed,
            "seconds": {"scratch": t1 - t0, "encode": t2 - t1, "write": t3 - t2}}



def forget_tokenizers() -> None:
    """Drop this process's loaded models (in-process runs: a later build may retrain a model at the same path)."""
    _TOKENIZERS.clear()


def assemble_train(tmp: Path, parts: list[tuple[int, tuple[int, int]]], first, dtype: str, counts: dict,
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
            out[name] = stack.enter_context(open(scratch_path(tmp, f"train_{name}.npy"), "wb"))
            np.lib.format.write_array_header_1_0(out[name], {
                "descr": np.lib.format.dtype_to_descr(np.dtype(dt)), "fortran_order": False, "shape": (size,)})
            header[name] = out[name].tell()
        r = {"src": 0, "tgt": 0}
        for side in ("src", "tgt"):
            np.zeros(1, np.int64).tofile(out[f"{side}_off"])
        for i in range(len(parts)):
            for side in ("src", "tgt"):
                ids, lens = load_scratch(tmp, f"b-{i}-{side}_ids.npy"), load_scratch(tmp, f"b-{i}-{side}_len.npy")
                ids.astype(dtype, copy=False).tofile(out[f"{side}_ids"])
                (r[side] + np.cumsum(lens, dtype=np.int64)).tofile(out[f"{side}_off"])
                r[side] += len(ids)
            (first[i] + load_scratch(tmp, f"b-{i}-rows.npy")).astype(np.int64, copy=False).tofile(out["rows"])
            for name in ("src_ids", "src_len", "tgt_ids", "tgt_len", "rows"):
                os.unlink(scratch_path(tmp, f"b-{i}-{name}.npy"))
        for name, (dt, size) in shapes.items():  # the header promised exactly what was written
            wrote = out[name].tell() - header[name]
            if wrote != size * np.dtype(dt).itemsize:
                raise RuntimeError(f"train_{name}.npy: wrote {wrote} bytes of data, the header says "
                                   f"{size} x {np.dtype(dt)}")
    counts["train"], tokens["train"] = n, tot


def merge_held(parts: list[tuple[int, dict]], first) -> dict:
    """The held-out rows of one split from the chunks that hold some: ``(chunk, its part)`` in chunk order."""
    out = {"src": [], "tgt": [], "src_ids": [], "tgt_ids": [], "rows": [], "truncated": 0}
    for i, p in parts:
        for k in ("src", "tgt", "src_ids", "tgt_ids"):
            out[k] += p[k]
        out["rows"] += (first[i] + p["local"]).tolist()
        out["truncated"] += p["truncated"]
    return out


def encode_eval(tok: Tokenizer, texts: tuple[list[str], list[str]], max_len: int) -> dict:
    src, tgt = texts
    ids_s = [x.tolist() for x in tok.encode(src)]
    ids_t = [x.tolist() for x in tok.encode(tgt)]
    over = sum(len(a) + 1 > max_len or len(b) + 1 > max_len for a, b in zip(ids_s, ids_t))
    return {"src": src, "tgt": tgt, "src_ids": [x[: max_len - 1] for x in ids_s],
            "tgt_ids": [x[: max_len - 1] for x in ids_t], "rows": list(range(len(src))), "truncated": over}


def save_held(tmp: Path, s: str, held: dict, dtype: str, counts: dict, tokens: dict) -> None:
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
