"""torch.compile for training: regional (per block type) or whole-model, with persistent caches.

Regional compilation (``run.compile_scope="blocks"``) compiles each unique encoder/decoder block's
forward and the projection + loss: the blocks of one type share a code object, so dynamo traces one
encoder block, one decoder block and the head, and every other layer (and every reuse of a shared
block) replays the same compiled code. Whole-model compilation (``"model"``) traces the loss module as
one graph: slower to compile, a little more fusion across block boundaries. With
``compile_mode="reduce-overhead"`` each compiled region replays as a CUDA graph.

The Inductor FX-graph / AOTAutograd caches and Triton's kernel cache live under ``run.cache_dir``
(default ``.cache/``), so a second run of the same configuration skips most of the compile.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def configure_caches(cache_dir: str) -> dict[str, str]:
    """Point Inductor's and Triton's on-disk caches at ``cache_dir`` (unless the environment already set
    them) and switch the FX-graph and AOTAutograd caches on. Returns the directories in use."""
    if not cache_dir:
        return {}
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = Path(cache_dir).resolve()
    # torch writes its default into the environment the first time it asks (importing dynamo does): that is
    # not a user's choice, so it is replaced; a directory the user exported is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return {"inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton": os.environ["TRITON_CACHE_DIR"]}


def compile_for_training(step_module: nn.Module, loss_module: nn.Module, *, scope: str, backend: str, mode: str,
                         dynamic: bool | None) -> nn.Module:
    """The module the training step calls. ``step_module`` is the loss module or its DDP wrapper;
    ``loss_module.model`` the Transformer. "model": the whole step module compiled; "blocks": the blocks
    and ``loss_module.criterion`` compiled in place, the (eager) step module returned."""
    kwargs = dict(backend=backend, mode=None if mode == "default" else mode, dynamic=dynamic)
    if scope == "model":
        return torch.compile(step_module, **kwargs)
    if scope != "blocks":
        raise ValueError(f"run.compile_scope={scope!r} is not 'blocks' or 'model'")
    model = loss_module.model
    for stack in (model.encoder, model.decoder):
        for block in stack.blocks:
            block.compile(**kwargs)
    loss_module.criterion = torch.compile(loss_module.criterion, **kwargs)
    return step_module


def compiled_graphs() -> int | None:
    """Graphs dynamo has compiled in this process (a diagnostics counter; None when unavailable)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a diagnostics counter, never fatal
        return None
