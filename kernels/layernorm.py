"""Fused LayerNorm(+residual)(+GELU) for fastmt (forward + backward), with an einops reference.

    s = x + residual            (when a residual is given; returned for the pre-LN residual stream)
    y = act(LayerNorm(s) * weight + bias),  act in {None, "gelu" (exact erf), "gelu_tanh"}

Fused: one pass over each row reads x (and residual), writes s (only when a residual is given),
y and the fp32 statistics (mean, rstd: (M,) each). The backward reads dy, ds (the upstream gradient
of s, when s is used), s, weight, bias, mean and rstd, recomputes x_hat and the GELU
pre-activation instead of saving them, and writes ds_total = ds + d LN / d s (the gradient of both
x and residual) plus one fp32 partial dW/dB row per program. A single ``sum`` over those rows
gives dW/dB: deterministic, no atomics, no locks.

Dtypes: x / residual fp32, bf16 or fp16; weight / bias of any float dtype (fp32 master weights
with bf16 activations are fine). x and residual may differ: ``s`` takes PyTorch's promoted dtype of
``x + residual`` (under autocast the residual stream stays fp32 while sublayer outputs are bf16, as
flash-attn's ``residual_in_fp32``). All math in fp32; y in x's dtype, s in the promoted dtype, each
input's gradient in its own dtype, dW / dB in the parameters' dtypes. ``s`` is rounded to its dtype
before the statistics are taken,
so the forward and the backward (which reads the stored ``s``) see the same numbers, as PyTorch's
``x + residual`` then LayerNorm does.

Shapes: x (..., N) with any leading dims; rows may be strided (last stride 1, else copied).
Limits of the Triton kernels: N <= 8192 (one row lives in registers; BLOCK_N = next power of two
of N, masked). ``backend="auto"`` sends wider rows to the reference; ``backend="triton"`` raises.
Not supported by the kernels: RMSNorm, dropout, elementwise_affine=False (pass ones), fp64.

Layers, in order: Triton kernels -> launchers ``ln_fwd`` / ``ln_bwd`` -> custom ops
``fastmt::layer_norm_fwd`` / ``fastmt::layer_norm_bwd`` (+ fake and autograd registrations) ->
reference ``layer_norm_reference`` -> public ``layer_norm`` and the ``LayerNorm`` module.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from kernels._utils import empty, interpreting, resolve_backend, triton_usable

NORM_BACKENDS = ("auto", "triton", "reference")
ACTIVATIONS = (None, "gelu", "gelu_tanh")
MAX_TRITON_N = 8192  # widest row the kernels hold in registers
_ACTIVATION_CODE = {"none": 0, "gelu": 1, "gelu_tanh": 2}  # the ops' string -> kernel constexpr

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_TANH_C = tl.constexpr(0.044715)


# ----------------------------------------------------------------------------------------------
# Autotuning space (CUDA only; the interpreter gets one config: >1 fails there, shared/ENV.md)
# ----------------------------------------------------------------------------------------------
# A program normalises a ROWS x BLOCK_N tile. Small widths need several rows per program to keep
# enough bytes in flight; wide rows need more warps. The pruner keeps, for the width at hand,
# tiles of a few thousand elements with 8-32 (forward) or 8-16 (backward, which holds ~3x more
# live values) elements per thread, so every thread issues 16-byte loads of bf16.
def _tile_grid() -> list[triton.Config]:
    return [triton.Config({"ROWS": rows}, num_warps=warps)
            for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256) for warps in (1, 2, 4, 8, 16)]


def _tile_pruner(min_elems: int, max_elems: int, min_per_thread: int, max_per_thread: int):
    def prune(configs, named_args, **kwargs):
        block_n = triton.next_power_of_2(named_args["N"])
        # Widths below 16 cannot fill min_elems with <= 256 rows: take the biggest tile there is.
        lo = min(min_elems, 256 * block_n)
        kept = [c for c in configs
                if lo <= c.kwargs["ROWS"] * block_n <= max_elems
                and min_per_thread <= c.kwargs["ROWS"] * block_n // (32 * c.num_warps) <= max_per_thread]
        if not kept:  # tiny tiles: the fewest warps that still cover them
            kept = [min((c for c in configs if c.kwargs["ROWS"] * block_n >= lo),
                        key=lambda c: (c.kwargs["ROWS"] * block_n > max_elems, c.num_warps))]
        return kept
    return prune


def _autotune(interpret_config: triton.Config, key: list[str], **prune_limits):
    if interpreting():
        return triton.autotune(configs=[interpret_config], key=key)
    return triton.autotune(configs=_tile_grid(), key=key,
                           prune_configs_by={"early_config_prune": _tile_pruner(**prune_limits)})


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


@_autotune(triton.Config({"ROWS": 16}, num_warps=4), key=["N", "HAS_RESIDUAL"],
           min_elems=4096, max_elems=16384, min_per_thread=8, max_per_thread=32)
@triton.jit
def _ln_fwd_kernel(
    X_ptr,  # (M, N) input rows, row stride stride_x_row, last stride 1
    R_ptr,  # (M, N) residual rows (read only when HAS_RESIDUAL)
    W_ptr,  # (N,) weight
    B_ptr,  # (N,) bias (read only when HAS_BIAS)
    Y_ptr,  # (M, N) out: act(LN(s) * w + b), x's dtype
    S_ptr,  # (M, N) out: s = x + residual in x's dtype (written only when HAS_RESIDUAL)
    Mean_ptr,  # (M,) out, fp32: mean of each row of s
    Rstd_ptr,  # (M,) out, fp32: 1 / sqrt(var + eps) of each row of s
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

    mean = tl.sum(x, axis=1) / N  # (ROWS,) fp32
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N  # two-pass variance: the row is in registers anyway
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(Mean_ptr + rows, mean, mask=row_mask)
    tl.store(Rstd_ptr + rows, rstd, mask=row_mask)

    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    z = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        b = tl.load(B_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        z += b[None, :]
    y = _activation(z, ACTIVATION)
    tl.store(Y_ptr + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y_ptr.dtype.element_ty), mask=mask)


@_autotune(triton.Config({"ROWS": 8}, num_warps=4), key=["N", "HAS_DS"],
           min_elems=2048, max_elems=8192, min_per_thread=8, max_per_thread=16)
@triton.jit
def _ln_bwd_kernel(
    DY_ptr,  # (M, N) upstream gradient of y
    DS_ptr,  # (M, N) upstream gradient of s (read only when HAS_DS)
    S_ptr,  # (M, N) the LN input s saved by the forward (x itself when there was no residual)
    W_ptr,  # (N,) weight
    B_ptr,  # (N,) bias (read only when HAS_BIAS and ACTIVATION != 0: GELU's pre-activation)
    Mean_ptr,  # (M,) fp32 mean of s, from the forward
    Rstd_ptr,  # (M,) fp32 rstd of s, from the forward
    DX_ptr,  # (M, N) out: ds + dLN/ds, the gradient of x and of residual; x's dtype
    DW_ptr,  # (G, N) out, fp32: this program's partial dW (row pid)
    DB_ptr,  # (G, N) out, fp32: this program's partial dB (row pid)
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
        mean = tl.load(Mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(Rstd_ptr + rows, mask=row_mask, other=0.0)  # 0 on padding rows: x_hat = 0
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

        # ds = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),  g = dz * w
        g = dz * w[None, :]
        c_g = tl.sum(g, axis=1) / N
        c_gx = tl.sum(g * x_hat, axis=1) / N
        dx = (g - c_g[:, None] - x_hat * c_gx[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS_ptr + rows64[:, None] * stride_ds_row + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(DX_ptr + rows64[:, None] * stride_dx_row + cols[None, :], dx.to(DX_ptr.dtype.element_ty),
                 mask=mask)

    # Every program writes its full partial row, even one that owned no rows (zeros).
    tl.store(DW_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(DB_ptr + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Launchers: reshape to 2-D rows, allocate, launch. Inputs were validated by ``layer_norm``.
# ----------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """(..., N) -> (M, N) view; copies only when the last stride is not 1 (or no view exists)."""
    t2 = t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _bwd_num_programs(M: int, device: torch.device) -> int:
    """Persistent backward grid: ~2 programs per SM on CUDA; a few under the interpreter."""
    if device.type == "cuda":
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4  # interpreter: each program costs ~1 ms, and this still exercises G > 1
    return max(1, min(M, target))


def ln_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
           eps: float, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., N) -> y (..., N), s (..., N) (or an empty (0,) tensor without residual),
    mean (...,) and rstd (...,) in fp32."""
    N = x.shape[-1]
    assert N <= MAX_TRITON_N and activation in _ACTIVATION_CODE, (N, activation)
    x2 = _rows(x, N)
    r2 = _rows(residual, N) if residual is not None else None
    M = x2.shape[0]
    y = empty(*x.shape, dtype=x.dtype, device=x.device)
    s = (empty(*x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
         if residual is not None else x.new_empty(0))
    mean = empty(*x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = empty(*x.shape[:-1], dtype=torch.float32, device=x.device)
    if M == 0:
        return y, s, mean, rstd
    grid = lambda meta: (triton.cdiv(M, meta["ROWS"]),)  # noqa: E731
    _ln_fwd_kernel[grid](
        x2, r2 if r2 is not None else x2, weight, bias if bias is not None else weight,
        y, s if residual is not None else y, mean, rstd,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, N, N,
        M, N, eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        ACTIVATION=_ACTIVATION_CODE[activation], BLOCK_N=triton.next_power_of_2(N),
    )
    return y, s, mean, rstd


def ln_bwd(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, activation: str,
           num_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``ln_fwd``: (dx (..., N) in s's dtype, dw (N,) in weight's dtype,
    db (N,) in weight's dtype, computed whether or not there is a bias).
    dx is the gradient of s, i.e. of x and of residual: ds + dLN/ds."""
    N = s.shape[-1]
    assert N <= MAX_TRITON_N and activation in _ACTIVATION_CODE, (N, activation)
    dy2, s2 = _rows(dy, N), _rows(s, N)
    ds2 = _rows(ds, N) if ds is not None else None
    M = s2.shape[0]
    G = num_programs or _bwd_num_programs(M, s.device)
    rows_per_program = triton.cdiv(M, G) if M else 1
    G = triton.cdiv(M, rows_per_program) if M else 0  # no program without rows
    dx = empty(*s.shape, dtype=s.dtype, device=s.device)
    dw_partial = empty(G, N, dtype=torch.float32, device=s.device)
    db_partial = empty(G, N, dtype=torch.float32, device=s.device)
    if M > 0:
        _ln_bwd_kernel[(G,)](
            dy2, ds2 if ds2 is not None else dy2, s2, weight, bias if bias is not None else weight,
            mean, rstd, dx, dw_partial, db_partial,
            dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, s2.stride(0), N,
            M, N, rows_per_program,
            HAS_DS=ds is not None, HAS_BIAS=bias is not None,
            ACTIVATION=_ACTIVATION_CODE[activation], BLOCK_N=triton.next_power_of_2(N),
        )
    # One fixed-order reduction over the G partial rows: deterministic.
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(bias.dtype if bias is not None else weight.dtype)
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile, with fake (meta) and autograd registrations.
# ``activation`` travels as "none" | "gelu" | "gelu_tanh".
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("fastmt::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor | None, eps: float, activation: str,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ln_fwd(x, weight, bias, residual, eps, activation)


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, residual, eps, activation):
    s = (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
         if residual is not None else x.new_empty(0))
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), s, stats, torch.empty_like(stats)


@torch.library.custom_op("fastmt::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, activation: str,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ln_bwd(dy, ds, s, weight, bias, mean, rstd, activation)


@_layer_norm_bwd_op.register_fake
def _(dy, ds, s, weight, bias, mean, rstd, activation):
    db_dtype = bias.dtype if bias is not None else weight.dtype
    return torch.empty_like(s), torch.empty_like(weight), weight.new_empty(weight.shape, dtype=db_dtype)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, activation = inputs
    _, s, mean, rstd = output
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.activation = activation
    ctx.save_for_backward(s if residual is not None else x, weight, bias, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # an unused s gets None, not a tensor of zeros to read


def _layer_norm_backward(ctx, dy, ds, _dmean, _drstd):
    s, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:  # only s was used downstream
        dy = torch.zeros_like(s)
    ds = ds if ctx.has_residual else None
    dx, dw, db = torch.ops.fastmt.layer_norm_bwd(dy, ds, s, weight, bias, mean, rstd, ctx.activation)
    # dx is the gradient of s (s's dtype); x and residual each get it in their own dtype
    dres = dx.to(ctx.residual_dtype) if ctx.has_residual else None
    return dx.to(ctx.x_dtype), dw, db if bias is not None else None, dres, None, None


_layer_norm_fwd_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


# ----------------------------------------------------------------------------------------------
# Reference
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, s) with s = x + residual (or x), s in x's dtype.

    ``upcast=True`` normalises in fp32 (y is cast back to x's dtype); ``upcast=False`` computes in
    x's own dtype, as plain PyTorch would (tests use it to measure PyTorch's same-dtype error, and
    fp64 inputs with ``upcast=False`` as the ground truth).
    """
    dtype = x.dtype
    s = x + residual if residual is not None else x
    h = s.float() if upcast else s
    w = weight.to(h.dtype)
    b = bias.to(h.dtype) if bias is not None else None
    y = F.layer_norm(h, (h.shape[-1],), w, b, eps)
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y.to(dtype), s


# ----------------------------------------------------------------------------------------------
# Public function and module
# ----------------------------------------------------------------------------------------------
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(x, weight, bias, residual, activation):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"layer_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"layer_norm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"layer_norm: weight shape {tuple(weight.shape)} != ({N},) (last dim of x {tuple(x.shape)})")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"layer_norm: bias shape {tuple(bias.shape)} != ({N},)")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if not residual.is_floating_point():
            raise TypeError(f"layer_norm: residual must be floating point, got {residual.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"layer_norm: {name} must be floating point, got {t.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"layer_norm: {name} is on {t.device}, x on {x.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"layer_norm: activation={activation!r} is not one of {ACTIVATIONS}")


def _check_triton_supported(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Why ``backend="triton"`` cannot serve x (+ residual), as a ValueError/TypeError; None when it can."""
    N = x.shape[-1]
    if N > MAX_TRITON_N:
        raise ValueError(f"layer_norm: backend='triton' supports widths N <= {MAX_TRITON_N}, got N={N} "
                         f"(use backend='auto' or 'reference')")
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"layer_norm: backend='triton' supports {_KERNEL_DTYPES}, got {x.dtype}")
    if residual is not None and residual.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"layer_norm: backend='triton' supports residuals in {_KERNEL_DTYPES}, got {residual.dtype}")
    if not triton_usable(x):
        raise ValueError(f"layer_norm: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), "
                         f"x is on {x.device}")


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
):
    """``act(LayerNorm(x + residual))`` over the last dimension; x (..., N), weight/bias (N,).

    Returns y shaped like x, or ``(y, s)`` with ``s = x + residual`` when ``return_residual``.
    ``backend``: "auto" (Triton on CUDA when N <= 8192 and the dtype is fp32/bf16/fp16, the
    reference otherwise), "triton" or "reference"; ``FASTMT_NORM_BACKEND`` overrides "auto".
    """
    _check_inputs(x, weight, bias, residual, activation)
    backend = resolve_backend(backend, "FASTMT_NORM_BACKEND", NORM_BACKENDS)
    if backend == "auto":
        kernel_dtypes = x.dtype in _KERNEL_DTYPES and (residual is None or residual.dtype in _KERNEL_DTYPES)
        backend = "triton" if x.is_cuda and x.shape[-1] <= MAX_TRITON_N and kernel_dtypes else "reference"
    if backend == "triton":
        _check_triton_supported(x, residual)
        y, s, _, _ = torch.ops.fastmt.layer_norm_fwd(x, weight, bias, residual, float(eps), activation or "none")
        if residual is None:
            s = x
    else:
        y, s = layer_norm_reference(x, weight, bias, residual, eps=eps, activation=activation, upcast=True)
    return (y, s) if return_residual else y


class LayerNorm(nn.Module):
    """LayerNorm(+residual)(+GELU) module; ``forward(x, residual=None)`` returns y, or (y, x + residual)."""

    def __init__(self, dim: int, eps: float = 1e-5, activation: str | None = None, bias: bool = True,
                 backend: str = "auto"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNorm: activation={activation!r} is not one of {ACTIVATIONS}")
        self.dim, self.eps, self.activation, self.backend = dim, eps, activation, backend
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return layer_norm(x, self.weight, self.bias, residual, eps=self.eps, activation=self.activation,
                          return_residual=residual is not None, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, activation={self.activation}, backend={self.backend!r}"
