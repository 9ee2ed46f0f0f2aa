"""What every config field is: its type, choices, default and one-line help, read from the config classes.

The help text is each field's own comment in its dataclass (``data/config.py``, ``models/config.py``,
``train/config.py``): the trailing comment on the field's line(s), else the comment lines right above it.
Nothing is written twice, so a field added with a comment is documented everywhere at once:
``--help-fields`` (grouped by section; printed by ``train.cli.flags.format_fields``), the "did you mean" of a
typo, and the tests that check that every field has a help line, a type and (for closed sets of strings) its choices.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import os
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

# str fields whose dataclass accepts a closed set of values (the others take any string).
# Literal-typed fields carry their choices in their annotation and need no entry here.
# tests/train/test_cli_fields.py checks that every str field outside this table really takes any string.


@functools.cache
def _str_choices() -> dict[str, tuple[str, ...]]:
    from data import config as D
    from models import config as M

    table = {
        "data.batching": "BATCHING_MODES",
        "data.spm_model": "SPM_MODELS",
        "data.overlong": "OVERLONG_POLICIES",
        "data.split_grouping": "SPLIT_GROUPINGS",
        "model.sharing": "SHARING",
        "model.positions": "POSITIONS",
        "model.activation": "ACTIVATIONS",
        "model.attn_backend": "ATTN_BACKENDS",
        "model.norm": "NORMS",
        "model.layout": "LAYOUTS",
    }
    modules = {"data": D, "model": M}
    # a constant the module does not (yet) define is left out: the field then shows no choices
    return {key: tuple(getattr(modules[key.partition(".")[0]], const)) for key, const in table.items()
            if hasattr(modules[key.partition(".")[0]], const)}


# float fields where an infinite value has a meaning (the others refuse inf as well as NaN)
INF_OK = {"data.max_len_ratio": "inf keeps every length ratio"}


# ---------------------------------------------------------------------------------------------
# Bounds: every numeric field's range, declared once here and applied to every source of a value (the command
# line, --config, a run's config.json, a checkpoint, an export folder's records): `check_bounds` on a Config
# (Config.__post_init__ calls it), `bounded` on one value read from a file.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bounds:
    lo: float | None = None  # smallest value allowed (None: no lower bound)
    hi: float | None = None  # largest value allowed (None: no upper bound)
    lo_open: bool = False  # the value must be > lo (not >= lo)
    hi_open: bool = False  # the value must be < hi
    # a resource the machine limits: "cores" = also at most the cores this process may use, applied where the value
    # is used (`machine_capped`: a checkpoint written on a larger machine still loads here)
    machine: str | None = None
    why: str = ""  # what the upper bound protects, said when a value is refused

    def problem(self, v: float) -> str | None:
        """Why ``v`` is out of range (None: in range)."""
        if self.lo is not None and (v < self.lo or self.lo_open and v == self.lo):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None and (v > self.hi or self.hi_open and v == self.hi):
            return f"must be {'<' if self.hi_open else '<='} {self.hi:g}" + (f" ({self.why})" if self.why else "")
        return None

    def text(self) -> str:
        """The range as ``--help-fields`` shows it, e.g. ``[1, 64]``, ``(0, 1)``, ``>= 0``."""
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else ""


MAX_THREADS = 1024  # threads a run or a decoding may ask for (and never more than the machine's cores)
MAX_WORKERS = 64  # DataLoader worker processes (each a forked copy of the process)
MAX_BUILD_WORKERS = 256  # processes of a cold data build
MAX_LAYERS = 1024  # applied layers per stack: far above any model fastmt trains
MAX_BEAM = 64  # decoding beam
MAX_DECODE_BATCH = 4096  # sentences per decoding batch
MAX_HYPOTHESES = 8192  # beam x decoding batch: hypotheses decoded at once (their logits are allocated together)
MAX_LENGTH = 2**16  # tokens of a sequence (max_len, seq_len, a decoding's length bonus)
MAX_POSITIONS = 2**20  # the model's position table
MAX_VOCAB = 2**20  # SentencePiece pieces
MAX_WIDTH = 2**16  # d_model
MAX_FF = 2**18  # d_ff
MAX_BATCH_TOKENS = 2**22  # a batch's token budget
MAX_COUNT = 10**12  # steps, rows, sentences
SEED = Bounds(-(2**63), 2**64 - 1, why="a 64-bit seed")
_RES = "a resource of this machine"
BOUNDS: dict[str, Bounds] = {
    "data.toy_rows": Bounds(1, 10**8, why="rows generated in memory"),
    "data.max_len": Bounds(2, MAX_LENGTH),
    "data.max_len_ratio": Bounds(1, None),
    "data.valid_size": Bounds(0, MAX_COUNT),
    "data.test_size": Bounds(0, MAX_COUNT),
    "data.split_seed": SEED,
    "data.vocab_size": Bounds(300, MAX_VOCAB),
    "data.character_coverage": Bounds(0, 1, lo_open=True),
    "data.spm_sample_pairs": Bounds(0, MAX_COUNT),
    "data.spm_threads": Bounds(0, MAX_THREADS, machine="cores", why=_RES),
    "data.build_workers": Bounds(0, MAX_BUILD_WORKERS, why="processes forked for a build"),
    "data.max_tokens": Bounds(1, MAX_BATCH_TOKENS, why="tokens allocated per batch"),
    "data.batch_size": Bounds(1, MAX_LENGTH),
    "data.seq_len": Bounds(1, MAX_LENGTH),
    "data.pad_multiple": Bounds(1, 4096),
    "data.seed": SEED,
    "data.num_workers": Bounds(0, MAX_WORKERS, why="processes forked for loading"),
    "data.prefetch_factor": Bounds(1, 64, why="batches held in memory per worker"),
    "model.vocab_size": Bounds(1, MAX_VOCAB),
    "model.pad_id": Bounds(0, MAX_VOCAB),
    "model.d_model": Bounds(1, MAX_WIDTH),
    "model.n_heads": Bounds(1, 1024),
    "model.d_ff": Bounds(1, MAX_FF),
    "model.enc_layers": Bounds(1, MAX_LAYERS),
    "model.dec_layers": Bounds(1, MAX_LAYERS),
    "model.enc_unique": Bounds(1, MAX_LAYERS),
    "model.dec_unique": Bounds(1, MAX_LAYERS),
    "model.dropout": Bounds(0, 1, hi_open=True),
    "model.max_positions": Bounds(1, MAX_POSITIONS),
    "optim.lr": Bounds(0, None, lo_open=True),
    "optim.betas": Bounds(0, 1, hi_open=True),
    "optim.eps": Bounds(0, 1, lo_open=True),
    "optim.weight_decay": Bounds(0, None),
    "optim.pct_start": Bounds(0, 1, lo_open=True, hi_open=True),
    "optim.div_factor": Bounds(1, 1e12),
    "optim.final_div_factor": Bounds(1, 1e12),
    "optim.warmup_steps": Bounds(1, MAX_COUNT),
    "optim.grad_clip": Bounds(0, None, lo_open=True),
    "optim.accum_steps": Bounds(1, 4096, why="micro-batches per step"),
    "optim.label_smoothing": Bounds(0, 1, hi_open=True),
    "run.epochs": Bounds(1, 10**6),
    "run.max_steps": Bounds(1, MAX_COUNT),
    "run.max_batches_per_epoch": Bounds(1, MAX_COUNT),
    "run.max_wall_seconds": Bounds(0, 10**9, lo_open=True),
    "run.seed": SEED,
    "run.cpu_threads": Bounds(1, MAX_THREADS, machine="cores", why=_RES),
    "run.log_every": Bounds(1, MAX_COUNT),
    "run.max_nonfinite": Bounds(1, 10**6),
    "run.keep_last": Bounds(1, 10**4, why="checkpoints kept on disk"),
    "run.peak_flops": Bounds(0, 1e21, lo_open=True),
    "eval.every": Bounds(1, 10**6),
    "eval.beam_size": Bounds(1, MAX_BEAM, why="hypotheses per sentence, allocated together"),
    "eval.max_sentences": Bounds(1, MAX_COUNT),
    "eval.batch_size": Bounds(1, MAX_DECODE_BATCH, why="sentences decoded at once"),
    "eval.max_len_a": Bounds(0, 16, why="tokens decoded per source token"),
    "eval.max_len_b": Bounds(0, MAX_LENGTH),
    "eval.length_penalty": Bounds(0, 100),
    "eval.bleu_thresholds": Bounds(0, 100),
    "eval.patience": Bounds(1, 10**6),
    "eval.average_last": Bounds(0, 10**4),
    "eval.num_samples": Bounds(0, 1000),
}


def _numbers(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def bounds_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is outside ``key``'s `BOUNDS` (None: within, or no bounds, or None / not a number: the type
    check says that)."""
    b = BOUNDS.get(key)
    if b is None:
        return None
    for v in _numbers(value):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")) and not (key in INF_OK and v > 0)):
            return f"{key}={_cut(value)} must be a finite number"  # (NaN compares false with every bound)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            why = b.problem(v)
            if why:
                return f"{key}={_cut(value)} {why}"
    return None


def _cut(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_bounds(cfg, where: str = "") -> None:
    """Refuse (``ValueError`` naming the field, the value, its bound and ``where``) a ``Config`` with a value outside
    its field's bounds, or more hypotheses decoded at once than `MAX_HYPOTHESES`."""
    at = f"{where}: " if where else ""
    for info in field_infos(type(cfg)).values():
        problem = bounds_problem(info.key, getattr(getattr(cfg, info.section), info.name))
        if problem:
            raise ValueError(f"{at}{problem}")
    ev = cfg.eval
    hyp = hypotheses_problem(ev.beam_size, ev.batch_size, "eval.beam_size", "eval.batch_size")
    if hyp:
        raise ValueError(f"{at}{hyp}")


def hypotheses_problem(beam: Any, batch: Any, beam_name: str, batch_name: str) -> str | None:
    """Why ``beam`` x ``batch`` hypotheses at once are too many (None: fine, or not two ints)."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (beam, batch)) and beam * batch > MAX_HYPOTHESES:
        return (f"{beam_name}={beam} x {batch_name}={batch} = {beam * batch:,} hypotheses decoded at once, at most "
                f"{MAX_HYPOTHESES:,} (their logits are allocated together): lower one of them")
    return None


def bounded(key: str, value: Any, where: str, tp: Any = None) -> Any:
    """``value`` of field ``key`` read from a file (a checkpoint's config, an export's record), if it has type ``tp``
    (the field's annotation; None: not checked) and lies within the field's bounds; else ``ValueError`` naming
    ``where``, the field and the value."""
    if tp is not None:
        problem = type_problem(value, tp)
        if problem:
            raise ValueError(f"{where}: {key}={_cut(value)} {problem}")
    problem = bounds_problem(key, value)
    if problem:
        raise ValueError(f"{where}: {problem}")
    return value


def check_section(cls: type, section: str, values: Any, where: str) -> None:
    """`bounded` for every field of dataclass ``cls`` that ``values`` (one section read from a file, a dict) holds,
    typed by its annotation; unknown keys are left to the dataclass."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: {section} is a {type(values).__name__}, not an object of fields")
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints:
            bounded(f"{section}.{name}", value, where, hints[name])


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def article(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def check_type(value: Any, tp: Any) -> bool:
    """Loose isinstance against an annotation, for values loaded from JSON/checkpoints."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(check_type(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if args and args[-1] is Ellipsis:
            return all(check_type(v, args[0]) for v in value)
        if args and origin is tuple:
            return len(value) == len(args) and all(check_type(v, a) for v, a in zip(value, args))
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def type_problem(value: Any, tp: Any) -> str | None:
    """Why ``value`` (read from JSON or a checkpoint) does not have annotation ``tp`` (None: it does)."""
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        value = tuple(value)
    return None if check_type(value, tp) else f"is not {article(type_name(tp))}"


def machine_capped(key: str, value: int | None, log=None) -> int | None:
    """``value`` of a resource field capped by this machine (`Bounds.machine`: ``"cores"`` = the cores this process
    may use); said in one line to ``log`` when it was lowered."""
    b = BOUNDS.get(key)
    if value is None or b is None or b.machine != "cores":
        return value
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if value > cores:
        if log is not None:
            log(f"note: {key}={value} is more than the {cores} cores this process may use: {cores} used")
        return cores
    return value

SECTION_HELP = {
    "data": "corpus, cleaning, split, tokenizer, batching (data/config.py)",
    "model": "architecture and kernel switches (models/config.py)",
    "optim": "optimizer, schedule, accumulation, loss (train/config.py)",
    "run": "epochs, device, precision, compile, logging, checkpoints (train/config.py)",
    "eval": "validation decoding, BLEU thresholds, early stop, test (train/config.py)",
}


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    key: str  # "section.field"
    type: Any  # the resolved annotation
    help: str  # the field's comment in its dataclass
    choices: tuple[Any, ...] | None  # closed set of values, or None
    bounds: Bounds | None = None  # the numeric range (`BOUNDS`), or None

    @property
    def section(self) -> str:
        return self.key.partition(".")[0]

    @property
    def name(self) -> str:
        return self.key.partition(".")[2]

    def type_text(self) -> str:
        """How the command line reads a value of this field, e.g. "float", "int or none", "{a,b}"."""
        if self.choices is not None:
            text = "{" + ",".join(str(c) for c in self.choices) + "}"
            return text + (" or none" if _optional(self.type) else "")
        return type_text(self.type)


def type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts + (["none"] if type(None) in args else []))
    if origin is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is str:
                return "path (repeat the flag for more, or a JSON list)"
            return f"{type_text(args[0])}s, comma-separated"
        return f"{len(args)} {type_text(args[0])}s, comma-separated"
    if tp is bool:
        return "bool (true/false)"
    return getattr(tp, "__name__", str(tp))


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def is_float_type(tp: Any) -> bool:
    """True for float, ``float | None``, ``int | float``, ``tuple[float, ...]``: fields that can hold a float."""
    if tp is float:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType, tuple):
        return any(is_float_type(a) for a in args if a is not Ellipsis)
    return False


# ---------------------------------------------------------------------------------------------
# Comments of a dataclass's fields
# ---------------------------------------------------------------------------------------------
@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """``{field: help}`` from the class source: the comments on the field's own lines, else the comment
    block right above it (a ``# --- heading ---`` line ends the block)."""
    lines, _ = inspect.getsourcelines(cls)
    src = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    text_lines = src.splitlines()
    out: dict[str, str] = {}
    body = ast.parse(src).body[0].body  # the class body
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        if not own:
            n = node.lineno - 1
            while n >= 1 and text_lines[n - 1].lstrip().startswith("#") and not comments.get(n, "").startswith("---"):
                own.insert(0, comments[n])
                n -= 1
        out[node.target.id] = " ".join(own)
    return out


# ---------------------------------------------------------------------------------------------
# Every field of a Config
# ---------------------------------------------------------------------------------------------
def sections(cfg_cls: type) -> list[tuple[str, type]]:
    """``[(section, its dataclass), ...]`` of ``Config`` in declaration order."""
    hints = typing.get_type_hints(cfg_cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cfg_cls)]


@functools.cache
def field_infos(cfg_cls: type) -> dict[str, FieldInfo]:
    """``{"section.field": FieldInfo}`` for every field of every section of ``cfg_cls`` (``Config``)."""
    choices = _str_choices()
    out: dict[str, FieldInfo] = {}
    for section, cls in sections(cfg_cls):
        hints = typing.get_type_hints(cls)
        docs = field_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            tp = hints[f.name]
            literal = _literal_args(tp)
            out[key] = FieldInfo(key, tp, docs.get(f.name, ""), literal or choices.get(key), BOUNDS.get(key))
    return out


def _literal_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if typing.get_origin(a) is Literal:
                return typing.get_args(a)
    return None


# ---------------------------------------------------------------------------------------------
# "did you mean"
# ---------------------------------------------------------------------------------------------
def suggest(word: str, candidates: Iterable[str], n: int = 2) -> list[str]:
    """The closest few of ``candidates`` to ``word`` (a typo), best first. ``section.field`` names are
    compared by their field part (``optim.lrr`` -> ``optim.lr``; a bare ``lr`` -> ``optim.lr``), those of
    the same section first; other words as a whole."""
    candidates = list(candidates)
    word = word.lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(word, candidates, n=n, cutoff=0.75 if "." in word else 0.6)
    section, _, bare = word.rpartition(".")
    by_name: dict[str, list[str]] = {}
    for c in candidates:
        if "." in c:
            by_name.setdefault(c.rpartition(".")[2], []).append(c)
    for name in difflib.get_close_matches(bare, list(by_name), n=n + 2, cutoff=0.6):
        ranked = sorted(by_name[name], key=lambda c: not c.startswith(section + ".")) if section else by_name[name]
        close += [c for c in ranked if c not in close]
    if section:  # a known section: its own fields first
        close.sort(key=lambda c: not c.startswith(section + "."))
    return close[:n]


def did_you_mean(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean --optim.lr?"`` (or ``""`` when nothing is close)."""
    close = suggest(word, candidates)
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"{prefix}{c}" for c in close) + "?"
