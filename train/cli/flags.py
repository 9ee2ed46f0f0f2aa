"""The training command line: flags, config files, config-field overrides, preset resolution, machine checks.

``resolve_config(argv)`` turns a command line into a validated ``Config`` plus the parsed flags, before
anything is written: every mistake is one line on stderr and exit code 2 (``train.errors.EXIT_USAGE``).
``train/cli/train.py`` runs it; ``fastmt stats`` resolves the same flags (a training command line with
``train`` replaced by ``stats`` reports that run's data), and ``fastmt model`` takes the same
``--section.field`` overrides. Where a value comes from, last wins:

    --preset P (or --auto)  ->  --config FILE  ->  --section.field VALUE and the shortcuts

``--config FILE`` reads JSON, exactly what ``--print-config`` writes and what each run folder keeps as
``config.json``: JSON because ``Config.to_dict()`` maps onto it one to one (null for None, lists for
tuples), Python reads and writes it with the standard library alone, and it is the format of every
other file fastmt writes (metrics.jsonl, provenance.json). (TOML has no null, and Python can read TOML
but not write it.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from train.config import PRESETS, Config, apply_overrides, get_config, load_config_file
from train.errors import debug_enabled

DESCRIPTION = ("Train an encoder-decoder translator: --preset P (or --auto, or --config FILE), then any "
               "--section.field VALUE.")
EPILOG = """Config fields: --<section>.<field> VALUE, sections data, model, optim, run, eval
(--help-fields [SECTION] lists each with its type, choices, value and meaning).
Examples:
  %(prog)s --preset tiny --data.dataset toy          # a generated toy corpus: a minute on a laptop
  %(prog)s --preset tiny --data-files a.jsonl b.jsonl --epochs 3
  %(prog)s --preset tiny --print-config > my.json    # edit, then: %(prog)s --config my.json
"""

# shortcut flag -> the config field it sets (giving both is an error)
SHORTCUTS = {"epochs": "run.epochs", "max_steps": "run.max_steps", "data_files": "data.data_files"}
# One rule for repeated flags, as for repeated fields (``split_overrides``): a flag that takes one value, given
# twice, is an error (argparse would keep the last silently); ``--data-files``, like ``--data.data_files``,
# accumulates: every path of every occurrence, in order.

DEFAULT_PROG = "python -m train"
PROG = DEFAULT_PROG  # the parser's name; `fastmt train` / `fastmt stats` set theirs while they run


class Once(argparse.Action):
    """``store`` that refuses a second occurrence, naming both values."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r}, then {values!r}): give it "
                         f"once (a flag that takes one value, like a config field, is set once)")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class OneLineParser(argparse.ArgumentParser):
    """``error()`` prints one line, ``<prog>: error: <message>`` (no usage block), and exits 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog or PROG, description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", metavar="P", action=Once, help=f"configuration preset: {', '.join(PRESETS)}")
    p.add_argument("--auto", action="store_true",
                   help="CUDA: the fast preset (best measured time to BLEU); CPU: the tiny preset")
    p.add_argument("--config", metavar="FILE", action=Once,
                   help="JSON config as --print-config writes it (a run folder's config.json too); fields it "
                        "leaves out come from --preset; command-line fields override it")
    p.add_argument("--epochs", type=int, action=Once, help="shortcut for --run.epochs")
    p.add_argument("--max-steps", type=int, action=Once, help="shortcut for --run.max_steps (optimizer steps in total)")
    p.add_argument("--data-files", nargs="+", action="extend", metavar="F",
                   help="local jsonl/parquet/tsv files instead of the Hub (each argument is one path; given twice: "
                        "the paths of both)")
    p.add_argument("--resume", metavar="PATH|auto", action=Once, help="checkpoint to continue from; auto: newest of this run")
    p.add_argument("--init-from", metavar="CKPT", action=Once,
                   help="start a new run from this checkpoint's weights and tokenizer (fresh optimizer and schedule)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as JSON (a valid --config file) and exit")
    p.add_argument("--help-fields", nargs="?", const="", metavar="SECTION",
                   help="list every config field (or one section's) with type, choices, value and meaning")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of user errors too (also FASTMT_DEBUG=1)")
    return p


def split_overrides(rest: list[str], parser: argparse.ArgumentParser) -> dict[str, str | list[str]]:
    """``["--optim.lr", "3e-4", "--run.name=x"]`` -> ``{"optim.lr": "3e-4", "run.name": "x"}``. A field given
    more than once maps to the list of its values (only path lists accept that: ``apply_overrides``)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--") or "." not in tok.split("=", 1)[0]:
            parser.error(f"unrecognized argument {tok!r}{_flag_hint(tok, parser)}")
        if "=" in tok:
            key, value = tok[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                parser.error(f"{tok} needs a value")
            key, value = tok[2:], rest[i + 1]
            i += 2
        if key in out:
            out[key] = [*([out[key]] if isinstance(out[key], str) else out[key]), value]
        else:
            out[key] = value
    return out


def _flag_hint(tok: str, parser: argparse.ArgumentParser) -> str:
    from train.fields import did_you_mean, field_infos

    word = tok.split("=", 1)[0]
    if not word.startswith("-"):
        return ": values follow a flag; config fields are --<section>.<field> VALUE (see --help-fields)"
    flags = [o.lstrip("-") for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hint = did_you_mean(word, flags + list(field_infos(Config)), prefix="--")
    return hint or ": config fields are --<section>.<field> VALUE, e.g. --optim.lr 3e-4 (see --help-fields)"


def choose_preset(args: argparse.Namespace, parser: argparse.ArgumentParser, log) -> str | None:
    """The preset named by --preset or picked by --auto (None: neither, which only --config allows)."""
    from train.fields import did_you_mean

    if args.auto and args.preset:
        parser.error("give either --auto or --preset, not both")
    if args.preset is not None and args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}"
                     + did_you_mean(args.preset, list(PRESETS)))
    if not args.auto:
        return args.preset
    import torch

    if torch.cuda.is_available():
        log(f"--auto: CUDA device {torch.cuda.get_device_name(0)!r} -> preset 'fast': of the recipes measured on "
            f"an H100 it reached validation BLEU 37 soonest (AdamW 5e-4 on 4k-token packed batches, CUDA graphs; "
            f"Lion peaked at 35.6)")
        return "fast"
    log("--auto: no CUDA device -> preset 'tiny' (a CPU smoke run; the 'fast' preset needs a GPU)")
    return "tiny"


def _stderr(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def resolve_config(argv: list[str] | None = None, *, log=None, parser: argparse.ArgumentParser | None = None,
                   machine: bool = True) -> tuple[Config, argparse.Namespace]:
    """(validated Config, parsed flags) of a command line; a mistake exits 2 with one line on stderr.
    ``log``: where notes and warnings go (stderr, so that ``--print-config`` output stays a valid file);
    ``parser``: ``build_parser()`` with more flags; ``machine``: check the config against this machine
    (the device, the compile backend; a GPU recipe on a CPU is warned about) — training needs it."""
    log = log or _stderr
    parser = parser or build_parser()
    args, rest = parser.parse_known_args(argv)
    vars(args).pop("_given", None)
    args.debug = bool(getattr(args, "debug", False)) or debug_enabled()
    overrides = split_overrides(rest, parser)
    if args.help_fields is not None:
        _print_fields(args, parser)
        raise SystemExit(0)
    preset = choose_preset(args, parser, log)
    if preset is None and not args.config:
        parser.error(f"choose --preset {{{','.join(PRESETS)}}}, --auto, or --config FILE")
    args.preset = preset
    for flag, key in SHORTCUTS.items():
        if getattr(args, flag) is not None and key in overrides:
            parser.error(f"--{flag.replace('_', '-')} and --{key} both set {key}: give one of them")
    if args.data_files:
        overrides["data.data_files"] = list(args.data_files)
    if "data.data_files" in overrides and "data.dataset" in overrides:
        parser.error("--data-files (or --data.data_files) and --data.dataset both name the data: local files "
                     "win and the dataset would be ignored; give one of them")
    if args.epochs is not None:
        overrides["run.epochs"] = str(args.epochs)
    if args.max_steps is not None:
        overrides["run.max_steps"] = str(args.max_steps)
    try:
        base = get_config(preset) if preset else None
        cfg = load_config_file(args.config, base, log=log) if args.config else base
        cfg = apply_overrides(cfg, overrides)
    except (ValueError, TypeError) as e:
        _fail(parser, args, e)
    from data.config import DATA_FILES_ENV, env_data_files

    env = os.environ.get(DATA_FILES_ENV)
    if env and not env_data_files() and not cfg.data.data_files and not cfg.data.is_toy():
        parser.error(f"${DATA_FILES_ENV}={env!r} names no file (paths separated by {os.pathsep!r}): give paths, or "
                     f"unset it to read the Hub dataset {cfg.data.dataset!r}")
    missing = [f for f in cfg.data.data_files if not Path(f).is_file()]
    if missing:
        odd = [f for f in missing if Path(f).exists()]  # a folder, a pipe, a device
        parser.error(f"data files not found: {', '.join(map(repr, missing))} (give existing jsonl/parquet/tsv "
                     f"files; each --data-files argument is one path)" if not odd else
                     f"data files must be regular files: {', '.join(map(repr, odd))} "
                     f"{'is' if len(odd) == 1 else 'are'} not (a folder, a pipe or a device); give jsonl/parquet/tsv files")
    data_file_notes(cfg.data, log)
    if machine:
        try:
            check_machine(cfg, preset, log)
        except ValueError as e:
            _fail(parser, args, e)
    return cfg, args


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def data_file_notes(d, log) -> None:
    """Warn of data files that are allowed but rarely meant: a training file given twice (its rows then count
    twice: an oversampling, kept as asked) and one file as both the validation and the test set (best.pt is then
    chosen on the test set, so the test BLEU is no longer held out)."""
    files = list(d.data_files)
    twice = sorted({b for i, a in enumerate(files) for b in files[i + 1:] if _same_file(a, b)})
    if twice:
        log(f"warning: {', '.join(twice)} given more than once in data.data_files: its rows are read once per "
            f"mention (an oversampling); give each file once unless that is meant")
    both = sorted({v for v in d.valid_files for t in d.test_files if _same_file(v, t)})
    if both:
        log(f"warning: {', '.join(both)} is both data.valid_files and data.test_files: best.pt is chosen on the "
            f"test set, so its test BLEU is not a held-out score; give a separate validation file")


def _fail(parser: argparse.ArgumentParser, args: argparse.Namespace, e: Exception):
    """One line and exit 2; under ``--debug`` / ``FASTMT_DEBUG=1`` the traceback first."""
    if args.debug:
        import traceback

        traceback.print_exception(e)
    parser.error(str(e))


# --help-fields: each field's type, value and help line (train.fields reads them from the config classes)
# ---------------------------------------------------------------------------------------------
# --help-fields
# ---------------------------------------------------------------------------------------------
def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def format_fields(cfg, only: Sequence[str] = (), preset: str | None = None) -> str:
    """Every field grouped by section: ``--section.field TYPE (preset value)`` then its help line.
    ``cfg``: the config whose values are shown (the preset's, or the classes' defaults); ``only``: sections."""
    from train.fields import SECTION_HELP, field_infos, sections

    infos = field_infos(type(cfg))
    where = f"preset {preset!r}" if preset else "defaults"
    out = [f"Config fields: --<section>.<field> VALUE (also the keys of a --config JSON file); after '=' the "
           f"value under {where}.", ""]
    for section, _ in sections(type(cfg)):
        if only and section not in only:
            continue
        out.append(f"{section}: {SECTION_HELP.get(section, '')}")
        obj = getattr(cfg, section)
        for key, info in infos.items():
            if info.section != section:
                continue
            value = getattr(obj, info.name)
            out.append(f"  --{key} {info.type_text()} = {_shown(value)}")
            bound = f" (range {info.bounds.text()})" if info.bounds is not None and info.bounds.text() else ""
            out.append(f"      {info.help or '(no description)'}{bound}; on --resume: {_resume_text(info.resume)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _resume_text(resume) -> str:
    """A field's resume class (data/declare.py) as ``--help-fields`` says it."""
    if resume.kind == "safe":
        return "may change" + (f" (not to or from {', '.join(map(str, resume.refuse_values))})"
                               if resume.refuse_values else "")
    return {"replan": "may change (the schedule is re-planned)", "epoch": "may change at an epoch boundary",
            "derived": "set from the tokenizer"}.get(resume.kind, f"fixed ({resume.why})")


def _print_fields(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from train.fields import sections

    only = [s for s in args.help_fields.replace(",", " ").split() if s]
    names = [s for s, _ in sections(Config)]
    bad = [s for s in only if s not in names]
    if bad:
        parser.error(f"--help-fields {bad[0]!r}: sections are {', '.join(names)}")
    if args.preset is not None and args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}")
    preset = args.preset or "tiny"
    print(format_fields(get_config(preset), only, preset=preset), end="")


# ---------------------------------------------------------------------------------------------
# What only this machine can tell: the device, the interpreter, the compile backend
# ---------------------------------------------------------------------------------------------
def busy_machine() -> tuple[float, int] | None:
    """(1-minute load average, usable cores) when other work already keeps every usable core busy, else None.
    (Measured on a shared 2-core machine at load 5-7: 40 tiny-preset batches took 44-83 s with 2 threads,
    5-6 s with 1; idle, 2 threads beat 1: 10.2 s against 13.1 s an epoch, issue 23.)"""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    except OSError:
        return None
    return (load, cores) if load >= cores + 1 else None


def check_machine(cfg: Config, preset: str | None, log) -> None:
    """Refuse what cannot run on this machine (``ValueError``, one line) and warn when a GPU recipe is about
    to run on the CPU, with the suggestion."""
    import torch

    run, model = cfg.run, cfg.model
    if run.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--run.device cuda, but torch sees no CUDA device here (torch "
                         f"{torch.__version__}): use --run.device auto or cpu, or a CUDA build of torch")
    from train.compile import compiles
    from train.distributed import device_type

    device = device_type(run.device)
    if device == "cpu" and model.attn_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("model.attn_backend='triton' needs a CUDA device (on a CPU only under TRITON_INTERPRET=1, "
                         "which is slow): use --model.attn_backend auto")
    compiled = compiles(run, device)
    if compiled:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if run.compile_backend not in backends:
            from train.fields import did_you_mean

            raise ValueError(f"run.compile_backend={run.compile_backend!r} is not a torch.compile backend here"
                             + (did_you_mean(run.compile_backend, backends) or f"; choose one of {backends}"))
    if device == "cpu":
        busy = busy_machine()
        if busy and (run.cpu_threads or 2) > 1:
            from train.cli import cpu_wait

            load, cores = busy
            if run.cpu_adapt:
                log(f"warning: this machine is busy (load {load:.1f} on the {cores} cores this process may use): this "
                    f"run gets a share of them; it adapts its CPU threads while it trains (one while other programs "
                    f"use the cores: run.cpu_adapt), so they do not spin on a taken core")
            elif cpu_wait.in_force == cpu_wait.POLICY:
                log(f"warning: this machine is busy (load {load:.1f} on the {cores} cores this process may use): this "
                    f"run gets a share of them; its threads wait passively (OMP_WAIT_POLICY=PASSIVE) and their "
                    f"count is fixed (--run.cpu_adapt false); --run.cpu_threads 1 avoids waiting at all")
            else:
                log(f"warning: this machine is busy (load {load:.1f} on the {cores} cores this process may use) and "
                    f"the CPU threads may spin-wait (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}) "
                    f"with their count fixed (--run.cpu_adapt false): beside busy neighbours the tiny preset took "
                    f"up to 20x longer; drop --run.cpu_adapt false, or use --run.cpu_threads 1")
        slow = [w for w, on in ((f"{run.precision} autocast", run.precision != "fp32"),
                                ("torch.compile", compiled)) if on]
        if slow:
            what = f"preset {preset!r}" if preset else "this config"
            log(f"warning: {what} runs {' and '.join(slow)} on a CPU, which are built for a GPU: expect hours per "
                f"epoch (the fast preset took 238 s for its first step on a 2-core machine). For a CPU run use "
                f"--preset tiny (or --auto), or add --run.precision fp32 --run.compile false.")
