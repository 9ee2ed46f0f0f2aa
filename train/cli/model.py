"""``fastmt model PRESET [--vocab N] [--src-len S] [--tgt-len T] [--json] [--section.field VALUE ...]``:
what a training run of preset PRESET would build.

PRESET is a training preset (``tiny s18 s16 fast baseline``, train/config.py), with the same
``--model.*`` / ``--data.*`` overrides as ``python -m train``. The tokenizer decides the embedding's size:
a run asks SentencePiece for ``data.vocab_size`` pieces, so that is the vocabulary assumed here (a small
corpus can give fewer; the run's log prints the real size). ``--vocab N`` assumes another. The model is
built on the meta device (no memory, no init time). Prints its config, parameter counts and training
FLOPs per target token; ``--json`` prints exactly
``{"params_unique": int, "params_applied": int, "flops_per_token": float}`` (the vocabulary on stderr).
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    # the training presets live in train/ (a layer above models/): imported here, when run as a command
    from train.cli.flags import OneLineParser, split_overrides
    from train.config import PRESETS, apply_overrides, get_config
    from train.fields import did_you_mean

    p = OneLineParser(prog="fastmt model", description=__doc__.split("\n\n")[0],
                      epilog="Any --<section>.<field> VALUE of the training config applies too (see "
                             "python -m train --help-fields).", allow_abbrev=False)
    p.add_argument("preset", help=f"training preset: {', '.join(PRESETS)}")
    p.add_argument("--vocab", type=int, help="joint vocabulary size to assume (default: the preset's data.vocab_size)")
    p.add_argument("--src-len", type=float, default=32.0, help="mean source length for FLOPs (default 32)")
    p.add_argument("--tgt-len", type=float, default=32.0, help="mean target length for FLOPs (default 32)")
    p.add_argument("--json", action="store_true", help="print only the counts as JSON")
    args, rest = p.parse_known_args(argv)
    if args.preset not in PRESETS:
        p.error(f"preset {args.preset!r} is not one of {', '.join(PRESETS)}" + did_you_mean(args.preset, list(PRESETS)))
    try:
        cfg = apply_overrides(get_config(args.preset), split_overrides(rest, p))
        vocab = args.vocab if args.vocab is not None else cfg.data.vocab_size
        model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
    except (ValueError, TypeError) as e:
        p.error(str(e))

    import torch

    from models.flops import count_params, flops_per_token
    from models.transformer import Transformer

    with torch.device("meta"):
        counts = count_params(Transformer(model_cfg))
    fpt = flops_per_token(model_cfg, args.src_len, args.tgt_len)
    source = "--vocab" if args.vocab is not None else "the preset's data.vocab_size, the size a run requests"
    assumed = (f"vocabulary {vocab:,} ({source}; SentencePiece may give a small corpus fewer pieces, and the "
               f"run's log prints the real size)")
    if args.json:
        print(f"fastmt model: preset {args.preset}, {assumed}", file=sys.stderr)
        print(json.dumps({"params_unique": counts["unique"], "params_applied": counts["applied"],
                          "flops_per_token": fpt}))
        return 0
    print(f"preset {args.preset}: the model a training run builds, at {assumed}")
    for k, v in dataclasses.asdict(model_cfg).items():
        print(f"  {k:15s} {v}")
    print(f"  enc schedule    {model_cfg.schedule('enc')}")
    print(f"  dec schedule    {model_cfg.schedule('dec')}")
    print(f"params unique   {counts['unique']:,}")
    print(f"params applied  {counts['applied']:,}")
    print(f"train FLOPs/tgt token (src {args.src_len:g}, tgt {args.tgt_len:g}): {fpt:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
