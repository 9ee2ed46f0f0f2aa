"""What ``python -m train.translate`` and ``python -m train.evaluate`` share: a model and tokenizer rebuilt
from a checkpoint, and one definition of the decoding options.

Every decoding option defaults to the checkpoint's own ``eval`` settings (``eval.beam_size``,
``eval.length_penalty``, ``eval.max_len_a``, ``eval.max_len_b``, ``eval.batch_size``) and its
``run.precision``: the settings the training run's final test decoded with, so translating or scoring
with a run's ``best.pt`` reproduces what the run reported. A flag overrides its one setting.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from train.errors import EXIT_ABORTED, UserError, debug_enabled

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Decoding:
    """How a command decodes: beam search (``beam_size`` 1 = greedy) and the length limit
    ``floor(max_len_a * source tokens + max_len_b)``, in batches under an autocast ``precision``."""

    beam_size: int  # hypotheses kept per sentence (1: greedy)
    length_penalty: float  # GNMT length penalty alpha of beam search
    max_len_a: float  # generated tokens <= max_len_a * source tokens (incl. EOS) + max_len_b
    max_len_b: int  # see max_len_a
    batch_size: int  # sentences per decoding batch
    precision: str  # autocast dtype while decoding: fp32 (none), bf16 or fp16

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"beam {self.beam_size}, length penalty {self.length_penalty:g}, max length {self.max_len_a:g} x "
                f"source + {self.max_len_b}, batch {self.batch_size}, {self.precision}")


# flag -> (Decoding field, the checkpoint's config key it defaults to, type, metavar, help)
_OPTIONS = {
    "--beam": ("beam_size", ("eval", "beam_size"), int, "N", "beam size, 1 = greedy"),
    "--length-penalty": ("length_penalty", ("eval", "length_penalty"), float, "X", "GNMT length penalty alpha"),
    "--max-len-a": ("max_len_a", ("eval", "max_len_a"), float, "A", "decoding length limit: A x source tokens + B"),
    "--max-len-b": ("max_len_b", ("eval", "max_len_b"), int, "B", "see --max-len-a"),
    "--batch-size": ("batch_size", ("eval", "batch_size"), int, "N", "sentences per decoding batch"),
    "--precision": ("precision", ("run", "precision"), str, "P", "autocast while decoding: fp32, bf16 or fp16"),
}
# what a checkpoint without these config fields gets (train.config.EvalConfig's and RunConfig's defaults)
_FALLBACK = {"beam_size": 4, "length_penalty": 0.6, "max_len_a": 1.5, "max_len_b": 10, "batch_size": 128,
             "precision": "fp32"}


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """The decoding flags and ``--device``; none has a parser default (None = the checkpoint's value)."""
    g = p.add_argument_group("decoding (default: the checkpoint's eval settings, what its final test used)")
    for flag, (name, (section, key), _, metavar, text) in _OPTIONS.items():
        g.add_argument(flag, dest=name, metavar=metavar, help=f"{text} (default: the checkpoint's {section}.{key})")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    g.add_argument("--engine", choices=("fastmt", "ct2"), help="ct2: --ckpt is a folder made by fastmt export --to ct2, "
                   "decoded by CTranslate2 under fastmt's rules (default: detected from --ckpt)")


def _parse(flag: str, value: str, kind: type):
    try:
        v = kind(value)
    except ValueError:
        raise UserError(f"{flag} {value!r}: not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(v):
        raise UserError(f"{flag} {value}: must be a finite number")
    return v


def resolve_decoding(args: argparse.Namespace, config: dict[str, Any]) -> tuple[Decoding, list[str]]:
    """The ``Decoding`` of parsed flags over the checkpoint's ``config`` dict, and the flags that were given.
    Bad values raise ``UserError`` naming the flag and the value."""
    from train.export.engine import check_engine

    check_engine(args, config)
    values, given = {}, []
    for flag, (name, (section, key), kind, _, _) in _OPTIONS.items():
        raw = getattr(args, name)
        if raw is None:
            values[name] = (config.get(section) or {}).get(key, _FALLBACK[name])
        else:
            given.append(flag)
            values[name] = _parse(flag, raw, kind) if kind is not str else raw
    d = Decoding(**values)
    for flag, ok, rule in (("--beam", d.beam_size >= 1, ">= 1"), ("--batch-size", d.batch_size >= 1, ">= 1"),
                           ("--length-penalty", d.length_penalty >= 0, ">= 0"),
                           ("--max-len-a", d.max_len_a >= 0, ">= 0"), ("--max-len-b", d.max_len_b >= 0, ">= 0"),
                           ("--precision", d.precision in PRECISIONS, f"one of {', '.join(PRECISIONS)}")):
        if not ok:
            raise UserError(f"{flag} {getattr(d, _OPTIONS[flag][0])}: must be {rule}")
    return d, given


def resolve_device(name: str) -> torch.device:
    """``--device``: auto | cpu | cuda | cuda:N, refused in one line when CUDA is not there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device here; use --device cpu")
    return device


def configure_cpu(device: torch.device, config: dict[str, Any]) -> None:
    """On the CPU, set up as the checkpoint's run was: denormals flushed (3x slower eager steps otherwise)
    and ``run.cpu_threads`` threads when it set them (on the shared 2-core machine, load average 3-4, decoding
    the tiny preset's 427-sentence test split of the stand-in corpus took 2.7 s on 1 thread, 29.5 s on 2)."""
    if device.type != "cpu":
        return
    from train import flush_denormals

    flush_denormals()
    threads = (config.get("run") or {}).get("cpu_threads")
    if isinstance(threads, int) and threads >= 1:
        torch.set_num_threads(threads)


def autocast_for(device: torch.device, precision: str):
    """The autocast context the Trainer builds for ``run.precision`` (re-enterable)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


MAX_LAYERS = 1024  # per stack: far above any model fastmt trains; a larger count in a file is forged
EXTRA_BUFFER_BYTES = 256 * 2**20  # memory a model may allocate beyond its stored tensors (position tables)


def check_model_config(cfg, state: dict[str, Any], path) -> int:
    """Refuse (``UserError``) a checkpoint whose model config does not describe exactly the tensors it stores,
    before any memory is allocated: the model is built on the ``meta`` device (shapes only), its parameter
    count and shapes compared with the file's. A few-KB file with a forged config (d_model 10^6) would
    otherwise make ``translate`` allocate the model it describes. Returns the parameter count."""
    from models import Transformer

    layers = max(n for n in (cfg.enc_layers, cfg.dec_layers, cfg.enc_unique, cfg.dec_unique) if n is not None)
    if layers > MAX_LAYERS:
        raise UserError(f"{path}: its model config asks for {layers:,} layers (at most {MAX_LAYERS}): a damaged or "
                        f"forged checkpoint; nothing was built")
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    n_cfg, n_file = sum(math.prod(s) for s in expected.values()), sum(math.prod(s) for s in stored.values())
    if expected != stored or len(stored) != len(state):
        diff = sorted(set(expected) ^ set(stored)) or [k for k in expected if expected[k] != stored.get(k)]
        first = diff[0] if diff else next(k for k in state if k not in stored)
        raise UserError(f"{path}: its model config (d_model {cfg.d_model}, {cfg.enc_layers}+{cfg.dec_layers} layers, "
                        f"vocab {cfg.vocab_size}) makes {n_cfg:,} parameters in {len(expected)} tensors, but the file "
                        f"stores {n_file:,} in {len(state)} (first difference: {first!r}: config "
                        f"{expected.get(first)}, file {stored.get(first, type(state.get(first)).__name__)}): a damaged "
                        f"or forged checkpoint; nothing was built")
    extra = sum(b.numel() * b.element_size() for k, b in model.named_buffers() if k not in expected)
    if extra > EXTRA_BUFFER_BYTES:
        raise UserError(f"{path}: its model config needs {extra / 2**20:,.0f} MB of tables beyond its stored weights "
                        f"(max_positions {cfg.max_positions}): a damaged or forged checkpoint; nothing was built")
    return n_cfg


def load_for_inference(ckpt_path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer, checkpoint dict) from a training checkpoint; a file that is not one
    (missing, unreadable, without a tokenizer, asking for code, a config that disagrees with its tensors)
    raises ``UserError`` naming it, before the model is allocated."""
    from models import ModelConfig, Transformer
    from train.checkpoint import load_checkpoint
    from train.export.engine import is_ct2_dir, load_ct2
    from train.preflight import tokenizer_of

    if is_ct2_dir(ckpt_path):  # an exported CTranslate2 folder (train/export/engine.py)
        return load_ct2(ckpt_path, torch.device(device))
    try:
        ckpt = load_checkpoint(ckpt_path)
    except UserError:
        raise
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"--ckpt: {e}") from e
    try:
        tok = tokenizer_of(ckpt, Path(ckpt_path))
    except (RuntimeError, OSError, TypeError, ValueError) as e:  # SentencePiece's parse error of a damaged model
        raise UserError(f"{ckpt_path}: its tokenizer does not load ({' '.join(str(e).split())[:160]}): a damaged "
                        f"or forged checkpoint") from e
    try:
        cfg = ModelConfig(**ckpt["config"]["model"])
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{ckpt_path}: its model config does not build with this fastmt ({e})") from e
    if cfg.vocab_size != tok.vocab_size:
        raise UserError(f"{ckpt_path}: tokenizer mismatch: model vocab {cfg.vocab_size} != tokenizer vocab "
                        f"{tok.vocab_size} ({tok.model_file})")
    if not isinstance(ckpt["model"], dict):
        raise UserError(f"{ckpt_path}: its 'model' entry is a {type(ckpt['model']).__name__}, not a state dict")
    check_model_config(cfg, ckpt["model"], ckpt_path)
    model = Transformer(cfg).to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, tok, ckpt


def translate_lines(model, tok, lines: list[str | None], device: torch.device, d: Decoding,
                    cuda_graph: bool = False) -> list[str]:
    """One output line per entry of ``lines``: "" for a blank line or None (an unreadable input line),
    else the translation with any line break in it printed as a space (so output line k answers input k)."""
    from train.evaluate import translate

    todo = [k for k, line in enumerate(lines) if line is not None and line.strip()]
    if hasattr(model, "translate_texts"):  # an exported CTranslate2 model (train/export/engine.py)
        hyps = model.translate_texts([lines[k] for k in todo], d)
    else:
        hyps = translate(model, tok, [lines[k] for k in todo], device, beam_size=d.beam_size,
                         batch_size=d.batch_size, max_len_ratio=d.max_len_a, max_len_extra=d.max_len_b,
                         length_penalty=d.length_penalty, autocast=autocast_for(device, d.precision),
                         cuda_graph=cuda_graph and device.type == "cuda")
    out = [""] * len(lines)
    for k, h in zip(todo, hyps):
        out[k] = " ".join(h.splitlines())  # a decoded line break would shift every later line
    return out


def run_command(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, *,
                interrupted: str | None = None) -> int:
    """``run(args)`` under the inference commands' error policy: a ``UserError`` prints one line, ``error: ...``
    (its traceback too under ``--debug`` or ``FASTMT_DEBUG=1``), and returns its exit code; Ctrl-C returns 130
    (after printing ``interrupted``, if given)."""
    from data.clean import DataInputError  # data.files.FileRefusedError: a refused path, in one line too

    try:
        return run(args)
    except (UserError, DataInputError) as e:
        if getattr(args, "debug", False) or debug_enabled():
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        if interrupted:
            print(interrupted, file=sys.stderr)
        return EXIT_ABORTED
