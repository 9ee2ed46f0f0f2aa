"""``fastmt translate``/``evaluate`` on an exported CTranslate2 folder (``--engine ct2``, or detected when ``--ckpt``
is one): the same protocol, the same signatures, decoded by CTranslate2 under fastmt's rules (``CT2Translator``).

``train.evaluation.load.load_for_inference`` calls ``load_ct2(path, device)`` for such a folder: it returns what it
returns for a checkpoint, a ``(model, tokenizer, checkpoint dict)`` triple: here the model is a ``CT2Model`` (``.cfg.max_positions`` and
``translate_texts(sentences, decoding)``, which ``train.evaluation.decode.translate_lines`` calls), the tokenizer the
export's SentencePiece model, and the dict holds the run config recorded at export (its eval settings are the
decoding defaults, as a checkpoint's are).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from train.errors import UserError
from train.export.common import EXTRA

ENGINE_KEY = "_engine"  # marks the config of an exported model (train.cli.decoding.resolve_decoding checks --engine)
QUANTIZATION_KEY = "_quantization"  # an exported model's stored type (float32, int8, ...)


def check_engine(args, config: dict) -> None:
    """``--engine`` agrees with what ``--ckpt`` is (a fastmt checkpoint, or a CTranslate2 export), and a CTranslate2
    folder gets no ``--precision`` (it decodes in the type its export stored: that flag would change nothing)."""
    asked, loaded = getattr(args, "engine", None), config.get(ENGINE_KEY, "fastmt")
    if asked is not None and asked != loaded:
        raise UserError(f"--engine {asked}: --ckpt {args.ckpt} is a {'CTranslate2 export' if loaded == 'ct2' else 'fastmt checkpoint'}"
                        f" ({loaded}); drop --engine or give " + ("a folder made by fastmt export --to ct2" if asked == "ct2"
                                                                  else "a training checkpoint"))
    if loaded == "ct2" and getattr(args, "precision", None) is not None:
        raise UserError(f"--precision {args.precision}: --ckpt {args.ckpt} is a CTranslate2 export, which decodes in the "
                        f"type its export stored ({config.get(QUANTIZATION_KEY)}); drop --precision, or export another "
                        f"one with fastmt export --quantization int8|int8_float16|float16")


def engine_record(model, device, precision: str) -> dict:
    """What decoded, for a record: ``engine`` (fastmt or ctranslate2), ``quantization`` (the type the weights are
    stored in: fastmt's checkpoints float32; a CTranslate2 folder's from its export), ``compute`` (fastmt: the
    autocast precision; CTranslate2: its compute type) and ``threads`` (CPU threads; None on a GPU)."""
    import torch

    cpu = device.type == "cpu"
    if isinstance(model, CT2Model):
        tr = model.translator
        return {"engine": "ctranslate2", "quantization": tr.quantization, "compute": tr.translator.compute_type,
                "threads": tr.threads if cpu else None}
    return {"engine": "fastmt", "quantization": "float32", "compute": precision,
            "threads": torch.get_num_threads() if cpu else None}


def is_ct2_dir(path) -> bool:
    """A folder that ``fastmt export --to ct2`` made (model.bin and fastmt's decoding settings)."""
    from train.export.ct2 import is_ct2_dir as check

    return check(path)


class CT2Model:
    """An exported CTranslate2 folder as ``translate_lines`` uses a model."""

    def __init__(self, translator):
        self.translator = translator
        self.cfg = SimpleNamespace(max_positions=translator.max_positions)

    def translate_texts(self, sentences: list[str], d) -> list[str]:
        return self.translator.translate(sentences, beam_size=d.beam_size, length_penalty=d.length_penalty,
                                         max_len_a=d.max_len_a, max_len_b=d.max_len_b, batch_size=d.batch_size)


def load_ct2(path, device):
    """(CT2Model, tokenizer, {"config": the run config}) of an exported CTranslate2 folder on ``device``."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise UserError(f"{path} is a CTranslate2 model: decoding it needs ctranslate2, which does not import here "
                        f"({e}): {EXTRA}") from None
    from data.files import read_json
    from train.bounds import bounded, machine_capped
    from train.export.common import CONFIG_FILE
    from train.export.ct2 import CT2Translator

    # the run's run.cpu_threads, as train.evaluation.decode.configure_cpu sets them for fastmt's own decoding: read
    # through the one reader, typed and bounded as the field is, capped by this machine's cores; without one,
    # fastmt's own default (torch's: every physical core), never CTranslate2's hidden one
    where = f"{Path(path) / CONFIG_FILE}"
    try:
        run = (read_json(Path(path) / CONFIG_FILE, "export record", inside=path) or {}).get("run") or {}
        threads = bounded("run.cpu_threads", run.get("cpu_threads") if isinstance(run, dict) else None, where, int | None)
    except FileNotFoundError:
        threads = None
    except (OSError, ValueError, AttributeError) as e:  # (the reader's refusals are ValueErrors)
        raise UserError(f"{path}: {' '.join(str(e).split())}") from None
    import torch

    threads = machine_capped("run.cpu_threads", threads) or torch.get_num_threads()
    translator = CT2Translator(path, device="cuda" if device.type == "cuda" else "cpu", threads=threads)
    config = {**translator.config, ENGINE_KEY: "ct2", QUANTIZATION_KEY: translator.quantization}
    return CT2Model(translator), translator.tok, {"config": config}


def checkpoint_file(path: str | Path) -> Path:
    """The file whose hash identifies the weights: the checkpoint, or an exported folder's model.bin."""
    p = Path(path)
    return p / "model.bin" if p.is_dir() else p
