"""What every config field is: its type, choices, default, bounds, resume class and one-line help, read from the
config classes (each field is declared once, ``data/declare.py``).

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
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from data.declare import MAX_HYPOTHESES, Bounds, Declaration, Resume, declaration, default_of


# ---------------------------------------------------------------------------------------------
# Bounds: every numeric field's range, declared with the field (data/declare.py) and applied to every source of a
# value (the command line, --config, a run's config.json, a checkpoint, an export folder's records): `check_bounds`
# on a Config (Config.__post_init__ calls it), `bounded` on one value read from a file.
# ---------------------------------------------------------------------------------------------
@functools.cache
def _declared(cfg_cls: type) -> dict[str, Declaration]:
    """``{"section.field": Declaration}`` of every field of ``cfg_cls`` (``Config``): each must be declared."""
    out = {}
    for section, cls in sections(cfg_cls):
        for f in dataclasses.fields(cls):
            d = declaration(f)
            if d is None:
                raise TypeError(f"{section}.{f.name} ({cls.__name__}) is not declared: write it with "
                                f"data.declare.declare(default, resume class, bounds) (docs/ARCHITECTURE.md)")
            out[f"{section}.{f.name}"] = d
    return out


def inf_ok(cfg_cls: type) -> dict[str, str]:
    """Float fields of ``cfg_cls`` where an infinite value has a meaning (the others refuse inf as NaN): ``{key:
    meaning}``."""
    return {k: d.bounds.inf_ok for k, d in _declared(cfg_cls).items() if d.bounds is not None and d.bounds.inf_ok}


def missing_default(cfg_cls: type, name: str) -> Any:
    """What field ``name`` (``section.field``) of ``cfg_cls`` held in a run written before it existed: its declared
    default (the behaviour of the code before the field was added); ``dataclasses.MISSING`` for one with no default."""
    section, _, key = name.partition(".")
    return default_of({f.name: f for f in dataclasses.fields(dict(sections(cfg_cls))[section])}[key])


def _numbers(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def bounds_problem(key: str, value: Any, b: Bounds | None) -> str | None:
    """Why ``value`` of field ``key`` is outside its bounds ``b`` (None: within, or no bounds, or None / not a number:
    the type check says that)."""
    if b is None:
        return None
    for v in _numbers(value):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")) and not (b.inf_ok and v > 0)):
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
        problem = bounds_problem(info.key, getattr(getattr(cfg, info.section), info.name), info.bounds)
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
    if check_type(value, tp):
        return None
    choices = _literal_args(tp)
    if choices is not None and isinstance(value, str):
        return f"is not one of {list(choices)}" + did_you_mean(value, [str(c) for c in choices])
    return f"is not {article(type_name(tp))}"


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
    resume: Resume | None = None  # whether a resume may change it (data/declare.py)
    was: tuple[Any, ...] = ()  # (the default before it changed,) or ()

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
    out: dict[str, FieldInfo] = {}
    for section, cls in sections(cfg_cls):
        hints = typing.get_type_hints(cls)
        docs = field_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            tp = hints[f.name]
            literal = _literal_args(tp)
            d = _declared(cfg_cls)[key]
            out[key] = FieldInfo(key, tp, docs.get(f.name, ""), literal, d.bounds, d.resume, d.was)
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
