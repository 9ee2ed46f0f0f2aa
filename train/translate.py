"""``python -m train.translate --ckpt C "text" ...`` (or one sentence per stdin line): beam-search translations.

The model and tokenizer are rebuilt from the checkpoint alone: its config gives the architecture, and it
carries the SentencePiece model (bytes, plus the path and cache key it was trained under).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
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
        tmp = Path(tempfile.mkdtemp(prefix="fastmt-spm-")) / "spm.model"
        tmp.write_bytes(ref["model_bytes"])
        tok = Tokenizer(tmp, key=ref.get("key", ""))
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
    sentences = args.text or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    hyps = translate(model, tok, sentences, torch.device(args.device), beam_size=args.beam,
                     batch_size=args.batch_size)
    for h in hyps:
        print(h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
