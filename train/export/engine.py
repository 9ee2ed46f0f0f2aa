"""``fastmt translate``/``evaluate`` on an exported CTranslate2 folder (``--engine ct2``, or detected when ``--ckpt``
is one): the same protocol, the same signatures, decoded by CTranslate2 under fastmt's rules (``CT2Translator``).

``load_model(args, device)`` returns what ``train.inference.load_for_inference`` returns for a checkpoint, a
``(model, tokenizer, checkpoint dict)`` triple: here the model is a ``CT2Model`` (``.cfg.max_positions`` and
``translate_texts(sentences, decoding)``, which ``train.inference.translate_lines`` calls), the tokenizer the
export's SentencePiece model, and the dict holds the run config recorded at export (its eval settings are the
decoding defaults, as a checkpoint's are).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from train.errors import UserError
from train.export.common import EXTRA

ENGINES = ("fastmt", "ct2")


def is_export(args) -> bool:
    """Does ``args`` ask for the CTranslate2 engine (``--engine ct2``, or ``--ckpt`` an exported folder)?"""
    from train.export.common import DECODING_FILE

    engine = getattr(args, "engine", None)
    if engine not in (None, *ENGINES):
        raise UserError(f"--engine {engine!r}: choose fastmt or ct2")
    p = Path(args.ckpt)
    return engine == "ct2" or (engine is None and p.is_dir() and (p / DECODING_FILE).is_file()
                               and (p / "model.bin").is_file())


class CT2Model:
    """An exported CTranslate2 folder as ``translate_lines`` uses a model."""

    def __init__(self, translator):
        self.translator = translator
        self.cfg = SimpleNamespace(max_positions=translator.max_positions)

    def translate_texts(self, sentences: list[str], d) -> list[str]:
        return self.translator.translate(sentences, beam_size=d.beam_size, length_penalty=d.length_penalty,
                                         max_len_a=d.max_len_a, max_len_b=d.max_len_b, batch_size=d.batch_size)


def load_model(args, device):
    """(model, tokenizer, checkpoint-like dict) of ``args.ckpt``: a fastmt checkpoint, or an exported CT2 folder."""
    from train.inference import load_for_inference

    if not is_export(args):
        return load_for_inference(args.ckpt, device)
    from train.export.ct2 import is_ct2_dir

    if not is_ct2_dir(args.ckpt):
        raise UserError(f"--engine ct2 --ckpt {args.ckpt}: not a folder made by fastmt export --to ct2 (no model.bin "
                        f"and fastmt_decoding.json in it)")
    try:
        from train.export.ct2 import CT2Translator
    except ImportError as e:  # pragma: no cover - the module imports ctranslate2 lazily
        raise UserError(f"--engine ct2 needs ctranslate2 ({e}): {EXTRA}") from None
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise UserError(f"--engine ct2 needs ctranslate2, which does not import here ({e}): {EXTRA}") from None
    translator = CT2Translator(args.ckpt, device="cuda" if device.type == "cuda" else "cpu")
    return CT2Model(translator), translator.tok, {"config": translator.config}


def checkpoint_file(path: str | Path) -> Path:
    """The file whose hash identifies the weights: the checkpoint, or an exported folder's model.bin."""
    p = Path(path)
    return p / "model.bin" if p.is_dir() else p
