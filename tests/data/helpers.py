"""Shared pieces for the data tests: generated parallel rows, jsonl writing, the toy data setting on them.

``make_rows`` is not the toy corpus (data/toy.py): its sides are unrelated draws of 1-25 words with
punctuation, so lengths, ratios and cleaning have something to act on.
"""

import json

import numpy as np

from data import DataConfig
from tests.utils import toy_data

WORDS = [
    w + s
    for w in ("casa", "gatto", "libro", "sole", "mare", "notte", "strada", "amico", "porta", "fiume")
    for s in ("", "lo", "ne", "tti", "rra")
]


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(1, 25))
        en = " ".join(rng.choice(WORDS, k)) + "."
        it = " ".join(rng.choice(WORDS, max(1, k + int(rng.integers(-2, 3))))) + "!"
        rows.append({"id": str(i), "translation": {"en": en, "it": it}})
    return rows


BAD_ROWS = [
    {"id": "b0", "translation": {"en": None, "it": "ciao"}},
    {"id": "b1", "translation": {"en": "hello"}},
    {"id": "b2", "translation": {"en": "   ", "it": "ciao"}},
    {"id": "b3", "translation": {"en": "hi", "it": 7}},
    {"id": "b4", "translation": {"en": "x " * 400, "it": "y " * 400}},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg_for(tmp_path, files, **kw) -> DataConfig:
    """The toy data setting on ``files`` (none: the toy source) with pairs up to 64 tokens, no padding
    multiple, 20 valid / 20 test rows and one SentencePiece thread; cache under ``tmp_path``."""
    base = dict(data_files=files, max_len=64, pad_multiple=1, valid_size=20, test_size=20, spm_threads=1)
    return toy_data(tmp_path, **{**base, **kw})
