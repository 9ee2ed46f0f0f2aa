"""Fused RMSNorm(+residual)(+GELU): the LayerNorm kernels with ``IS_RMS_NORM``, against the reference.

Same accuracy rule as tests/kernels/test_layernorm.py (kernel error vs the fp64 reference <= 2x / 3x PyTorch's
same-dtype error, a tiny floor), same inputs, NaN-poisoned outputs; small shapes under the interpreter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.layernorm import RMSNorm, layer_norm_reference, rms_norm
from tests.kernels.test_layernorm import BF16, DEVICE, F16, F32, SHORT, assert_within_torch_error, make_inputs


@pytest.fixture(autouse=True)
def _poison_outputs(poison, monkeypatch):
    monkeypatch.delenv("FASTMT_NORM_BACKEND", raising=False)


def run(x, r, w, b, dy, ds, activation, impl):
    """Forward + backward of RMSNorm: {"y", "dx", "dw"} plus "s", "dr" and "db" when given."""
    x_, r_, w_, b_ = (t.detach().clone().requires_grad_() if t is not None else None for t in (x, r, w, b))
    if impl == "triton":
        y, s = rms_norm(x_, w_, b_, r_, activation=activation, return_residual=True, backend="triton")
    else:
        y, s = layer_norm_reference(x_, w_, b_, r_, activation=activation, upcast=False, is_rms_norm=True)
    outs, grads = ([y, s], [dy, ds]) if r is not None else ([y], [dy])
    torch.autograd.backward(outs, grads)
    res = {"y": y, "dx": x_.grad, "dw": w_.grad}
    res.update({"s": s, "dr": r_.grad} if r is not None else {})
    res.update({"db": b_.grad} if b is not None else {})
    return {k: v.detach() for k, v in res.items()}


def errors(inputs, activation):
    truth = run(*(t.double() if t is not None else None for t in inputs), activation, "torch")
    same, ours = run(*inputs, activation, "torch"), run(*inputs, activation, "triton")
    out = {}
    for name, ref in truth.items():
        assert ours[name].dtype == same[name].dtype and ours[name].shape == ref.shape, name
        assert torch.isfinite(ours[name]).all(), f"{name} has non-finite (unwritten/poisoned) elements"
        out[name] = ((ours[name].double() - ref).abs().max().item(), (same[name].double() - ref).abs().max().item(),
                     ref.abs().max().item())
    return out


def case(rows, N, dtype, residual, bias, act):
    cid = f"R{rows}-N{N}-{SHORT[dtype]}-{'res' if residual else 'nores'}-{'bias' if bias else 'nobias'}-{act or 'noact'}"
    return pytest.param(rows, N, dtype, residual, bias, act, id=cid)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows, N, dtype, residual, bias, act", [
    case(37, 1000, F32, True, False, None), case(37, 1000, BF16, False, False, "gelu"),
    case(3, 7, F16, True, True, "gelu_tanh"), case(1, 1, F32, False, False, None), case(16, 1024, BF16, True, False, None),
])
def test_forward_and_gradients_against_the_reference(rows, N, dtype, residual, bias, act):
    inputs = make_inputs(rows, N, dtype, residual=residual, bias=bias)
    assert_within_torch_error(errors(inputs, act), dtype)


@pytest.mark.interpreter
def test_reference_is_torch_rms_norm_and_differs_from_layer_norm():
    x, _, w, *_ = make_inputs(5, 33, F32, residual=False, bias=False)  # rows with a non-zero mean
    y, _ = layer_norm_reference(x, w, eps=1e-5, is_rms_norm=True)
    torch.testing.assert_close(y, F.rms_norm(x, (33,), w, 1e-5))
    ours = rms_norm(x, w, backend="triton")
    torch.testing.assert_close(ours, y, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, layer_norm_reference(x, w)[0], atol=1e-2)  # the mean is not subtracted


@pytest.mark.interpreter
def test_stats_hold_a_zero_mean_and_the_rms():
    x, _, w, *_ = make_inputs(4, 16, F32, residual=False, bias=False)
    _, _, stats = torch.ops.fastmt.rms_norm_fwd(x, w, None, None, 1e-5, "none")
    torch.testing.assert_close(stats[0], torch.zeros(4, device=DEVICE))
    torch.testing.assert_close(stats[1], torch.rsqrt(x.pow(2).mean(-1) + 1e-5))


@pytest.mark.interpreter
@pytest.mark.parametrize("residual, bias, act", [(True, False, "gelu"), (False, True, "none")], ids=["res-gelu", "bias"])
def test_opcheck(residual, bias, act):
    x, r, w, b, dy, ds = make_inputs(3, 8, F32, residual=residual, bias=bias)
    args = [t.requires_grad_() if t is not None else None for t in (x, w, b, r)]
    torch.library.opcheck(torch.ops.fastmt.rms_norm_fwd.default, (*args, 1e-5, act))
    x, r, w, b = (t.detach() if t is not None else None for t in (x, r, w, b))
    y, s, stats = torch.ops.fastmt.rms_norm_fwd(x, w, b, r, 1e-5, act)
    torch.library.opcheck(torch.ops.fastmt.rms_norm_bwd.default, (dy, ds, s if residual else x, w, b, stats, act))


@pytest.mark.interpreter
def test_compile_fullgraph_matches_eager():
    x, r, w, _, dy, _ = make_inputs(6, 24, F32, bias=False)

    def f(x, r, w):
        y, s = rms_norm(x, w, residual=r, activation="gelu", return_residual=True, backend="triton")
        return y * 2 + s

    leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
    eager = f(*leaves)
    eager.backward(dy)
    leaves_c = [t.detach().clone().requires_grad_() for t in (x, r, w)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves_c)
    compiled.backward(dy)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(leaves, leaves_c):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.interpreter
def test_model_rmsnorm_runs_fused_with_the_torch_modules_parameters(monkeypatch):
    """``model.norm_kind rmsnorm`` on ``model.norm fused``: the kernels, computing what nn.RMSNorm does."""
    from types import SimpleNamespace

    from models import components as C

    monkeypatch.setenv("FASTMT_NORM_BACKEND", "triton")  # the kernels on CPU tensors (interpreter)
    fused = C.norm_for(SimpleNamespace(norm="fused", norm_kind="rmsnorm"), 24, activation="gelu")
    torch_ = C.norm_for(SimpleNamespace(norm="torch", norm_kind="rmsnorm"), 24, activation="gelu")
    assert isinstance(fused, RMSNorm)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in torch_.named_parameters()] == ["weight"]
    with torch.no_grad():
        fused.weight.normal_()
    torch_.load_state_dict(fused.state_dict())
    x, r = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    (y, s), (y_t, s_t) = fused(x, r), torch_(x, r)
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_t)
    torch.testing.assert_close(fused.plain(s), torch_.plain(s))
