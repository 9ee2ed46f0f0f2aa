"""Every config field's bounds by its key (``"section.field"``), for a value that comes without its Config: a
checkpoint's config section, an export folder's records, a decoding flag, a resource used on this machine.

The bounds are declared with each field (``data/declare.py``); ``train/fields.py`` reads them from a Config class,
and this module binds them to ``train.config.Config`` (which imports ``train.fields``, so that module cannot):

    BOUNDS, INF_OK                       the tables, ``{key: Bounds}`` and ``{key: what inf means}``
    bounded(key, value, where, tp)       ``value`` if it has type ``tp`` and lies within its bounds, else ValueError
    check_section(cls, section, values)  `bounded` for every field of one section read from a file
    machine_capped(key, value, log)      a resource field capped by the cores this process may use
"""

from __future__ import annotations

import os
import typing
from typing import Any

from train.config import Config
from train.fields import _cut, bounds_problem, field_infos, inf_ok, type_problem

BOUNDS = {k: info.bounds for k, info in field_infos(Config).items() if info.bounds is not None}
INF_OK = inf_ok(Config)


def bounded(key: str, value: Any, where: str, tp: Any = None) -> Any:
    """``value`` of field ``key`` read from a file (a checkpoint's config, an export's record), if it has type ``tp``
    (the field's annotation; None: not checked) and lies within the field's bounds; else ``ValueError`` naming
    ``where``, the field and the value."""
    if tp is not None:
        problem = type_problem(value, tp)
        if problem:
            raise ValueError(f"{where}: {key}={_cut(value)} {problem}")
    problem = bounds_problem(key, value, BOUNDS.get(key))
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

