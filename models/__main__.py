"""``python -m models PRESET [--vocab N] [--src-len S] [--tgt-len T] [--json]``.

Builds the preset on the meta device (no memory, no init time) and prints its config, parameter
counts and training FLOPs per target token. ``--json`` prints exactly
``{"params_unique": int, "params_applied": int, "flops_per_token": float}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from models.config import DEFAULT_VOCAB, PRESETS, get_preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models", description="Print a model preset and its counts.")
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"joint vocabulary size (default {DEFAULT_VOCAB})")
    p.add_argument("--src-len", type=float, default=32.0, help="mean source length for FLOPs (default 32)")
    p.add_argument("--tgt-len", type=float, default=32.0, help="mean target length for FLOPs (default 32)")
    p.add_argument("--json", action="store_true", help="print only the counts as JSON")
    args = p.parse_args(argv)

    import torch

    from models.flops import count_params, flops_per_token
    from models.transformer import Transformer

    try:
        cfg = get_preset(args.preset, vocab_size=args.vocab)
    except ValueError as e:
        p.error(str(e))
    with torch.device("meta"):
        counts = count_params(Transformer(cfg))
    fpt = flops_per_token(cfg, args.src_len, args.tgt_len)
    if args.json:
        print(json.dumps({"params_unique": counts["unique"], "params_applied": counts["applied"],
                          "flops_per_token": fpt}))
        return 0
    print(f"preset {args.preset}:")
    for k, v in dataclasses.asdict(cfg).items():
        print(f"  {k:15s} {v}")
    print(f"  enc schedule    {cfg.schedule('enc')}")
    print(f"  dec schedule    {cfg.schedule('dec')}")
    print(f"params unique   {counts['unique']:,}")
    print(f"params applied  {counts['applied']:,}")
    print(f"train FLOPs/tgt token (src {args.src_len:g}, tgt {args.tgt_len:g}): {fpt:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
