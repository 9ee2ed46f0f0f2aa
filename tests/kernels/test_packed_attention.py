"""Stream-tiled attention (kernels/packed_attention.py): tiles of consecutive stream rows that span
segments, against the fp64 reference (interpreter on CPU: 32-row tiles, segments of 0-40 tokens, so
tiles hold several segments and segments cross tiles; packed-batch streams on CUDA), plus segment
ids, the tiling rule, validation, torch.library registration and torch.compile.

Tolerances: STYLE.md #3 through test_attention's ``_check_against_reference``. On CUDA the tests take
each kernel's first fitting config (``FASTMT_AUTOTUNE=0``); dedicated GPU tests run every config
once and the autotuner once.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels.packed_attention as pa
from kernels import _utils
from kernels._utils import interpreting
from kernels.flash_attention import (
    STREAM_ATTENTION_OP,
    STREAM_MEAN_MAX,
    FlashAttention,
    attention,
    attention_reference,
    attention_tiling,
    pad_varlen,
    unpad_varlen,
)
from kernels.packed_attention import packed_layout as _packed_layout
from kernels.packed_attention import segment_ids
from tests.kernels.test_attention import _check_against_reference, _fwd_bwd

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
STREAM_KERNELS = ("_stream_attention_fwd_kernel", "_stream_attention_bwd_dq_kernel",
                  "_stream_attention_bwd_dkdv_kernel")


@pytest.fixture(autouse=True)
def _stream_setup(monkeypatch):
    """Every varlen Triton call here takes the stream kernels; CUDA: no autotuning (module docstring)."""
    monkeypatch.setenv("FASTMT_ATTN_TILING", "stream")
    if HAS_CUDA:
        monkeypatch.setenv("FASTMT_AUTOTUNE", "0")


@pytest.fixture
def poison(monkeypatch):
    """Kernel outputs start NaN-filled, so an element no program writes fails the comparison."""
    monkeypatch.setenv("FASTMT_POISON", "1")


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _stream_case(lq, lk, H, D, dtype, causal, seed=0, max_len=None, ids=False):
    """Packed q (sum lq, H, D), k/v (sum lk, H, D) + the kernel call and the padded-reference call.
    ``max_len``: the static max_seqlen bound (default: the true maximum); ``ids``: pass segment ids."""
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu(lq).to(DEVICE), _cu(lk).to(DEVICE)
    tq, tk = sum(lq), sum(lk)
    mq = max_len or max(max(lq), 1)
    mk = max_len or max(max(lk), 1)
    q, do = (torch.randn(tq, H, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    k, v = (torch.randn(tk, H, D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    ql, kl = (cu_q[1:] - cu_q[:-1]).int(), (cu_k[1:] - cu_k[:-1]).int()
    extra = dict(segment_ids_q=segment_ids(cu_q, tq), segment_ids_k=segment_ids(cu_k, tk)) if ids else {}

    def kernel(q, k, v):
        return attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                         max_seqlen_k=mk, backend="triton", **extra)

    def reference(q, k, v):
        out = attention_reference(pad_varlen(q, cu_q, mq), pad_varlen(k, cu_k, mk), pad_varlen(v, cu_k, mk),
                                  causal=causal, q_lengths=ql, k_lengths=kl, upcast=False)
        return unpad_varlen(out, cu_q, tq)

    return (q, k, v, do), kernel, reference


# ----------------------------------------------------------------------------------------------
# segment ids, tiling rule, validation
# ----------------------------------------------------------------------------------------------
def test_segment_ids_follow_cu_seqlens():
    lengths = [3, 0, 1, 0, 0, 4, 2]
    cu = _cu(lengths)
    total = sum(lengths) + 2  # two tokens past cu[-1]: no segment
    want = [s for s, n in enumerate(lengths) for _ in range(n)] + [len(lengths)] * 2
    ids = segment_ids(cu, total)
    assert ids.dtype == torch.int32 and ids.tolist() == want


def test_tiling_rule_and_env_override(monkeypatch):
    monkeypatch.delenv("FASTMT_ATTN_TILING")
    assert attention_tiling(4096, 4096, 4096 // STREAM_MEAN_MAX) == "stream"  # mean exactly the bound
    assert attention_tiling(4096, 4096 + 1, 4096 // STREAM_MEAN_MAX) == "sequence"  # either side counts
    assert attention_tiling(300, 40, 2) == "sequence"
    monkeypatch.setenv("FASTMT_ATTN_TILING", "sequence")
    assert attention_tiling(64, 64, 32) == "sequence"
    monkeypatch.setenv("FASTMT_ATTN_TILING", "stream")
    assert attention_tiling(4096, 4096, 1) == "stream"
    monkeypatch.setenv("FASTMT_ATTN_TILING", "tiles")
    with pytest.raises(ValueError, match="FASTMT_ATTN_TILING='tiles' is not one of"):
        attention_tiling(64, 64, 2)


def _varlen_args(lengths=(3, 0, 5)):
    cu = _cu(list(lengths))
    x = torch.randn(int(cu[-1]), 2, 16)
    return (x, x, x), dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)


@pytest.mark.parametrize("ids,match", [
    pytest.param(torch.tensor([0, 0, 0, 2, 2, 2, 2, 2], dtype=torch.int64), r"must be int32 \(8,\).*int64",
                 id="int64"),
    pytest.param(torch.zeros(7, dtype=torch.int32), r"must be int32 \(8,\).*\(7,\)", id="short"),
    pytest.param(torch.tensor([0, 0, 0, 1, 2, 2, 2, 2], dtype=torch.int32),
                 r"segment_ids_q\[3\]=1 but token 3 lies in segment 2 of \[0, 3, 3, 8\]",
                 id="empty-segment-id"),
])
def test_segment_ids_are_validated(ids, match):
    qkv, kw = _varlen_args()
    with pytest.raises(ValueError, match=match):
        attention(*qkv, **kw, segment_ids_q=ids)


def test_segment_ids_belong_to_the_varlen_layout():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="segment_ids_q/segment_ids_k belong to the varlen layout"):
        attention(q, q, q, segment_ids_k=torch.zeros(4, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# the kernels against the fp64 reference (interpreter on CPU)
# ----------------------------------------------------------------------------------------------
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SELF_1_40 = [1, 40, 3, 17, 29, 2, 8, 33, 1, 5]
WITH_EMPTY = [5, 0, 38, 1, 0, 12, 31, 0]
STREAM_CASES = [
    # lq, lk (None: self), H, D, dtype, causal
    pytest.param(SELF_1_40, None, 2, 16, F32, False, id="self-L1..40-D16-fp32"),
    pytest.param(WITH_EMPTY, None, 2, 32, F16, True, id="self-empty-D32-fp16-causal"),
    pytest.param([3, 20, 9, 0, 14, 1], [18, 4, 0, 7, 30, 1], 1, 16, BF16, True, id="cross-D16-bf16-causal"),
    pytest.param([12, 7, 25], [40, 1, 16], 1, 64, F16, False, id="cross-D64-fp16"),
]


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("lq,lk,H,D,dtype,causal", STREAM_CASES)
def test_stream_matches_reference(poison, lq, lk, H, D, dtype, causal):
    if HAS_CUDA and dtype == F32:
        pytest.skip("fp32 is served by the kernels only under the interpreter")
    inputs, kernel, reference = _stream_case(lq, lk or lq, H, D, dtype, causal)
    _check_against_reference(kernel, reference, *inputs)


# a packed batch: 4 real pairs, 2 empty slots, tails cut into dummies of <= 24, static bound 24
PACKED_SRC = [14, 3, 22, 9, 0, 0, 16, 0, 0]  # capacity 64
PACKED_TGT = [11, 5, 19, 2, 0, 0, 11, 0, 0]  # capacity 48


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["encoder-self", "decoder-causal", "cross"])
def test_stream_packed_batch_matches_reference(poison, kind):
    lq, lk, causal = {"encoder-self": (PACKED_SRC, PACKED_SRC, False),
                      "decoder-causal": (PACKED_TGT, PACKED_TGT, True),
                      "cross": (PACKED_TGT, PACKED_SRC, False)}[kind]
    dtype = F16 if HAS_CUDA else F32
    inputs, kernel, reference = _stream_case(lq, lk, 2, 16, dtype, causal, seed=3, max_len=24,
                                             ids=kind != "cross")
    _check_against_reference(kernel, reference, *inputs)


@needs_triton
@pytest.mark.interpreter
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
    cross=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stream_fuzz_segment_lengths(lengths, cross, causal, seed):
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths] if cross else lq
    if sum(lq) == 0 or sum(lk) == 0:
        lq, lk = lq + [1], lk + [1]
    dtype = F16 if HAS_CUDA else F32
    os.environ["FASTMT_POISON"] = "1"
    try:
        inputs, kernel, reference = _stream_case(lq, lk, 1, 16, dtype, causal, seed)
        _check_against_reference(kernel, reference, *inputs)
    finally:
        del os.environ["FASTMT_POISON"]


@needs_triton
@pytest.mark.interpreter
def test_rows_and_keys_outside_every_pair_get_exact_zeros(poison):
    """Cross attention, causal: segment 1 has no keys, segment 2 no queries, and in segment 0 (Lq 6 > Lk 2,
    bottom-right) queries 0-3 see nothing: those rows and their dQ are 0, those keys' dK/dV are 0."""
    lq, lk = [6, 3, 0, 4], [2, 0, 5, 4]
    (q, k, v, do), kernel, _ = _stream_case(lq, lk, 1, 16, F16 if HAS_CUDA else F32, True)
    out, dq, dk, dv = _fwd_bwd(kernel, q, k, v, do)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    for rows in (slice(0, 4), slice(6, 9)):
        assert (out[rows] == 0).all() and (dq[rows] == 0).all()
    assert out[4:6].abs().sum() > 0 and out[9:].abs().sum() > 0
    assert (dk[2:7] == 0).all() and (dv[2:7] == 0).all()  # keys of segment 2: no queries
    assert dk[7:].abs().sum() > 0


@needs_triton
@pytest.mark.interpreter
def test_precomputed_segment_ids_change_nothing(poison):
    """With ids, without (computed per call), and through the module; with and without autograd."""
    lq = [7, 0, 19, 4]
    inputs, with_ids, _ = _stream_case(lq, lq, 2, 16, F16 if HAS_CUDA else F32, True, ids=True)
    _, without_ids, _ = _stream_case(lq, lq, 2, 16, F16 if HAS_CUDA else F32, True)
    q, k, v, do = inputs
    cu = _cu(lq).to(DEVICE)
    layer = FlashAttention(causal=True, backend="triton")

    def module(q, k, v):
        return layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=19, max_seqlen_k=19,
                     segment_ids_q=segment_ids(cu, 30))

    want = _fwd_bwd(without_ids, *inputs)
    for got in (_fwd_bwd(with_ids, *inputs), _fwd_bwd(module, *inputs)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(with_ids(q, k, v), want[0], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# torch.library registration and torch.compile
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.interpreter
def test_opcheck_stream_ops():
    dtype = F16 if HAS_CUDA else F32
    gen = torch.Generator().manual_seed(7)
    cu_q, cu_k = _cu([4, 0, 3]).to(DEVICE), _cu([2, 5, 2]).to(DEVICE)
    q = torch.randn(7, 1, 16, generator=gen).to(DEVICE, dtype).requires_grad_(True)
    k, v = (torch.randn(9, 1, 16, generator=gen).to(DEVICE, dtype).requires_grad_(True) for _ in range(2))
    seg_q, seg_k = segment_ids(cu_q, 7), segment_ids(cu_k, 9)
    args = (q, k, v, cu_q, cu_k, seg_q, seg_k, True, 0.3)
    torch.library.opcheck(torch.ops.fastmt.stream_attention_fwd.default, args)
    out, lse = torch.ops.fastmt.stream_attention_fwd.default(*args)
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fastmt.stream_attention_bwd.default, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                     cu_q, cu_k, seg_q, seg_k, True, 0.3))


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("ids", [False, True], ids=["ids-computed", "ids-passed"])
def test_compile_fullgraph_stream_matches_eager(ids):
    """Compiled: the custom ops (segment ids by torch.bucketize in the graph); eager: the autograd.Function
    (same launchers)."""
    torch._dynamo.reset()
    lq, lk = [5, 0, 9, 3], [4, 6, 0, 8]
    inputs, kernel, _ = _stream_case(lq, lk, 2, 16, F16 if HAS_CUDA else F32, False, ids=ids)

    def block(q, k, v):
        return (kernel(q * 2.0, k, v) + 1.0).square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    one = torch.ones(1, device=DEVICE)
    eager = _fwd_bwd(lambda a, b, c: block(a, b, c).reshape(1), *inputs[:3], one)
    comp = _fwd_bwd(lambda a, b, c: compiled(a, b, c).reshape(1), *inputs[:3], one)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), comp, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------------------------
# CUDA: packed batches with the corpus' length distribution (mean ~15, p99 ~75), 8 heads
# ----------------------------------------------------------------------------------------------
def _gpu_packed_case(kind, D, dtype, seed=0, capacity=(2048, 2048), slots=176, max_len=128):
    gen = torch.Generator().manual_seed(seed)
    src, tgt = _packed_layout(gen, capacity, slots, max_len, mean=15, p99=75)
    lq, lk, causal = {"encoder-self": (src, src, False), "decoder-causal": (tgt, tgt, True),
                      "cross": (tgt, src, False)}[kind]
    return _stream_case(lq, lk, 8, D, dtype, causal, seed=seed, max_len=max_len, ids=True)


GPU_PACKED = [pytest.param(kind, D, dtype, id=f"{kind}-D{D}-{'bf16' if dtype == BF16 else 'fp16'}")
              for kind, D, dtype in STREAM_ATTENTION_OP.shapes["packed"]]  # the op's declared launches


@pytest.mark.gpu
@pytest.mark.parametrize("kind,D,dtype", GPU_PACKED)
def test_gpu_packed_batches(poison, kind, D, dtype):
    inputs, kernel, reference = _gpu_packed_case(kind, D, dtype)
    _check_against_reference(kernel, reference, *inputs)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    inputs, kernel, _ = _gpu_packed_case("decoder-causal", 64, BF16, seed=1)
    first, second = _fwd_bwd(kernel, *inputs), _fwd_bwd(kernel, *inputs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(max(len(getattr(pa, n).configs) for n in STREAM_KERNELS)))
def test_gpu_every_config_is_correct(poison, monkeypatch, index):
    """Config ``index`` of each stream kernel (its last one past the end), alone, on causal cross-length
    segments (the causal rule with Lq != Lk) of the corpus distribution."""
    monkeypatch.delenv("FASTMT_AUTOTUNE", raising=False)
    monkeypatch.setattr(_utils, "_CHOSEN", {})
    for name in STREAM_KERNELS:
        kernel = getattr(pa, name)
        monkeypatch.setattr(kernel, "configs", [kernel.configs[min(index, len(kernel.configs) - 1)]])
    gen = torch.Generator().manual_seed(2)
    src, tgt = _packed_layout(gen, (2048, 2048), 176, 128, mean=15, p99=75)
    inputs, kernel, reference = _stream_case(tgt, src, 8, 64, BF16, True, seed=2, max_len=128, ids=True)
    _check_against_reference(kernel, reference, *inputs)


@pytest.mark.gpu
def test_gpu_autotuned_matches(poison, monkeypatch):
    monkeypatch.setenv("FASTMT_AUTOTUNE", "full")  # the decoder's shape has pinned configs (kernels/pinned.py)
    inputs, kernel, reference = _gpu_packed_case("decoder-causal", 64, BF16, seed=3)
    _check_against_reference(kernel, reference, *inputs)
