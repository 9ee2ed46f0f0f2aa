"""Typed ``section.field`` overrides for nested dataclass configs (no torch, no data/models imports).

``apply_overrides(cfg, {"optim.lr": "3e-4"})`` parses each string against the field's annotation
(int, float, bool, str, Literal, Optional, tuple), rejects unknown sections/fields with the list of
valid names, and rebuilds each section with ``dataclasses.replace`` so ``__post_init__`` validation
runs again.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

# ---------------------------------------------------------------------------------------------


def resolved_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_value(text: str, tp: Any, where: str) -> Any:
    """Parse a command-line string as annotation ``tp``; ``where`` names the field in errors."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(text, a, where)
            except ValueError:
                pass
        raise ValueError(f"{where}: cannot parse {text!r} as {_type_name(tp)}")
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(f"{where}: {text!r} is not one of {list(args)}")
    if origin in (tuple, list):
        parts = [p for p in text.replace(",", " ").split() if p]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            vals = [parse_value(p, args[0], where) for p in parts]
        elif origin is tuple:
            if len(parts) != len(args):
                raise ValueError(f"{where}: expected {len(args)} comma-separated values, got {text!r}")
            vals = [parse_value(p, a, where) for p, a in zip(parts, args)]
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
            return float(text)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not a float") from None
    if tp is str or tp is Any:
        return text
    raise ValueError(f"{where}: fields of type {_type_name(tp)} cannot be set from the command line")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(value: Any, tp: Any) -> bool:
    """Loose isinstance against an annotation, for values loaded from JSON/checkpoints."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (tuple, list):
        return isinstance(value, (tuple, list))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def build_dataclass(cls, values: dict[str, Any], section: str):
    """``cls(**values)`` for values loaded from JSON/checkpoints: unknown keys and wrong types fail."""
    hints = resolved_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown field(s) {[f'{section}.{u}' for u in unknown]}; valid: {names}")
    kwargs = {}
    for k, v in values.items():
        tp = hints[k]
        if typing.get_origin(tp) is tuple and isinstance(v, list):
            v = tuple(v)
        if not _check_type(v, tp):
            raise TypeError(f"{section}.{k}={v!r} is not a {_type_name(tp)}")
        kwargs[k] = v
    return cls(**kwargs)


def field_names(cfg) -> list[str]:
    """All overridable ``section.field`` names."""
    return [
        f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))
    ]


def apply_overrides(cfg, overrides: dict[str, str]):
    """Return a new config with ``{"optim.lr": "3e-4", ...}`` applied; validates types and values."""
    per_section: dict[str, dict[str, Any]] = {}
    sections = {f.name for f in dataclasses.fields(cfg)}
    for key, text in overrides.items():
        section, _, name = key.partition(".")
        if section not in sections or not name:
            raise ValueError(
                f"unknown option --{key}: options are --<section>.<field> with section in {sorted(sections)}, "
                f"e.g. --optim.lr 3e-4; valid fields: {field_names(cfg)}"
            )
        obj = getattr(cfg, section)
        hints = resolved_hints(type(obj))
        if name not in hints or name not in {f.name for f in dataclasses.fields(obj)}:
            valid = [f"{section}.{f.name}" for f in dataclasses.fields(obj)]
            raise ValueError(f"unknown field --{key}; valid fields of {section!r}: {valid}")
        per_section.setdefault(section, {})[name] = parse_value(text, hints[name], f"--{key}")
    new = {}
    for section, changes in per_section.items():
        # dataclasses.replace re-runs __post_init__, so value checks (ranges, choices) apply too.
        new[section] = dataclasses.replace(getattr(cfg, section), **changes)
    return dataclasses.replace(cfg, **new)
