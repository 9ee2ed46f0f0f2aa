"""Shared pieces for the train tests: a synthetic parallel corpus and a tiny Config around it."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from data import DataConfig
from models import get_preset
from train.config import Config, EvalConfig, OptimConfig, RunConfig

# A learnable toy "language pair": every English word has one Italian word; sentences keep word order.
EN = ("the cat dog house red big small eats sees runs sleeps green tree water bread man woman child "
      "black white old new book table under over near far quick slow blue sun moon").split()
IT = ("il gatto cane casa rosso grande piccolo mangia vede corre dorme verde albero acqua pane uomo donna "
      "bambino nero bianco vecchio nuovo libro tavolo sotto sopra vicino lontano veloce lento blu sole luna").split()
assert len(EN) == len(IT)


def write_corpus(path: Path, n: int = 1200, seed: int = 0) -> Path:
    """``n`` jsonl rows ``{"id", "translation": {"en", "it"}}`` of 2-7 word sentences."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 7))]
            row = {"id": str(i), "translation": {"en": " ".join(EN[j] for j in idx),
                                                 "it": " ".join(IT[j] for j in idx)}}
            f.write(json.dumps(row) + "\n")
    return path


def tiny_config(corpus: Path, tmp: Path, *, name: str = "t", **changes) -> Config:
    """A 2+2 x 32 model on the synthetic corpus, fp32 eager on CPU, every output under ``tmp``.
    ``changes``: RunConfig or EvalConfig fields."""
    data = DataConfig(data_files=(str(corpus),), vocab_size=400, max_len=32, max_tokens=512, pad_multiple=8,
                      valid_size=60, test_size=60, num_workers=0, cache_dir=str(tmp / "cache"))
    model = get_preset("tiny", d_model=32, n_heads=2, d_ff=64, dropout=0.1, max_positions=64)
    optim = OptimConfig(name="adamw", lr=3e-3, betas=(0.9, 0.98), weight_decay=1e-2, pct_start=0.2)
    run = RunConfig(name=name, out_dir=str(tmp / "runs"), epochs=2, precision="fp32", compile=False,
                    progress=False, tensorboard=False, plot=False, log_every=5)
    ev = EvalConfig(beam_size=2, max_sentences=16, num_samples=0, test_at_end=False)
    eval_fields = {f.name for f in dataclasses.fields(EvalConfig)}
    run = dataclasses.replace(run, **{k: v for k, v in changes.items() if k not in eval_fields})
    ev = dataclasses.replace(ev, **{k: v for k, v in changes.items() if k in eval_fields})
    return Config(data=data, model=model, optim=optim, run=run, eval=ev)
