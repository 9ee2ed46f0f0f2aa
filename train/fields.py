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

from data.declare import (
    CONFIG_FORMAT,
    FORMAT_KEY,
    MAX_HYPOTHESES,
    Bounds,
    Declaration,
    Resume,
    declaration,
    default_of,
)


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
    since: int = 1  # the config format the field appeared in (data/declare.py: FORMATS)

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
# Field provenance: which fields a config record (a run's config.json, a checkpoint's config) may lack, judged by the
# config format it was written in (data/declare.py: CONFIG_FORMAT, each field's ``since``). The one reader of a
# record's missing fields for train (--config, --resume, --init-from), translate, evaluate and export.
# ---------------------------------------------------------------------------------------------
def config_record(cfg) -> dict[str, Any]:
    """What fastmt writes of a ``Config`` (config.json, a checkpoint's ``config``, ``--print-config``): its sections
    and the format they were written in."""
    return {FORMAT_KEY: CONFIG_FORMAT, **cfg.to_dict()}


def record_format(cfg_cls: type, d: dict[str, Any], where: str) -> int:
    """The config format record ``d`` was written in: the one it names (``"format"``), and at least the newest
    ``since`` of the fields it holds (a record written before formats were recorded names none). A named format that
    is not a whole number in 1..`CONFIG_FORMAT` is refused (``ValueError`` naming ``where``)."""
    named = 1
    if FORMAT_KEY in d:
        named = d[FORMAT_KEY]
        if type(named) is not int or named < 1:
            raise ValueError(f"{where}: \"{FORMAT_KEY}\": {_cut(named)} is not a config format (fastmt writes a whole "
                             f"number, 1 to {CONFIG_FORMAT}): a damaged or hand-edited record; restore the file fastmt "
                             f"wrote, or drop the key from a hand-written --config")
        if named > CONFIG_FORMAT:
            raise ValueError(f"{where}: written in config format {named}, newer than this fastmt's {CONFIG_FORMAT} (its "
                             f"fields may mean what this fastmt cannot know): read it with the fastmt that wrote it, "
                             f"or update fastmt")
    held = [info.since for info in field_infos(cfg_cls).values()
            if isinstance(d.get(info.section), dict) and info.name in d[info.section]]
    return max([named, *held])


def provenance(cfg_cls: type, d: dict[str, Any], where: str, *, others: Iterable[tuple[str, Any]] = (),
               only: Iterable[str] | None = None, fill_new: bool = True, fix: str = "",
               log=None) -> dict[str, Any]:
    """Config record ``d`` (read from ``where``) with the fields it lacks filled by their provenance, and its format
    (``"format"``: the one it was written in, `record_format`):

    - a value another record of the same run holds (``others``: ``(where, record)`` pairs, e.g. the checkpoint of a
      run's config.json) is taken, typed and bounded as its declaration says, said in one line to ``log``;
    - else a field newer than ``d`` (``since`` > its format) did not exist when it was written: its declared default
      (``fill_new``; else it is left out, for ``train.runs.resume.compare_configs`` to record), said in one line;
    - else (a field that existed then, or one with no default) ``ValueError``: one line naming ``where``, the
      fields, the format and ``fix``.

    ``only``: these sections only (the others are returned as they are). Nothing else is checked here."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a config is a JSON object of sections, got {type(d).__name__}")
    version = record_format(cfg_cls, d, where)
    sections_only = None if only is None else set(only)
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    out[FORMAT_KEY] = version
    others = [(w, o) for w, o in others if isinstance(o, dict)]
    taken, defaulted, lacking = {}, {}, []
    for key, info in field_infos(cfg_cls).items():
        section, name = info.section, info.name
        if sections_only is not None and section not in sections_only:
            continue
        values = out.setdefault(section, {})
        if not isinstance(values, dict):
            raise ValueError(f"{where}: {section} must be an object of fields, got {type(values).__name__}: "
                             f"{_cut(values)}")
        if name in values:
            continue
        held = next(((w, o[section][name]) for w, o in others
                     if isinstance(o.get(section), dict) and name in o[section]), None)
        if held is not None:
            w, value = held
            problem = type_problem(value, info.type) if info.type is not None else None
            if problem:
                raise ValueError(f"{w}: {key}={_cut(value)} {problem}")
            problem = bounds_problem(key, value, info.bounds)
            if problem:
                raise ValueError(f"{w}: {problem}")
            values[name] = value
            taken[key] = (w, value)
            continue
        default = missing_default(cfg_cls, key)
        if info.since > version and default is not dataclasses.MISSING:
            defaulted[key] = json_value(default)
            if fill_new:
                values[name] = default
            continue
        lacking.append(key)
    if lacking:
        shown = ", ".join(f"{k} (format {field_infos(cfg_cls)[k].since})" for k in lacking[:4])
        more = f" and {len(lacking) - 4} more" if len(lacking) > 4 else ""
        elsewhere = (f"; no other record of the run holds {'it' if len(lacking) == 1 else 'them'} ("
                     + ", ".join(w for w, _ in others) + ")") if others else ""
        raise ValueError(f"{where}: written in config format {version}, it lacks {shown}{more}, which that format "
                         f"always records{elsewhere}: a damaged or hand-edited record, not taken as a default"
                         + (f"; {fix}" if fix else ""))
    if log is not None and taken:
        log(f"{where} lacks " + ", ".join(f"{k}={v!r} (from {w})" for k, (w, v) in taken.items())
            + ": taken from the run's other record (a value the run recorded wins over a default)")
    if log is not None and defaulted and fill_new:
        log(defaulted_line(where, version, defaulted))
    return out


def defaulted_line(where: str, version: int, defaulted: dict[str, Any]) -> str:
    """The one line that says which fields a record written before they existed lacks, and the defaults taken."""
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted(defaulted.items()))
    return (f"{where} was written in config format {version} (an earlier fastmt) and lacks {shown}: taken as declared "
            f"(newer fields; the defaults, what that fastmt did)")


def json_value(value: Any) -> Any:
    """``value`` as a JSON record holds it (tuples as lists)."""
    import json

    return json.loads(json.dumps(value, default=str))


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
            out[key] = FieldInfo(key, tp, docs.get(f.name, ""), literal, d.bounds, d.resume, d.was, d.since)
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
