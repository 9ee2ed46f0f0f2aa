"""Register data flow in PTX text: which instructions compute a difference with a given value, and whether the
compiler contracted it into a multiply-add.

Why: on the GPU ``a * b - c`` may run as ``fma(a, b, -c)``, one rounding instead of two. Where the math needs
``a * b - c`` to be exactly 0 because ``c`` was computed from the same rounded product (a row mean of one
element, LayerNorm's backward with one column), the fused form leaves the product's rounding error instead.
Two compilers may fuse: LLVM (an ``fma.rn.f32`` in the PTX) and ptxas (a plain ``mul.f32`` followed by a plain
``add.f32``/``sub.f32`` may become one FFMA; an instruction with an explicit rounding mode, ``mul.rn.f32``, is
never fused: PTX ISA, "Floating-point instructions: mul"). Pure text processing: no GPU, no Triton.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+([^;]*);", re.M)
_COPIES = ("mov.f32", "mov.b32", "neg.f32")  # a value passed on unchanged (or negated: a difference stays one)


@dataclass(frozen=True)
class Instruction:
    op: str  # e.g. "fma.rn.f32"
    dst: str | None  # first operand when it is a register
    srcs: tuple[str, ...]


def parse(ptx: str) -> list[Instruction]:
    """Every instruction of the PTX text (inline-asm bodies included), in order."""
    out = []
    for m in _INSTRUCTION.finditer(ptx):
        operands = [o.strip() for o in m.group(2).split(",")]
        dst = operands[0] if operands and operands[0].startswith("%") else None
        out.append(Instruction(m.group(1), dst, tuple(operands[1:] if dst else operands)))
    return out


def _producers(code: list[Instruction]) -> dict[str, Instruction]:
    return {i.dst: i for i in code if i.dst}


def _origin(reg: str, producers: dict[str, Instruction]) -> Instruction | None:
    """The instruction that computed ``reg``, looking through copies and negations."""
    for _ in range(16):
        inst = producers.get(reg)
        if inst is None or inst.op not in _COPIES:
            return inst
        reg = inst.srcs[0]
    return None


def _aliases(regs: set[str], code: list[Instruction]) -> set[str]:
    """``regs`` plus every register that copies or negates one of them (transitively)."""
    out = set(regs)
    grew = True
    while grew:
        grew = False
        for i in code:
            if i.op in _COPIES and i.dst and i.srcs and i.srcs[0] in out and i.dst not in out:
                out.add(i.dst)
                grew = True
    return out


@dataclass(frozen=True)
class Differences:
    """How the differences ``x - c`` with the values ``c`` of interest were compiled."""

    exact: int  # add/sub whose other operand is not a plain product: x is one rounded value
    fused_by_llvm: list[str]  # fma.rn.f32 with c (or -c) as its addend: x * y - c in one rounding
    fusable_by_ptxas: list[str]  # plain add/sub whose other operand is a plain mul.f32: ptxas may fuse them


def differences_with(values_of: str, ptx: str) -> Differences:
    """Classify every subtraction (or addition of a negation) of a value produced by an instruction ``values_of``
    (e.g. ``"div.rn.f32"``: the row means) in the PTX. An ``fma`` that takes such a value as a multiplicand is
    a product, not a difference, and is not counted."""
    code = parse(ptx)
    producers = _producers(code)
    values = _aliases({i.dst for i in code if i.op == values_of and i.dst}, code)
    exact, fused, fusable = 0, [], []
    for i in code:
        if i.op.startswith("fma.") and len(i.srcs) == 3 and i.srcs[2] in values:
            fused.append(f"{i.op} {i.dst}, {', '.join(i.srcs)}")
        elif i.op in ("add.f32", "sub.f32", "add.rn.f32", "sub.rn.f32") and any(s in values for s in i.srcs):
            other = [s for s in i.srcs if s not in values]
            origin = _origin(other[0], producers) if other else None
            if i.op in ("add.f32", "sub.f32") and origin is not None and origin.op == "mul.f32":
                fusable.append(f"{i.op} {i.dst}, {', '.join(i.srcs)} <- {origin.op} {', '.join(origin.srcs)}")
            else:
                exact += 1
    return Differences(exact, fused, fusable)


def sass_ops(sass: str, prefix: str) -> int:
    """How many SASS instructions (nvdisasm output) start with ``prefix`` (e.g. "FFMA", "FMUL")."""
    return len(re.findall(rf"\b{re.escape(prefix)}\b", sass))
