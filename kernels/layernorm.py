"""Fused LayerNorm(+residual)(+GELU) for fastmt (forward + backward), with a plain-PyTorch reference.

    s = x + residual            (when a residual is given; returned for the pre-LN residual stream)
    y = act(LayerNorm(s) * weight + bias),  act in {None, "gelu" (exact erf), "gelu_tanh"}
    RMSNorm (``rms_norm`` / ``RMSNorm``, flash-attn's ``IS_RMS_NORM`` on the same kernels): no mean,
    x_hat = s / sqrt(mean(s^2) + eps); its statistics hold a zero mean (the backward's x_hat is the same code)

Fused: one pass over each row reads x (and residual), writes s (only when a residual is given),
y and the fp32 statistics (mean and rstd of each row). The backward reads dy, ds (the upstream
gradient of s, when s is used), s, weight, bias and the statistics, recomputes x_hat and the GELU
pre-activation instead of saving them, and writes ds_total = ds + d LN / d s (the gradient of both x
and residual) plus one fp32 partial dW/dB row per program; one ``sum`` over those rows gives dW/dB:
deterministic, no atomics, no locks.

Dtypes: x / residual fp32, bf16 or fp16; weight / bias of any float dtype (fp32 master weights with
bf16 activations are fine). ``s`` takes PyTorch's promoted dtype of ``x + residual`` (under autocast
the residual stream stays fp32 while sublayer outputs are bf16, as flash-attn's
``residual_in_fp32``) and is rounded to it before the statistics are taken, so the forward and the
backward (which reads the stored ``s``) see the same numbers. All math in fp32; y in x's dtype, each
input's gradient in its own dtype, dW / dB in the parameters' dtypes.

Shapes: x (..., N) with any leading dims; rows may be strided (last stride 1, else copied).
Limits of the Triton kernels: N <= 8192 (a row lives in registers; BLOCK_N = next power of two of N,
masked). ``backend="auto"`` sends wider rows and other dtypes to the reference; "triton" raises.
Not supported by the kernels: dropout, elementwise_affine=False (pass ones), fp64.

Layout of this file (every kernel file follows it): reference -> Triton kernels ``_layer_norm_fwd_kernel``
/ ``_bwd_kernel`` (their autotuning space, the tiles kept per width: kernels/layernorm_tiles.py) ->
launchers ``layer_norm_fwd`` / ``_bwd`` -> one ``KernelOp`` registration per norm (custom ops
``fastmt::layer_norm_fwd`` / ``_bwd`` and ``fastmt::rms_norm_fwd`` / ``_bwd``: torch.compile) and the eager path ->
public ``layer_norm`` / ``rms_norm`` -> ``LayerNorm`` / ``RMSNorm`` modules.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from kernels import NORM_BACKENDS
from kernels._utils import (
    KernelOp,
    empty,
    interpreting,
    launch,
    poison_enabled,
    resolve_backend,
    triton_usable,
)
from kernels.layernorm_tiles import BWD_TILES, FWD_TILES, block_n, gpu_shapes, layer_norm_autotune

ACTIVATIONS = (None, "gelu", "gelu_tanh")
MAX_TRITON_N = 8192  # widest row the kernels hold in registers
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x and residual dtypes the kernels take
_ACTIVATION_CODE = {"none": 0, "gelu": 1, "gelu_tanh": 2}  # the ops' string -> kernel constexpr

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_TANH_C = tl.constexpr(0.044715)
_ROUNDED_PRODUCTS = tl.constexpr(not interpreting())  # inline PTX does not run under the interpreter


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch): the semantics every backend must match
# ----------------------------------------------------------------------------------------------
def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    activation: str | None = None,
    upcast: bool = True,
    is_rms_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, s) with s = x + residual (PyTorch's promoted dtype) or x itself.

    ``upcast=True`` normalises in fp32 (y is cast back to x's dtype); ``upcast=False`` computes in
    x's own dtype, as plain PyTorch would (tests use it to measure PyTorch's same-dtype error, and
    fp64 inputs with ``upcast=False`` as the ground truth).
    """
    dtype = x.dtype
    s = x + residual if residual is not None else x
    h = s.float() if upcast else s
    w = weight.to(h.dtype)
    b = bias.to(h.dtype) if bias is not None else None
    if is_rms_norm:  # RMSNorm(s) * w + b
        y = F.rms_norm(h, (h.shape[-1],), w, eps)
        y = y + b if b is not None else y
    else:
        y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y.to(dtype), s


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    """act(z) in fp32: 0 identity, 1 exact GELU z*Phi(z), 2 tanh GELU z*sigmoid(2u)."""
    if ACTIVATION == 1:
        return 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    elif ACTIVATION == 2:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation, no tanh needed.
        u = _SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z)
        return z * tl.sigmoid(2.0 * u)
    else:
        return z


@triton.jit
def _activation_grad(z, ACTIVATION: tl.constexpr):
    """d act / dz in fp32 (only called for ACTIVATION 1 and 2)."""
    if ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2))
        pdf = _INV_SQRT_2PI * tl.exp(-0.5 * z * z)
        return cdf + z * pdf
    else:
        u = _SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)
        # d/dz [z * sigmoid(2u)] = sigmoid(2u) + 2 z du sigmoid(2u) sigmoid(-2u); sigmoid(-2u) rather
        # than 1 - sigmoid(2u), which cancels for large z.
        return tl.sigmoid(2.0 * u) + 2.0 * z * du * tl.sigmoid(2.0 * u) * tl.sigmoid(-2.0 * u)


@triton.jit
def _mul_rn(a, b):
    """a * b in fp32, rounded by itself: a product the compiler may not contract into an fma with a later add
    or subtract (on the GPU LLVM and ptxas contract a plain ``*`` followed by ``-``; numpy never does)."""
    if _ROUNDED_PRODUCTS:
        # mul.rn.f32: an explicit rounding mode is never fused (PTX ISA, "mul"); no ftz, unlike libdevice's
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@layer_norm_autotune(16, key=["N", "HAS_RESIDUAL"], limits=FWD_TILES)
@triton.jit(do_not_specialize=["M"])  # the row count bounds a mask along rows: one compile for every M
def _layer_norm_fwd_kernel(
    X_ptr,  # (M, N) input rows, row stride stride_x_row, last stride 1
    R_ptr,  # (M, N) residual rows (read only when HAS_RESIDUAL)
    W_ptr,  # (N,) weight
    B_ptr,  # (N,) bias (read only when HAS_BIAS)
    Y_ptr,  # (M, N) out: act(LN(s) * w + b), x's dtype
    S_ptr,  # (M, N) out: s = x + residual in the promoted dtype (written only when HAS_RESIDUAL)
    Stats_ptr,  # (2, M) out, fp32: row 0 the mean of each row of s, row 1 its 1 / sqrt(var + eps)
    stride_x_row,  # elements between rows of X
    stride_r_row,  # elements between rows of R
    stride_y_row,  # elements between rows of Y
    stride_s_row,  # elements between rows of S
    M,  # rows
    N,  # row width (normalised dimension)
    eps,  # added to the variance
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 exact GELU, 2 tanh GELU
    IS_RMS_NORM: tl.constexpr,  # RMSNorm: no mean subtracted (the stored mean is 0)
    BLOCK_N: tl.constexpr,  # next power of two >= N
    ROWS: tl.constexpr,  # rows per program (autotuned)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]  # (ROWS, BLOCK_N)
    rows64 = rows.to(tl.int64)

    x = tl.load(X_ptr + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + rows64[:, None] * stride_r_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S_ptr.dtype.element_ty)
        tl.store(S_ptr + rows64[:, None] * stride_s_row + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)  # normalise exactly the s the backward will read

    # IEEE division (div_rn): Triton's fp32 `/` is the GPU's approximate div.full.f32 (2 ulp). (Not the cause of
    # the one-column dx error on the H200, 2026-11-27: that was a contracted product in the backward, see _mul_rn.)
    if IS_RMS_NORM:
        mean = tl.zeros((ROWS,), dtype=tl.float32)
        xc = tl.where(mask, x, 0.0)
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), N * 1.0)  # (ROWS,) fp32
        xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.math.div_rn(tl.sum(xc * xc, axis=1), N * 1.0)  # two-pass variance: the row is in registers anyway
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(Stats_ptr + rows64, mean, mask=row_mask)
    tl.store(Stats_ptr + M + rows64, rstd, mask=row_mask)

    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    z = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        z += b[None, :]
    y = _activation(z, ACTIVATION)
    tl.store(Y_ptr + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


@layer_norm_autotune(8, key=["N", "HAS_DS"], limits=BWD_TILES)
@triton.jit(do_not_specialize=["M", "rows_per_program"])  # row counts (and the GPU's SM count through G)
def _layer_norm_bwd_kernel(
    DY_ptr,  # (M, N) upstream gradient of y
    DS_ptr,  # (M, N) upstream gradient of s (read only when HAS_DS)
    S_ptr,  # (M, N) the LN input s saved by the forward (x itself when there was no residual)
    W_ptr,  # (N,) weight
    B_ptr,  # (N,) bias (read only when HAS_BIAS and ACTIVATION != 0: GELU's pre-activation)
    Stats_ptr,  # (2, M) fp32 mean and rstd of s, from the forward
    DX_ptr,  # (M, N) out: ds + dLN/ds, the gradient of x and of residual; s's dtype
    Partial_ptr,  # (2, G, N) out, fp32: [0, pid] this program's partial dW, [1, pid] its partial dB
    stride_dy_row,  # elements between rows of DY
    stride_ds_row,  # elements between rows of DS
    stride_s_row,  # elements between rows of S
    stride_dx_row,  # elements between rows of DX
    M,  # rows
    N,  # row width
    rows_per_program,  # program pid owns rows [pid * rows_per_program, (pid + 1) * rows_per_program)
    HAS_DS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0 none, 1 exact GELU, 2 tanh GELU
    IS_RMS_NORM: tl.constexpr,  # RMSNorm: dx has no mean(g) term (x_hat = s * rstd: the stored mean is 0)
    BLOCK_N: tl.constexpr,  # next power of two >= N
    ROWS: tl.constexpr,  # rows per loop step (autotuned)
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N

    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Per-row-slot partial sums; reduced over the ROWS axis once, after the loop.
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for first in range(row_start, row_end, ROWS):
        rows = first + tl.arange(0, ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        s = tl.load(S_ptr + rows64[:, None] * stride_s_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY_ptr + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Stats_ptr + rows64, mask=row_mask, other=0.0)
        rstd = tl.load(Stats_ptr + M + rows64, mask=row_mask, other=0.0)  # 0 on padding rows: x_hat = 0
        x_hat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        if ACTIVATION != 0:
            z = x_hat * w[None, :]
            if HAS_BIAS:
                z += b[None, :]
            dz = dy * _activation_grad(z, ACTIVATION)  # 0 where masked: dy was loaded as 0
        else:
            dz = dy
        dw_acc += dz * x_hat
        db_acc += dz

        # ds = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),  g = dz * w.
        # g is rounded by itself (mul.rn): contracted into fma(dz, w, -mean(g)), g - mean(g) was the product's
        # rounding error instead of 0 where g equals its mean (one column: dx errors up to 6e-5 on the H200, rstd
        # = 1/sqrt(eps) ~ 316 amplifying it). tests/kernels/test_layernorm_codegen.py checks the PTX.
        # RMSNorm: ds = rstd * (g - x_hat * mean(g * x_hat)).
        g = _mul_rn(dz, w[None, :])
        c_gx = tl.math.div_rn(tl.sum(g * x_hat, axis=1), N * 1.0)  # IEEE division, as in the forward
        if IS_RMS_NORM:
            dx = (g - x_hat * c_gx[:, None]) * rstd[:, None]
        else:
            c_g = tl.math.div_rn(tl.sum(g, axis=1), N * 1.0)
            dx = (g - c_g[:, None] - x_hat * c_gx[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS_ptr + rows64[:, None] * stride_ds_row + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(DX_ptr + rows64[:, None] * stride_dx_row + cols[None, :], dx.to(DX_ptr.dtype.element_ty),
                 mask=mask)

    # Every program writes its full partial rows, even one that owned no rows (zeros).
    G = tl.num_programs(0)
    tl.store(Partial_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(Partial_ptr + (G + pid) * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Launchers: rows as 2-D, allocate, launch. Inputs were validated by ``layer_norm``.
# ----------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """(tensor, row stride) for t (..., N): t itself when contiguous, else an (M, N) view, copied
    only when its last stride is not 1 (or no view exists)."""
    if t.is_contiguous():
        return t, N
    t2 = t.reshape(-1, N)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, t2.stride(0)


_PROGRAMS: dict[torch.device, int] = {}  # device -> backward programs (a persistent grid)
_PARTIALS: dict[tuple, torch.Tensor] = {}  # (device, G, N) -> the eager backward's (2, G, N) scratch


_promoted = functools.cache(torch.promote_types)  # a dispatcher op per call otherwise


def _bwd_programs(device: torch.device) -> int:
    """Backward grid: ~2 programs per SM on CUDA; 4 under the interpreter (~1 ms per program)."""
    G = _PROGRAMS.get(device)
    if G is None:
        G = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        _PROGRAMS[device] = G
    return G


def _partials(G: int, N: int, device: torch.device, reuse: bool, poison: bool) -> torch.Tensor:
    """The backward's (2, G, N) fp32 dW/dB partial rows.

    With ``reuse`` (the eager path on CUDA, not while capturing a CUDA graph) one buffer per
    (device, G, N) serves every call: each call's kernel writes all of it and its one ``sum`` reads
    it, in stream order (an op's backward runs on its forward's stream). Compiled graphs (the custom
    op) allocate per call, so a buffer never lives in a CUDA-graph memory pool.
    """
    if not (reuse and device.type == "cuda") or torch.cuda.is_current_stream_capturing():
        return empty(2, G, N, dtype=torch.float32, device=device, poison=poison)
    buf = _PARTIALS.get((device, G, N))
    if buf is None:
        buf = _PARTIALS[(device, G, N)] = empty(2, G, N, dtype=torch.float32, device=device, poison=poison)
    return buf


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, eps: float, activation: str, is_rms_norm: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., N) -> y (..., N) in x's dtype; s (..., N) = x + residual in the promoted dtype (an
    empty (0,) tensor without residual); stats (2, ...) fp32: each row's mean (0 for RMSNorm), then its rstd."""
    N = x.shape[-1]
    act = _ACTIVATION_CODE[activation]
    x2, stride_x = _rows(x, N)
    poison = poison_enabled()
    y = empty(x.shape, dtype=x.dtype, device=x.device, poison=poison)
    stats = empty((2, *x.shape[:-1]), dtype=torch.float32, device=x.device, poison=poison)
    if residual is None:
        r2, stride_r, s = x2, 0, x.new_empty(0)
    else:
        r2, stride_r = _rows(residual, N)
        s = empty(x.shape, dtype=_promoted(x.dtype, residual.dtype), device=x.device, poison=poison)
    M = x.numel() // N
    if M == 0:
        return y, s, stats
    key = (N, act, x.dtype, residual.dtype if residual is not None else None, weight.dtype,
           bias.dtype if bias is not None else None) + (("rms",) if is_rms_norm else ())
    launch(
        _layer_norm_fwd_kernel, lambda meta: ((M + meta["ROWS"] - 1) // meta["ROWS"],), key,
        x2, r2, weight, bias if bias is not None else weight, y, s if residual is not None else y, stats,
        stride_x, stride_r, N, N, M, N, eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, ACTIVATION=act, IS_RMS_NORM=is_rms_norm,
        BLOCK_N=block_n(N),
    )
    return y, s, stats


def layer_norm_bwd(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, stats: torch.Tensor, activation: str,
                   num_programs: int | None = None, reuse_scratch: bool = False, is_rms_norm: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``layer_norm_fwd``: dx (..., N) in s's dtype, the gradient of s (so of x and of
    residual): ds + dLN/ds; and dwdb (2, N) fp32: dW, then dB (computed with or without a bias).
    ``num_programs`` overrides the backward grid (tests); ``reuse_scratch``: see ``_partials``."""
    N = s.shape[-1]
    act = _ACTIVATION_CODE[activation]
    dy2, stride_dy = _rows(dy, N)
    s2, stride_s = _rows(s, N)
    ds2, stride_ds = _rows(ds, N) if ds is not None else (dy2, 0)
    M = s.numel() // N
    poison = poison_enabled()
    dx = empty(s.shape, dtype=s.dtype, device=s.device, poison=poison)
    if M == 0:
        return dx, torch.zeros(2, N, dtype=torch.float32, device=s.device)
    G = num_programs or _bwd_programs(s.device)
    partial = _partials(G, N, s.device, reuse_scratch, poison)
    key = (N, act, dy.dtype, ds.dtype if ds is not None else None, s.dtype, weight.dtype,
           bias.dtype if bias is not None else None) + (("rms",) if is_rms_norm else ())
    launch(
        _layer_norm_bwd_kernel, lambda meta: (G,), key,
        dy2, ds2, s2, weight, bias if bias is not None else weight, stats, dx, partial,
        stride_dy, stride_ds, stride_s, N, M, N, (M + G - 1) // G,
        HAS_DS=ds is not None, HAS_BIAS=bias is not None, ACTIVATION=act, IS_RMS_NORM=is_rms_norm,
        BLOCK_N=block_n(N),
    )
    return dx, partial.sum(1)  # one fixed-order reduction over the G partial rows: deterministic


# ----------------------------------------------------------------------------------------------
# Registration: the custom ops for torch.compile, their autograd rule and the eager path (KernelOp).
# ``activation`` travels as "none" | "gelu" | "gelu_tanh".
# ----------------------------------------------------------------------------------------------
def _fwd_fake(x, weight, bias, residual, eps, activation):
    s = (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
         if residual is not None else x.new_empty(0))
    return x.new_empty(x.shape), s, x.new_empty((2, *x.shape[:-1]), dtype=torch.float32)  # contiguous, as real


def _bwd_fake(dy, ds, s, weight, bias, stats, activation):
    return s.new_empty(s.shape), s.new_empty((2, s.shape[-1]), dtype=torch.float32)


def _save(ctx, inputs, output):
    x, weight, bias, residual, eps, activation = inputs
    _, s, stats = output
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.activation = activation
    ctx.save_for_backward(s if residual is not None else x, weight, bias, stats)
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # an unused s gets None, not a tensor of zeros to read


def _grads(ctx, bwd, dy, ds, _dstats):
    """Gradients of (x, weight, bias, residual, eps, activation) given those of (y, s)."""
    s, weight, bias, stats = ctx.saved_tensors
    if dy is None:  # only s was used downstream
        dy = torch.zeros_like(s)
    dx, dwdb = bwd(dy, ds if ctx.has_residual else None, s, weight, bias, stats, ctx.activation)
    dw, db = dwdb.unbind(0)
    # dx is the gradient of s (s's dtype); x and residual each get it in their own dtype
    dres = _cast(dx, ctx.residual_dtype) if ctx.has_residual else None
    db = _cast(db, bias.dtype) if bias is not None else None
    return _cast(dx, ctx.x_dtype), _cast(dw, weight.dtype), db, dres, None, None


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # skips a dispatcher round trip when already there


def _eager_bwd(*args):
    return layer_norm_bwd(*args, reuse_scratch=True)


def rms_norm_fwd(x, weight, bias, residual, eps, activation):
    return layer_norm_fwd(x, weight, bias, residual, eps, activation, is_rms_norm=True)


def rms_norm_bwd(dy, ds, s, weight, bias, stats, activation, reuse_scratch=False):
    return layer_norm_bwd(dy, ds, s, weight, bias, stats, activation, reuse_scratch=reuse_scratch, is_rms_norm=True)


def _rms_eager_bwd(*args):
    return rms_norm_bwd(*args, reuse_scratch=True)


_FWD_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, float eps, str activation) "
               "-> (Tensor, Tensor, Tensor)")
_BWD_SCHEMA = "(Tensor dy, Tensor? ds, Tensor s, Tensor weight, Tensor? bias, Tensor stats, str activation) -> (Tensor, Tensor)"
_ROLES = {"bwd_schema": _BWD_SCHEMA, "bwd_fake": _bwd_fake, "save": _save, "grads": _grads}
LAYER_NORM_OP = KernelOp("fastmt::layer_norm_fwd", layer_norm_fwd, _FWD_SCHEMA, _fwd_fake, bwd=layer_norm_bwd,
                         eager_bwd=_eager_bwd, shapes=gpu_shapes(ACTIVATIONS), **_ROLES)
RMS_NORM_OP = KernelOp("fastmt::rms_norm_fwd", rms_norm_fwd, _FWD_SCHEMA, _fwd_fake, bwd=rms_norm_bwd,
                       eager_bwd=_rms_eager_bwd, **_ROLES)


# ----------------------------------------------------------------------------------------------
# Public function and module
# ----------------------------------------------------------------------------------------------
def _check_inputs(x, weight, bias, residual, activation):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"layer_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    shape = x.shape
    N = shape[-1] if shape else 0
    if N == 0:
        raise ValueError(f"layer_norm: x must have a non-empty last dimension, got shape {tuple(shape)}")
    if weight.shape != (N,):
        raise ValueError(f"layer_norm: weight shape {tuple(weight.shape)} != ({N},) (last dim of x {tuple(shape)})")
    if not weight.is_floating_point():
        raise TypeError(f"layer_norm: weight must be floating point, got {weight.dtype}")
    device = x.device
    if weight.device != device:
        raise ValueError(f"layer_norm: weight is on {weight.device}, x on {device}")
    if bias is not None:
        if bias.shape != (N,):
            raise ValueError(f"layer_norm: bias shape {tuple(bias.shape)} != ({N},)")
        if not bias.is_floating_point():
            raise TypeError(f"layer_norm: bias must be floating point, got {bias.dtype}")
        if bias.device != device:
            raise ValueError(f"layer_norm: bias is on {bias.device}, x on {device}")
    if residual is not None:
        if residual.shape != shape:
            raise ValueError(f"layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(shape)}")
        if not residual.is_floating_point():
            raise TypeError(f"layer_norm: residual must be floating point, got {residual.dtype}")
        if residual.device != device:
            raise ValueError(f"layer_norm: residual is on {residual.device}, x on {device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"layer_norm: activation={activation!r} is not one of {ACTIVATIONS}")


def check_triton_support(x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """Raise TypeError (dtype) or ValueError (width, then device) when the kernels cannot serve x."""
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"layer_norm: backend='triton' supports x in {KERNEL_DTYPES}, got {x.dtype} "
                        f"(use backend='auto' or 'reference')")
    if residual is not None and residual.dtype not in KERNEL_DTYPES:
        raise TypeError(f"layer_norm: backend='triton' supports residuals in {KERNEL_DTYPES}, got {residual.dtype}")
    if x.shape[-1] > MAX_TRITON_N:
        raise ValueError(f"layer_norm: backend='triton' supports widths N <= {MAX_TRITON_N}, got N={x.shape[-1]} "
                         f"(use backend='auto' or 'reference')")
    if not triton_usable(x):
        raise ValueError(f"layer_norm: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), "
                         f"x is on {x.device}")


def triton_supports(x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``check_triton_support`` passes."""
    try:
        check_triton_support(x, residual)
    except (TypeError, ValueError):
        return False
    return True


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    activation: str | None = None,
    return_residual: bool = False,
    backend: str = "auto",
    is_rms_norm: bool = False,
):
    """``act(LayerNorm(x + residual))`` over the last dimension; x (..., N), weight/bias (N,);
    ``act(RMSNorm(x + residual))`` with ``is_rms_norm`` (``rms_norm``).

    Returns y shaped like x, or ``(y, s)`` with ``s = x + residual`` when ``return_residual``.
    ``backend``: "auto" (Triton on CUDA when ``triton_supports``: N <= 8192, fp32/bf16/fp16; the
    reference otherwise), "triton" (raises what ``check_triton_support`` finds) or "reference";
    ``FASTMT_NORM_BACKEND`` overrides "auto".
    """
    _check_inputs(x, weight, bias, residual, activation)
    backend = resolve_backend(backend, "FASTMT_NORM_BACKEND", NORM_BACKENDS)
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_supports(x, residual) else "reference"
    elif backend == "triton":
        check_triton_support(x, residual)
    if backend == "reference":
        y, s = layer_norm_reference(x, weight, bias, residual, eps=eps, activation=activation, upcast=True,
                                    is_rms_norm=is_rms_norm)
        return (y, s) if return_residual else y
    op = RMS_NORM_OP if is_rms_norm else LAYER_NORM_OP
    y, s, _ = op(x, weight, bias, residual, float(eps), activation or "none")
    if not return_residual:
        return y
    return y, (s if residual is not None else x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, **kwargs):
    """``act(RMSNorm(x + residual) * weight + bias)``: ``layer_norm(..., is_rms_norm=True)``, same arguments."""
    return layer_norm(x, weight, bias, residual, is_rms_norm=True, **kwargs)


class LayerNorm(nn.Module):
    """LayerNorm(+residual)(+GELU) module; ``forward(x, residual=None)`` returns y, or (y, x + residual)."""

    is_rms_norm = False

    def __init__(self, dim: int, eps: float = 1e-5, activation: str | None = None, bias: bool = True,
                 backend: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNorm: activation={activation!r} is not one of {ACTIVATIONS}")
        if backend not in NORM_BACKENDS:
            raise ValueError(f"LayerNorm: backend={backend!r} is not one of {NORM_BACKENDS}")
        self.dim, self.eps, self.activation, self.backend = dim, eps, activation, backend
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, residual, eps=self.eps, activation=self.activation,
                          return_residual=residual is not None, backend=self.backend, is_rms_norm=self.is_rms_norm)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, activation={self.activation}, backend={self.backend!r}"


class RMSNorm(LayerNorm):
    """RMSNorm(+residual)(+GELU) on the same kernels (``IS_RMS_NORM``); no bias unless ``bias=True``."""

    is_rms_norm = True

    def __init__(self, dim: int, eps: float = 1e-5, activation: str | None = None, bias: bool = False,
                 backend: str = "auto"):
        super().__init__(dim, eps, activation, bias, backend)
