"""Kernel time (a CUDA graph replayed), op time (the eager call, host included) and first-call time: the
three timings of a ``host_split`` case; wall clock without CUDA. Protocol: bench/README.md."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench import harness as H

GRAPH_WARMUP_STEPS = 3  # eager iterations on the side stream before the capture (autotuning, lazy init)
MIN_OP_REPS, MAX_OP_REPS = 5, 1000

_warm_devices: set[str] = set()


@dataclass(frozen=True)
class KernelTime:
    timing: H.Timing
    timer: str  # "cuda-graph", "cuda-events (graph capture failed: ...)" or "wallclock (no CUDA)"


def _reset(leaves: Sequence[torch.Tensor]) -> None:
    for t in leaves:
        t.grad = None


def warm_up_capture(device: torch.device) -> str:
    """Capture and replay one tiny unrelated graph, once per process and device; '' or why it failed."""
    if str(device) in _warm_devices:
        return ""
    _warm_devices.add(str(device))
    why = ""
    for _ in range(2):  # the first attempt may be the one that fails
        try:
            x = torch.zeros(64, device=device)
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                x.add_(1)
            torch.cuda.current_stream(device).wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                x.add_(1)
            g.replay()
            torch.cuda.synchronize(device)
            return ""
        except Exception as e:  # noqa: BLE001 - reported, the timing falls back per provider
            why = H.short_error(e)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
    return why


def kernel_time(step: Callable[[Any], Any], eager: Callable[[], Any], *, device: torch.device,
                leaves: Sequence[torch.Tensor], warmup_ms: float, rep_ms: float,
                prologue: Callable[[], Any] | None = None) -> KernelTime:
    """GPU time of ``step(state)`` replayed from a CUDA graph (``state = prologue()``, run eagerly on the
    capture stream, e.g. the forward whose backward is timed); ``eager()`` is the same work for the
    fallback. ``leaves`` get ``.grad = None`` before the capture, so gradients live in the graph's pool
    and every replay rewrites them."""
    if device.type != "cuda":
        return KernelTime(H.bench(eager, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=leaves),
                          "wallclock (no CUDA)")
    why = warm_up_capture(device)
    if why:
        print(f"bench.timing: the warm-up capture failed twice ({why}); capturing anyway", flush=True)
    graph = state = None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            state = prologue() if prologue is not None else None
            for _ in range(GRAPH_WARMUP_STEPS):
                _reset(leaves)
                step(state)
        torch.cuda.current_stream(device).wait_stream(side)
        _reset(leaves)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            step(state)
    except Exception as e:  # noqa: BLE001 - not capturable: time the eager launches instead
        why = H.short_error(e)
        graph = state = None
        _reset(leaves)
        torch.cuda.synchronize(device)
        t = H.bench(eager, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=leaves)
        return KernelTime(t, f"cuda-events (graph capture failed: {why})")
    try:
        return KernelTime(H.bench(graph.replay, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms), "cuda-graph")
    finally:
        del graph, state
        _reset(leaves)


def op_time(fn: Callable[[], Any], *, device: torch.device, leaves: Sequence[torch.Tensor], warmup_ms: float,
            rep_ms: float) -> H.Timing:
    """Wall clock of ``fn()`` + a device synchronisation per call (L2 flushed before each, untimed)."""
    if device.type != "cuda":
        return H.bench(fn, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=leaves)
    import triton

    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()

    def once() -> float:
        _reset(leaves)
        driver.clear_cache(cache)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    return H.repeat(once, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=MIN_OP_REPS, max_reps=MAX_OP_REPS)


@contextlib.contextmanager
def triton_launches() -> Iterator[list[str] | None]:
    """Names of the Triton kernels launched inside the block (a list), or None where Triton cannot
    tell (no launch hook in this version; the interpreter never calls it)."""
    try:
        from triton import knobs

        chain = knobs.runtime.launch_enter_hook
    except (ImportError, AttributeError):
        chain = None
    if chain is None or not hasattr(chain, "add"):
        yield None
        return
    names: list[str] = []

    def hook(metadata) -> None:
        with contextlib.suppress(Exception):
            names.append(str(metadata.get()["name"]))

    chain.add(hook)
    try:
        yield names
    finally:
        chain.remove(hook)
