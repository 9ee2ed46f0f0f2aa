"""The attention op (kernels/flash_attention.py): reference semantics, validation, dispatch between
the backends, torch.compile of the module; plus the helpers the kernel tests share
(test_sequence_attention.py: the per-sequence tiling; test_packed_attention.py: the stream tiling).

Inputs live on the test device. On CUDA the kernels serve fp16/bf16 only, so the tests that run
on both use fp16 there. Each new (kernel, key) on CUDA would compile and time every config: the
tests take each kernel's first fitting config (``FASTMT_AUTOTUNE=0``).

Tolerances follow STYLE.md #3: the kernel's error against the fp64 reference must be at most 2x
(3x for gradients) the error of PyTorch's own same-dtype reference, plus a tiny floor: fp32 rounding
of D-long dot products at the output's scale (the kernels compute in fp32; FA's delta = rowsum(dO*O)
cancels where PyTorch's softmax backward is exactly 0) and, for bf16 under the interpreter, whose
fp32 -> bf16 cast truncates, two ulps of each element.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import kernels.flash_attention as fa
from kernels._utils import interpreting
from kernels.flash_attention import (
    FlashAttention,
    _auto_backend,
    attention,
    attention_reference,
    pad_varlen,
    unpad_varlen,
    visibility_mask,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _first_configs(monkeypatch):
    """CUDA: no autotuning in this module's tests (see the module docstring)."""
    if HAS_CUDA:
        monkeypatch.setenv("FASTMT_AUTOTUNE", "0")


# fp16 where the test runs on CUDA (the kernels refuse fp32 there), fp32 under the interpreter
KERNEL_DTYPE = torch.float16 if HAS_CUDA else torch.float32


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _lengths(B: int, T: int, kind: str, gen: torch.Generator) -> torch.Tensor | None:
    """"full" -> None; "ragged" -> random in [1, T] with one sequence at T; "empty" -> includes 0."""
    if kind == "full":
        return None
    lens = torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32)
    lens[0] = T
    if kind == "empty":
        lens[-1] = 0
    return lens


def _inputs(B, H, Tq, Tk, D, dtype, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=gen) for T in (Tq, Tk, Tk, Tq))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, do)], gen


def _fwd_bwd(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn`` at (q, k, v) with output gradient ``do``."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do.to(out.dtype))
    return [out.detach(), *grads]


def _check_against_reference(run_kernel, run_reference, q, k, v, do, *, names=("out", "dq", "dk", "dv")):
    """Kernel error vs fp64 truth <= factor x same-dtype PyTorch error + ulp floor (STYLE.md #3)."""
    got = _fwd_bwd(run_kernel, q, k, v, do)
    same = _fwd_bwd(run_reference, q, k, v, do)
    truth = _fwd_bwd(run_reference, *(t.double() for t in (q, k, v, do)))
    return _assert_within_rule(got, same, truth, q, k, v, do, names=names)


def _assert_within_rule(got, same, truth, q, k, v, do, *, names=("out", "dq", "dk", "dv")):
    """``got`` (kernel), ``same`` (same-dtype reference), ``truth`` (fp64 reference): lists of tensors in
    ``names`` order; the kernel's error must be within the STYLE.md #3 allowance (see the module docstring)."""
    dtype = q.dtype
    # the kernels compute in fp32: the floor is fp32 rounding over D-long dot products, relative to
    # the output's scale (FA's delta = rowsum(dO * O) cancels where torch's softmax backward is exact)
    floor_eps = torch.finfo(torch.float32).eps * math.sqrt(q.shape[-1])
    # the interpreter's fp32 -> bf16 cast truncates: two bf16 ulps of each element on top
    truncation_ulps = 2 if (dtype == torch.bfloat16 and interpreting()) else 0
    report = []
    for name, g, s, t in zip(names, got, same, truth):
        factor = 2.0 if name == "out" else 3.0
        assert torch.isfinite(g).all(), f"{name}: non-finite values (unwritten under FASTMT_POISON?)"
        allowance = truncation_ulps * torch.finfo(dtype).eps * t.abs()
        err = ((g.double() - t).abs() - allowance).clamp_min(0).max().item()
        ref_err = (s.double() - t).abs().max().item()
        scale = max(t.abs().max().item(), 1.0)
        if name != "out":  # dS = P * (dP - delta): dP = dO.v and delta = rowsum(dO * O) cancel in fp32
            # (torch's softmax backward is exact where they cancel fully, e.g. one visible key)
            dp_scale = do.abs().max().item() * v.abs().max().item() * math.sqrt(q.shape[-1])
            scale = max(scale, dp_scale * max(q.abs().max().item(), k.abs().max().item()))
        floor = floor_eps * scale
        report.append(f"{name}: err={err:.2e} torch_err={ref_err:.2e} ratio={err / max(ref_err, 1e-30):.2f}")
        assert err <= factor * ref_err + floor, "; ".join(report)
    return report


def _padded_fns(causal, scale, ql, kl):
    def kernel(q, k, v):
        return attention(q, k, v, causal=causal, softmax_scale=scale, q_lengths=ql, k_lengths=kl, backend="triton")

    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale, q_lengths=ql, k_lengths=kl,
                                   upcast=False)

    return kernel, reference


def _naive_attention(q, k, v, causal, scale, Lq, Lk):
    """Loop-per-query attention of one (H, T, D) sequence, written from the docstring's rule."""
    out = torch.zeros_like(q)
    for i in range(Lq):
        js = [j for j in range(Lk) if not causal or j <= i + (Lk - Lq)]
        if not js:
            continue
        s = (q[:, i : i + 1] @ k[:, js].transpose(-1, -2)) * scale  # (H, 1, n)
        out[:, i] = (torch.softmax(s, -1) @ v[:, js])[:, 0]
    return out


# ----------------------------------------------------------------------------------------------
# reference semantics
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_visibility_mask_matches_rule(causal):
    Tq, Tk = 5, 7
    ql = torch.tensor([5, 3, 0, 2], dtype=torch.int32)
    kl = torch.tensor([7, 4, 3, 0], dtype=torch.int32)
    mask = visibility_mask(Tq, Tk, ql, kl, causal)
    assert mask.shape == (4, 1, Tq, Tk)
    for b in range(4):
        Lq, Lk = int(ql[b]), int(kl[b])
        for i in range(Tq):
            for j in range(Tk):
                want = i < Lq and j < Lk and (not causal or j <= i + (Lk - Lq))
                assert bool(mask[b, 0, i, j]) == want, (b, i, j)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_matches_naive_loops(causal):
    gen = torch.Generator().manual_seed(1)
    B, H, Tq, Tk, D = 3, 2, 6, 9, 8
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for T in (Tq, Tk, Tk))
    ql = torch.tensor([6, 2, 4], dtype=torch.int32)
    kl = torch.tensor([9, 5, 1], dtype=torch.int32)  # b=2 causal: Lk - Lq = -3, rows 0..2 see nothing
    out = attention_reference(q, k, v, causal=causal, softmax_scale=0.7, q_lengths=ql, k_lengths=kl, upcast=False)
    for b in range(B):
        want = _naive_attention(q[b], k[b], v[b], causal, 0.7, int(ql[b]), int(kl[b]))
        torch.testing.assert_close(out[b], want, rtol=1e-12, atol=1e-12)


def test_reference_empty_rows_are_zero_with_zero_gradients():
    q, k, v = (torch.randn(2, 1, 4, 8, requires_grad=True) for _ in range(3))
    kl = torch.tensor([0, 4], dtype=torch.int32)
    out = attention_reference(q, k, v, k_lengths=kl)
    assert (out[0] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[0] == 0).all()


@pytest.mark.parametrize(
    "Tq,Tk,causal,lengths",
    [
        pytest.param(8, 8, False, False, id="T8-full"),
        pytest.param(8, 8, True, False, id="T8-causal"),
        pytest.param(5, 9, True, False, id="Tq5-Tk9-causal-bottom-right"),
        pytest.param(7, 6, False, True, id="Tq7-Tk6-ragged"),
        pytest.param(7, 7, True, True, id="T7-causal-ragged"),
    ],
)
def test_sdpa_backend_matches_reference(Tq, Tk, causal, lengths):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 2, T, 16, generator=gen) for T in (Tq, Tk, Tk))
    ql = torch.tensor([Tq, 1, 0], dtype=torch.int32) if lengths else None
    kl = torch.tensor([Tk, 3, 2], dtype=torch.int32) if lengths else None
    kw = dict(causal=causal, q_lengths=ql, k_lengths=kl)
    torch.testing.assert_close(attention(q, k, v, backend="sdpa", **kw), attention(q, k, v, backend="reference", **kw))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_padded_reference(causal):
    gen = torch.Generator().manual_seed(3)
    lq, lk = [3, 1, 5], [4, 6, 2]
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    q, k, v = torch.randn(9, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    out = attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                    backend="reference")
    padded = attention_reference(pad_varlen(q, cu_q, 5), pad_varlen(k, cu_k, 6), pad_varlen(v, cu_k, 6), causal=causal,
                                 q_lengths=torch.tensor(lq, dtype=torch.int32), k_lengths=torch.tensor(lk, dtype=torch.int32))
    torch.testing.assert_close(out, unpad_varlen(padded, cu_q, 9))


# ----------------------------------------------------------------------------------------------
# validation and dispatch
# ----------------------------------------------------------------------------------------------
def _qkv(B=2, H=2, T=4, D=16, dtype=torch.float32):
    """CPU tensors: the data-dependent checks (lengths, cu_seqlens) run on CPU inputs only. The triton
    cases must name dtype / head dim first on every machine, CPU tensors on a CUDA machine included."""
    return [torch.randn(B, H, T, D, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "make,kw,exc,match",
    [
        pytest.param(lambda: (_qkv()[0][0], *_qkv()[1:]), {}, ValueError, r"\(B, H, T, D\)", id="rank3-padded"),
        pytest.param(lambda: (_qkv()[0], _qkv()[1].half(), _qkv()[2]), {}, TypeError, "dtypes differ", id="dtype-mismatch"),
        pytest.param(lambda: (*_qkv(),), {"q_lengths": torch.tensor([4, 5], dtype=torch.int32)}, ValueError,
                     r"q_lengths=\[4, 5\] must lie in \[0, 4\]", id="lengths-exceed-T"),
        pytest.param(lambda: (*_qkv(),), {"k_lengths": torch.tensor([4, 4])}, ValueError, "int32", id="lengths-int64"),
        pytest.param(lambda: (torch.randn(5, 2, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)),
                     {"cu_seqlens_q": torch.tensor([0, 2, 4], dtype=torch.int32),
                      "cu_seqlens_k": torch.tensor([0, 3, 6], dtype=torch.int32), "max_seqlen_q": 2, "max_seqlen_k": 3},
                     ValueError, r"cu_seqlens_q=\[0, 2, 4\].*total 5", id="cu-seqlens-last-not-total"),
        pytest.param(lambda: (torch.randn(4, 2, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)),
                     {"cu_seqlens_q": torch.tensor([0, 1, 4], dtype=torch.int32),
                      "cu_seqlens_k": torch.tensor([0, 3, 6], dtype=torch.int32), "max_seqlen_q": 2, "max_seqlen_k": 3},
                     ValueError, "length 3 > max_seqlen 2", id="max-seqlen-too-small"),
        pytest.param(lambda: (*_qkv(D=24, dtype=torch.float16),), {"backend": "triton"}, ValueError, "head dim D=24",
                     id="triton-hd24"),
        pytest.param(lambda: (*_qkv(dtype=torch.float64),), {"backend": "triton"}, TypeError, "dtype=torch.float64",
                     id="triton-fp64"),
        pytest.param(lambda: (*_qkv(),), {"backend": "flash"}, ValueError, "'flash'", id="unknown-backend"),
    ],
)
def test_validation_names_the_values(make, kw, exc, match):
    with pytest.raises(exc, match=match):
        attention(*make(), **kw)


@pytest.mark.gpu
def test_gpu_triton_refuses_fp32_by_dtype():
    q, k, v = (t.cuda() for t in _qkv(D=64))
    with pytest.raises(TypeError, match=r"dtype=torch.float32 .*on CUDA"):
        attention(q, k, v, backend="triton")


def test_auto_dispatch_rule():
    def fake(device, dtype=torch.bfloat16, D=64, Tq=8, Tk=8, requires_grad=False):
        return SimpleNamespace(is_cuda=device == "cuda", device=torch.device(device), dtype=dtype,
                               shape=(2, 4, Tq, D), requires_grad=requires_grad)

    lens = torch.ones(2, dtype=torch.int32)
    cpu, cuda = fake("cpu"), fake("cuda")
    k_cuda = fake("cuda", Tq=8)
    # CPU: the reference where a gradient flows (training), PyTorch's fused SDPA where none does (decoding)
    cpu_grad = fake("cpu", requires_grad=True)
    assert _auto_backend(cpu_grad, cpu_grad, True, lens, None, False) == "reference"
    assert _auto_backend(cpu, cpu, True, lens, None, False) == "sdpa"
    with torch.no_grad():
        assert _auto_backend(cpu_grad, cpu_grad, True, lens, None, False) == "sdpa"
    assert _auto_backend(cuda, k_cuda, False, None, None, False) == "sdpa"  # no mask: SDPA flash
    assert _auto_backend(cuda, k_cuda, True, None, None, False) == "sdpa"  # square causal: SDPA flash
    assert _auto_backend(cuda, fake("cuda", Tq=5), True, None, None, False) == "triton"  # bottom-right causal
    assert _auto_backend(cuda, k_cuda, False, None, lens, False) == "triton"  # padding mask
    assert _auto_backend(cuda, k_cuda, False, None, None, True) == "triton"  # varlen
    assert _auto_backend(fake("cuda", D=96), k_cuda, False, None, lens, False) == "sdpa"  # unsupported head dim
    assert _auto_backend(fake("cuda", dtype=torch.float32), k_cuda, False, None, lens, False) == "sdpa"


@needs_triton
def test_env_override_routes_auto_to_triton(monkeypatch):
    """"auto" (the reference on CPU, SDPA for square causal on CUDA) runs our kernel under the override."""
    (q, k, v, _), _ = _inputs(1, 1, 5, 5, 16, KERNEL_DTYPE)
    launches = []
    launcher = fa.SEQUENCE_ATTENTION_OP.fwd  # fa.sequence_attention_fwd
    monkeypatch.setattr(fa.SEQUENCE_ATTENTION_OP, "fwd", lambda *a: launches.append(a) or launcher(*a))
    monkeypatch.setenv("FASTMT_POISON", "1")
    explicit = attention(q, k, v, causal=True, backend="triton")
    monkeypatch.setenv("FASTMT_ATTN_BACKEND", "triton")
    out = attention(q, k, v, causal=True)
    assert len(launches) == 2, "the override did not reach the Triton launcher"
    torch.testing.assert_close(out, explicit, rtol=0, atol=0)
    monkeypatch.setenv("FASTMT_ATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match="'nope'"):
        attention(q, k, v)


# ----------------------------------------------------------------------------------------------
# torch.compile (the custom ops' own opcheck: test_sequence_attention.py, test_packed_attention.py)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=[needs_triton, pytest.mark.interpreter]),
                                     "reference"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    dtype = torch.float16 if (HAS_CUDA and backend == "triton") else torch.float32
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, T, 16, generator=gen).to(DEVICE, dtype) for T in (7, 9, 9))
    kl = torch.tensor([9, 4], dtype=torch.int32, device=DEVICE)
    layer = FlashAttention(causal=True, backend=backend)

    def block(q, k, v):
        return (layer(q * 2.0, k, v, k_lengths=kl) + 1.0).square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager = _fwd_bwd(lambda a, b, c: block(a, b, c).reshape(1), q, k, v, torch.ones(1, device=DEVICE))
    comp = _fwd_bwd(lambda a, b, c: compiled(a, b, c).reshape(1), q, k, v, torch.ones(1, device=DEVICE))
    for name, a, b in zip(("loss", "dq", "dk", "dv"), comp, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------------------------
# CUDA: auto picks our kernel for masks
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_auto_uses_triton_for_masks_and_matches():
    (q, k, v, _), _ = _inputs(2, 4, 64, 64, 64, torch.bfloat16)
    kl = torch.tensor([64, 10], dtype=torch.int32, device="cuda")
    auto = attention(q, k, v, k_lengths=kl)
    torch.testing.assert_close(auto, attention(q, k, v, k_lengths=kl, backend="triton"), rtol=0, atol=0)
