"""Profile the compiled training step and check it for graph breaks (exit status 3 if it has any).

A fresh ``Trainer`` (compile on) runs untimed warm-up steps, then ``torch.profiler`` records N steps into
``<out>/profile-<gpu>/`` (trace, top kernels, dynamo log, report.md). Details: bench/README.md."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import cli
from bench import harness as H
from bench.harness import dynamo_counters
from train import flush_denormals

TRACE_GZIP_BYTES = 8 * 2**20


class GraphBreakError(RuntimeError):
    pass


# -- Graph breaks ----------------------------------------------------------------------------------
def explain(fn: Callable, *args, **kwargs) -> dict[str, Any]:
    """``torch._dynamo.explain`` of one call: graph count, graph-break count and the reasons."""
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = []
    for r in out.break_reasons:
        where = ""
        if getattr(r, "user_stack", None):
            fr = r.user_stack[-1]
            where = f" ({fr.filename}:{fr.lineno})"
        reasons.append(" ".join(str(r.reason).split())[:300] + where)
    return {"graphs": int(out.graph_count), "graph_breaks": int(out.graph_break_count), "reasons": reasons}


def check_no_graph_breaks(*reports: dict[str, Any], what: str = "the training step") -> None:
    """Raise ``GraphBreakError`` listing the reasons if any report counts a graph break."""
    n = sum(r["graph_breaks"] for r in reports)
    if n:
        reasons = sorted({x for r in reports for x in r["reasons"]})
        raise GraphBreakError(f"{n} graph break(s) in {what}:\n  - " + "\n  - ".join(reasons))


def _drop(_record: logging.LogRecord) -> bool:
    return False


def _console_handlers() -> list[logging.Handler]:
    """The console (stream, not file) handlers of the ``torch`` loggers: where TORCH_LOGS output goes."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] == "torch"]
    return [h for lg in [logging.getLogger("torch"), *loggers] for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def capture_dynamo_logs(path: Path):
    """TORCH_LOGS="graph_breaks,recompiles" into ``path``, and nothing of them onto the console (torch's own
    console handlers drop every record while the block runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    logger.addHandler(handler)
    try:
        with _quiet_torch_console():
            yield path
    finally:
        logger.removeHandler(handler)
        handler.close()
        torch._logging.set_logs()


@contextlib.contextmanager
def stderr_into(path: Path, enabled: bool = True):
    """File descriptor 2 appended to ``path`` while the block runs: what C++ libraries print there (the
    profiler's "profiler_start" / "profiler_stop" lines) stays off the console. Python errors still raise."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


# -- Configuration ---------------------------------------------------------------------------------
def profile_config(preset: str, *, smoke: bool, data_files: Sequence[str], work: Path):
    from train.config import get_config

    cfg = get_config(preset)
    if smoke:  # the tiny model, keeping the preset's layout and kernel switches (packed stays packed)
        m = cfg.model
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_tokens=512, pad_multiple=8),
                                  model=dataclasses.replace(get_config("tiny").model, layout=m.layout, norm=m.norm,
                                                            attn_backend=m.attn_backend, ffn_norm=m.ffn_norm))
    return cli.bench_config(cfg, "profile", work, data_files, smoke=smoke, compile=True)


# -- Profiling -------------------------------------------------------------------------------------
def top_kernels(prof, cuda: bool, limit: int = 25) -> tuple[list[dict[str, Any]], str]:
    """Rows (name, calls, self time) sorted by self device time (CPU: self CPU time), and torch's table."""
    avgs = prof.key_averages()
    sort_by = "self_cpu_time_total"
    if cuda:  # the name of the device time in this torch version
        sort_by = "self_device_time_total" if hasattr(avgs[0], "self_device_time_total") else "self_cuda_time_total"
    times = [float(getattr(e, sort_by, 0.0)) for e in avgs]
    total = sum(times) or 1.0
    rows = sorted(({"name": e.key[:90], "calls": int(e.count), "self_ms": t / 1e3, "pct": 100.0 * t / total}
                   for e, t in zip(avgs, times)), key=lambda r: -r["self_ms"])
    rows = [r for r in rows if r["self_ms"] > 0][:limit]
    try:
        text = avgs.table(sort_by=sort_by, row_limit=limit, max_name_column_width=90)
    except (KeyError, AttributeError):  # older/newer key names
        text = avgs.table(row_limit=limit)
    return rows, text


def busy_stats(kernels: Sequence[tuple[float, float]], steps: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """GPU busy share of the profiled steps: the union of the kernels' [start, end) intervals inside the steps'
    window over the window's length, with kernel launches and wall milliseconds per step (times in µs)."""
    if not steps:
        return {"gpu_busy": None, "launches_per_step": None, "step_ms": None}
    lo, hi = min(a for a, _ in steps), max(b for _, b in steps)
    busy, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in kernels if b > lo and a < hi):
        if b > end:
            busy += b - max(a, end)
            end = b
    n = len(steps)
    return {"gpu_busy": busy / (hi - lo) if hi > lo else None,
            "launches_per_step": sum(1 for a, b in kernels if lo <= a < hi) / n, "step_ms": (hi - lo) / n / 1e3}


def gpu_busy(prof) -> dict[str, Any]:
    """``busy_stats`` of a torch.profiler run: CUDA kernel events against the ProfilerStep windows."""
    from torch.autograd import DeviceType

    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep#")]
    no_kernels = {"gpu_busy": None, "launches_per_step": None}
    return busy_stats(kernels, steps) if kernels else {**busy_stats([], steps), **no_kernels}


def run_profile(preset: str, *, smoke: bool, data_files: Sequence[str], out_dir: Path, warmup: int, active: int,
                work: Path, log=print, quiet: bool = False) -> dict[str, Any]:
    """Warm up, profile ``active`` steps, time them again without the profiler; write the outputs.
    ``quiet``: what libraries print to the process's stderr while profiling goes to ``<out>/run.log``."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile, schedule

    from data import build_data
    from train.loop import Trainer

    cfg = profile_config(preset, smoke=smoke, data_files=data_files, work=work)
    device = torch.device("cuda" if cfg.run.device != "cpu" and torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    prov = H.provenance(device)
    out = out_dir / f"profile-{prov['gpu_slug']}"
    out.mkdir(parents=True, exist_ok=True)
    bundle = build_data(cfg.data, log=lambda m: log(str(m)))
    wait_s, warm_s = 1, 1
    batches = cli.train_batches(bundle, warmup + wait_s + warm_s + active)

    torch._dynamo.reset()
    counters.clear()
    with capture_dynamo_logs(out / "dynamo.log"):
        trainer = Trainer(cfg, data=bundle, log=lambda *a, **k: None)
        if not trainer.compiled:
            raise ValueError(f"preset {preset!r} does not compile on {device}: nothing to check")
        t0 = time.perf_counter()
        for b in batches[:warmup]:
            trainer.train_step(b)
        H.synchronize(device)
        compile_s = time.perf_counter() - t0
        graphs_after_warmup = dynamo_counters()["graphs"]
        trace_path = out / "trace.json"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with stderr_into(out / "run.log", quiet), profile(
                activities=activities, schedule=schedule(wait=wait_s, warmup=warm_s, active=active, repeat=1),
                on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path)),
                record_shapes=False, with_stack=False, profile_memory=False) as prof:
            for b in batches[warmup:]:
                trainer.train_step(b)
                prof.step()
        H.synchronize(device)
        steps_counters = dynamo_counters()
        # the step time without the profiler's overhead: the profiled batches again (their shapes compiled)
        step_ms = []
        for b in batches[warmup:]:
            t = time.perf_counter()
            trainer.train_step(b)
            H.synchronize(device)
            step_ms.append((time.perf_counter() - t) * 1e3)
        # explain: dynamo's own account of one forward of the compiled module on the first batch
        b = batches[0].to(device)
        with trainer.autocast:
            expl = explain(trainer.loss_module, b.tgt_out, **b.model_inputs(static_max_len=True))
    rows, text = top_kernels(prof, cuda)
    busy = gpu_busy(prof)
    del trainer, prof
    if trace_path.stat().st_size > TRACE_GZIP_BYTES:
        with trace_path.open("rb") as f, gzip.open(str(trace_path) + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        trace_path.unlink()
        trace_path = Path(str(trace_path) + ".gz")
    (out / "top_kernels.txt").write_text(text + "\n")
    unit = "self device ms" if cuda else "self CPU ms"
    (out / "top_kernels.md").write_text(
        f"# Top {'kernels' if cuda else 'ops'} by {unit} — {prov['gpu']}, preset `{preset}`, {active} active steps\n\n"
        + H.markdown_table(rows, ("name", "calls", "self_ms", "pct"), ("name", "calls", unit, "% of total")) + "\n")
    result = {"preset": preset, "smoke": smoke, "device": prov["gpu"], "out": out, "trace": trace_path, "compile_s": compile_s,
              "graphs_after_warmup": graphs_after_warmup, "steps": steps_counters, "explain": expl,
              "recompiles_while_profiling": steps_counters["graphs"] - graphs_after_warmup, "prov": prov,
              "shapes": len({tuple(x.src.shape) + tuple(x.tgt_in.shape) for x in batches}), **busy,
              "profiled_step_ms": busy["step_ms"], "step_ms": statistics.median(step_ms), "timed_steps": len(step_ms)}
    (out / "report.md").write_text(report_markdown(result, rows, cfg))
    return result


def report_markdown(r: dict[str, Any], rows, cfg) -> str:
    st, ex, prov = r["steps"], r["explain"], r["prov"]
    ok = st["graph_breaks"] == 0 and ex["graph_breaks"] == 0
    lines = [
        f"# Profile of the compiled training step — preset `{r['preset']}` on {prov['gpu']}"
        + (" (smoke configuration: the tiny model, aot_eager)" if r.get("smoke") else ""),
        "",
        H.provenance_markdown(prov, None),
        f"- compile: backend {cfg.run.compile_backend}, mode {cfg.run.compile_mode}, dynamic {cfg.run.compile_dynamic}; "
        f"batching {cfg.data.batching}, layout {cfg.model.layout}, attention {cfg.model.attn_backend}, "
        f"norm {cfg.model.norm}, precision {cfg.run.precision}",
        f"- warm-up (compile included): {r['compile_s']:.1f} s; {r['shapes']} distinct batch shapes in the profiled batches",
        f"- step: **{H.fmt(r['step_ms'])} ms** wall (median of {r['timed_steps']} steps run again after profiling, "
        f"no profiler; the batches' shapes already compiled)",
        "- GPU busy: "
        + (f"**{100 * r['gpu_busy']:.0f} %** of the profiled steps' {H.fmt(r['profiled_step_ms'])} ms (goal >= 80 %), "
           f"{r['launches_per_step']:.0f} kernel launches per step"
           if r["gpu_busy"] is not None else "n/a (no CUDA kernels: a CPU run)"),
        "",
        f"## Graph breaks: **{'none' if ok else 'FOUND'}**",
        "",
        f"- training steps (dynamo counters): {st['graphs']} graph(s) compiled, {st['graph_breaks']} graph break(s); "
        f"{r['graphs_after_warmup']} after warm-up, {r['recompiles_while_profiling']} compiled during profiling",
        f"- `torch._dynamo.explain` of the loss module on one batch: {ex['graphs']} graph(s), "
        f"{ex['graph_breaks']} graph break(s)",
    ]
    for reason in sorted(set(st["reasons"] + ex["reasons"])):
        lines.append(f"  - {reason}")
    lines += ["- logs: `dynamo.log` (graph_breaks, recompiles)", "",
              f"## Top {len(rows)} by self time", "", H.markdown_table(rows, ("name", "calls", "self_ms", "pct"),
                                                                      ("name", "calls", "self ms", "%")),
              "", f"Trace: `{r['trace'].name}` (open in https://ui.perfetto.dev or chrome://tracing)."]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _quiet_torch_console():
    """torch's warnings-level console logging muted for the run (the report says what matters)."""
    muted = _console_handlers()
    for h in muted:
        h.addFilter(_drop)
    try:
        yield
    finally:
        for h in muted:
            h.removeFilter(_drop)


# -- Command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    cli.add_cli_args(p, "tiny preset, aot_eager, CPU", plot=False)
    p.add_argument("--preset", help="training preset (default: fast on CUDA, tiny with --smoke)")
    p.add_argument("--warmup", type=int, help="untimed steps before profiling, compile included (default 4; smoke 2)")
    p.add_argument("--active", type=int, default=3, help="profiled steps (keep the trace small)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the data log, recompiles and graph breaks as they happen (else: run.log, "
                        "dynamo.log in the output folder)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    work = Path(tempfile.mkdtemp(prefix="fastmt-profile-"))
    files = cli.cli_data_files(p, a, toy=lambda: work / "toy.jsonl", toy_rows=400, announce=a.verbose)
    if a.smoke:
        flush_denormals()
    preset = a.preset or ("tiny" if a.smoke else "fast")
    out = a.out or (work / "out" if a.smoke else H.RESULTS_DIR)
    warmup = a.warmup if a.warmup is not None else (2 if a.smoke else 4)
    lines: list[str] = []
    log = print if a.verbose else (lambda *x: lines.append(" ".join(map(str, x))))
    with contextlib.nullcontext() if a.verbose else _quiet_torch_console():
        r = run_profile(preset, smoke=a.smoke, data_files=files, out_dir=out, warmup=warmup, active=a.active,
                        work=work, log=log, quiet=not a.verbose)
    if not a.verbose:
        with (r["out"] / "run.log").open("a") as f:
            f.write("\n".join(lines) + "\n")
    print((r["out"] / "report.md").read_text(), flush=True)
    print(f"[profile] outputs in {r['out']} (run.log: the data log; dynamo.log: recompiles, graph breaks)")
    try:
        check_no_graph_breaks(r["steps"], r["explain"], what=f"the compiled training step of preset {preset!r}")
    except GraphBreakError as e:
        bar = "!" * 100
        print(f"\n{bar}\nGRAPH BREAK(S) IN THE DEFAULT CONFIGURATION -- {e}\nSee {r['out'] / 'dynamo.log'}\n{bar}",
              file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
