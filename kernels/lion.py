"""Fused Lion optimizer step (one launch per flat buffer), with a plain-PyTorch reference.

lion-pytorch's update, in place on (param, exp_avg), elementwise:

    param   *= 1 - lr * weight_decay
    param   -= lr * sign(beta1 * exp_avg + (1 - beta1) * grad)
    exp_avg  = beta2 * exp_avg + (1 - beta2) * grad

One program updates BLOCK consecutive elements: param, grad and exp_avg are each read once and param
and exp_avg written once, so a step over a parameter group flattened into one contiguous buffer is a
single launch. Nothing syncs the host: ``lr`` may be a 0-d fp32 device tensor (a scheduler changes it
without recompiles, and the step can be captured in a CUDA graph), and ``found_inf`` (a 0-d device
tensor, float or bool) skips the whole update on the device when nonzero, like the ``found_inf`` of
torch's fused AdamW.

Dtypes: param and exp_avg fp32 (master weights and state); grad fp32, bf16 or fp16 (cast to fp32 after
loading). All math in fp32, in lion-pytorch's order of roundings: ``(1 - beta)`` and
``1 - lr * weight_decay`` (for a python ``lr``) are computed on the host in double as PyTorch does,
no multiply-add contraction except where PyTorch's ``add(alpha=)`` fuses one.
Not supported by the kernel: non-contiguous param / exp_avg, other param dtypes (``backend="auto"``
sends those to the reference), ``maximize``, sparse gradients.

Layout: reference -> Triton kernel -> launcher ``lion_step_triton`` -> custom op ``fastmt::lion_step``
(for torch.compile) -> public ``lion_step`` -> ``Lion`` optimizer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import LION_BACKENDS
from kernels._utils import KernelOp, resolve_backend, triton_usable

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024  # elements per program: 8 fp32 per thread with 4 warps (two 16-byte vectors)
NUM_WARPS = 4
# PyTorch's roundings: no multiply-add contraction beyond the kernel's explicit tl.fma
LAUNCH_OPTIONS = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------------
# Reference (plain PyTorch, the CPU path and the test oracle)
# ----------------------------------------------------------------------------------------------
def lion_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``lion_step`` in PyTorch ops: lion-pytorch's arithmetic, a fixed number of ops whatever the size,
    ``found_inf`` applied with ``torch.where`` (no host sync)."""
    update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
    if isinstance(lr, torch.Tensor):
        new_param = param.mul(1.0 - lr * weight_decay).sub_(lr * update)
    else:
        new_param = param.mul(1.0 - lr * weight_decay).add_(update, alpha=-lr)
    new_exp_avg = exp_avg.mul(beta2).add_(grad, alpha=1.0 - beta2)
    if found_inf is not None:
        skip = found_inf.reshape(()) != 0
        new_param = torch.where(skip, param, new_param)
        new_exp_avg = torch.where(skip, exp_avg, new_exp_avg)
    param.copy_(new_param)
    exp_avg.copy_(new_exp_avg)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
@triton.jit
def _lion_step_kernel(
    P_ptr,  # (n,) fp32 parameters, updated in place
    G_ptr,  # (n,) gradients: fp32, bf16 or fp16
    M_ptr,  # (n,) fp32 exp_avg (Lion's momentum), updated in place
    LR_ptr,  # () fp32 learning rate (read only when LR_IS_TENSOR)
    FoundInf_ptr,  # () skip flag, any dtype: nonzero leaves everything untouched (read when HAS_FOUND_INF)
    lr,  # python learning rate (used when not LR_IS_TENSOR)
    decay,  # 1 - lr * weight_decay computed on the host (used when not LR_IS_TENSOR)
    weight_decay,  # decoupled weight decay, scaled by lr (used when LR_IS_TENSOR)
    beta1,  # momentum of the update's interpolation
    one_minus_beta1,  # 1 - beta1, from the host
    beta2,  # momentum of exp_avg
    one_minus_beta2,  # 1 - beta2, from the host
    n,  # elements
    LR_IS_TENSOR: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    if HAS_FOUND_INF:
        n = tl.where(tl.load(FoundInf_ptr) == 0, n, 0)  # a skipped step reads and writes nothing
    mask = offs < n
    if LR_IS_TENSOR:
        lr = tl.load(LR_ptr)
        decay = 1.0 - lr * weight_decay
    p = tl.load(P_ptr + offs, mask=mask, other=0.0)
    g = tl.load(G_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M_ptr + offs, mask=mask, other=0.0)
    c = tl.fma(g, one_minus_beta1, m * beta1)  # PyTorch's mul(beta1).add(g, alpha=1 - beta1)
    update = (c > 0).to(tl.float32) - (c < 0).to(tl.float32)  # torch.sign: 0 and NaN give 0
    p = p * decay - lr * update  # lr * update is exact (update is -1, 0 or 1): one rounding, as add_
    m = tl.fma(g, one_minus_beta2, m * beta2)
    tl.store(P_ptr + offs, p, mask=mask)
    tl.store(M_ptr + offs, m, mask=mask)


# ----------------------------------------------------------------------------------------------
# Launcher. Inputs were validated by ``lion_step``.
# ----------------------------------------------------------------------------------------------
def lion_step_triton(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, lr: float,
                     lr_tensor: torch.Tensor | None, beta1: float, beta2: float, weight_decay: float,
                     found_inf: torch.Tensor | None) -> None:
    """One launch updating contiguous fp32 ``param`` and ``exp_avg`` in place; ``lr_tensor`` (0-d fp32
    on param's device) replaces the python ``lr`` when given."""
    n = param.numel()
    if n == 0:
        return
    if not grad.is_contiguous():
        grad = grad.contiguous()
    _lion_step_kernel[((n + BLOCK - 1) // BLOCK,)](
        param, grad, exp_avg,
        lr_tensor if lr_tensor is not None else param, found_inf if found_inf is not None else param,
        lr, 1.0 - lr * weight_decay, weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, n,
        LR_IS_TENSOR=lr_tensor is not None, HAS_FOUND_INF=found_inf is not None, BLOCK=BLOCK,
        **LAUNCH_OPTIONS,
    )


# ----------------------------------------------------------------------------------------------
# Custom op: opaque to torch.compile (a compiled or CUDA-graph-captured step calls it as one node)
# ----------------------------------------------------------------------------------------------
LION_STEP_OP = KernelOp(
    "fastmt::lion_step", lion_step_triton,
    "(Tensor(a0!) param, Tensor grad, Tensor(a2!) exp_avg, float lr, Tensor? lr_tensor, float beta1, float beta2, "
    "float weight_decay, Tensor? found_inf) -> ()", lambda *args: None, mutates_args=("param", "exp_avg"),
)


# ----------------------------------------------------------------------------------------------
# Public function and optimizer
# ----------------------------------------------------------------------------------------------
def _check_inputs(param, grad, exp_avg, lr, beta1, beta2, weight_decay, found_inf):
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"lion_step: {name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if grad.shape != param.shape or exp_avg.shape != param.shape:
        raise ValueError(f"lion_step: grad {tuple(grad.shape)} and exp_avg {tuple(exp_avg.shape)} must have "
                         f"param's shape {tuple(param.shape)}")
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise TypeError(f"lion_step: a tensor lr must be one floating-point value, got {lr.dtype} "
                            f"{tuple(lr.shape)}")
    elif not isinstance(lr, (int, float)):
        raise TypeError(f"lion_step: lr must be a float or a 0-d tensor, got {type(lr).__name__}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"lion_step: betas must lie in [0, 1), got beta1={beta1}, beta2={beta2}")
    if weight_decay < 0.0:
        raise ValueError(f"lion_step: weight_decay must be >= 0, got {weight_decay}")
    if found_inf is not None and (not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1):
        raise TypeError(f"lion_step: found_inf must be a one-element tensor or None, got "
                        f"{tuple(found_inf.shape) if isinstance(found_inf, torch.Tensor) else type(found_inf).__name__}")
    device = param.device
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("lr", lr), ("found_inf", found_inf)):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"lion_step: {name} is on {t.device}, param on {device}")


def check_triton_support(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         lr: float | torch.Tensor) -> None:
    """Raise TypeError (dtype), then ValueError (layout, then device) when the kernel cannot serve the step."""
    if param.dtype != torch.float32 or exp_avg.dtype != torch.float32:
        raise TypeError(f"lion_step: backend='triton' needs fp32 param and exp_avg, got {param.dtype} and "
                        f"{exp_avg.dtype} (use backend='auto' or 'reference')")
    if grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"lion_step: backend='triton' supports grads in {GRAD_DTYPES}, got {grad.dtype}")
    if isinstance(lr, torch.Tensor) and lr.dtype != torch.float32:
        raise TypeError(f"lion_step: backend='triton' needs an fp32 lr tensor, got {lr.dtype}")
    if not (param.is_contiguous() and exp_avg.is_contiguous()):
        raise ValueError(f"lion_step: backend='triton' updates contiguous buffers; param strides {param.stride()}, "
                         f"exp_avg strides {exp_avg.stride()}")
    if not triton_usable(param):
        raise ValueError(f"lion_step: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), "
                         f"param is on {param.device}")


def triton_supports(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    lr: float | torch.Tensor) -> bool:
    """Whether ``check_triton_support`` passes."""
    try:
        check_triton_support(param, grad, exp_avg, lr)
    except (TypeError, ValueError):
        return False
    return True


@torch.no_grad()
def lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    found_inf: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """One Lion step, in place on ``param`` and ``exp_avg`` (same shape as ``grad``; a flat buffer per
    parameter group makes the step one launch).

    ``lr``: a python float or a 0-d fp32 tensor on param's device. ``found_inf``: None or a 0-d tensor
    on param's device; nonzero leaves param and exp_avg untouched. ``backend``: "auto" (the kernel on
    CUDA when ``triton_supports``: fp32 contiguous param/exp_avg, fp32/bf16/fp16 grad; the reference
    otherwise), "triton" (raises what ``check_triton_support`` finds) or "reference";
    ``FASTMT_LION_BACKEND`` overrides "auto". Never syncs the host.
    """
    _check_inputs(param, grad, exp_avg, lr, beta1, beta2, weight_decay, found_inf)
    backend = resolve_backend(backend, "FASTMT_LION_BACKEND", LION_BACKENDS)
    if backend == "auto":
        backend = "triton" if param.is_cuda and triton_supports(param, grad, exp_avg, lr) else "reference"
    elif backend == "triton":
        check_triton_support(param, grad, exp_avg, lr)
    if backend == "reference":
        lion_step_reference(param, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                            found_inf=found_inf)
        return
    lr_tensor = lr.reshape(()) if isinstance(lr, torch.Tensor) else None
    lr_value = 0.0 if lr_tensor is not None else float(lr)
    found = found_inf.reshape(()) if found_inf is not None else None
    args = (param, grad, exp_avg, lr_value, lr_tensor, float(beta1), float(beta2), float(weight_decay), found)
    LION_STEP_OP(*args)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023) with lion-pytorch's semantics, one ``lion_step`` per parameter.

    ``lr`` may be a float or a 0-d fp32 tensor (per group too: schedulers that ``fill_`` it change the
    rate without recompiling or re-capturing). When the attribute ``found_inf`` is set (a 0-d device
    tensor, as torch's fused optimizers read it), a nonzero value skips the step on the device. A group
    holding one flat buffer is updated by a single launch. State per parameter: ``exp_avg``.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, backend: str = "auto"):
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"Lion: a tensor lr must hold one value, got shape {tuple(lr.shape)}")
        elif not lr > 0.0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion: betas must lie in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        if backend not in LION_BACKENDS:
            raise ValueError(f"Lion: backend={backend!r} is not one of {LION_BACKENDS}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, backend=backend))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lion_step(p, p.grad, state["exp_avg"], lr=group["lr"], beta1=beta1, beta2=beta2,
                          weight_decay=group["weight_decay"], found_inf=found_inf, backend=group["backend"])
        return loss
