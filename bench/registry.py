"""The provider registry of ``bench.kernels``: which implementations of an op a case group runs.

An op registers its inputs, fp32 reference and counted work (`register_op`), and, when it is not one of the
built-in case groups of bench/cases.py, its own cases and report table (``Op.cases``, ``Op.table``); each
implementation a ``prepare`` (`register`). `load` imports them and any ``--provider-module``: a new provider is
benchmarked without editing ``bench/``, a new op by its own ``bench/<op>.py`` listed in ``OP_MODULES``."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

OP_MODULES = ("bench.attention", "bench.layernorm")


class Unsupported(RuntimeError):
    """A provider that cannot run this case by design (recorded as status 'unsupported')."""


@dataclass
class Prepared:
    """One provider on one case's inputs: the forward and how to check and differentiate it."""

    fn: Callable[[], Any]  # the forward; returns a tensor or a tuple of tensors
    leaves: tuple[torch.Tensor, ...]  # inputs whose .grad is reset between repetitions
    check: Callable[[torch.Tensor], torch.Tensor]  # first output -> the layout of the op's reference
    note: str = ""
    setup_ms: float = float("nan")  # per-batch structures built once, outside the timing (Flex block mask)
    extra: dict[str, Any] = field(default_factory=dict)  # more row columns (e.g. the SDPA backend that ran)


@dataclass(frozen=True)
class Op:
    """What the runner needs to know about a benchmarked op, whatever the provider."""

    name: str
    make_inputs: Callable[..., Any]  # (case, dtype, device, opts) -> inputs
    reference: Callable[[Any, Any], torch.Tensor]  # (case, inputs) -> fp32 reference slice
    work: Callable[..., dict[str, float]]  # (case, mode, inputs, dtype) -> {"flops"|"bytes", "floor_bytes"?}
    columns: Callable[[Any, Any], dict[str, Any]]  # (case, inputs or None) -> descriptive row columns
    cases: Callable[[bool], list] | None = None  # (smoke) -> the op's own bench.cases.Case list (None: built-in)
    table: tuple[str, str] | None = None  # (title, metric column) of the report's per-mode pivot, e.g. GB/s


@dataclass(frozen=True)
class Provider:
    op: str
    name: str
    groups: tuple[str, ...]  # case groups it runs on
    prepare: Callable[..., Prepared]  # (case, inputs, opts) -> Prepared
    triton: bool = False  # our Triton kernels: skipped on CPU unless --cpu-triton
    env: Mapping[str, str] = field(default_factory=dict)  # environment set while it runs


_OPS: dict[str, Op] = {}
_PROVIDERS: list[Provider] = []


def register_op(op: Op) -> Op:
    if op.name in _OPS and _OPS[op.name] != op:
        raise ValueError(f"op {op.name!r} is registered twice ({_OPS[op.name].make_inputs} and {op.make_inputs})")
    _OPS[op.name] = op
    return op


def register(op: str, name: str, *, groups: Sequence[str], triton: bool = False,
             env: Mapping[str, str] | None = None) -> Callable:
    """Decorator: ``prepare`` serves provider ``name`` of ``op`` on the case ``groups``.

    A name may be registered several times for disjoint groups (one prepare per input layout)."""
    def deco(prepare: Callable[..., Prepared]) -> Callable[..., Prepared]:
        clash = [g for p in _PROVIDERS if (p.op, p.name) == (op, name) and p.prepare is not prepare
                 for g in p.groups if g in groups]
        if clash:
            raise ValueError(f"provider {op}/{name} is already registered for groups {clash}")
        if not any(p.prepare is prepare and (p.op, p.name) == (op, name) for p in _PROVIDERS):
            _PROVIDERS.append(Provider(op, name, tuple(groups), prepare, triton, dict(env or {})))
        return prepare

    return deco


def load(modules: Sequence[str] = ()) -> None:
    """Import the op modules (they register at import) and ``modules`` (extra providers)."""
    for m in (*OP_MODULES, *modules):
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ImportError(f"--provider-module {m!r} cannot be imported: {e}; give a module path "
                              "importable from the repository root, e.g. mypkg.my_providers") from e


_COMPILED: dict[tuple[str, str, Any], Callable] = {}


def compiled(name: str, fn: Callable, backend: str, dynamic: bool | None) -> Callable:
    """One torch.compile wrapper per (function, backend, dynamic) for the whole run (its cache persists)."""
    key = (name, backend, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=dynamic)
    return _COMPILED[key]


def op(name: str) -> Op:
    if name not in _OPS:
        raise KeyError(f"no op {name!r} registered; known: {sorted(_OPS)} (call bench.registry.load() first)")
    return _OPS[name]


def ops() -> list[Op]:
    """The registered ops, in registration order."""
    return list(_OPS.values())


def providers(op_name: str | None = None, group: str | None = None) -> list[Provider]:
    """Registered providers in registration order, optionally those of one op and case group."""
    return [p for p in _PROVIDERS if (op_name is None or p.op == op_name) and (group is None or group in p.groups)]


def names(op_name: str | None = None, group: str | None = None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.name for p in providers(op_name, group)))


def get(op_name: str, name: str, group: str) -> Provider:
    for p in providers(op_name, group):
        if p.name == name:
            return p
    raise KeyError(f"no provider {name!r} for {op_name} cases of group {group!r}; "
                   f"registered there: {names(op_name, group)}")
