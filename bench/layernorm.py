"""LayerNorm providers of ``bench.kernels``: ``y = GELU(LayerNorm(x + r))`` returning ``(y, s = x + r)``:
``ours`` (fused Triton), ``eager`` and ``compile`` (of the reference). Counted: the fewest bytes moved.
The ``rmsnorm`` op (``y = RMSNorm(x + r) * w``, no bias) owns its cases (group "rms") and table here too."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from bench import harness as H
from bench import registry
from bench.cases import Case, LNInputs, make_ln_inputs
from bench.registry import Op, Prepared, compiled, register, register_op

LN_EPS = 1e-5
GROUPS = ("ln",)


def reference(case: Case, d: LNInputs, rms: bool = False) -> torch.Tensor:
    from kernels import layer_norm_reference

    kw = {"is_rms_norm": True} if rms else {"activation": "gelu"}
    with torch.no_grad():
        y, _ = layer_norm_reference(d.x.detach().float(), d.w.detach().float(), None if rms else d.b.detach().float(),
                                    d.r.detach().float(), eps=LN_EPS, **kw)
    return y


def work(case: Case, mode: str, d, dtype: torch.dtype, bias: bool = True) -> dict[str, float]:
    elem = torch.empty((), dtype=dtype).element_size()
    return {"bytes": H.layer_norm_bytes(case.rows, case.width, mode=mode, elem_bytes=elem, bias=bias)}


def columns(case: Case, d) -> dict[str, Any]:
    return {"rows": case.rows, "width": case.width, "tokens": case.rows}


def inputs(case: Case, dtype: torch.dtype, device, opts) -> LNInputs:
    return make_ln_inputs(case, dtype, device)


register_op(Op("layernorm", inputs, reference, work, columns, table=("LayerNorm+residual+GELU {mode}: GB/s", "gbps")))


def _rows(out: torch.Tensor) -> torch.Tensor:
    return out


@register("layernorm", "ours", groups=GROUPS, triton=True)
def ours(case: Case, d: LNInputs, opts) -> Prepared:
    import kernels

    return Prepared(lambda: kernels.layer_norm(d.x, d.w, d.b, d.r, eps=LN_EPS, activation="gelu",
                                               return_residual=True, backend="triton"), (d.x, d.r, d.w, d.b), _rows)


def _eager(x, w, b, r):
    s = x + r
    return F.gelu(F.layer_norm(s, (s.shape[-1],), w, b, LN_EPS)), s


@register("layernorm", "eager", groups=GROUPS)
def eager(case: Case, d: LNInputs, opts) -> Prepared:
    return Prepared(lambda: _eager(d.x, d.w, d.b, d.r), (d.x, d.r, d.w, d.b), _rows,
                    note="add + F.layer_norm + F.gelu")


@register("layernorm", "compile", groups=GROUPS)
def compile_(case: Case, d: LNInputs, opts) -> Prepared:
    from kernels import layer_norm_reference

    fn = compiled("layer_norm_reference", layer_norm_reference, opts.compile_backend, False)
    return Prepared(lambda: fn(d.x, d.w, d.b, d.r, eps=LN_EPS, activation="gelu"), (d.x, d.r, d.w, d.b), _rows,
                    note=f"torch.compile(layer_norm_reference, backend={opts.compile_backend}, dynamic=False)")


# -- RMSNorm (``IS_RMS_NORM`` on the same kernels): its own op, cases and report table --------------------------
def rms_cases(smoke: bool) -> list[Case]:
    shapes = [(64, 32)] if smoke else [(16384, 512), (32768, 1024)]
    return [Case("rmsnorm", "rms", registry.names("rmsnorm", "rms"), rows=rows, width=width, seed=rows + width,
                 name=f"rms-R{rows}-N{width}") for rows, width in shapes]


register_op(Op("rmsnorm", inputs, functools.partial(reference, rms=True), functools.partial(work, bias=False),
               columns, cases=rms_cases, table=("RMSNorm+residual {mode}: GB/s", "gbps")))


@register("rmsnorm", "ours", groups=("rms",), triton=True)
def rms_ours(case: Case, d: LNInputs, opts) -> Prepared:
    from kernels.layernorm import rms_norm

    return Prepared(lambda: rms_norm(d.x, d.w, None, d.r, eps=LN_EPS, return_residual=True, backend="triton"),
                    (d.x, d.r, d.w), _rows)


def _rms_eager(x, w, r):
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, LN_EPS), s


@register("rmsnorm", "eager", groups=("rms",))
def rms_eager(case: Case, d: LNInputs, opts) -> Prepared:
    return Prepared(lambda: _rms_eager(d.x, d.w, d.r), (d.x, d.r, d.w), _rows, note="add + F.rms_norm")


@register("rmsnorm", "compile", groups=("rms",))
def rms_compile(case: Case, d: LNInputs, opts) -> Prepared:
    fn = compiled("rms_eager", _rms_eager, opts.compile_backend, False)
    return Prepared(lambda: fn(d.x, d.w, d.r), (d.x, d.r, d.w), _rows,
                    note=f"torch.compile(add + F.rms_norm, backend={opts.compile_backend}, dynamic=False)")
