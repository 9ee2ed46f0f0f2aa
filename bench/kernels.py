"""Kernel benchmarks: our Triton attention and fused LayerNorm against what PyTorch offers.

The command line only: one row per case x provider x mode appended to ``kernels-<gpu>.csv``, this run's
markdown and PNG beside it. ``--smoke`` (automatic without CUDA): tiny shapes in a temp dir. Layout and
options: bench/README.md."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import cli, registry, report, runner
from bench import harness as H
from bench.cases import CORPUS_TOKENS, GROUPS, LENGTH_MEAN, LENGTH_P99


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_cli_args(p, "tiny shapes in seconds",
                     data="corpus cases: segment lengths of this corpus's train split (default: generated log-normal)")
    p.add_argument("--only", help="one benchmark: an op of bench.registry (attention, layernorm, ...)")
    p.add_argument("--groups", help=f"comma-separated case groups: {','.join(GROUPS)} (default: all)")
    p.add_argument("--providers", help="comma-separated subset of providers")
    p.add_argument("--provider-module", dest="provider_modules", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: it registers more providers (bench.registry.register); repeatable")
    p.add_argument("--modes", default=",".join(H.MODES), help="comma-separated subset of fwd,bwd,fwd+bwd")
    p.add_argument("--budget-s", type=float, help="start no new work after this many seconds (rest: skipped)")
    p.add_argument("--warmup-ms", type=float, help="do_bench warm-up (default 10; smoke 1)")
    p.add_argument("--rep-ms", type=float, help="do_bench repetition time (default 50; smoke 5)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="input dtype")
    p.add_argument("--min-fill", type=float, default=0.5,
                   help="ragged lengths are uniform in [min_fill*T, T] (default 0.5)")
    p.add_argument("--length-mean", type=float, default=LENGTH_MEAN,
                   help=f"generated segment lengths: mean tokens per side (default {LENGTH_MEAN:g})")
    p.add_argument("--length-p99", type=float, default=LENGTH_P99,
                   help=f"generated segment lengths: 99th percentile (default {LENGTH_P99:g})")
    p.add_argument("--corpus-tokens", default=",".join(map(str, CORPUS_TOKENS)),
                   help="corpus cases: src+tgt tokens per packed batch (default 4096,16384)")
    p.add_argument("--compile-backend", help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--isolate", choices=("auto", "process", "none"), default="auto",
                   help="run cases in a worker process (auto: on CUDA)")
    p.add_argument("--cpu-triton", action="store_true", help="run our Triton providers on CPU (interpreter)")
    opts = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if opts.cpu_triton and not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    opts.data_files = cli.cli_data_files(p, opts) or None
    opts.warmup_ms = opts.warmup_ms if opts.warmup_ms is not None else (1.0 if opts.smoke else 10.0)
    opts.rep_ms = opts.rep_ms if opts.rep_ms is not None else (5.0 if opts.smoke else 50.0)
    opts.compile_backend = opts.compile_backend or ("inductor" if cuda else "aot_eager")
    opts.modes = cli.choose(p, "--modes", opts.modes, H.MODES)
    opts.groups = cli.choose(p, "--groups", opts.groups, GROUPS) if opts.groups else None
    try:
        opts.corpus_tokens = [int(t) for t in opts.corpus_tokens.split(",") if t.strip()]
        registry.load(opts.provider_modules)
    except (ValueError, ImportError) as e:
        p.error(f"--corpus-tokens {opts.corpus_tokens!r} / --provider-module {opts.provider_modules}: {e}")
    if opts.only is not None and opts.only not in (ops := [op.name for op in registry.ops()]):
        p.error(f"--only {opts.only!r} is not one of the registered ops {ops} (bench.registry.OP_MODULES)")
    opts.providers = cli.choose(p, "--providers", opts.providers or ",".join(registry.names()), registry.names())
    if not 0 < opts.min_fill <= 1:
        p.error(f"--min-fill must be in (0, 1], got {opts.min_fill}")
    if opts.out is None:
        opts.out = Path(tempfile.mkdtemp(prefix="fastmt-bench-smoke-")) if opts.smoke else H.RESULTS_DIR
    opts.out = str(opts.out)
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    t_start = time.time()
    device, dtype = runner.device_and_dtype(opts)
    runner.configure_torch()

    def on_term(signum, frame):
        raise runner.Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    prov = H.provenance(device)
    print(f"bench.kernels: {prov['gpu']} | torch {prov['torch']} | triton {prov['triton']} | CUDA {prov['cuda'] or '-'} "
          f"| git {prov['git_sha'][:10]}{' (dirty)' if prov['git_dirty'] == 'yes' else ''} | out {opts.out}", flush=True)
    peak_kw = {"warmup_ms": opts.warmup_ms, "rep_ms": opts.rep_ms}
    if opts.smoke:
        peak_kw.update(copy_bytes=4 * 2**20, matmul_n=128)
    peaks = H.measure_peaks(device, dtype=dtype, **peak_kw)
    print(f"ceilings: copy {peaks.copy_gbps:,.0f} GB/s, {peaks.dtype} matmul {peaks.matmul_tflops:,.1f} TFLOP/s", flush=True)
    deadline = t_start + opts.budget_s if opts.budget_s else None
    cases = runner.select_cases(opts)
    ctx = runner.Context(device, dtype, opts, prov, peaks, deadline, emit=lambda ev: None)
    isolate = opts.isolate == "process" or (opts.isolate == "auto" and device.type == "cuda")
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        (runner.run_isolated if isolate else runner.run_in_process)(ctx, cases, rows)
    except (runner.Terminated, KeyboardInterrupt):
        interrupted = True
        print("bench.kernels: interrupted; writing what was measured", flush=True)
    except Exception:  # noqa: BLE001 - e.g. a lost CUDA context with --isolate none: keep the rows
        interrupted = True
        traceback.print_exc()
        print("bench.kernels: aborted; writing what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = runner.fill_skipped(ctx, cases, rows, interrupted)
    out, slug = Path(opts.out), prov["gpu_slug"]
    paths = [H.append_csv(H.result_path(out, "kernels", slug, "csv"), rows, runner.COLUMNS)]
    md = H.result_path(out, "kernels", slug, "md")
    report.write_markdown(md, rows, prov, peaks, opts)
    paths.append(md)
    if not opts.no_plot:
        try:
            paths.append(report.write_plot(H.result_path(out, "kernels", slug, "png"), rows, prov, peaks))
        except Exception:  # noqa: BLE001 - a plot must not cost the numbers
            traceback.print_exc()
    report.print_summary(rows, prov, peaks, paths)
    print(f"bench.kernels: {time.time() - t_start:.0f} s", flush=True)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
