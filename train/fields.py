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
            out[key] = FieldInfo(key, tp, docs.get(f.name, ""), literal or choices.get(key))
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
