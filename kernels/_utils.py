"""Helpers shared by the kernel files: backend choice, interpreter detection, poisoned outputs, a few
host-side helpers of the attention launchers, and the one autotune decorator + launcher every
autotuned kernel goes through (tune once per kernel and key per process, then launch directly)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

LOG2E = 1.4426950408889634  # log2(e): the attention kernels' online softmax runs in base 2
LOG2E_C = tl.constexpr(LOG2E)  # the same, as a constant @triton.jit functions may read
AUTOTUNE_ENV = "FASTMT_AUTOTUNE"  # "0": first fitting config, untimed; "full": tune even pinned keys; else pins


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: a CUDA tensor, or any tensor under the interpreter."""
    return t.is_cuda or interpreting()


def resolve_backend(backend: str, env_var: str, allowed: tuple[str, ...]) -> str:
    """Validate ``backend``; "auto" is replaced by ``env_var``'s value when that is set."""
    if backend not in allowed:
        raise ValueError(f"backend={backend!r} is not one of {allowed}")
    if backend == "auto":
        override = os.environ.get(env_var, "").strip()
        if override:
            if override not in allowed:
                raise ValueError(f"{env_var}={override!r} is not one of {allowed}")
            return override
    return backend


def poison_enabled() -> bool:
    """``FASTMT_POISON=1``: kernel outputs start as NaN, so an element no program writes fails tests."""
    return os.environ.get("FASTMT_POISON", "0") not in ("", "0")


def empty(*shape, dtype: torch.dtype, device: torch.device, poison: bool | None = None) -> torch.Tensor:
    """``torch.empty``, NaN-filled under ``FASTMT_POISON=1`` (integer outputs are filled with -1).
    ``poison``: the flag read once by a caller that allocates several outputs (None: read it here)."""
    out = torch.empty(*shape, dtype=dtype, device=device)
    if poison_enabled() if poison is None else poison:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


# ----------------------------------------------------------------------------------------------
# Host helpers of the two attention tilings (kernels/sequence_attention.py, kernels/packed_attention.py)
# ----------------------------------------------------------------------------------------------
def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied only when its last stride is not 1 (e.g. expanded gradients)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def pow2(n: int, lo: int, hi: int) -> int:
    """The power of two >= n, clipped to [lo, hi] (plain int ops: triton.next_power_of_2 is slow to call)."""
    return min(max(1 << (max(int(n), 1) - 1).bit_length(), lo), hi)


def fp32_dot(dtype: torch.dtype) -> bool:
    """Whether the attention kernels upcast every tile to fp32 before ``tl.dot``: fp32 inputs, and the
    interpreter, whose bf16 (and numpy fp16 matmul) arithmetic is not the GPU's."""
    return interpreting() or dtype == torch.float32


def block_configs(shapes: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> Configs."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# ----------------------------------------------------------------------------------------------
# Autotuning: one decorator and one launcher for every kernel file
# ----------------------------------------------------------------------------------------------
def autotune(configs: list[triton.Config], key: list[str], *, interpret_config: triton.Config, prune=None):
    """``triton.autotune`` as the kernel files use it.

    On CUDA: tune over ``configs``, keyed by the argument names in ``key`` (Triton adds the dtype of
    every tensor argument), with ``prune(configs, named_args, **kwargs) -> configs`` as Triton's
    ``early_config_prune`` (it picks the few configs worth timing for the shape at hand). Under the
    interpreter: ``interpret_config`` alone and no pruner (more than one config fails there).
    """
    if interpreting():
        return triton.autotune(configs=[interpret_config], key=key)
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": prune} if prune is not None else None)


_CHOSEN: dict[Autotuner, dict[tuple, dict]] = {}  # kernel -> launch key -> the chosen config's kwargs
TUNING_LOG: list[dict] = []  # per (kernel, Autotuner key) this process tuned: seconds, configs, best
COLLECTING: list[bool] = []  # non-empty inside kernels.tuning.warm_compile's collection: compile, never launch
_ARCH: list[int | None] = []  # the GPU's compute capability x10 (cached), or bench/aot.py's target when set


def device_arch() -> int | None:
    """Compute capability x10 of the current CUDA device (90: H100/H200), None without one. bench/aot.py's
    compile-only driver sets its target here, so that a CPU machine picks the configs a GPU run would."""
    if not _ARCH:
        _ARCH.append(torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]
                     if torch.cuda.is_available() and not interpreting() else None)
    return _ARCH[-1]


def key_text(key: tuple) -> str:
    """A launch key as the pinned-config tables spell it: "512,1,bfloat16,float32,float32,None"."""
    return ",".join(str(k).removeprefix("torch.") for k in key)


def pinned_config(kernel: Autotuner, key: tuple) -> dict | None:
    """The pinned config of (kernel, launch key) on this GPU (kernels/pinned.py), as launch kwargs; None when the
    table has no entry for this architecture and key, or its entry is not one of the kernel's configs."""
    from kernels.pinned import PINNED

    table = PINNED.get(device_arch())
    entry = table.get(kernel.base_fn.__name__, {}).get(key_text(key)) if table else None
    if entry is None:
        return None
    for config in kernel.configs:
        if (config.kwargs, config.num_warps, config.num_stages) == (entry["kwargs"], entry["num_warps"],
                                                                    entry["num_stages"]):
            return config.all_kwargs()
    return None


def launch(kernel: Autotuner, grid, key: tuple, *args, **kwargs) -> None:
    """Launch the autotuned ``kernel`` on ``args``/``kwargs`` (the non-tuned arguments).

    ``grid(meta) -> tuple`` reads the tuned meta-parameters (e.g. ``meta["BLOCK_M"]``). ``key`` is a
    hashable that determines the Autotuner's key (its key arguments and the tensors' dtypes); it may
    be finer. The first call for a ``key`` takes its pinned config when kernels/pinned.py has one for this GPU
    (nothing timed, one compile); otherwise it goes through the Autotuner, which times the pruned configs
    once per Autotuner key per process (recorded in ``TUNING_LOG``). Later calls launch the JIT
    function directly with the config chosen, skipping the Autotuner's per-call argument
    dictionaries and key building. ``FASTMT_AUTOTUNE`` (read per call): "0" times nothing, each launch
    takes the first config the kernel's pruner keeps (quick starts; test grids that would otherwise
    compile and time every config of every case); "full" ignores the pins and tunes every key (to measure
    new pins). Inside ``kernels.tuning.warm_compile``'s collection a launch compiles what it would run and
    launches nothing.
    """
    policy = os.environ.get(AUTOTUNE_ENV, "1").strip()
    if COLLECTING:
        for meta in _configs_to_compile(kernel, key, policy, args, kwargs):
            kernel.fn.run(*args, grid=grid(meta), warmup=True, **kwargs, **meta)
        return
    if policy == "0":
        meta = _first_config(kernel, args, kwargs)
        kernel.fn.run(*args, grid=grid(meta), warmup=False, **kwargs, **meta)
        return
    chosen = _CHOSEN.get(kernel)
    meta = chosen.get(key) if chosen is not None else None
    if meta is None and policy != "full" and len(kernel.configs) > 1:  # the interpreter has one config
        meta = pinned_config(kernel, key)
        if meta is not None:
            _CHOSEN.setdefault(kernel, {})[key] = meta
    if meta is not None:
        kernel.fn.run(*args, grid=grid(meta), warmup=False, **kwargs, **meta)
        return
    tuned = len(kernel.cache)
    kernel[grid](*args, **kwargs)
    config = getattr(kernel, "best_config", None)  # set by Autotuner.run to the config it launched
    if config is None:  # Autotuner.run replaced (tests): nothing chosen to remember
        return
    if len(kernel.cache) > tuned:
        TUNING_LOG.append({
            "kernel": kernel.base_fn.__name__, "key": key, "configs": len(kernel.configs_timings),
            "seconds": getattr(kernel, "bench_time", None), "best": str(config),
        })
    _CHOSEN.setdefault(kernel, {})[key] = config.all_kwargs()


def _configs_to_compile(kernel: Autotuner, key: tuple, policy: str, args: tuple, kwargs: dict) -> list[dict]:
    """What the first launch of (kernel, key) compiles under ``policy``: the first pruned config ("0"), the
    pinned one, or every pruned config (the Autotuner compiles each to time it)."""
    if policy == "0":
        return [_first_config(kernel, args, kwargs)]
    pinned = pinned_config(kernel, key) if policy != "full" else None
    if pinned is not None:
        return [pinned]
    return [c.all_kwargs() for c in pruned_configs(kernel, args, kwargs)]


def _first_config(kernel: Autotuner, args: tuple, kwargs: dict) -> dict:
    """The kwargs of the first config the kernel's pruner keeps for these arguments."""
    return pruned_configs(kernel, args, kwargs)[0].all_kwargs()


def pruned_configs(kernel: Autotuner, args: tuple, kwargs: dict) -> list[triton.Config]:
    """The configs the kernel's pruner keeps for these arguments: what its Autotuner compiles and times."""
    configs = kernel.configs
    prune = getattr(kernel, "early_config_prune", None)
    if prune is not None and len(configs) > 1:
        configs = prune(configs, dict(zip(kernel.arg_names, args)), **kwargs) or configs
    return configs


# ----------------------------------------------------------------------------------------------
# One registration per kernel: the custom op (torch.compile), its fake, its autograd rule and the
# eager path, all built from a forward and a backward launcher
# ----------------------------------------------------------------------------------------------
class KernelOp:
    """A fused op built from its launchers: ``op = KernelOp("fastmt::name", fwd, schema, fake, ...)``, then
    ``op(*inputs)`` in the public function. What it registers and how it dispatches:

    - ``fastmt::name`` (``torch.ops.fastmt.name``): a custom op over ``fwd``, opaque to torch.compile, with
      ``fake(*inputs)`` (outputs' shapes/dtypes, allocated as the launcher does) as its meta function;
    - with a ``bwd`` launcher: the backward op likewise (``fastmt::x_fwd`` -> ``fastmt::x_bwd``, else ``name_bwd``) (``bwd_schema``, ``bwd_fake``), and the autograd
      rule: ``save(ctx, inputs, outputs)`` keeps what the backward reads (it runs inside both the op's
      ``setup_context`` and the eager Function's forward: ``ctx.save_for_backward``, ``ctx.mark_non_differentiable``),
      ``grads(ctx, bwd, *output_grads) -> input grads`` calls ``bwd`` (the backward op when compiled; the
      backward launcher, or ``eager_bwd`` when given, in eager mode) and returns one gradient per input;
    - ``op(*inputs)``: the custom op while torch.compile traces, an ``autograd.Function`` over the same
      launchers in eager mode when a tensor input needs a gradient (no dispatcher round trips; no double
      backward: it raises instead of silently wrong), the forward launcher alone otherwise.

    ``schema``/``bwd_schema``: the ops' argument lists in torch's schema language, e.g.
    ``"(Tensor x, Tensor? bias, float eps) -> (Tensor, Tensor)"``; ``mutates_args``: the inputs an in-place op
    writes (an optimizer step; no backward then). Outputs are returned as the forward launcher returns them.
    ``shapes``: the launches the op declares, {name: cases} in plain tuples (its GPU tests' grids; ``bench.aot``
    compiles them ahead of time from here), kept as ``op.shapes``.
    """

    def __init__(self, name: str, fwd, schema: str, fake, *, bwd=None, bwd_schema: str | None = None,
                 bwd_fake=None, save=None, grads=None, eager_bwd=None, mutates_args: tuple[str, ...] = (),
                 shapes: dict | None = None):
        if (bwd is None) != (grads is None) or (bwd is None) != (save is None):
            raise ValueError(f"KernelOp {name}: bwd, save and grads come together")
        self.name, self.fwd, self.shapes = name, fwd, dict(shapes or {})
        self.op = torch.library.custom_op(name, fwd, mutates_args=mutates_args, schema=schema)
        self.op.register_fake(fake)
        self.function = None
        if bwd is None:
            return
        self.bwd_op = torch.library.custom_op(name.removesuffix("_fwd") + "_bwd", bwd, mutates_args=(), schema=bwd_schema)
        self.bwd_op.register_fake(bwd_fake)
        kernel_op, bwd_op, eager = self, self.bwd_op, eager_bwd or bwd

        def setup_context(ctx, inputs, output):
            save(ctx, inputs, output)

        def op_backward(ctx, *output_grads):
            return grads(ctx, bwd_op, *output_grads)

        self.op.register_autograd(op_backward, setup_context=setup_context)

        class Function(torch.autograd.Function):
            # classic ``forward(ctx, ...)``: a ``setup_context`` staticmethod would make ``apply`` bind the
            # arguments with ``inspect.signature`` on every call
            @staticmethod
            def forward(ctx, *inputs):
                output = kernel_op.fwd(*inputs)  # read per call: tests count launches by replacing it
                save(ctx, inputs, output)
                return output

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *output_grads):
                return grads(ctx, eager, *output_grads)

        Function.__name__ = Function.__qualname__ = f"{name.split('::')[-1]}_function"
        self.function = Function

    def __call__(self, *inputs):
        if torch.compiler.is_compiling():
            return self.op(*inputs)
        if self.function is not None and torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return self.function.apply(*inputs)
        return self.fwd(*inputs)
