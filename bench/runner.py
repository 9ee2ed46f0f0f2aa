"""Running cases: every (case, provider, mode) becomes one row, whatever happens; process isolation.

On CUDA the cases run in a worker process (``python -m bench.runner SPEC``), so a crash that poisons the
CUDA context costs one provider's case, not the run. Details: bench/README.md."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import harness as H
from bench import registry, timing
from bench.cases import Case, build_cases
from bench.registry import Provider, Unsupported

CRASHES_BEFORE_EXCLUDING = 2  # a provider that kills its worker this often is left out afterwards
WORKER_GRACE_S = 45.0  # how long past the deadline a worker may finish the provider in flight
WORKER_ENV = "FASTMT_BENCH_WORKER"  # "1" in worker processes

COLUMNS = (
    "timestamp", "bench", "case", "group", "provider", "mode", "status",
    "dtype", "B", "H", "Tq", "Tk", "D", "causal", "masked", "fill", "tokens", "rows", "width",
    "ms", "ms_p20", "ms_p80", "flops", "bytes", "tflops", "gbps", "pct_peak", "peak_mem_mb", "rel_err",
    "error", "note",
    "kind", "segments", "mean_len", "max_seg", "max_tokens", "max_len", "lengths",
    "kernel_timer", "op_ms", "op_p20", "op_p80", "host_ms", "host_pct", "op_tflops", "op_gbps",
    "first_call_s", "setup_ms", "floor_bytes", "floor_ms", "pct_floor", "tiling", "triton_kernels", "sdpa_backend",
    "peak_tflops", "peak_gbps", *H.PROVENANCE_COLUMNS,
)


class Terminated(BaseException):
    """SIGTERM (e.g. from ``timeout``): stop measuring, still write what was measured."""


@dataclass
class Context:
    """What every row shares: device, options, provenance and the ceilings of this run."""

    device: torch.device
    dtype: torch.dtype
    opts: argparse.Namespace
    prov: dict[str, Any]
    peaks: H.Peaks
    deadline: float | None  # time.time() after which no new provider starts
    emit: Callable[[dict[str, Any]], None]  # receives events {"ev": "start"|"row"|"end"|"fatal", ...}
    in_worker: bool = False
    skip: set[tuple[str, str]] = field(default_factory=set)  # (case id, provider) not to run


def select_cases(opts: argparse.Namespace) -> list[Case]:
    registry.load(opts.provider_modules)
    return build_cases(smoke=opts.smoke, only=opts.only, groups=opts.groups, corpus_tokens=opts.corpus_tokens)


def device_and_dtype(opts) -> tuple[torch.device, torch.dtype]:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu"), getattr(torch, opts.dtype)


def configure_torch() -> None:
    import torch._dynamo
    import torch._functorch.config

    # Recompiles past the limit fall back to eager *silently*: raise it so "compile" stays compiled.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
    # bwd rows time the backward alone, again and again over one graph (retain_graph=True); a compiled
    # backward that donates its saved buffers refuses that ("non-empty donated buffers ... retain_graph"):
    # the compile providers keep their buffers (donation saves memory, not time)
    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False


# -- Errors ----------------------------------------------------------------------------------------
def classify(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower():
        return "oom"
    if isinstance(exc, NotImplementedError):
        return "not-implemented"
    if isinstance(exc, Unsupported) or "No available kernel" in text or "No viable backend" in text:
        return "unsupported"
    return "error"


def message(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    msg = H.short_error(exc, limit=400)
    reasons = []
    for w in caught:  # SDPA explains a refusal in warnings: keep the first few
        text = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        if text and text not in reasons:
            reasons.append(text)
    if reasons:
        msg += " | " + " | ".join(reasons[:3])
    return msg[:400]


def cuda_context_broken(device: torch.device) -> bool:
    """After an error: does the CUDA context still work? (An illegal address poisons it for good.)"""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return False
    except Exception:  # noqa: BLE001 - any failure means the context is gone
        return True


def _after_error(ctx: Context, case: Case, name: str) -> None:
    """Free memory after an error; in a worker, exit if the CUDA context is gone (the parent restarts)."""
    gc.collect()
    if ctx.device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    if cuda_context_broken(ctx.device):
        ctx.emit({"ev": "fatal", "case": case.id, "provider": name})
        if ctx.in_worker:
            os._exit(3)
        raise RuntimeError(f"CUDA context lost while running {name} on {case.id}; use --isolate process")


# -- Rows ------------------------------------------------------------------------------------------
def case_columns(case: Case, dtype: torch.dtype, inputs: Any | None) -> dict[str, Any]:
    cols = {"bench": case.bench, "case": case.id, "group": case.group, "dtype": str(dtype).removeprefix("torch.")}
    return cols | registry.op(case.bench).columns(case, inputs)


def make_row(ctx: Context, base: dict[str, Any], provider: str, mode: str, status: str, **values) -> dict[str, Any]:
    row = {"timestamp": ctx.prov.get("timestamp"), **base, "provider": provider, "mode": mode, "status": status,
           **values, **ctx.peaks.as_row()}
    row.update({k: ctx.prov.get(k, "") for k in H.PROVENANCE_COLUMNS})
    return row


def failed_rows(ctx: Context, case: Case, provider: str, status: str, error: str, skip=()) -> list[dict[str, Any]]:
    """One row per mode (but ``skip``) of a provider that never measured anything."""
    base = case_columns(case, ctx.dtype, None)
    return [make_row(ctx, base, provider, m, status, error=error) for m in ctx.opts.modes if m not in skip]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def _pick(out, keep: tuple[int, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The outputs of a forward as a tuple, or those at ``keep``."""
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return outs if keep is None else tuple(outs[i] for i in keep)


@dataclass
class FirstCall:
    outs: tuple[torch.Tensor, ...]
    keep: tuple[int, ...]  # differentiable outputs
    douts: tuple[torch.Tensor, ...]  # their random upstream gradients
    seconds: float  # first forward + first backward, synchronised
    note: str
    kernels: str  # Triton kernels launched ('' where Triton cannot tell)


def first_call(fn: Callable[[], Any], leaves: Sequence[torch.Tensor], device: torch.device) -> FirstCall:
    """The provider's first forward and backward, timed alone (autotuning, compilation)."""
    note = ""
    with timing.triton_launches() as launched:
        H.synchronize(device)
        t0 = time.perf_counter()
        outs = _pick(fn())
        H.synchronize(device)
        seconds = time.perf_counter() - t0
        keep = tuple(i for i, o in enumerate(outs) if o.requires_grad)
        douts = tuple(torch.randn_like(outs[i]) for i in keep)
        try:
            t0 = time.perf_counter()
            torch.autograd.backward(_pick(outs, keep), douts)
            H.synchronize(device)
            seconds += time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the backward modes report it in their own rows
            note = f"first backward failed ({type(e).__name__}); first_call_s is the forward"
    for leaf in leaves:
        leaf.grad = None
    return FirstCall(outs, keep, douts, seconds, note, "+".join(sorted(set(launched))) if launched else "")


def _mode_fns(prep: registry.Prepared, mode: str, keep, douts):
    """(eager fn, graph step, graph prologue) of one mode; bwd differentiates a graph built once."""
    if mode == "fwd":
        return prep.fn, (lambda _: prep.fn()), None
    if mode == "bwd":
        def backward(outs):
            torch.autograd.backward(outs, douts, retain_graph=True)

        graph_outs = _pick(prep.fn(), keep)
        return (lambda: backward(graph_outs)), backward, (lambda: _pick(prep.fn(), keep))

    def fwd_bwd():
        torch.autograd.backward(_pick(prep.fn(), keep), douts)

    return fwd_bwd, (lambda _: fwd_bwd()), None


def _measure(ctx: Context, case: Case, prep: registry.Prepared, mode: str, keep, douts, inputs) -> dict[str, Any]:
    opts, device = ctx.opts, ctx.device
    kw = {"device": device, "warmup_ms": opts.warmup_ms, "rep_ms": opts.rep_ms}
    eager, step, prologue = _mode_fns(prep, mode, keep, douts)
    op_t = None
    if case.host_split:
        kt = timing.kernel_time(step, eager, leaves=prep.leaves, prologue=prologue, **kw)
        t, timer = kt.timing, kt.timer
        op_t = timing.op_time(eager, leaves=prep.leaves, **kw) if device.type == "cuda" else t
    else:
        t = H.bench(eager, grad_to_none=prep.leaves, **kw)
        timer = "cuda-events (do_bench)" if device.type == "cuda" else "wallclock"
    values: dict[str, Any] = {"ms": t.ms, "ms_p20": t.p20, "ms_p80": t.p80, "kernel_timer": timer,
                              "peak_mem_mb": H.peak_memory_mb(eager, device, prep.leaves)}
    counted = registry.op(case.bench).work(case, mode, inputs, ctx.dtype)
    values.update(counted)
    if "floor_bytes" in counted:
        values["floor_ms"] = counted["floor_bytes"] / (ctx.peaks.copy_gbps * 1e9) * 1e3
        values["pct_floor"] = 100 * values["floor_ms"] / t.ms
    if op_t is not None:
        values.update(op_ms=op_t.ms, op_p20=op_t.p20, op_p80=op_t.p80, host_ms=op_t.ms - t.ms,
                      host_pct=100 * (op_t.ms - t.ms) / op_t.ms)
    for work, rate, col, peak in (("flops", H.tflops, "tflops", ctx.peaks.matmul_tflops),
                                  ("bytes", H.gbps, "gbps", ctx.peaks.copy_gbps)):
        if work in counted:
            values[col] = rate(counted[work], t.ms)
            values["pct_peak"] = 100 * values[col] / peak
            if op_t is not None:
                values[f"op_{col}"] = rate(counted[work], op_t.ms)
    return values


def run_provider(ctx: Context, case: Case, provider: Provider, inputs, base: dict[str, Any]) -> None:
    """Time one provider in every mode; emits one row per mode, whatever happens."""
    opts, device, name = ctx.opts, ctx.device, provider.name

    def emit(mode, status, **values):
        ctx.emit({"ev": "row", "row": make_row(ctx, base, name, mode, status, **values)})

    if device.type != "cuda" and provider.triton and not opts.cpu_triton:
        for mode in opts.modes:
            emit(mode, "skipped", error="Triton needs a CUDA device (--cpu-triton runs it through the interpreter)")
        return
    with H.environ(provider.env), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # each distinct warning once: SDPA explains its refusals
        try:
            prep = provider.prepare(case, inputs, opts)
            first = first_call(prep.fn, prep.leaves, device)
            if inputs.ref is None:
                inputs.ref = registry.op(case.bench).reference(case, inputs)
            shared = {"rel_err": rel_err(prep.check(first.outs[0]), inputs.ref), "first_call_s": first.seconds,
                      "setup_ms": prep.setup_ms, "triton_kernels": first.kernels, **prep.extra,
                      "note": "; ".join(s for s in (prep.note, first.note) if s)}
            keep, douts = first.keep, first.douts
            del first
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            status, msg = classify(e), message(e, caught)
            if status == "error":
                traceback.print_exc()
            for mode in opts.modes:
                emit(mode, status, error=msg, tiling=provider.env.get("FASTMT_ATTN_TILING", ""))
            if status != "unsupported":  # a refusal allocates nothing and cannot break the context
                _after_error(ctx, case, name)
            return
        for mode in opts.modes:
            caught.clear()
            try:
                emit(mode, "ok", **shared, **_measure(ctx, case, prep, mode, keep, douts, inputs))
            except Exception as e:  # noqa: BLE001
                status = classify(e)
                if status == "error":
                    traceback.print_exc()
                emit(mode, status, error=message(e, caught), **shared)
                _after_error(ctx, case, name)
            finally:
                for leaf in prep.leaves:
                    leaf.grad = None


def run_cases(ctx: Context, cases: Sequence[Case]) -> None:
    for case in cases:
        todo = [p for p in case.providers if p in ctx.opts.providers and (case.id, p) not in ctx.skip]
        if not todo:
            continue
        if ctx.deadline is not None and time.time() > ctx.deadline:
            return
        try:
            inputs = registry.op(case.bench).make_inputs(case, ctx.dtype, ctx.device, ctx.opts)
        except Exception as e:  # noqa: BLE001 - e.g. OOM while building inputs
            traceback.print_exc()
            for p in todo:
                ctx.emit({"ev": "start", "case": case.id, "provider": p})
                for row in failed_rows(ctx, case, p, classify(e), message(e)):
                    ctx.emit({"ev": "row", "row": row})
                ctx.emit({"ev": "end", "case": case.id, "provider": p})
            _after_error(ctx, case, "inputs")
            continue
        base = case_columns(case, ctx.dtype, inputs)
        for p in todo:
            if ctx.deadline is not None and time.time() > ctx.deadline:
                return
            ctx.emit({"ev": "start", "case": case.id, "provider": p})
            run_provider(ctx, case, registry.get(case.bench, p, case.group), inputs, base)
            ctx.emit({"ev": "end", "case": case.id, "provider": p})
        del inputs
        if ctx.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def fill_skipped(ctx: Context, cases: Sequence[Case], rows: list[dict[str, Any]], interrupted: bool) -> list[dict]:
    """Record every (case, provider, mode) that never ran, so the CSV shows what is missing and why."""
    have = {(r["case"], r["provider"], r["mode"]) for r in rows}
    if interrupted:
        why = "interrupted or aborted (see the log)"
    elif ctx.deadline is not None and time.time() > ctx.deadline:
        why = f"time budget (--budget-s {ctx.opts.budget_s:g}) spent"
    else:
        why = "not run: the worker stopped early (see the log)"
    out = list(rows)
    for c in cases:
        for p in (p for p in c.providers if p in ctx.opts.providers):
            out += failed_rows(ctx, c, p, "skipped", why, {m for m in ctx.opts.modes if (c.id, p, m) in have})
    return out


# -- In process, or isolated: cases run in a worker process; the parent restarts one after a crash -
def _progress(ev: dict[str, Any]) -> None:
    if ev.get("ev") != "row":
        return
    r = ev["row"]
    if r["status"] == "ok":
        rate = f"{H.fmt(r['tflops']):>7} TFLOP/s" if "tflops" in r else f"{H.fmt(r['gbps']):>7} GB/s"
        text = f"{r['ms']:9.4f} ms {rate}"
        if "op_ms" in r:
            text += f" | op {r['op_ms']:.4f} ms"
    else:
        text = f"{r['status']}: {r.get('error', '')[:90]}"
    print(f"  {r['case']:<30} {r['provider']:<18} {r['mode']:<8} {text}", flush=True)


def run_in_process(ctx: Context, cases: Sequence[Case], sink: list[dict[str, Any]]) -> None:
    """Run ``cases`` here, appending rows to ``sink`` as they come (so an interruption keeps them)."""
    def emit(ev):
        _progress(ev)
        if ev.get("ev") == "row":
            sink.append(ev["row"])

    ctx.emit = emit
    run_cases(ctx, cases)


def run_isolated(ctx: Context, cases: Sequence[Case], sink: list[dict[str, Any]]) -> None:
    """Run ``cases`` in worker processes, restarting one after a crash.

    A worker appends events to a file: ``start`` / ``row``... / ``end`` per provider. When it dies,
    the provider in flight keeps the modes it finished and gets 'crash' rows for the others; a
    provider that crashes CRASHES_BEFORE_EXCLUDING times is left out for the rest of the run.
    Rows reach ``sink`` after each worker, and also when SIGTERM interrupts the wait."""
    workdir = Path(tempfile.mkdtemp(prefix="fastmt-bench-worker-"))
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    crashes: dict[str, int] = {}
    excluded: set[tuple[str, str]] = set()
    by_id = {c.id: c for c in cases}
    try:
        for attempt in range(1, 2 * len(cases) + 3):
            pending = [(c.id, p) for c in cases for p in c.providers
                       if p in ctx.opts.providers and (c.id, p) not in rows and (c.id, p) not in excluded]
            if not pending or (ctx.deadline is not None and time.time() > ctx.deadline):
                break
            events = workdir / f"events{attempt}.jsonl"
            spec = workdir / f"spec{attempt}.json"
            spec.write_text(json.dumps({
                "opts": vars(ctx.opts), "prov": ctx.prov, "peaks": asdict(ctx.peaks), "deadline": ctx.deadline,
                "skip": sorted(set(rows) | excluded), "events": str(events),
            }))
            log = workdir / f"worker{attempt}.log"
            timeout = None if ctx.deadline is None else max(30.0, ctx.deadline - time.time() + WORKER_GRACE_S)
            try:  # its own process group: past the deadline, or on SIGTERM here, the whole group is killed
                rc = H.run_in_group([sys.executable, "-m", "bench.runner", str(spec)], log, timeout_s=timeout,
                                    env={**os.environ, WORKER_ENV: "1"}, cwd=H.REPO_ROOT, check=False)
            finally:
                print(log.read_text(errors="replace"), end="", flush=True)
                running, partial = _collect_events(events, rows)
            if rc == 0:
                break
            if running is not None:  # the provider in flight died with its worker
                provider = running[1]
                crashes[provider] = crashes.get(provider, 0) + 1
                why = (f"worker exited with code {rc} while this ran (CUDA context lost or killed); "
                       "see the log")
                rows[running] = partial + failed_rows(ctx, by_id[running[0]], provider, "crash", why,
                                                      {r["mode"] for r in partial})
                if crashes[provider] >= CRASHES_BEFORE_EXCLUDING:
                    excluded |= {(c.id, provider) for c in cases
                                 if provider in c.providers and (c.id, provider) not in rows}
                    print(f"bench.kernels: {provider} crashed {crashes[provider]} times; left out from here on",
                          flush=True)
            if rc == 124:
                print("bench.kernels: the worker overran the budget; killed", flush=True)
                break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        sink.extend(r for pair_rows in rows.values() for r in pair_rows)
        for case_id, provider in sorted(excluded - set(rows)):
            sink.extend(failed_rows(ctx, by_id[case_id], provider, "skipped",
                                    f"left out after {CRASHES_BEFORE_EXCLUDING} worker crashes"))


def _collect_events(path: Path, rows: dict[tuple[str, str], list[dict[str, Any]]]):
    """Move finished providers' rows from a worker's event file into ``rows``.

    Returns ``(pair in flight, its rows so far)``, or ``(None, [])`` when the worker ended cleanly."""
    if not path.exists():
        return None, []
    running, partial = None, []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if ev["ev"] == "start":
            running, partial = (ev["case"], ev["provider"]), []
        elif ev["ev"] == "row" and running is not None:
            partial.append(ev["row"])
        elif ev["ev"] == "end":
            rows[(ev["case"], ev["provider"])] = partial
            running, partial = None, []
    return running, partial


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    opts = argparse.Namespace(**spec["opts"])
    device, dtype = device_and_dtype(opts)
    configure_torch()
    events = open(spec["events"], "a", buffering=1)  # line-buffered: a crash loses at most one line

    def emit(ev):
        _progress(ev)
        events.write(json.dumps(ev, default=str) + "\n")
        events.flush()

    ctx = Context(device, dtype, opts, spec["prov"], H.Peaks(**spec["peaks"]), spec["deadline"], emit,
                  in_worker=True, skip={tuple(p) for p in spec["skip"]})
    run_cases(ctx, select_cases(opts))
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
