"""Kernel time, op time and the first call: the three timings of a ``host_split`` case.

kernel time  the GPU time of one call without the host: the call is captured in a CUDA graph and the
             graph replayed under ``harness.bench`` (``triton.testing.do_bench``: L2 flushed before each
             replay, CUDA events). The capture follows torch.cuda.graphs' recipe: warm-up iterations on
             a side stream first, then the capture on that stream. One unrelated capture per process
             comes first (on an H100 the first capture in a process failed whatever the op). When a
             provider cannot be captured, CUDA events around its eager launches are the fallback and
             the row says so.
op time      what a call costs the model in eager mode, host included: wall clock of one call
             followed by a device synchronisation, L2 flushed before each call. op - kernel = host.
first call   the first call of a provider on a case (autotuning, compilation), timed alone and never
             part of the medians.
Without CUDA all three are wall clock, and kernel and op time are one measurement.
"""

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


def _short(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


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
            why = _short(e)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
    return why


def kernel_time(
    step: Callable[[Any], Any],
    eager: Callable[[], Any],
    *,
    device: torch.device,
    leaves: Sequence[torch.Tensor],
    warmup_ms: float,
    rep_ms: float,
    prologue: Callable[[], Any] | None = None,
) -> KernelTime:
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
        why = _short(e)
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

    once()
    estimate = max(sum(once() for _ in range(3)) / 3, 1e-3)
    for _ in range(min(MAX_OP_REPS, int(warmup_ms / estimate))):
        once()
    n = max(MIN_OP_REPS, min(MAX_OP_REPS, int(rep_ms / estimate)))
    times = [once() for _ in range(n)]
    return H.Timing(*H.quantiles(times, H.QUANTILES))


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
