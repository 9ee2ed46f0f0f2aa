"""What the pipeline makes of a corpus: the library behind ``fastmt stats`` (``python -m train.stats``).

``collect(bundle, epoch)`` gathers the cleaning report, token-length percentiles per side, tokens per epoch,
and for every batching mode over the train split (epoch ``epoch``): padding fraction (pad tokens / computed
tokens), batches, distinct padded shapes (B, S, T), and the packed mode's fixed layout (capacities, slots);
``format_table`` prints it. The command lives in train/ because it takes training's own flags (``--preset``,
``--data.*``), so it reports exactly the data a training run reads; ``python -m data.stats`` says so.
"""

from __future__ import annotations

import sys

import numpy as np

from .batching import MODES, plan_batches, plan_stats
from .clean import format_report

PCTS = (50, 90, 95, 99, 100)
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
    """The command moved: it takes training's flags now (its old flags reported other settings than a run's)."""
    del argv
    print("python -m data.stats is now `fastmt stats` (or `python -m train.stats`): it takes the flags of "
          "training (--preset P, --data-files F ..., --data.FIELD VALUE), so it reports the data that run reads",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
