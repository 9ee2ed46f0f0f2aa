"""torch.compile for training: regional (per block type) or whole-model, with persistent caches.

Regional compilation (``run.compile_scope="blocks"``) compiles each unique encoder/decoder block's
forward and the projection + loss: the blocks of one type share a code object, so dynamo traces one
encoder block, one decoder block and the head, and every other layer (and every reuse of a shared
block) replays the same compiled code. Whole-model compilation (``"model"``) traces the loss module as
one graph: slower to compile, a little more fusion across block boundaries. With
``compile_mode="reduce-overhead"`` each compiled region replays as a CUDA graph.

The Inductor FX-graph / AOTAutograd caches and Triton's kernel cache live under ``run.cache_dir``, so a
second run of the same configuration skips most of the compile. These caches hold code (Inductor unpickles
its FX graphs, Triton loads ``.so`` launchers), so they are private: the default is a per-user folder,
``$XDG_CACHE_HOME/fastmt/compile`` (else ``~/.cache/fastmt/compile``), made with mode 0700; a folder given
with ``--run.cache_dir`` must belong to this user and be writable by nobody else, or the run is refused in
one line (`check_private`). Never the current folder: a copied project would carry code into the next run.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from torch import nn

from data.ownership import ownership_problem
from train.errors import UserError


class CacheDirError(UserError):
    """A compile cache folder other users could write (or another user owns): code in it would run."""



def compiles(run, device_type: str) -> bool:
    """Whether a run of ``RunConfig`` ``run`` on ``device_type`` uses torch.compile: ``run.compile``, or by default
    on CUDA only. The one rule: the command's checks before any side effect and the Trainer both ask it."""
    return run.compile if run.compile is not None else device_type == "cuda"

def default_cache_dir() -> Path:
    """The per-user compile cache: ``$XDG_CACHE_HOME/fastmt/compile``, else ``~/.cache/fastmt/compile``. A relative
    ``$XDG_CACHE_HOME`` is ignored, as the XDG base directory spec says (it would put code in the current folder)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastmt" / "compile"


def check_private(path: Path, flag: str = "--run.cache_dir") -> Path:
    """Make ``path`` (mode 0700) if missing and refuse (``CacheDirError``) a folder that another user owns or
    that group/others may write: anything planted there would run in the next compiled run."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
    except OSError as e:
        raise CacheDirError(f"{flag} {path}: cannot use it as the compile cache ({e.strerror or e}); give a "
                            f"writable folder of your own") from None
    if not stat.S_ISDIR(st.st_mode):
        problem = "it is not a folder"
    elif st.st_mode & 0o022:  # (group write too, even a private group's: this folder holds code)
        problem = f"other users may write in it (mode {stat.filemode(st.st_mode)})"
    else:  # another owner; a folder above it owned by another user or that others may write without the sticky
        problem = ownership_problem(path)  # bit, which lets them swap this one out (data.ownership: one rule for all)
    if problem:
        raise CacheDirError(f"{flag} {path}: {problem}; the compile caches hold code that the next compiled run "
                            f"loads, so fastmt uses only a folder of yours that nobody else can write. Fix: "
                            f"chmod go-w {path}, or give another {flag} (default: {default_cache_dir()})")
    return path


def configure_caches(cache_dir: str) -> dict[str, str]:
    """Point Inductor's and Triton's on-disk caches at ``cache_dir`` ("": `default_cache_dir`), checked
    private (`check_private`), unless the environment already set them, and switch the FX-graph and
    AOTAutograd caches on. Returns the directories in use."""
    root = check_private(Path(cache_dir) if cache_dir else default_cache_dir()).resolve()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default

    # torch writes its default into the environment the first time it asks (importing dynamo does): that is
    # not a user's choice, so it is replaced; a directory the user exported is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(torch_default())):
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


def graph_breaks() -> int | None:
    """Graph breaks dynamo has met in this process, every reason summed (None when unavailable): a compiled
    training region should have none (its break runs eagerly, and each break is one more graph)."""
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    except Exception:  # noqa: BLE001 - a diagnostics counter, never fatal
        return None


def compile_seconds() -> float | None:
    """Seconds dynamo spent compiling in this process (frames and their backward graphs, recompiles included);
    None when torch does not say."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a diagnostics counter, never fatal
        return None
