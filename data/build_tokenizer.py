"""The tokenizer phase of the cold build (`data.build`): the cached ``spm-<key>`` SentencePiece model, or one
trained on a seeded sample of the train pairs (drawn by the split, `data.build_split`), whose texts the build
workers read back from the chunks' scratch files, each only its rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import cache as C
from .build_scan import load_texts
from .entry import build_workers
from .tokenizer import Tokenizer, train_spm
from .workers import BuildRunner


def _sample(job) -> tuple[list[str], list[str]]:
    """The sampled rows (local indices) of one chunk's cleaned texts."""
    i, tmp, local = job
    return load_texts(tmp, i, local)


def train_or_load_tokenizer(cfg, cache: Path, tok_key: str, spm_set: dict, pick: np.ndarray, first,
                            run: BuildRunner, tmp: Path, log) -> Tokenizer:
    """The cached ``spm-<tok_key>`` model, or one trained on the sampled train pairs ``pick`` (clean-row indices)."""
    out = cache / f"spm-{tok_key}"
    threads = cfg.spm_threads or build_workers(cfg)
    with C.locked(cache, tok_key, log, "this tokenizer"):
        if out.is_dir():
            try:
                if C.read_json(out / "settings.json") != spm_set:
                    raise ValueError("settings.json differs from the settings")
                return Tokenizer(out / "spm.model", tok_key, threads, inside=cache)
            except (OSError, ValueError, RuntimeError, TypeError) as e:
                C.discard(out, f"{type(e).__name__}: {str(e)[:120]}", log)
        chunk_of = np.searchsorted(first, pick, side="right") - 1
        jobs = [(i, str(tmp), pick[chunk_of == i] - first[i]) for i in range(len(first) - 1)]
        srcs, tgts = [], []
        for s, t in run.imap(_sample, jobs):
            srcs += s
            tgts += t
        texts = srcs + tgts
        del srcs, tgts
        spm_tmp = C.temp_dir(cache, tok_key)
        try:
            train_spm(texts, spm_set, spm_tmp, threads, cfg)
            C.write_json(spm_tmp / "settings.json", spm_set)
            C.publish(spm_tmp, out)
        finally:
            C.remove(spm_tmp)
        tok = Tokenizer(out / "spm.model", tok_key, threads, inside=cache)
        log(f"[data] trained SentencePiece {spm_set['model_type']} vocab {tok.vocab_size} on a seeded sample of "
            f"{len(pick):,} train pairs ({len(texts):,} sentences) -> {out / 'spm.model'}")
        return tok
