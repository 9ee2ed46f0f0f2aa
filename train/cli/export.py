"""``fastmt export --ckpt C --to ct2|hf OUT``: a trained checkpoint as a CTranslate2 model or a Hugging Face folder.

``--to ct2``: CTranslate2's ``model.bin`` (``--quantization int8|int8_float16|float16``; default float32), the shared
vocabulary, fastmt's SentencePiece model (``spm.model``) and ``fastmt_decoding.json``: the checkpoint's decoding
settings (beam size, GNMT alpha, the max length rule a * source tokens + b, suppressed ``<pad>``/``<s>``) and the
``translate_batch`` options that reproduce them. ``fastmt translate``/``evaluate --ckpt OUT`` decode it with them.
A ``model.ffn_norm`` model is refused (CTranslate2 has no mid-FFN LayerNorm; train with ``--model.ffn_norm false``).
Each target states the model option values it represents (train/export/supported.py); any other value, or a model
field the table does not know, is refused in one line naming it before anything is written.

``--to hf``: ``config.json`` (Pegasus), ``model.safetensors``, the MarianTokenizer files, ``generation_config.json``
and, for ``ffn_norm`` models, ``modeling_fastmt.py`` (load with ``trust_remote_code=True``).

Both folders hold a README.md model card (data, split, the run's test BLEU/chrF with their signatures, this
command). OUT is built in a temp folder beside it and renamed at the end; an existing non-empty OUT is refused unless
it holds an earlier export and ``--force`` is given (a folder of other files is never replaced, nor one holding the
checkpoint). ``--ckpt`` may be a run folder (its best.pt). Needs the export extra: ``pip install -e '.[export]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from pathlib import Path

from train.errors import EXIT_OK, UserError
from train.export.common import EXTRA, LICENSE_DEFAULT, Source, check_out, model_card, write_dir
from train.export.supported import refuse_unsupported

TARGETS = {"ct2": ("ctranslate2",), "hf": ("transformers", "safetensors")}
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # the form of the Hub's license ids


def load_source(path: str | Path) -> Source:
    """The checkpoint at ``path`` as a padded-layout fp32 CPU model; a missing file or one that is not a fastmt
    checkpoint raises ``UserError`` naming it (before anything is written)."""
    from train.evaluation.load import checkpoint_file, load_for_inference

    p = Path(checkpoint_file(str(path)))  # a file, or a run folder's best.pt; else one line naming it
    if p.is_dir():
        raise UserError(f"--ckpt {path}: a folder fastmt export made; export the training checkpoint it came from")
    try:
        model, tok, ckpt = load_for_inference(p, "cpu")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a foreign file makes the loader raise: one line, exit 2
        raise UserError(f"--ckpt {path}: not a fastmt checkpoint ({type(e).__name__}: {e})") from None
    if model.cfg.layout != "padded":  # the weights do not depend on the layout; decoding runs padded
        from models import Transformer

        padded = Transformer(dataclasses.replace(model.cfg, layout="padded"))
        padded.load_state_dict(model.state_dict())
        model = padded.eval()
    return Source(p, model.float().eval(), tok, ckpt)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastmt export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--ckpt", required=True, help="a training checkpoint, e.g. runs/<name>/checkpoints/best.pt")
    p.add_argument("--to", required=True, metavar="TARGET", help="ct2 (CTranslate2) or hf (Hugging Face)")
    p.add_argument("--quantization", metavar="Q", help="ct2 only: int8, int8_float16 or float16 (default float32)")
    p.add_argument("--license", default=LICENSE_DEFAULT, metavar="ID",
                   help="the model card's license, a Hub license id such as apache-2.0 or cc-by-4.0 (default "
                        f"{LICENSE_DEFAULT}: the training data's license decides; OPUS corpora carry their sources')")
    p.add_argument("--force", action="store_true", help="replace an earlier export in OUT")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error too")
    p.add_argument("out", metavar="OUT", help="the folder to write")
    return p


def require_extra(target: str) -> None:
    """One line naming the extra when a library of ``target`` does not import."""
    for module in TARGETS[target]:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(f"fastmt export --to {target} needs {module}, which does not import here ({e}); "
                            f"install the export extra: {EXTRA}") from None


def check_args(args) -> None:
    if not LICENSE_ID.fullmatch(args.license):
        raise UserError(f"--license {args.license!r}: give a Hub license id (lower case letters, digits, '.', '-', "
                        f"e.g. apache-2.0, cc-by-4.0, other, unknown)")
    if args.to not in TARGETS:
        raise UserError(f"--to {args.to!r}: choose ct2 (CTranslate2) or hf (Hugging Face)")
    if args.quantization is not None:
        from train.export.ct2 import QUANTIZATIONS

        if args.to != "ct2":
            raise UserError(f"--quantization {args.quantization}: only --to ct2 quantizes (hf stores float32)")
        if args.quantization not in QUANTIZATIONS:
            raise UserError(f"--quantization {args.quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")


def run(args, argv: list[str]) -> int:
    check_args(args)
    out = Path(args.out)
    check_out(out, args.force, args.ckpt)
    require_extra(args.to)
    src = load_source(args.ckpt)
    refuse_unsupported(args.to, src.cfg, str(args.ckpt))  # before anything is written
    notes: list[str] = []
    if args.to == "ct2":
        from train.export import ct2

        notes.append("decode it like fastmt: fastmt translate --ckpt THIS_DIR, fastmt evaluate --ckpt THIS_DIR "
                     "(fastmt_decoding.json holds the settings; CTranslate2's own length penalty is not GNMT's: "
                     "fastmt rescores the n-best with GNMT)")
        notes.append(f"ctranslate2.Translator(DIR).translate_batch(pieces, max_input_length={src.cfg.max_positions}, "
                     f"...): a longer source is cut to its first {src.cfg.max_positions - 1} pieces + </s>, as fastmt "
                     f"cuts it (pieces: spm.model's, fastmt_decoding.json has every option)")

        def build(tmp: Path) -> None:
            ct2.write(src, tmp, args.quantization)
            (tmp / "README.md").write_text(model_card(src, "CTranslate2", notes, argv, args.license))
    else:
        from train.export import hf

        notes.append("load: AutoModelForSeq2SeqLM.from_pretrained(DIR" +
                     (", trust_remote_code=True)" if src.cfg.ffn_norm else ")") + ", MarianTokenizer.from_pretrained(DIR)"
                     + (" (model_type fastmt_pegasus: its mid-FFN LayerNorm is in modeling_fastmt.py; without "
                        "trust_remote_code transformers refuses it)" if src.cfg.ffn_norm else " (stock Pegasus)"))
        notes.append(f"inputs: tokenizer(texts, truncation=True) cuts a source to {src.cfg.max_positions - 1} pieces + "
                     f"</s>, as fastmt does; generation_config.json caps the output at {src.cfg.max_positions - 1} tokens")
        notes.append("generate: HF's length penalty divides by len^alpha, fastmt's GNMT by ((5 + len) / 6)^alpha: "
                     "generation_config.json uses alpha 0; fastmt's alpha is in fastmt_decoding.json")

        def build(tmp: Path) -> None:
            hf.write(src, tmp)
            (tmp / "README.md").write_text(model_card(src, "Hugging Face", notes, argv, args.license))

    write_dir(out, build)
    print(f"exported {args.ckpt} -> {out} ({args.to}{', ' + args.quantization if args.quantization else ''})")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and export; a user error prints one line (``error: ...``) and returns 2."""
    from train.cli.decoding import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return run_command(lambda a: run(a, argv), args)


if __name__ == "__main__":
    sys.exit(main())
