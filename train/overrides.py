"""Typed ``section.field`` values for nested dataclass configs (no torch, no data/models imports).

``apply_overrides(cfg, {"optim.lr": "3e-4"})`` parses each command-line string against the field's
annotation (int, float, bool, str, Literal, Optional, tuple), refuses unknown names with the closest valid
ones ("did you mean"), and rebuilds each section with ``dataclasses.replace`` so ``__post_init__``
validation runs again. ``build_dataclass`` does the same for values read from JSON (``--config`` files,
checkpoints). Float values must be finite (NaN never makes sense; inf only where a field's bounds say (``Bounds.inf_ok``)).

Path lists (``data.data_files``, a ``tuple[str, ...]``) are never split on spaces or commas: each
occurrence of the flag is one path (``--data.data_files a.jsonl --data.data_files "b c.jsonl"``), or the
value is a JSON list (``--data.data_files '["a.jsonl", "b c.jsonl"]'``). Tuples of numbers are
comma-separated (``--optim.betas 0.9,0.98``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from train.fields import article, check_type, type_name

# ---------------------------------------------------------------------------------------------


class DuplicateKeyError(ValueError):
    """A JSON config whose object gives one key twice (``json`` would silently keep the last)."""


def unique_keys(where: str | os.PathLike) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """An ``object_pairs_hook`` for ``json.loads`` of a config (``--config``, a run's config.json): each object as a
    dict, a key given twice in one object refused (`DuplicateKeyError`, one line naming the key, both values and
    ``where``) instead of the last one silently winning."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise DuplicateKeyError(f"{where}: the key {_shown(key)} is given twice in one object ({_shown(seen[key])} "
                                        f"and {_shown(value)}); JSON would silently keep the last. Keep one of them")
            seen[key] = value
        return seen

    return hook


def resolved_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_str_tuple(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, Ellipsis)


def parse_value(text: str, tp: Any, where: str, *, choices: Sequence[Any] | None = None,
                inf_ok: bool = False) -> Any:
    """Parse a command-line string as annotation ``tp``; ``where`` names the field in errors.
    ``choices``: the closed set of a str field; ``inf_ok``: a float field where inf has a meaning."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(text, a, where, choices=choices, inf_ok=inf_ok)
            except ValueError as e:
                errors.append(str(e))
        finite = [e for e in errors if "finite" in e or "not one of" in e]
        if finite:  # the value parsed but is not allowed: say why, not "cannot parse"
            raise ValueError(finite[0])
        raise ValueError(f"{where}: cannot parse {text!r} as {type_name(tp)}")
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(f"{where}: {text!r} is not one of {list(args)}{_closest(text, args)}")
    if origin in (tuple, list):
        if _is_str_tuple(tp):  # paths: one per occurrence, or a JSON list; never split
            return tuple(_str_list(text, where))
        parts = [p for p in text.replace(",", " ").split() if p]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            vals = [parse_value(p, args[0], where, inf_ok=inf_ok) for p in parts]
        elif origin is tuple:
            if len(parts) != len(args):
                raise ValueError(f"{where}: expected {len(args)} comma-separated values, got {text!r}")
            vals = [parse_value(p, a, where, inf_ok=inf_ok) for p, a in zip(parts, args)]
        else:
            vals = [parse_value(p, args[0] if args else str, where) for p in parts]
        return tuple(vals) if origin is tuple else vals
    if tp is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: {text!r} is not a bool (true/false)")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not an int") from None
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not a float") from None
        check_finite(value, where, inf_ok=inf_ok)
        return value
    if tp is str or tp is Any:
        if choices is not None and text not in choices:
            raise ValueError(f"{where}: {text!r} is not one of {list(choices)}{_closest(text, choices)}")
        return text
    raise ValueError(f"{where}: fields of type {type_name(tp)} cannot be set from the command line")


def _str_list(text: str, where: str) -> list[str]:
    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: {text!r} starts with '[' but is not a JSON list of strings ({e.msg}); "
                             f"give one path per flag instead") from None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{where}: {text!r} is not a JSON list of strings")
        return value
    return [text]


def _closest(text: str, choices: Sequence[Any]) -> str:
    from train.fields import did_you_mean

    return did_you_mean(text, [str(c) for c in choices])


def check_finite(value: float, where: str, *, inf_ok: bool = False) -> None:
    """Refuse NaN and -inf (and +inf unless ``inf_ok``) for a float setting, naming it."""
    if math.isnan(value) or (math.isinf(value) and not (inf_ok and value > 0)):
        raise ValueError(f"{where}={value} must be a finite number" + (" (or inf)" if inf_ok else ""))


def require_finite(obj, section: str, inf_ok: Mapping[str, str] | Sequence[str] = ()) -> None:
    """``check_finite`` every float-valued field of dataclass ``obj`` (floats inside tuples too);
    ``inf_ok``: ``section.field`` names where inf has a meaning. For ``__post_init__`` methods."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, float):
                check_finite(v, f"{section}.{f.name}", inf_ok=f"{section}.{f.name}" in inf_ok)


def _shown(v: Any, limit: int = 80) -> str:
    """A value as an error message shows it: JSON when it is JSON, cut to ``limit`` characters."""
    text = json.dumps(v) if _jsonable(v) else repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_dataclass(cls, values: dict[str, Any], section: str, *, where: str = "",
                    choices: Mapping[str, Sequence[Any]] | None = None):
    """``cls(**values)`` for values loaded from JSON/checkpoints: unknown keys, wrong types and values outside
    ``choices`` (field -> allowed values) fail, naming the key (and ``where``, e.g. the file) and the closest
    valid key or value."""
    from train.fields import did_you_mean

    at = f"{where}: " if where else ""
    if not isinstance(values, dict):
        raise TypeError(f"{at}{section} must be an object of fields, got {type(values).__name__}: {values!r}")
    hints = resolved_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{at}unknown key {section}.{unknown[0]}"
                         + did_you_mean(f"{section}.{unknown[0]}", [f"{section}.{n}" for n in names]))
    kwargs = {}
    for k, v in values.items():
        tp = hints[k]
        if typing.get_origin(tp) is tuple and isinstance(v, list):
            v = tuple(v)
        shown = _shown(v)
        allowed = (choices or {}).get(k)
        if allowed is not None and isinstance(v, str) and v not in allowed:
            raise ValueError(f"{at}{section}.{k}={shown} is not one of {list(allowed)}"
                             + did_you_mean(v, [str(c) for c in allowed]))
        if not check_type(v, tp):
            raise TypeError(f"{at}{section}.{k}={shown} is not {article(type_name(tp))}")
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{at}{e}") from None


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


# fields a run takes from its tokenizer (train/loop.py): a flag for them would be accepted and then ignored
SET_BY_THE_TOKENIZER = {
    "model.vocab_size": "a run's vocabulary is its tokenizer's; give --data.vocab_size (fastmt model: --vocab N)",
    "model.pad_id": "the tokenizer's padding id (0) is used",
}


def apply_overrides(cfg, overrides: Mapping[str, str | Sequence[str]]):
    """Return a new config with ``{"optim.lr": "3e-4", ...}`` applied; validates names, types and values.

    A value is the flag's text; a list of texts is the flag given several times, which only path lists
    (``tuple[str, ...]`` fields) accept: one path per occurrence."""
    from train.fields import did_you_mean, field_infos

    infos = field_infos(type(cfg))
    per_section: dict[str, dict[str, Any]] = {}
    sections = [f.name for f in dataclasses.fields(cfg)]
    for key, text in overrides.items():
        if key not in infos:
            section = key.partition(".")[0]
            if section not in sections:
                hint = did_you_mean(key, list(infos), prefix="--") or (
                    f"; sections are {', '.join(sections)} (--help-fields lists every field)")
                raise ValueError(f"unknown option --{key}{hint}")
            hint = did_you_mean(key, [k for k in infos if k.startswith(section + ".")], prefix="--")
            raise ValueError(f"unknown field --{key}{hint or f' (--help-fields {section} lists its fields)'}")
        if key in SET_BY_THE_TOKENIZER:
            raise ValueError(f"--{key} cannot be set: {SET_BY_THE_TOKENIZER[key]}")
        info = infos[key]
        texts = [text] if isinstance(text, str) else list(text)
        if len(texts) > 1 and not _is_str_tuple(info.type):
            raise ValueError(f"--{key} given {len(texts)} times ({', '.join(map(repr, texts))}): give it once")
        parsed = [parse_value(t, info.type, f"--{key}", choices=info.choices, inf_ok=bool(info.bounds and info.bounds.inf_ok)) for t in texts]
        value = tuple(p for v in parsed for p in v) if _is_str_tuple(info.type) else parsed[0]
        per_section.setdefault(info.section, {})[info.name] = value
    new = {}
    for section, changes in per_section.items():
        # dataclasses.replace re-runs __post_init__, so value checks (ranges, choices) apply too.
        new[section] = dataclasses.replace(getattr(cfg, section), **changes)
    return dataclasses.replace(cfg, **new)
