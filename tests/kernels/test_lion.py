"""Fused Lion step: the Triton kernel vs the reference vs lion-pytorch, found_inf, tensor lr, the optimizer.

The reference repeats lion-pytorch's ops one by one, so on the same device it matches lion-pytorch
bit for bit (for a python lr). The kernel computes the same roundings except that the interpreter's
fused multiply-add rounds twice (CUDA's rounds once, as PyTorch's ``add(alpha=)``): exp_avg may differ
by one fp32 ulp under the interpreter, and the tolerances below allow exactly that. On CPU the kernel
runs through TRITON_INTERPRET=1 (tests/conftest.py); with CUDA every test builds its tensors there.
"""

from __future__ import annotations

import pytest
import torch

import kernels.lion as kl
from kernels import Lion, lion_step, lion_step_reference
from tests.utils import OpCounter

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SHORT = {F32: "f32", BF16: "bf16", F16: "f16"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = torch.finfo(F32).eps
HYPER = dict(beta1=0.9, beta2=0.99, weight_decay=0.1)


def lion_pytorch():
    """lion-pytorch's ``Lion``, or a skip of the test that compares with it (a bare GPU image lacks the
    package: a module-level import was a collection error, and then no test of this file ran). Only its
    ``use_triton=False`` path is used: its triton variant calls exit() when its triton import fails."""
    return pytest.importorskip("lion_pytorch", reason="lion-pytorch is not installed (make gpu-wheels carries it)").Lion


def rnd(*shape, scale=1.0, dtype=F32, gen):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def assert_within_ulps(got, want, name, ulps=2):
    """|got - want| <= ulps fp32 ulps of want (plus ulps of the largest value, for values near 0)."""
    tol = ulps * EPS
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(), msg=lambda m: f"{name}: {m}")


def three_ways(n, grad_dtype, lr, steps, seed=0, found_inf=None, peer=True):
    """(kernel, reference, lion-pytorch) (param, exp_avg) after ``steps`` steps on the same grads
    (lion-pytorch's pair is None with ``peer=False``)."""
    gen = torch.Generator().manual_seed(seed)
    p0 = rnd(n, gen=gen)
    grads = [rnd(n, dtype=grad_dtype, gen=gen) for _ in range(steps)]
    kern = [p0.clone(), torch.zeros_like(p0)]
    ref = [p0.clone(), torch.zeros_like(p0)]
    param = torch.nn.Parameter(p0.clone())
    lr_value = lr.item() if isinstance(lr, torch.Tensor) else lr
    opt = lion_pytorch()([param], lr=lr_value, betas=(HYPER["beta1"], HYPER["beta2"]),
                         weight_decay=HYPER["weight_decay"], use_triton=False) if peer else None
    for g in grads:
        lion_step(kern[0], g, kern[1], lr=lr, found_inf=found_inf, backend="triton", **HYPER)
        lion_step_reference(ref[0], g, ref[1], lr=lr, found_inf=found_inf, **HYPER)
        if opt is not None:
            param.grad = g.float()
            opt.step()
    return kern, ref, (param.detach(), opt.state[param]["exp_avg"]) if opt is not None else None


# ----------------------------------------------------------------------------------------------
# Kernel vs reference vs lion-pytorch
# ----------------------------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("n", [1, 1000, 1024, 3001], ids=lambda n: f"n{n}")  # < / = / not a multiple of BLOCK
@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16], ids=SHORT.get)
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_kernel_matches_reference_and_lion_pytorch(n, grad_dtype, lr_kind):
    lr = 3e-3 if lr_kind == "float" else torch.tensor(3e-3, device=DEVICE)
    (kp, km), (rp, rm), (pp, pm) = three_ways(n, grad_dtype, lr, steps=4)
    if lr_kind == "float":  # the reference is lion-pytorch's arithmetic, op for op
        assert torch.equal(rp, pp) and torch.equal(rm, pm)
    else:  # 1 - lr * wd rounded in fp32 on the device instead of in double on the host
        assert_within_ulps(rp, pp, "param (tensor lr)", ulps=4)
        torch.testing.assert_close(rm, pm, rtol=0, atol=0)
    assert_within_ulps(km, rm, "exp_avg", ulps=2)
    # every sign agreed (a flipped sign would move param by 2 lr): param within a few ulps
    assert_within_ulps(kp, rp, "param", ulps=4)
    assert not torch.equal(kp, rnd(n, gen=torch.Generator().manual_seed(0)))  # it did move


@pytest.mark.interpreter
def test_zero_and_nan_signs_like_torch_sign():
    """torch.sign gives 0 for 0 and for NaN: such elements only decay; a NaN gradient still poisons
    exp_avg (what ``found_inf`` is for)."""
    p = torch.tensor([1.0, 2.0, -3.0, 4.0], device=DEVICE)
    g = torch.tensor([0.0, float("nan"), 1.0, -1.0], device=DEVICE)
    results = []
    for impl in ("triton", "reference"):
        param, m = p.clone(), torch.zeros_like(p)
        lion_step(param, g, m, lr=0.5, backend=impl, **HYPER)
        results.append((param, m))
    (kp, km), (rp, rm) = results
    assert torch.equal(kp, rp)
    torch.testing.assert_close(km, rm, equal_nan=True, rtol=0, atol=0)
    decayed = p * (1 - 0.5 * 0.1)
    assert torch.equal(kp[:2], decayed[:2]) and torch.isnan(km[1])
    assert torch.equal(kp[2:], decayed[2:] + torch.tensor([-0.5, 0.5], device=DEVICE))


# ----------------------------------------------------------------------------------------------
# found_inf: the device-side skip
# ----------------------------------------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("flag", [torch.tensor(1.0), torch.tensor(True), torch.tensor(float("inf"))],
                         ids=["float-1", "bool-true", "float-inf"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_found_inf_skips_exactly(flag, backend):
    gen = torch.Generator().manual_seed(1)
    p, m = rnd(2049, gen=gen), rnd(2049, scale=0.1, gen=gen)
    g = rnd(2049, gen=gen)
    g[7] = float("nan")  # what found_inf guards against
    param, exp_avg = p.clone(), m.clone()
    lion_step(param, g, exp_avg, lr=torch.tensor(1e-2, device=DEVICE), found_inf=flag.to(DEVICE),
              backend=backend, **HYPER)
    assert torch.equal(param, p) and torch.equal(exp_avg, m)


@pytest.mark.interpreter
@pytest.mark.parametrize("flag", [torch.tensor(0.0), torch.tensor(False)], ids=["float-0", "bool-false"])
def test_found_inf_zero_is_an_ordinary_step(flag):
    (kp, km), (rp, rm), _ = three_ways(1500, BF16, 1e-2, steps=2, found_inf=flag.to(DEVICE), peer=False)
    (kp0, km0), (rp0, rm0), _ = three_ways(1500, BF16, 1e-2, steps=2, peer=False)
    assert torch.equal(kp, kp0) and torch.equal(km, km0) and torch.equal(rp, rp0) and torch.equal(rm, rm0)


# ----------------------------------------------------------------------------------------------
# The reference: O(1) aten ops, no host sync
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("found_inf", [False, True], ids=["plain", "found_inf"])
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_reference_op_count_does_not_depend_on_size(found_inf, lr_kind):
    counts = {}
    for n in (10, 100_000):
        gen = torch.Generator().manual_seed(0)
        p, m, g = rnd(n, gen=gen), rnd(n, gen=gen), rnd(n, dtype=BF16, gen=gen)
        lr = 1e-3 if lr_kind == "float" else torch.tensor(1e-3, device=DEVICE)
        flag = torch.tensor(0.0, device=DEVICE) if found_inf else None
        with OpCounter() as mode:
            lion_step(p, g, m, lr=lr, found_inf=flag, backend="reference", **HYPER)
        counts[n] = mode.ops
    assert counts[10] == counts[100_000]
    assert sum(counts[10].values()) <= 20, counts[10]
    assert not any("_local_scalar_dense" in op or "item" in op for op in counts[10]), counts[10]  # no host sync


# ----------------------------------------------------------------------------------------------
# Validation and dispatch
# ----------------------------------------------------------------------------------------------
def test_validation_messages_name_the_values(monkeypatch):
    p, g, m = (torch.zeros(8, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=r"grad \(4,\) and exp_avg \(8,\) must have param's shape \(8,\)"):
        lion_step(p, g[:4], m, lr=1e-3, **HYPER)
    with pytest.raises(TypeError, match="grad must be a floating-point tensor, got torch.int64"):
        lion_step(p, g.long(), m, lr=1e-3, **HYPER)
    with pytest.raises(TypeError, match="lr must be a float or a 0-d tensor, got list"):
        lion_step(p, g, m, lr=[1e-3], **HYPER)
    with pytest.raises(TypeError, match=r"one floating-point value, got torch.float32 \(2,\)"):
        lion_step(p, g, m, lr=torch.ones(2, device=DEVICE), **HYPER)
    with pytest.raises(ValueError, match="beta1=1.5"):
        lion_step(p, g, m, lr=1e-3, beta1=1.5, beta2=0.99, weight_decay=0.0)
    with pytest.raises(ValueError, match="weight_decay must be >= 0, got -1"):
        lion_step(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=-1)
    with pytest.raises(TypeError, match=r"found_inf must be a one-element tensor or None, got \(2,\)"):
        lion_step(p, g, m, lr=1e-3, found_inf=torch.zeros(2, device=DEVICE), **HYPER)
    with pytest.raises(ValueError, match="found_inf is on meta, param on"):
        lion_step(p, g, m, lr=1e-3, found_inf=torch.zeros((), device="meta"), **HYPER)
    with pytest.raises(ValueError, match="backend='cuda'"):
        lion_step(p, g, m, lr=1e-3, backend="cuda", **HYPER)
    with pytest.raises(TypeError, match="fp32 param and exp_avg, got torch.float64"):
        lion_step(p.double(), g.double(), m.double(), lr=1e-3, backend="triton", **HYPER)
    with pytest.raises(TypeError, match="fp32 lr tensor, got torch.float64"):
        lion_step(p, g, m, lr=torch.tensor(1e-3, dtype=torch.float64, device=DEVICE), backend="triton", **HYPER)
    with pytest.raises(ValueError, match=r"contiguous buffers; param strides \(2,\)"):
        lion_step(torch.zeros(16, device=DEVICE)[::2], g, m, lr=1e-3, backend="triton", **HYPER)
    # dtype before device: without the interpreter a CPU fp64 step names the dtype
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(8)
    with pytest.raises(TypeError, match="got torch.float64"):
        lion_step(cpu.double(), cpu.double(), cpu.double(), lr=1e-3, backend="triton", **HYPER)
    with pytest.raises(ValueError, match="param is on cpu"):
        lion_step(cpu, cpu, cpu.clone(), lr=1e-3, backend="triton", **HYPER)


def test_optimizer_validation():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, match in ((dict(lr=0.0), "lr must be > 0, got 0.0"), (dict(betas=(0.9, 1.0)), r"betas"),
                          (dict(weight_decay=-0.1), "weight_decay"), (dict(backend="x"), "backend='x'"),
                          (dict(lr=torch.ones(2)), r"one value, got shape \(2,\)")):
        with pytest.raises(ValueError, match=match):
            Lion(p, **kwargs)


@pytest.mark.parametrize("env, backend, expect_kernel", [
    ("", "auto", DEVICE == "cuda"),  # CPU tensors: the reference, even under the interpreter
    ("triton", "auto", True),
    ("reference", "triton", True),  # the env var never overrides an explicit backend
    ("", "reference", False),
], ids=["auto", "env-triton", "env-ignored-when-explicit", "reference"])
def test_dispatch(monkeypatch, env, backend, expect_kernel):
    calls = []
    real = kl.LION_STEP_OP.fwd  # kl.lion_step_triton
    monkeypatch.setattr(kl.LION_STEP_OP, "fwd", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("FASTMT_LION_BACKEND", env)
    gen = torch.Generator().manual_seed(0)
    p, g = rnd(100, gen=gen), rnd(100, gen=gen)
    ref_p, ref_m = p.clone(), torch.zeros_like(p)
    m = torch.zeros_like(p)
    lion_step(p, g, m, lr=1e-2, backend=backend, **HYPER)
    lion_step_reference(ref_p, g, ref_m, lr=1e-2, **HYPER)
    assert_within_ulps(p, ref_p, "param")
    assert bool(calls) == expect_kernel


# ----------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------
def _flat_model(seed=0):
    """Two parameter groups, each ONE contiguous fp32 buffer whose views are the 'parameters'."""
    gen = torch.Generator().manual_seed(seed)
    decay = torch.nn.Parameter(rnd(3 * 40 + 7, gen=gen))
    no_decay = torch.nn.Parameter(rnd(40 + 40, gen=gen))
    return decay, no_decay


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = rnd(p.numel(), dtype=BF16, gen=gen).float()


@pytest.mark.interpreter
def test_optimizer_one_launch_per_flat_group_matches_lion_pytorch(monkeypatch):
    calls = []
    real = kl.LION_STEP_OP.fwd  # the launcher the op calls eagerly: kl.lion_step_triton
    monkeypatch.setattr(kl.LION_STEP_OP, "fwd", lambda *a: calls.append(a[0].numel()) or real(*a))
    ours, peer = _flat_model(), [torch.nn.Parameter(p.detach().clone()) for p in _flat_model()]

    def groups(ps):
        return [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]

    opt = Lion(groups(ours), lr=3e-3, betas=(0.9, 0.99), backend="triton")
    ref = lion_pytorch()(groups(peer), lr=3e-3, betas=(0.9, 0.99), use_triton=False)
    for step in range(3):
        _grads(ours, step)
        _grads(peer, step)
        opt.step()
        ref.step()
    assert calls == [127, 80] * 3  # one launch per group per step
    for a, b in zip(ours, peer):
        assert_within_ulps(a.detach(), b.detach(), "param", ulps=4)
        assert_within_ulps(opt.state[a]["exp_avg"], ref.state[b]["exp_avg"], "exp_avg", ulps=4)


@pytest.mark.interpreter
def test_optimizer_found_inf_attribute_and_tensor_lr_with_a_scheduler():
    params = _flat_model()
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = Lion([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}], lr=lr,
               weight_decay=0.1, backend="triton")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    opt.found_inf = torch.ones((), device=DEVICE)  # set once; the loop writes into it on the device
    before = [p.detach().clone() for p in params]
    _grads(params, 0)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[p]["exp_avg"], torch.zeros_like(p)) for p in params)
    opt.found_inf.zero_()
    sched.step()  # lr 1e-2 -> 5e-3, written into the same tensor
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(5e-3)
    expected = [b.clone() for b in before]
    for e, p in zip(expected, params):
        lion_step_reference(e, p.grad, torch.zeros_like(e), lr=5e-3, beta1=0.9, beta2=0.99,
                            weight_decay=0.1 if p is params[0] else 0.0)
    opt.step()
    for p, e in zip(params, expected):
        assert_within_ulps(p.detach(), e, "param", ulps=4)


def test_optimizer_state_dict_round_trip():
    params = _flat_model()
    groups = [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]
    opt = Lion(groups, lr=torch.tensor(2e-3, device=DEVICE), backend="reference")
    for step in range(2):
        _grads(params, step)
        opt.step()
    saved = opt.state_dict()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = Lion([{"params": [clones[0]]}, {"params": [clones[1]]}], lr=1.0, backend="reference")
    opt2.load_state_dict(saved)
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0.0]
    assert isinstance(opt2.param_groups[0]["lr"], torch.Tensor) and opt2.param_groups[0]["lr"].item() == pytest.approx(2e-3)
    for p, c in zip(params, clones):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[c]["exp_avg"])
    _grads(params, 5)
    _grads(clones, 5)
    opt.step()
    opt2.step()
    for p, c in zip(params, clones):
        assert torch.equal(p, c)


# ----------------------------------------------------------------------------------------------
# torch.library registration
# ----------------------------------------------------------------------------------------------
@pytest.mark.interpreter
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    p, m, g = rnd(300, gen=gen), rnd(300, gen=gen), rnd(300, dtype=BF16, gen=gen)
    for lr, lr_t, flag in ((1e-3, None, None), (0.0, torch.tensor(1e-3, device=DEVICE), torch.tensor(0.0))):
        torch.library.opcheck(torch.ops.fastmt.lion_step.default,
                              (p, g, m, lr, lr_t, 0.9, 0.99, 0.1, flag if flag is None else flag.to(DEVICE)))


def _two_steps(p, m, g, lr, flag):
    lion_step(p, g, m, lr=lr, found_inf=flag, backend="triton", **HYPER)
    lion_step(p, g * 0.5, m, lr=lr, found_inf=flag, backend="triton", **HYPER)
    return p.sum()


@pytest.mark.interpreter
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    p0, g = rnd(500, gen=gen), rnd(500, dtype=BF16, gen=gen)
    lr, flag = torch.tensor(1e-2, device=DEVICE), torch.tensor(False, device=DEVICE)
    results = []
    for fn in (_two_steps, torch.compile(_two_steps, fullgraph=True, backend="aot_eager")):
        p, m = p0.clone(), torch.zeros_like(p0)
        fn(p, m, g, lr, flag)
        results.append((p, m))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
