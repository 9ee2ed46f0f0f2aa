"""Shared pieces for the data tests: generated parallel rows, jsonl writing, a small DataConfig."""

import json

import numpy as np

from data import DataConfig

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
    base = dict(
        data_files=files,
        cache_dir=str(tmp_path / "cache"),
        vocab_size=400,
        max_len=64,
        max_tokens=512,
        valid_size=20,
        test_size=20,
        num_workers=0,
        spm_threads=1,
    )
    return DataConfig(**{**base, **kw})
