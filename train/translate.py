"""``python -m train.translate --ckpt C "text" ...`` (or one sentence per stdin line): beam-search translations.

One output line per input, in order: a blank input gives a blank output line, and a line break inside a
translation is printed as a space, so output line k always answers input line k. An input longer than the
model's positions is cut to fit, with a warning on stderr saying by how many tokens.
The model and tokenizer are rebuilt from the checkpoint alone: its config gives the architecture, and it
carries the SentencePiece model (bytes, loaded in memory, plus the path and cache key it was trained under).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def load_for_inference(ckpt_path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, checkpoint dict) from a training checkpoint."""
    from data.tokenizer import Tokenizer
    from models import ModelConfig, Transformer
    from train.checkpoint import load_checkpoint

    ckpt = load_checkpoint(ckpt_path)
    ref = ckpt.get("tokenizer") or {}
    if ref.get("model_bytes"):
        tok = Tokenizer(model_proto=ref["model_bytes"], key=ref.get("key", ""))
    elif ref.get("model_file") and Path(ref["model_file"]).is_file():
        tok = Tokenizer(ref["model_file"], key=ref.get("key", ""))
    else:
        raise FileNotFoundError(f"{ckpt_path}: the checkpoint carries no tokenizer and its model file "
                                f"{ref.get('model_file')!r} is gone; rebuild it with the run's data settings")
    cfg = ModelConfig(**ckpt["config"]["model"])
    if cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"tokenizer mismatch: model vocab {cfg.vocab_size} != tokenizer vocab {tok.vocab_size} "
                         f"({tok.model_file})")
    model = Transformer(cfg).to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, tok, ckpt


def overlong(tok, sentences: list[str], max_positions: int) -> list[tuple[int, int]]:
    """(index, tokens incl. EOS) of each sentence longer than ``max_positions``: the encoder reads only its
    first ``max_positions - 1`` tokens + EOS (train.evaluate.translate cuts the rest)."""
    lengths = [len(ids) + 1 for ids in tok.encode(sentences)]
    return [(i, n) for i, n in enumerate(lengths) if n > max_positions]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.translate", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint from runs/<name>/checkpoints/ (e.g. best.pt)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per decoding batch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("text", nargs="*", help="sentences to translate; none: read lines from stdin")
    args = p.parse_args(argv)
    if args.beam < 1:
        p.error(f"--beam {args.beam} must be >= 1")
    if not Path(args.ckpt).is_file():
        p.error(f"--ckpt {args.ckpt!r}: no such file (look under runs/<name>/checkpoints/)")
    from train.evaluate import translate

    model, tok, _ = load_for_inference(args.ckpt, args.device)
    lines = args.text or [line.rstrip("\r\n") for line in sys.stdin]
    todo = [k for k, line in enumerate(lines) if line.strip()]  # blank lines are answered by blank lines
    sentences = [lines[k] for k in todo]
    limit = model.cfg.max_positions
    for i, n in overlong(tok, sentences, limit):
        where = f"line {todo[i] + 1}" if not args.text else f"argument {todo[i] + 1}"
        print(f"warning: input {where} is {n:,} tokens (incl. EOS) but the model reads at most {limit}: "
              f"its last {n - limit:,} tokens are not translated", file=sys.stderr)
    hyps = translate(model, tok, sentences, torch.device(args.device), beam_size=args.beam,
                     batch_size=args.batch_size)
    out = [""] * len(lines)
    for k, h in zip(todo, hyps):
        out[k] = " ".join(h.splitlines())  # a decoded line break would shift every later line
    for line in out:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
