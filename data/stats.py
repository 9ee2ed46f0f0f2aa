"""``python -m data.stats --data-files F [...] [--json]``: what the pipeline makes of a corpus.

Prints the cleaning report, token-length percentiles per side, tokens per epoch, and for every batching
mode over the train split (epoch 0): padding fraction (pad tokens / computed tokens), batches, distinct
padded shapes (B, S, T), and the packed mode's fixed layout (capacities, slots). ``--json`` prints one JSON
object instead, with ``modes`` mapping each mode to ``{"padding_fraction", "batches", "shapes"}``. Any DataConfig field can be overridden:
``--max-tokens 4096``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from .batching import MODES, plan_batches, plan_stats
from .clean import DataInputError, format_report
from .config import DataConfig

PCTS = (50, 90, 95, 99, 100)
_ARG_TYPES = {
    "int": int,
    "float": float,
    "bool": lambda v: v.lower() in ("1", "true", "yes", "on"),
    "int | float": lambda v: float(v) if "." in v else int(v),
}


def _parse(argv) -> tuple[DataConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m data.stats", description=__doc__.split("\n")[0])
    p.add_argument(
        "--data-files",
        nargs="+",
        default=None,
        help="local jsonl/json/parquet/tsv files (default: --dataset toy, $FASTMT_DATA_FILES, the Hub)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--epoch", type=int, default=0)
    for f in dataclasses.fields(DataConfig):
        if f.name == "data_files":
            continue
        typ = _ARG_TYPES.get(str(f.type), str)  # config.py uses postponed annotations: f.type is a str
        p.add_argument("--" + f.name.replace("_", "-"), type=typ, default=None, dest=f.name)
    a = p.parse_args(argv)
    overrides = {
        f.name: getattr(a, f.name)
        for f in dataclasses.fields(DataConfig)
        if getattr(a, f.name, None) is not None
    }
    if a.data_files:
        overrides["data_files"] = tuple(a.data_files)
    overrides.setdefault("num_workers", 0)
    try:
        return DataConfig(**overrides), a
    except (ValueError, TypeError) as e:
        p.error(str(e))


def collect(bundle, epoch: int = 0) -> dict:
    cfg, tr = bundle.cfg, bundle.splits["train"]
    lens = {"src": tr.src_lengths, "tgt": tr.tgt_lengths}
    out = {
        "source": bundle.split_record["source"],
        "report": bundle.report.as_dict(),
        "split": bundle.split_record["sizes"],
        "vocab_size": bundle.tokenizer.vocab_size,
        "lengths": {
            side: {f"p{q}": float(np.percentile(v, q)) for q in PCTS} | {"mean": float(v.mean())}
            for side, v in lens.items()
        },
        "tokens_per_epoch": {"src": int(tr.src_lengths.sum()), "tgt": int(tr.tgt_lengths.sum())},
        "settings": {
            "batch_size": cfg.batch_size,
            "max_tokens": cfg.max_tokens,
            "seq_len": cfg.seq_len,
            "pad_multiple": cfg.pad_multiple,
        },
        "packing": bundle.pack_layout().as_dict(),
        "modes": {},
    }
    for mode in MODES:
        spec = bundle.spec(mode)
        st = plan_stats(
            plan_batches(tr.src_lengths, tr.tgt_lengths, spec, seed=cfg.seed, epoch=epoch),
            tr.src_lengths,
            tr.tgt_lengths,
            spec,
        )
        out["modes"][mode] = {
            "padding_fraction": round(st.padding_fraction, 5),
            "batches": st.batches,
            "shapes": st.shapes,
            "seq_shapes": st.seq_shapes,
            "computed_tokens": st.computed_tokens,
            "max_batch_tokens": st.max_batch_tokens,
        }
        if mode == "packed":
            out["modes"][mode]["full_slots"] = st.full_slots
    return out


def format_table(s: dict) -> str:
    lines = [f"source: {s['source']}", format_report(s["report"])]
    lines.append(f"split: {s['split']}  vocab: {s['vocab_size']}")
    lines.append(
        "train token lengths (incl. EOS/BOS): " + "  ".join(f"{k:>5}" for k in list(s["lengths"]["src"]))
    )
    for side, d in s["lengths"].items():
        lines.append(f"  {side:<33}  " + "  ".join(f"{v:5.1f}" for v in d.values()))
    t = s["tokens_per_epoch"]
    lines.append(f"tokens per epoch (train): src {t['src']:,} + tgt {t['tgt']:,} = {t['src'] + t['tgt']:,}")
    st = s["settings"]
    lines.append(
        f"batching (epoch 0, train; batch_size {st['batch_size']}, max_tokens {st['max_tokens']}, "
        f"seq_len {st['seq_len']}, pad_multiple {st['pad_multiple']}):"
    )
    lines.append(
        f"  {'mode':<13} {'padding':>8} {'batches':>8} {'shapes':>7} {'(S,T)':>6} {'computed tok':>13} {'max batch tok':>14}"
    )
    for mode, m in s["modes"].items():
        lines.append(
            f"  {mode:<13} {100 * m['padding_fraction']:7.2f}% {m['batches']:>8} {m['shapes']:>7} {m['seq_shapes']:>6} "
            f"{m['computed_tokens']:>13,} {m['max_batch_tokens']:>14,}"
        )
    pk = s["packing"]
    lines.append(
        f"  packed layout: src (1, {pk['src_capacity']}), tgt (1, {pk['tgt_capacity']}), {pk['slots']} segments "
        f"({pk['real_slots']} real slots, max_len {pk['max_len']}); batches closed on full slots: "
        f"{s['modes']['packed']['full_slots']}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg, a = _parse(argv)
    from .pipeline import build_data
    from .sources import HubUnavailableError

    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print
    try:
        bundle = build_data(cfg, log=log)
    except (
        DataInputError,
        FileNotFoundError,
        HubUnavailableError,
    ) as e:  # bad input: the message, no traceback
        print(f"python -m data.stats: {e}", file=sys.stderr)
        return 2
    s = collect(bundle, a.epoch)
    print(json.dumps(s) if a.json else format_table(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
