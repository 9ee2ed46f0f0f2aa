"""Helpers shared by the kernel files: backend choice, interpreter detection, poisoned outputs, and
autotuned launches (tune once per kernel and key, then launch the chosen config directly)."""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime.autotuner import Autotuner


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
TUNING_LOG: list[dict] = []  # one entry per (kernel, Autotuner key) this process tuned: bench/ reads it


def launch(kernel: Autotuner, grid, key: tuple, *args, **kwargs) -> None:
    """Launch the autotuned ``kernel`` on ``args``/``kwargs`` (the non-tuned arguments).

    ``grid(meta) -> tuple`` reads the tuned meta-parameters (e.g. ``meta["ROWS"]``). ``key`` is a
    hashable that determines the Autotuner's key (its key arguments and the tensors' dtypes); it may
    be finer. The first call for a ``key`` goes through the Autotuner, which times the pruned configs
    once per Autotuner key per process (recorded in ``TUNING_LOG``); later calls launch the JIT
    function directly with the config it chose, skipping the Autotuner's per-call argument
    dictionaries and key building.
    """
    chosen = _CHOSEN.get(kernel)
    meta = chosen.get(key) if chosen is not None else None
    if meta is not None:
        kernel.fn.run(*args, grid=grid(meta), warmup=False, **kwargs, **meta)
        return
    tuned = len(kernel.cache)
    kernel[grid](*args, **kwargs)
    config = getattr(kernel, "best_config", None)
    if config is None:  # Autotuner.run replaced (tests): nothing chosen to remember
        return
    if len(kernel.cache) > tuned:
        TUNING_LOG.append({
            "kernel": kernel.base_fn.__name__, "key": key, "configs": len(kernel.configs_timings),
            "seconds": getattr(kernel, "bench_time", None), "best": str(config),
        })
    _CHOSEN.setdefault(kernel, {})[key] = config.all_kwargs()
