"""A deterministic toy en-it corpus for tests and smoke runs (no shared data needed).

Each English word has one Italian word and sentences keep word order, so a tiny model learns it in a
few hundred steps. Row i depends only on the seed, not on ``n``: the first k rows of any larger corpus
are the k-row corpus. ``DataConfig(dataset="toy", toy_rows=n)`` writes it into the cache dir once.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .files import atomic_write, refuse_link

EN = (
    "the cat dog house red big small eats sees runs sleeps green tree water bread man woman child black "
    "white old new book table under over near far quick slow blue sun moon"
).split()
IT = (
    "il gatto cane casa rosso grande piccolo mangia vede corre dorme verde albero acqua pane uomo donna "
    "bambino nero bianco vecchio nuovo libro tavolo sotto sopra vicino lontano veloce lento blu sole luna"
).split()
assert len(EN) == len(IT)


def toy_rows(n: int, seed: int = 0):
    """Yield ``n`` rows ``{"id", "translation": {"en", "it"}}`` of 2-12 words."""
    rng = random.Random(seed)
    for i in range(n):
        idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 12))]
        yield {
            "id": str(i),
            "translation": {"en": " ".join(EN[j] for j in idx), "it": " ".join(IT[j] for j in idx)},
        }


def _write_rows(f, n: int, seed: int) -> None:
    for row in toy_rows(n, seed):
        f.write((json.dumps(row) + "\n").encode())


def write_toy_corpus(path: str | os.PathLike, n: int = 1500, seed: int = 0) -> Path:
    """Write ``n`` toy rows as JSON lines to ``path`` (parents created) and return it (atomically, never
    through a link: `data.files.atomic_write`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: _write_rows(f, n, seed), what="toy corpus")


def toy_corpus(cache_dir: str | os.PathLike, n: int = 1500, seed: int = 0) -> Path:
    """``<cache_dir>/toy/toy-en-it-n<n>-s<seed>.jsonl``, written atomically the first time (safe when
    several processes ask at once; a link planted as ``toy/`` is refused)."""
    path = Path(cache_dir) / "toy" / f"toy-en-it-n{n}-s{seed}.jsonl"
    if not path.is_file():
        refuse_link(path.parent, "cache folder")
        write_toy_corpus(path, n, seed)
    return path
