"""LayerNorm providers of ``bench.kernels``: ``y = GELU(LayerNorm(x + r))`` returning ``(y, s = x + r)``:
``ours`` (fused Triton), ``eager`` and ``compile`` (of the reference). Counted: the fewest bytes moved."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench import harness as H
from bench.cases import Case, LNInputs, make_ln_inputs
from bench.registry import Op, Prepared, compiled, register, register_op

LN_EPS = 1e-5
GROUPS = ("ln",)


def reference(case: Case, d: LNInputs) -> torch.Tensor:
    from kernels import layer_norm_reference

    with torch.no_grad():
        y, _ = layer_norm_reference(d.x.detach().float(), d.w.detach().float(), d.b.detach().float(),
                                    d.r.detach().float(), eps=LN_EPS, activation="gelu")
    return y


def work(case: Case, mode: str, d, dtype: torch.dtype) -> dict[str, float]:
    elem = torch.empty((), dtype=dtype).element_size()
    return {"bytes": H.layer_norm_bytes(case.rows, case.width, mode=mode, elem_bytes=elem)}


def columns(case: Case, d) -> dict[str, Any]:
    return {"rows": case.rows, "width": case.width, "tokens": case.rows}


register_op(Op("layernorm", lambda case, dtype, device, opts: make_ln_inputs(case, dtype, device), reference,
               work, columns, table=("LayerNorm+residual+GELU {mode}: GB/s", "gbps")))


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
