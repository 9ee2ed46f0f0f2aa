"""The GPU test grid's tolerances under the GPU's real rounding, on CPU (tests/kernels/lowp.py emulates the
kernels' precision path: fp32 accumulation, P and dS rounded to fp16/bf16 before the second matmuls).

Each case of the CUDA grids in test_sequence_attention.py and test_packed_attention.py (same inputs, seeds,
lengths and the config the GPU tests launch, ``FASTMT_AUTOTUNE=0``'s first fitting one) goes through the
emulation and must satisfy the same rule the GPU test applies (test_attention's ``_assert_within_rule``,
without the interpreter's truncation allowance, as on CUDA). Every forward config the autotuner may pick
is checked in the slow variant.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.packed_attention as pa
import kernels.sequence_attention as sa
import tests.kernels.test_attention as ta
from kernels._utils import block_configs
from kernels.flash_attention import attention_reference
from tests.kernels import test_packed_attention as tpa
from tests.kernels import test_sequence_attention as tsa
from tests.kernels.lowp import emulate_padded, emulate_varlen, reference_varlen

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def _as_on_cuda(monkeypatch):
    """The tests' tolerance rule as it runs on CUDA: no allowance for the interpreter's truncating casts."""
    monkeypatch.setattr(ta, "interpreting", lambda: False)


def _sequence_configs(rows: int, D: int) -> list[tuple[int, int]]:
    """(BLOCK_M, BLOCK_N) of the per-sequence forward configs the pruner keeps for ``rows`` query rows."""
    kept = sa._prune(block_configs(sa.FWD_CONFIGS), {"SEQ_BUCKET": sa._bucket(rows)}, HEAD_DIM=D)
    return list(dict.fromkeys((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept))


def _stream_configs(D: int) -> list[tuple[int, int]]:
    kept = pa._prune(block_configs(pa.STREAM_FWD_CONFIGS), {}, HEAD_DIM=D)
    return list(dict.fromkeys((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept))


def _check(emulate, reference, inputs):
    q, k, v, do = inputs
    same = ta._fwd_bwd(reference, q, k, v, do)
    truth = ta._fwd_bwd(reference, *(t.double() for t in inputs))
    return ta._assert_within_rule(emulate(), same, truth, q, k, v, do)


# ----------------------------------------------------------------------------------------------
# the cases of the CUDA grids, built as the GPU tests build them (on the CPU)
# ----------------------------------------------------------------------------------------------
def _padded(shape, D, dtype, causal, ragged, every_config=False):
    B, H, Tq, Tk = tsa.GPU_SHAPES[shape]
    (q, k, v, do), gen = ta._inputs(B, H, Tq, Tk, D, dtype, seed=Tq * 131 + Tk, device="cpu")
    ql = ta._lengths(B, Tq, "ragged" if ragged else "full", gen)
    kl = ta._lengths(B, Tk, "empty" if ragged and B > 1 else ("ragged" if ragged else "full"), gen)
    scale = 1.0 / math.sqrt(D)

    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal, q_lengths=ql, k_lengths=kl, upcast=False)

    configs = _sequence_configs(Tq, D)
    for bm, bn in configs if every_config else configs[:1]:
        _check(lambda bm=bm, bn=bn: emulate_padded(q, k, v, do, ql, kl, causal=causal, scale=scale, block_m=bm,
                                                   block_n=bn), reference, (q, k, v, do))


def _varlen(lq, lk, H, D, dtype, causal, seed, tiling, every_config=False, max_len=None):
    (q, k, v, do), _, _ = tpa._stream_case(lq, lk, H, D, dtype, causal, seed=seed, max_len=max_len)
    cu_q, cu_k = tpa._cu(lq), tpa._cu(lk)
    reference = reference_varlen(cu_q, cu_k, causal=causal)  # the GPU tests' reference, segments grouped
    configs = _sequence_configs(max_len or max(lq), D) if tiling == "sequence" else _stream_configs(D)
    for bm, bn in configs if every_config else configs[:1]:
        _check(lambda bm=bm, bn=bn: emulate_varlen(q, k, v, do, cu_q, cu_k, causal=causal, scale=1 / math.sqrt(D),
                                                   tiling=tiling, block_m=bm, block_n=bn), reference, (q, k, v, do))


def _packed(kind, D, dtype, seed=0, every_config=False):
    gen = torch.Generator().manual_seed(seed)
    src, tgt = tpa._packed_layout(gen, (2048, 2048), 176, 128, mean=15, p99=75)
    lq, lk, causal = {"encoder-self": (src, src, False), "decoder-causal": (tgt, tgt, True),
                      "cross": (tgt, src, False)}[kind]
    _varlen(lq, lk, 8, D, dtype, causal, seed, "stream", every_config, max_len=128)


PADDED = [pytest.param(*c, id=tsa._gpu_id(*c)) for c in tsa.GPU_COVER]
VARLEN = [pytest.param(lengths, D, dtype, causal, tiling, id=f"{tiling}-{lengths}-D{D}-{dtype}-{causal}")
          for tiling in ("sequence", "stream")
          for lengths, D, dtype, causal in (("self-ragged", 64, BF16, True), ("self-ragged", 16, FP16, False),
                                            ("cross-ragged-nokeys", 128, FP16, False),
                                            ("cross-ragged-nokeys", 64, BF16, True))]
PACKED = [pytest.param(p.values[0], p.values[1], p.values[2], id=p.id) for p in tpa.GPU_PACKED]


# the GPU grid's most exposed cases, in CI: long causal bf16 (1023 rows), the training shape (packed bf16,
# causal decoder and cross) and a no-key cross case; the rest of the grid and every config: slow
@pytest.mark.parametrize("case", [
    pytest.param(lambda: _padded("B1-H2-Tq1023-Tk1024", 64, BF16, True, True), id="B1-H2-Tq1023-Tk1024-D64-bf16-causal"),
    pytest.param(lambda: _packed("decoder-causal", 64, BF16), id="packed-decoder-causal-D64-bf16"),
    pytest.param(lambda: _packed("cross", 64, BF16), id="packed-cross-D64-bf16"),
    pytest.param(lambda: _varlen(*tsa.GPU_VARLEN["cross-ragged-nokeys"], 4, 64, BF16, True, 350, "stream"),
                 id="stream-cross-ragged-nokeys-D64-bf16-causal"),
])
def test_gpu_rounding_meets_the_tolerance_rule(case):
    case()


@pytest.mark.slow
@pytest.mark.parametrize("shape,D,dtype,causal,ragged", PADDED)
def test_gpu_rounding_padded_grid(shape, D, dtype, causal, ragged):
    _padded(shape, D, dtype, causal, ragged, every_config=True)


@pytest.mark.slow
@pytest.mark.parametrize("lengths,D,dtype,causal,tiling", VARLEN)
def test_gpu_rounding_varlen_grid(lengths, D, dtype, causal, tiling):
    lq, lk = tsa.GPU_VARLEN[lengths]
    _varlen(lq, lk, 4, D, dtype, causal, sum(lq), tiling, every_config=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind,D,dtype", PACKED)
def test_gpu_rounding_packed_grid(kind, D, dtype):
    _packed(kind, D, dtype, every_config=True)


# ----------------------------------------------------------------------------------------------
# the emulation itself
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiling", ["sequence", "stream"])
def test_emulation_in_fp32_is_exact_attention(tiling):
    """Without low-precision inputs nothing is rounded: any block size gives fp64 attention to fp32 accuracy,
    so the emulation's algebra (online softmax, masks, tiling origins, backward) is the reference's."""
    lq, lk = [5, 0, 17, 1, 9], [7, 3, 17, 0, 12]
    (q, k, v, do), _, reference = tpa._stream_case(lq, lk, 2, 16, torch.float32, True, seed=4)
    truth = ta._fwd_bwd(reference, *(t.double() for t in (q, k, v, do)))
    for bm, bn in ((16, 4), (32, 8), (64, 64)):
        got = emulate_varlen(q, k, v, do, tpa._cu(lq), tpa._cu(lk), causal=True, scale=1 / math.sqrt(16),
                             tiling=tiling, block_m=bm, block_n=bn)
        for name, g, t in zip(("out", "dq", "dk", "dv"), got, truth):
            torch.testing.assert_close(g.double(), t, rtol=1e-5, atol=1e-5, msg=f"{name} bm={bm} bn={bn}")


def test_emulation_rounds_where_the_kernel_does():
    """In bf16 the emulated output moves with the key block size (P is rounded relative to each block's
    running maximum) and differs from fp32 attention of the same inputs by about bf16's resolution."""
    lq = [40]
    (q, k, v, do), _, reference = tpa._stream_case(lq, lq, 1, 16, BF16, False, seed=5)
    cu = tpa._cu(lq)
    runs = [emulate_varlen(q, k, v, do, cu, cu, causal=False, scale=0.25, tiling="sequence", block_m=16,
                           block_n=bn)[0].float() for bn in (8, 64)]
    exact = reference(*(t.float() for t in (q, k, v)))
    assert not torch.equal(runs[0], runs[1])
    err = (runs[1] - exact).abs().max().item()
    assert 1e-4 < err < 0.05, err


def test_the_rule_rejects_a_coarser_precision_path():
    """The check has teeth: the same packed case with P and dS carried at fp8 (e4m3: 3 mantissa bits where
    bf16 has 7) breaks the rule that the kernels' real path meets. (Scores or accumulators rounded to bf16
    do not: PyTorch's own bf16 attention, the rule's yardstick, makes errors that large.)"""
    gen = torch.Generator().manual_seed(0)
    src, tgt = tpa._packed_layout(gen, (2048, 2048), 176, 128, mean=15, p99=75)
    (q, k, v, do), _, _ = tpa._stream_case(tgt, tgt, 8, 64, BF16, True, seed=0, max_len=128)
    cu = tpa._cu(tgt)
    (bm, bn), *_ = _stream_configs(64)

    def emulate(p_dtype):
        return lambda: emulate_varlen(q, k, v, do, cu, cu, causal=True, scale=1 / 8, tiling="stream", block_m=bm,
                                      block_n=bn, p_dtype=p_dtype)

    reference = reference_varlen(cu, cu, causal=True)
    _check(emulate(None), reference, (q, k, v, do))
    with pytest.raises(AssertionError, match="ratio"):
        _check(emulate(torch.float8_e4m3fn), reference, (q, k, v, do))
