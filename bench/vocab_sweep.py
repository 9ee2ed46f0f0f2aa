"""Vocabulary-size sweep (and token-bucket / packing settings sweep) behind the data defaults: per
SentencePiece setting the subword, rare-piece, byte-fallback and FLOP counts, then padding / batches /
shapes of token buckets and packing (``--only-packing``: just the packed table). See bench/README.md."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench import harness as H
from data.batching import BatchSpec, pack_layout, plan_batches, plan_stats
from data.config import DataConfig
from data.pipeline import build_data
from models import flops_per_token, get_preset


def table(heads: list[str], rows: list[list], align: str) -> list[str]:
    """``harness.markdown_table`` of rows given as lists; ``align``: r (right) or l (left) a column."""
    return H.markdown_table([dict(zip(heads, r)) for r in rows], heads, cell=str,
                            right=[h for h, c in zip(heads, align) if c == "r"]).splitlines()


def vocab_row(cfg: DataConfig) -> dict:
    t0 = time.perf_counter()
    b = build_data(cfg, log=lambda *_: None)
    secs = time.perf_counter() - t0
    tr, va, tok = b.splits["train"], b.splits["valid"], b.tokenizer
    counts = np.bincount(np.concatenate([tr.src_ids, tr.tgt_ids]), minlength=tok.vocab_size)
    real = counts[4 + 256 :]  # skip specials and byte pieces
    va_ids = np.concatenate([va.src_ids, va.tgt_ids])
    is_byte = np.array([tok.sp.is_byte(i) for i in range(tok.vocab_size)])
    lens = np.concatenate([tr.src_lengths, tr.tgt_lengths])
    # training FLOPs of one epoch for the S18 model at this vocabulary, at the split's mean lengths
    s18 = get_preset("s18", vocab_size=tok.vocab_size)
    per_token = flops_per_token(s18, float(tr.src_lengths.mean()), float(tr.tgt_lengths.mean()))
    flops = per_token * float(tr.tgt_lengths.sum())
    return {"model": cfg.spm_model, "vocab": tok.vocab_size, "tokens": int(lens.sum()), "mean": float(lens.mean()),
            "p99": float(np.percentile(lens, 99)), "rare": float((real < 10).mean()),
            "byte": float(is_byte[va_ids].mean()), "unk": float((va_ids == tok.unk_id).mean()),
            "flops": flops, "secs": secs, "bundle": b}


def _stats(tr, spec):
    plan = plan_batches(tr.src_lengths, tr.tgt_lengths, spec, seed=0, epoch=0)
    return plan, plan_stats(plan, tr.src_lengths, tr.tgt_lengths, spec)


def bucket_cells(tr, budget: int, multiples, seq_shapes: bool = False) -> list[str]:
    """token_bucket at ``budget`` per pad multiple: padding / batches / distinct (B,S,T) shapes [/ (S,T)]."""
    out = []
    for m in multiples:
        s = _stats(tr, BatchSpec("token_bucket", max_tokens=budget, pad_multiple=m))[1]
        out.append(f"{100 * s.padding_fraction:.1f} % / {s.batches} / {s.shapes}"
                   + (f" / {s.seq_shapes}" if seq_shapes else ""))
    return out


def packing_table(b) -> list[str]:
    """Packed vs token_bucket (exact lengths / multiples of 8) at the budgets a GPU step would use."""
    tr, max_len = b.splits["train"], b.cfg.max_len
    rows = []
    for budget in (2048, 8192, 16384, 32768):
        layout = pack_layout(tr.src_lengths, tr.tgt_lengths, budget, max_len)
        plan, p = _stats(tr, BatchSpec("packed", max_tokens=budget, pack=layout))
        least = min(int(tr.src_lengths[x].sum() + tr.tgt_lengths[x].sum()) for x in plan)  # the leftover batch
        rest = 1 - (p.real_tokens - least) / (p.computed_tokens - p.max_batch_tokens)
        rows.append([budget, f"{layout.src_capacity} + {layout.tgt_capacity}",
                     f"{layout.slots} ({layout.real_slots})",
                     f"{100 * p.padding_fraction:.2f} % / {p.batches} / {p.shapes}", f"{100 * rest:.2f} %",
                     p.full_slots, *bucket_cells(tr, budget, (1, 8))])
    return [f"## packed at vocab {b.tokenizer.vocab_size} (stand-in corpus): one shape per run", "",
            f"Capacity C_src + C_tgt from `max_tokens` (split by train token totals, each rounded up to 64), "
            f"max_len {max_len}; padding = 1 - real / (batches x (C_src + C_tgt)), epoch 0. "
            "Cells: padding / batches / distinct (B,S,T) shapes.", "",
            *table(["max_tokens", "C_src + C_tgt", "slots (real)", "packed",
                    "packed w/o the partial last batch", "closed on slots", "token_bucket pad_multiple 1",
                    "token_bucket pad_multiple 8"], rows, "rrrlrrll")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vocab_sweep")
    p.add_argument("--data-files", nargs="+", required=True)
    p.add_argument("--sizes", nargs="+", type=int, default=[2000, 4000, 8000, 16000, 24000])
    p.add_argument("--unigram", nargs="*", type=int, default=[8000], help="unigram sizes to add (slow to train)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None, help="write the markdown here as well")
    p.add_argument("--only-packing", action="store_true", help="only the packed table, at the default vocab")
    a = p.parse_args(argv)
    base = DataConfig(data_files=tuple(a.data_files), num_workers=0,
                      **({"cache_dir": a.cache_dir} if a.cache_dir else {}))
    if a.only_packing:
        print("\n".join(packing_table(build_data(base, log=lambda *_: None))))
        return 0

    rows = []
    for model, sizes in (("bpe", a.sizes), ("unigram", a.unigram)):
        for v in sizes:
            print(f"[sweep] {model} {v} ...", file=sys.stderr, flush=True)
            rows.append(vocab_row(dataclasses.replace(base, spm_model=model, vocab_size=v)))
    default = next((r for r in rows if r["model"] == "bpe" and r["vocab"] == base.vocab_size), None)
    ref = (default or rows[0])["flops"]
    b = next(r["bundle"] for r in rows if r is default)
    tr = b.splits["train"]
    text = "\n".join([
        "# Vocabulary and token-bucket sweep (stand-in corpus)", "",
        f"Data: {', '.join(os.path.basename(f) for f in a.data_files)} — **stand-in corpus** (23,355 en-it pairs, "
        "Tatoeba + news), not OPUS Books. Split as `build_data` does (1000 valid, 1000 test, seed 0).",
        f"Command: `python -m bench.vocab_sweep --data-files {' '.join(a.data_files)}`", "",
        "## Vocabulary (joint SentencePiece, byte fallback, trained on the train split)", "",
        *table(["model", "vocab", "train subwords/epoch", "mean len", "p99 len", "pieces seen <10x",
                "byte-fallback (valid)", "unk (valid)", "S18 train GFLOP/epoch", "vs default"],
               [[r["model"], r["vocab"], f"{r['tokens']:,}", f"{r['mean']:.1f}", f"{r['p99']:.0f}",
                 f"{100 * r['rare']:.1f} %", f"{100 * r['byte']:.3f} %", f"{100 * r['unk']:.3f} %",
                 f"{r['flops'] / 1e9:,.0f}", f"{r['flops'] / ref:.3f}"] for r in rows], "lrrrrrrrrr"),
        "", f"## token_bucket at vocab {b.tokenizer.vocab_size}: padding / batches / distinct (B,S,T) "
            "shapes / distinct (S,T)", "",
        *table(["max_tokens", *(f"pad_multiple {m}" for m in (1, 2, 8, 16))],
               [[budget, *bucket_cells(tr, budget, (1, 2, 8, 16), seq_shapes=True)]
                for budget in (1024, 2048, 4096, 8192, 16384)], "rllll"),
        "", *packing_table(b)]) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
