"""Compiling our Triton kernels before the first training step: which configs (kernels/pinned.py), and in a pool.

``warm_compile(step)`` runs ``step`` (one forward and backward of the model on a real batch, on the GPU) once with
every launch of our kernels replaced by a record of what it would compile (the pinned config of its key, else
every config the Autotuner would time; nothing launches, our kernels' outputs stay unwritten), then compiles
those kernels in worker processes into Triton's cache directory, in the background. The training step's own
launches then load them from that cache instead of compiling one after the other. On a machine without CUDA
(or under the interpreter) it is a no-op.

    warm = kernels.warm_compile(lambda: model(**batch).float().sum().backward())  # under the run's autocast
    model.zero_grad(set_to_none=True)  # the collection's gradients are garbage
    ...                                 # build the optimizer, compile the model, ...
    summary = warm.wait()               # before the first step: {"kernels", "failed", "seconds", ...}

Also here: ``CompileOnlyDriver``, Triton's active driver on a machine without the GPU (the workers and
bench/aot.py use it: compile for a target, launch nothing).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor

from kernels._utils import COLLECTING, interpreting


class CompileOnlyDriver:
    """Triton's active driver for a machine (or a worker process) without the GPU: device 0, stream 0, the given
    target (``triton.backends.compiler.GPUTarget``)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def collect(step: Callable[[], object]) -> list[tuple[str, str, str]]:
    """Run ``step`` with our kernels' launches recorded instead of compiled or run: one (module, kernel name,
    Triton specialization JSON) per kernel the step would compile, in launch order, without duplicates.
    Kernels already compiled in this process launch as usual (their outputs are then real)."""
    from triton import knobs

    seen: dict[str, tuple[str, str, str]] = {}

    def record(*, fn, compile, **_):
        data = compile["specialization_data"]
        seen.setdefault(data, (fn.module, fn.name, data))
        return True  # handled: Triton compiles nothing and launches nothing for this key

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    COLLECTING.append(True)
    try:
        step()
    finally:
        COLLECTING.pop()
        knobs.runtime.jit_cache_hook = previous
    return list(seen.values())


def _worker_init(arch: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))


def _compile_one(module: str, name: str, data: str) -> float:
    """Compile one recorded kernel into Triton's cache directory (a worker process); returns its seconds."""
    t0 = time.perf_counter()
    fn = getattr(importlib.import_module(module), name)
    getattr(fn, "fn", fn).preload(data)  # an Autotuner wraps the JITFunction
    return time.perf_counter() - t0


class WarmCompile:
    """A running ``warm_compile``: ``wait()`` blocks until every kernel is in the cache and returns a summary."""

    def __init__(self, specs: list, futures: list[Future], pool: ProcessPoolExecutor | None, t0: float):
        self.specs, self._futures, self._pool, self._t0 = specs, futures, pool, t0
        self._summary: dict | None = None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> dict:
        """{"kernels": recorded, "failed": compiles that raised (those compile again at launch), "errors": the
        first three, "compile_seconds": summed over the workers, "seconds": wall since the start}."""
        if self._summary is None:
            seconds, errors = 0.0, []
            for (_, name, _), f in zip(self.specs, self._futures):
                try:
                    seconds += f.result()
                except Exception as e:  # noqa: BLE001 - a failed warm compile costs only its time: the launch retries
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            if self._pool is not None:
                self._pool.shutdown()
            self._summary = {"kernels": len(self.specs), "failed": len(errors), "errors": errors[:3],
                             "compile_seconds": round(seconds, 2), "seconds": round(time.perf_counter() - self._t0, 2)}
        return self._summary


def compile_in_pool(specs: list[tuple[str, str, str]], arch: int, workers: int | None = None) -> WarmCompile:
    """Compile ``collect``'s records for compute capability ``arch`` (x10) in ``workers`` spawned processes
    (default: one per CPU core, at most one per kernel), into this process's TRITON_CACHE_DIR."""
    import multiprocessing

    t0 = time.perf_counter()
    if not specs:
        return WarmCompile([], [], None, t0)
    workers = max(1, min(workers or os.cpu_count() or 1, len(specs)))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(arch,))
    return WarmCompile(specs, [pool.submit(_compile_one, *spec) for spec in specs], pool, t0)


def warm_compile(step: Callable[[], object], *, workers: int | None = None) -> WarmCompile:
    """Start compiling, in worker processes, every kernel of ours that ``step`` launches (see the module
    docstring); returns at once with a handle whose ``wait()`` gives the summary. ``step``: a forward and
    backward of the model on a batch of the run's shape, under the run's autocast; not an optimizer step (its
    gradients are garbage: zero them after). A no-op without CUDA or under TRITON_INTERPRET (``step`` is not
    called)."""
    import torch

    if interpreting() or not torch.cuda.is_available():
        return WarmCompile([], [], None, time.perf_counter())
    major, minor = torch.cuda.get_device_capability()
    return compile_in_pool(collect(step), major * 10 + minor, workers)
