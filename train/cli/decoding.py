"""What ``fastmt translate``, ``evaluate`` and ``export`` share on the command line: the decoding flags (each
defaults to the checkpoint's own setting, ``train.evaluation.decode.Decoding``), ``--device``, the one setup of a
decoding command (``load_for_command``), stdout closed by its reader (``quiet_closed_stdout``), and the commands'
error policy (``run_command``: a ``UserError`` is one line and exit 2, Ctrl-C 130).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from train.errors import EXIT_ABORTED, UserError, debug_enabled
from train.evaluation.decode import DECODING_DEFAULTS, PRECISIONS, Decoding, configure_cpu
from train.evaluation.load import checkpoint_file, load_for_inference

# flag -> (Decoding field, the checkpoint's config key it defaults to, type, metavar, help)
_OPTIONS = {
    "--beam": ("beam_size", ("eval", "beam_size"), int, "N", "beam size, 1 = greedy"),
    "--length-penalty": ("length_penalty", ("eval", "length_penalty"), float, "X", "GNMT length penalty alpha"),
    "--max-len-a": ("max_len_a", ("eval", "max_len_a"), float, "A", "decoding length limit: A x source tokens + B"),
    "--max-len-b": ("max_len_b", ("eval", "max_len_b"), int, "B", "see --max-len-a"),
    "--batch-size": ("batch_size", ("eval", "batch_size"), int, "N", "sentences per decoding batch"),
    "--precision": ("precision", ("run", "precision"), str, "P", "autocast while decoding: fp32, bf16 or fp16"),
}


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
    from train.bounds import BOUNDS, bounded
    from train.export.engine import check_engine
    from train.fields import hypotheses_problem

    check_engine(args, config)
    values, given = {}, []
    for flag, (name, (section, key), kind, _, _) in _OPTIONS.items():
        raw = getattr(args, name)
        field = f"{section}.{key}"
        if raw is None:  # the checkpoint's value: typed and bounded as the field is (train/bounds.py BOUNDS)
            part = config.get(section) or {}
            value = part.get(key, DECODING_DEFAULTS[name]) if isinstance(part, dict) else part
            try:
                values[name] = bounded(field, value, f"--ckpt {getattr(args, 'ckpt', '')}: its config",
                                       int | None if field == "run.cpu_threads" else kind)
            except ValueError as e:
                raise UserError(f"{e}; give {flag} to decode with another value") from None
        else:
            given.append(flag)
            values[name] = _parse(flag, raw, kind) if kind is not str else raw
            problem = BOUNDS[field].problem(values[name]) if field in BOUNDS else None
            if problem:
                raise UserError(f"{flag} {raw}: {problem}")
    hyp = hypotheses_problem(values["beam_size"], values["batch_size"], "--beam", "--batch-size")
    if hyp:
        raise UserError(hyp)
    d = Decoding(**values)
    for flag, ok, rule in (("--beam", d.beam_size >= 1, ">= 1"), ("--batch-size", d.batch_size >= 1, ">= 1"),
                           ("--length-penalty", d.length_penalty >= 0, ">= 0"),
                           ("--max-len-a", d.max_len_a >= 0, ">= 0"), ("--max-len-b", d.max_len_b >= 0, ">= 0"),
                           ("--precision", d.precision in PRECISIONS, f"one of {', '.join(PRECISIONS)}")):
        if not ok:
            value = getattr(d, _OPTIONS[flag][0])
            if flag in given:
                raise UserError(f"{flag} {value}: must be {rule}")
            section, key = _OPTIONS[flag][1]  # not typed: the checkpoint's own value, said as such
            raise UserError(f"--ckpt {getattr(args, 'ckpt', '')}: its config's {section}.{key} {value!r} must be {rule} "
                            f"(a damaged or foreign checkpoint); give {flag} to decode with another value")
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
    except MemoryError:  # a test set larger than this process may hold (ulimit -v, a cgroup): one line, no traceback
        files = [f for f in (getattr(args, "src", None), *(getattr(args, "ref", None) or [])) if f]
        held = f" (it holds {', '.join(files)} whole, with their hypotheses)" if files else ""
        print(f"error: out of memory{held} under this process's limit ({_memory_limit()}): split the input into "
              f"smaller files (split -l 100000), or raise the limit (ulimit -v)", file=sys.stderr)
        return 2


def _memory_limit() -> str:
    """This process's address-space limit (RLIMIT_AS) in words."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return "ulimit -v unlimited" if soft == resource.RLIM_INFINITY else f"ulimit -v {soft // 1024} KB"


@dataclass
class Loaded:
    """What a decoding command works with once set up."""

    model: Any  # models.Transformer in eval mode, or an exported CTranslate2 model (train/export/engine.py)
    tok: Any  # data.tokenizer.Tokenizer
    config: dict[str, Any]  # the checkpoint's run config
    device: torch.device
    decoding: Decoding
    given: list[str]  # the decoding flags given on the command line
    weights_sha256: str | None = None  # sha256 of the file the weights were loaded from (``hash_weights``)


def load_for_command(args: argparse.Namespace, checks: Callable[[], None] | None = None, *,
                     hash_weights: bool = False) -> Loaded:
    """The one setup of ``fastmt translate`` and ``fastmt evaluate``: ``--ckpt`` resolved (a file, a run folder's
    ``best.pt``, an exported CTranslate2 folder), ``--device``, then ``checks()`` (the command's own refusals,
    before anything is loaded), the model and tokenizer, the CPU set up as the checkpoint's run was, and the
    decoding (the flags over the checkpoint's settings). ``hash_weights``: the sha256 of the bytes the weights
    were loaded from (read through the same descriptor, not the path again)."""
    import hashlib

    args.ckpt = checkpoint_file(args.ckpt)
    device = resolve_device(args.device)
    if checks is not None:
        checks()
    digest = hashlib.sha256() if hash_weights else None
    model, tok, ckpt = load_for_inference(args.ckpt, device, digest=digest)
    config = ckpt.get("config") or {}
    configure_cpu(device, config, f"--ckpt {args.ckpt}: its run config")
    decoding, given = resolve_decoding(args, config)
    return Loaded(model, tok, config, device, decoding, given, digest.hexdigest() if digest is not None else None)


def quiet_closed_stdout() -> None:
    """stdout's reader has gone (``| head``): point stdout at /dev/null, so that Python's flush at exit raises no
    second error. What was written is written; the command ends as if it had finished."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
