"""fastmt's leakage-free split written out as plain text files, so another toolkit (bench/peers.py's HF baseline,
eole, Marian, fairseq) trains, validates and tests on exactly the rows fastmt does.

``export_split(bundle, cfg, out)`` writes ``{train,valid,test}.{src,tgt}`` (one sentence a line, UTF-8, the
cleaned texts), the SentencePiece model (``spm.model``) and ``split.json``: per split its row count, the corpus
row indices' hash and the sha256 of each file (``rows_sha256`` hashes the (source, target) pairs themselves, so
two systems that read the same rows agree on it whatever their file layout). Train texts are not kept in the
cache (only their subword ids), so they are read again from the inputs and cleaned as the build cleans them
(``data.clean.clean_row``), then picked by the split's row indices (the cleaned-corpus index of each pair); a
file whose rows no longer match the cache (edited since) fails on the check that the re-encoded train rows
equal the cached ids. The command line is ``python -m bench.race export``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from data.files import TEXTS_MAX, TOKENIZER_MAX, read_bytes, read_text

SPLITS = ("train", "valid", "test")
SIDES = ("src", "tgt")


def pairs_sha256(src: Iterable[str], tgt: Iterable[str]) -> str:
    """The sha256 of a list of (source, target) pairs, in order (each pair "src\\ttgt\\n", UTF-8)."""
    h = hashlib.sha256()
    for s, t in zip(src, tgt, strict=True):
        h.update(f"{s}\t{t}\n".encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(read_bytes(path, "exported split file", limit=TEXTS_MAX)).hexdigest()


def read_pairs(folder: Path, split: str) -> tuple[list[str], list[str]]:
    """The (sources, targets) of an exported ``split``, as the files hold them."""
    src = read_text(Path(folder) / f"{split}.src", "exported split file", limit=TEXTS_MAX).split("\n")[:-1]
    tgt = read_text(Path(folder) / f"{split}.tgt", "exported split file", limit=TEXTS_MAX).split("\n")[:-1]
    if len(src) != len(tgt):
        raise ValueError(f"{folder}/{split}.src has {len(src)} lines but {split}.tgt has {len(tgt)}")
    return src, tgt


def cleaned_corpus(cfg) -> tuple[list[str], list[str]]:
    """Every cleaned training pair of ``cfg``'s inputs in the build's order (the index a split's ``rows`` holds)."""
    from .clean import clean_row
    from .entry import inputs
    from .sources import read_chunk

    inp = inputs(cfg)
    src, tgt = [], []
    for chunk in inp.chunks:
        rows = read_chunk(chunk, cfg.src_lang, cfg.tgt_lang)
        for row in rows.translation:
            got = clean_row(row, cfg.src_lang, cfg.tgt_lang)
            if got[0] is not None:
                src.append(got[0])
                tgt.append(got[1])
    return src, tgt


def _one_line(text: str, where: str) -> str:
    if "\n" in text or "\r" in text:  # clean_row collapses whitespace; a line break here would shift every row
        raise ValueError(f"{where}: a sentence holds a line break ({text[:60]!r}); cannot write one per line")
    return text


def split_texts(bundle, cfg) -> dict[str, tuple[list[str], list[str]]]:
    """split -> (sources, targets) of ``bundle`` (train read again from the inputs, valid/test from the cache)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    corpus = None
    for s in SPLITS:
        sp = bundle.splits[s]
        if sp.src_text is not None:
            out[s] = (list(sp.src_text), list(sp.tgt_text))
            continue
        if corpus is None:
            corpus = cleaned_corpus(cfg)
        rows = np.asarray(sp.rows, dtype=np.int64)
        if len(rows) and int(rows.max()) >= len(corpus[0]):
            raise ValueError(f"the {s} split names row {int(rows.max())} but the inputs clean to {len(corpus[0])} "
                             f"rows: the data files changed since the cache was built (rebuild it)")
        out[s] = ([corpus[0][i] for i in rows], [corpus[1][i] for i in rows])
        _check_ids(bundle, s, out[s])
    return out


def _check_ids(bundle, split: str, texts: tuple[list[str], list[str]], sample: int = 64) -> None:
    """The texts picked for ``split`` encode to the cached ids (a sample of rows): the export is the split."""
    sp, tok = bundle.splits[split], bundle.tokenizer
    n = len(sp)
    for i in sorted({(k * n) // sample for k in range(min(sample, n))}):
        ids = np.asarray(tok.encode([texts[0][i]])[0][: sp.src_offsets[i + 1] - sp.src_offsets[i]])
        cached = np.asarray(sp.src_ids[sp.src_offsets[i]:sp.src_offsets[i + 1]])
        if not np.array_equal(ids.astype(np.int64), cached.astype(np.int64)):
            raise ValueError(f"the {split} split's row {i} does not re-encode to the cached ids: the data files "
                             f"changed since the cache was built (rebuild it)")


def export_split(bundle, cfg, out: Path) -> dict:
    """Write ``bundle``'s split under ``out`` (see the module docstring); returns the ``split.json`` record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = split_texts(bundle, cfg)
    record: dict = {"source": bundle.split_record.get("source"), "vocab_size": bundle.tokenizer.vocab_size,
                    "src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang, "splits": {}}
    for s in SPLITS:
        src, tgt = texts[s]
        for side, lines in zip(SIDES, (src, tgt)):
            body = "".join(_one_line(x, f"{s}.{side}") + "\n" for x in lines)
            (out / f"{s}.{side}").write_text(body, encoding="utf-8")
        rows = np.asarray(bundle.splits[s].rows, dtype=np.int64)
        record["splits"][s] = {"pairs": len(src), "rows_sha256": pairs_sha256(src, tgt),
                               "row_index_sha256": hashlib.sha256(rows.tobytes()).hexdigest(),
                               **{f"{side}_sha256": file_sha256(out / f"{s}.{side}") for side in SIDES}}
    tok = bundle.tokenizer
    proto = tok.model_proto if tok.model_proto is not None else read_bytes(tok.model_file, "tokenizer", limit=TOKENIZER_MAX)
    (out / "spm.model").write_bytes(proto)
    record["spm_sha256"] = file_sha256(out / "spm.model")
    (out / "split.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
