"""The per-sequence Triton kernels (kernels/sequence_attention.py) through ``kernels.attention``, against
the fp64 reference (interpreter on CPU, tiny shapes; a covering grid on CUDA, the full product marked
slow), plus their custom ops' registration. Varlen cases pin ``FASTMT_ATTN_TILING=sequence``; the
CUDA varlen grid runs both tilings.

Inputs and tolerances as in test_attention.py (its helpers). On CUDA the tests take each kernel's first
fitting config (``FASTMT_AUTOTUNE=0``); dedicated GPU tests run every config once and the autotuner once.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels.sequence_attention as sa
from kernels import _utils
from kernels.flash_attention import (
    SEQUENCE_ATTENTION_OP,
    attention,
    attention_reference,
    pad_varlen,
    unpad_varlen,
    visibility_mask,
)
from tests.kernels.test_attention import (
    DEVICE,
    HAS_CUDA,
    KERNEL_DTYPE,
    _assert_within_rule,
    _check_against_reference,
    _fwd_bwd,
    _inputs,
    _lengths,
    _padded_fns,
    needs_triton,
)


@pytest.fixture(autouse=True)
def _first_configs(monkeypatch):
    """CUDA: no autotuning in this module's tests (see the module docstring; ``autotuned`` undoes it)."""
    if HAS_CUDA:
        monkeypatch.setenv("FASTMT_AUTOTUNE", "0")


@pytest.fixture
def autotuned(monkeypatch):
    monkeypatch.setenv("FASTMT_AUTOTUNE", "full")  # the Autotuner even where kernels/pinned.py pins a config


@pytest.fixture
def sequence_tiling(monkeypatch):
    """Varlen calls go to the per-sequence kernels (auto would pick stream tiling for short segments)."""
    monkeypatch.setenv("FASTMT_ATTN_TILING", "sequence")


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU): forward and all gradients against the fp64 reference
# ----------------------------------------------------------------------------------------------
KERNEL_CASES = [
    # B, H, Tq, Tk, D, dtype, causal, q lengths, k lengths
    pytest.param(2, 2, 17, 17, 16, torch.float32, False, "full", "full", id="B2-T17-H2-D16-fp32"),
    pytest.param(2, 2, 17, 17, 32, torch.float16, True, "full", "full", id="B2-T17-H2-D32-fp16-causal"),
    pytest.param(1, 1, 1, 1, 16, torch.float32, True, "full", "full", id="B1-T1-H1-D16-fp32-causal"),
    pytest.param(1, 2, 33, 33, 16, torch.bfloat16, True, "full", "full", id="B1-T33-H2-D16-bf16-causal"),
    pytest.param(3, 2, 20, 20, 16, torch.float16, False, "ragged", "ragged", id="B3-T20-H2-D16-fp16-ragged"),
    pytest.param(3, 1, 33, 33, 32, torch.float32, True, "ragged", "ragged", id="B3-T33-H1-D32-fp32-causal-ragged"),
    pytest.param(2, 2, 9, 33, 16, torch.float32, True, "full", "full", id="B2-Tq9-Tk33-D16-fp32-causal-cross"),
    pytest.param(2, 2, 33, 9, 16, torch.float32, True, "full", "full", id="B2-Tq33-Tk9-D16-fp32-causal-emptyrows"),
    pytest.param(2, 1, 17, 23, 32, torch.bfloat16, False, "ragged", "empty", id="B2-Tq17-Tk23-D32-bf16-cross-nokeys"),
    pytest.param(3, 1, 19, 13, 16, torch.float16, True, "empty", "ragged", id="B3-Tq19-Tk13-D16-fp16-causal-ragged"),
    pytest.param(1, 1, 16, 48, 64, torch.float32, False, "full", "ragged", id="B1-Tq16-Tk48-D64-fp32-cross"),
]


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("B,H,Tq,Tk,D,dtype,causal,qlen,klen", KERNEL_CASES)
def test_triton_padded_matches_reference(poison, B, H, Tq, Tk, D, dtype, causal, qlen, klen):
    if HAS_CUDA and dtype == torch.float32:
        pytest.skip("fp32 is served by the kernels only under the interpreter")
    (q, k, v, do), gen = _inputs(B, H, Tq, Tk, D, dtype)
    ql, kl = _lengths(B, Tq, qlen, gen), _lengths(B, Tk, klen, gen)
    ql, kl = (None if t is None else t.to(DEVICE) for t in (ql, kl))
    kernel, reference = _padded_fns(causal, None, ql, kl)
    _check_against_reference(kernel, reference, q, k, v, do)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("scale", [0.05, 3.0], ids=["scale0.05", "scale3"])
def test_triton_any_softmax_scale(poison, scale):
    (q, k, v, do), gen = _inputs(2, 1, 17, 17, 16, torch.float16)
    kl = torch.tensor([17, 5], dtype=torch.int32, device=DEVICE)
    kernel, reference = _padded_fns(True, scale, None, kl)
    _check_against_reference(kernel, reference, q, k, v, do)


def _varlen_case(lq: list[int], lk: list[int], H: int, D: int, dtype, causal: bool, seed: int = 0):
    """Packed inputs + the padded-reference functions that define the expected result."""
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk, mq, mk = sum(lq), sum(lk), max(lq), max(lk)
    q, do = (torch.randn(tq, H, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    k, v = (torch.randn(tk, H, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    cu_q, cu_k = cu_q.to(DEVICE), cu_k.to(DEVICE)
    ql, kl = (cu_q[1:] - cu_q[:-1]).int(), (cu_k[1:] - cu_k[:-1]).int()

    def kernel(q, k, v):
        return attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                         max_seqlen_k=mk, backend="triton")

    def reference(q, k, v):
        out = attention_reference(pad_varlen(q, cu_q, mq), pad_varlen(k, cu_k, mk), pad_varlen(v, cu_k, mk),
                                  causal=causal, q_lengths=ql, k_lengths=kl, upcast=False)
        return unpad_varlen(out, cu_q, tq)

    return (q, k, v, do), kernel, reference


VARLEN_CASES = [
    pytest.param([5, 17, 1], [5, 17, 1], 2, 16, torch.float32, False, id="self-L5,17,1-D16-fp32"),
    pytest.param([5, 17, 1], [5, 17, 1], 2, 32, torch.float16, True, id="self-L5,17,1-D32-fp16-causal"),
    pytest.param([3, 20, 9], [18, 4, 0], 1, 16, torch.float32, True, id="cross-Lq3,20,9-Lk18,4,0-D16-fp32-causal"),
    pytest.param([33], [7], 2, 16, torch.bfloat16, False, id="B1-Lq33-Lk7-D16-bf16"),
    pytest.param([0, 16, 2], [16, 16, 16], 1, 32, torch.float16, True, id="Lq0,16,2-Lk16-D32-fp16-causal"),
]


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("lq,lk,H,D,dtype,causal", VARLEN_CASES)
def test_triton_varlen_matches_reference(poison, sequence_tiling, lq, lk, H, D, dtype, causal):
    if HAS_CUDA and dtype == torch.float32:
        pytest.skip("fp32 is served by the kernels only under the interpreter")
    inputs, kernel, reference = _varlen_case(lq, lk, H, D, dtype, causal)
    _check_against_reference(kernel, reference, *inputs)


@needs_triton
@pytest.mark.interpreter
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_varlen_fuzz_ragged_lengths(sequence_tiling, lengths, causal, seed):
    lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
    if max(lq) == 0 or max(lk) == 0:
        lq[0], lk[0] = max(lq[0], 1), max(lk[0], 1)
    dtype = torch.float16 if HAS_CUDA else torch.float32
    os.environ["FASTMT_POISON"] = "1"
    try:
        inputs, kernel, reference = _varlen_case(lq, lk, 1, 16, dtype, causal, seed)
        _check_against_reference(kernel, reference, *inputs)
    finally:
        del os.environ["FASTMT_POISON"]


@needs_triton
@pytest.mark.interpreter
def test_triton_padding_content_is_never_read(poison):
    """NaN in padded q/k/v/dO positions must not leak: masked blocks are skipped or masked on load."""
    (q, k, v, do), _ = _inputs(2, 1, 20, 19, 16, KERNEL_DTYPE)
    ql = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    kl = torch.tensor([3, 19], dtype=torch.int32, device=DEVICE)
    qn, kn, vn, don = (t.clone() for t in (q, k, v, do))
    qn[1, :, 7:], don[1, :, 7:] = float("nan"), float("nan")
    kn[0, :, 3:], vn[0, :, 3:] = float("nan"), float("nan")
    kernel, _ = _padded_fns(True, None, ql, kl)
    got = _fwd_bwd(kernel, qn, kn, vn, don)
    want = _fwd_bwd(kernel, q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
    assert (got[0][1, :, 7:] == 0).all() and (got[1][1, :, 7:] == 0).all()  # rows past Lq
    assert (got[2][0, :, 3:] == 0).all() and (got[3][0, :, 3:] == 0).all()  # keys past Lk


@needs_triton
@pytest.mark.interpreter
def test_triton_strided_inputs_and_expanded_grad(poison):
    """q/k/v as strided views of one (B, T, 3, H, D) projection (row stride 3*H*D, heads not outermost),
    gradients through the views, and dO = ones expanded (every stride 0)."""
    B, T, H, D = 2, 17, 2, 16
    gen = torch.Generator().manual_seed(5)
    qkv0 = torch.randn(B, T, 3, H, D, generator=gen).to(DEVICE, KERNEL_DTYPE)
    kl = torch.tensor([17, 9], dtype=torch.int32, device=DEVICE)
    kernel, reference = _padded_fns(False, None, None, kl)

    def run(fn, qkv, do):
        qkv = qkv.detach().clone().requires_grad_(True)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
        assert q.stride() == (T * 3 * H * D, D, 3 * H * D, 1)
        out = fn(q, k, v)
        (grad,) = torch.autograd.grad(out, qkv, do.to(out.dtype))
        return [out.detach(), *(grad[:, :, i].transpose(1, 2) for i in range(3))]

    do = torch.ones(1, 1, 1, 1, device=DEVICE, dtype=KERNEL_DTYPE).expand(B, H, T, D)
    got, same = run(kernel, qkv0, do), run(reference, qkv0, do)
    truth = run(reference, qkv0.double(), do.double())
    views = [qkv0[:, :, i].transpose(1, 2) for i in range(3)]
    _assert_within_rule(got, same, truth, *views, do)


@needs_triton
@pytest.mark.interpreter
def test_triton_lse_is_masked_logsumexp(poison):
    """fp16 inputs on every device: their products are exact in fp32, so the saved lse differs from the
    fp64 masked logsumexp only by fp32 accumulation and exp2/log2 rounding (~1e-6 here); including or
    dropping one key shifts it by ~1e-2."""
    (q, k, v, _), _ = _inputs(2, 1, 9, 13, 16, torch.float16)
    ql = torch.tensor([9, 4], dtype=torch.int32, device=DEVICE)
    kl = torch.tensor([13, 0], dtype=torch.int32, device=DEVICE)
    out, lse = torch.ops.fastmt.sequence_attention_fwd.default(q, k, v, ql, kl, 9, 13, True, 0.25)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * 0.25
    mask = visibility_mask(9, 13, ql, kl, True)
    want = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)
    want = torch.where(torch.isinf(want), torch.full_like(want, float("inf")), want)  # empty rows: +inf
    torch.testing.assert_close(lse.double(), want, rtol=1e-4, atol=1e-4)
    assert lse.dtype == torch.float32 and out.shape == q.shape


# ----------------------------------------------------------------------------------------------
# torch.library registration (torch.compile of the op: test_attention.py)
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_opcheck(layout):
    dtype = torch.float16 if HAS_CUDA else torch.float32
    gen = torch.Generator().manual_seed(7)
    if layout == "padded":
        q, k, v = (torch.randn(2, 1, T, 16, generator=gen).to(DEVICE, dtype) for T in (5, 7, 7))
        seq_q = torch.tensor([5, 2], dtype=torch.int32, device=DEVICE)
        seq_k = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)
        mq, mk = 5, 7
    else:
        q, k, v = (torch.randn(T, 1, 16, generator=gen).to(DEVICE, dtype) for T in (6, 9, 9))
        seq_q = torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE)
        seq_k = torch.tensor([0, 2, 9], dtype=torch.int32, device=DEVICE)
        mq, mk = 4, 7
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    args = (q, k, v, seq_q, seq_k, mq, mk, True, 0.3)
    torch.library.opcheck(torch.ops.fastmt.sequence_attention_fwd.default, args)
    out, lse = torch.ops.fastmt.sequence_attention_fwd.default(*args)
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fastmt.sequence_attention_bwd.default, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                       seq_q, seq_k, mq, mk, True, 0.3))


# ----------------------------------------------------------------------------------------------
# CUDA: a covering grid (every head dim, dtype, causal/full, ragged/dense, q != k, odd sizes, each
# with the others varied), the full product (slow), every config once, the autotuner once
# ----------------------------------------------------------------------------------------------
GPU_SHAPES = SEQUENCE_ATTENTION_OP.shapes["padded"]  # the op's declared launches
BF16, FP16 = torch.bfloat16, torch.float16


def _gpu_padded_case(shape, D, dtype, causal, ragged):
    B, H, Tq, Tk = GPU_SHAPES[shape]
    (q, k, v, do), gen = _inputs(B, H, Tq, Tk, D, dtype, seed=Tq * 131 + Tk)
    ql = _lengths(B, Tq, "ragged" if ragged else "full", gen)
    kl = _lengths(B, Tk, "empty" if ragged and B > 1 else ("ragged" if ragged else "full"), gen)
    ql, kl = (None if t is None else t.cuda() for t in (ql, kl))
    kernel, reference = _padded_fns(causal, None, ql, kl)
    _check_against_reference(kernel, reference, q, k, v, do)


def _gpu_id(shape, D, dtype, causal, ragged):
    return f"{shape}-D{D}-{'bf16' if dtype == BF16 else 'fp16'}-{'causal' if causal else 'full'}-" + \
        ("ragged" if ragged else "dense")


GPU_COVER = SEQUENCE_ATTENTION_OP.shapes["cover"]  # (shape, D, dtype, causal, ragged)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,D,dtype,causal,ragged", [pytest.param(*c, id=_gpu_id(*c)) for c in GPU_COVER])
def test_gpu_grid_padded(poison, shape, D, dtype, causal, ragged):
    _gpu_padded_case(shape, D, dtype, causal, ragged)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [16, 32, 64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("ragged", [False, True], ids=["dense", "ragged"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_grid_padded_full(poison, shape, D, dtype, causal, ragged):
    _gpu_padded_case(shape, D, dtype, causal, ragged)


GPU_VARLEN = SEQUENCE_ATTENTION_OP.shapes["varlen"]


def _gpu_varlen_case(monkeypatch, tiling, lengths, D, dtype, causal):
    monkeypatch.setenv("FASTMT_ATTN_TILING", tiling)
    lq, lk = GPU_VARLEN[lengths]
    inputs, kernel, reference = _varlen_case(lq, lk, 4, D, dtype, causal, seed=sum(lq))
    _check_against_reference(kernel, reference, *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", ["sequence", "stream"])
@pytest.mark.parametrize("lengths,D,dtype,causal", [
    pytest.param(*c, id=f"{c[0]}-D{c[1]}-{'bf16' if c[2] == BF16 else 'fp16'}-{'causal' if c[3] else 'full'}")
    for c in SEQUENCE_ATTENTION_OP.shapes["varlen_cover"]])
def test_gpu_grid_varlen(poison, monkeypatch, tiling, lengths, D, dtype, causal):
    _gpu_varlen_case(monkeypatch, tiling, lengths, D, dtype, causal)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tiling", ["sequence", "stream"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [16, 32, 64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", list(GPU_VARLEN))
def test_gpu_grid_varlen_full(poison, monkeypatch, tiling, lengths, D, dtype, causal):
    _gpu_varlen_case(monkeypatch, tiling, lengths, D, dtype, causal)


SEQUENCE_KERNELS = ("_sequence_attention_fwd_kernel", "_sequence_attention_bwd_dkdv_kernel",
                    "_sequence_attention_bwd_dq_kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(max(len(getattr(sa, n).configs) for n in SEQUENCE_KERNELS)))
def test_gpu_every_config_is_correct(poison, monkeypatch, autotuned, index):
    """Config ``index`` of each kernel (its last one past the end), alone: whatever the autotuner picks on
    some GPU is correct. Bottom-right causal, ragged with an empty sequence, lengths off every block size."""
    monkeypatch.setattr(_utils, "_CHOSEN", {})
    for name in SEQUENCE_KERNELS:
        kernel = getattr(sa, name)
        monkeypatch.setattr(kernel, "configs", [kernel.configs[min(index, len(kernel.configs) - 1)]])
    _gpu_padded_case("B2-H4-Tq300-Tk77", 64, BF16, True, True)


@pytest.mark.gpu
def test_gpu_autotuned_matches(poison, autotuned):
    """The production path: the autotuner times the fitting configs and launches the fastest."""
    _gpu_padded_case("B2-H4-Tq300-Tk77", 64, BF16, True, True)


