"""The step audit: N training steps of a preset's structure on this device, and what each step costs the host.

    python -m bench.step [--preset fast] [--size small] [--steps 20] [--json]    (also: fastmt bench step)

Builds the preset's model (at ``--size``: ``preset`` keeps it, ``small``/``toy`` shrink it to run on a CPU in
seconds to minutes), its optimizer and schedule, its compile settings (``--backend``, ``--scope``) and, where
``run.step_graph`` applies, the static-buffer step (train/graph_step.py; one CUDA graph per step on CUDA);
feeds synthetic packed batches of ``data.max_tokens`` tokens a side (one shape, as packed batches have); runs
``--warmup`` untimed steps, then ``--steps`` timed ones, then the same steps again under ``torch.profiler``,
and prints one JSON object on its last line:

- ``graphs_per_step``: CUDA graphs replayed per step (0 on the CPU);
- ``regions_per_step``: compiled regions entered per step (a compiled forward, its backward and a compiled
  update count one each): the profiler's "Torch-Compiled Region" and "CompiledFunctionBackward" events;
- ``eager_ops_per_step``: aten ops dispatched outside every compiled region and graph: the profiler's
  top-level ``aten::`` events (an op nested in another op or in a region is not counted again). Not a
  ``TorchDispatchMode``: torch.compile runs its regions uncompiled while a (non-infra) dispatch mode is active,
  which would count the compiled ops as eager;
- ``host_syncs_per_step``: ``aten::_local_scalar_dense`` / ``aten::item`` events (values read on the host);
- ``step_ms`` (median of the timed steps, a sync after each), ``tokens_per_s`` (real src + tgt tokens),
  ``flops_per_step`` (models/flops.py, training = 3x forward matmuls), ``mfu`` against the peak of the precision
  in use (models/flops.py ``run_peak``; null on the CPU, which has no declared peak).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time

import torch

from bench import harness as H

SIZES = {  # --size: the model the audit builds (None: the preset's own)
    "preset": None,
    "small": dict(d_model=256, n_heads=4, d_ff=1024, enc_layers=3, dec_layers=3, vocab_size=8000),
    "toy": dict(d_model=32, n_heads=2, d_ff=64, enc_layers=2, dec_layers=2, vocab_size=256),
}
TOKENS = {"preset": None, "small": 1024, "toy": 128}  # tokens a side per packed batch (None: data.max_tokens)


def packed_batch(vocab: int, tokens: int, seg: int, seed: int):
    """A packed Batch of ``tokens`` tokens a side: segments of ``seg`` tokens (the last shorter), random ids."""
    from data.collate import Batch, segment_of_tokens

    g = torch.Generator().manual_seed(seed)
    lens = [seg] * (tokens // seg) + ([tokens % seg] if tokens % seg else [])
    n = len(lens)
    lengths = torch.tensor(lens, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    pos = torch.cat([torch.arange(k, dtype=torch.int32) for k in lens])[None]
    seg_ids = torch.from_numpy(segment_of_tokens(lengths.numpy()))  # as the packed collate builds them

    def ids():
        return torch.randint(4, vocab, (1, tokens), generator=g, dtype=torch.int32)

    return Batch(src=ids(), tgt_in=ids(), tgt_out=ids(), src_lengths=lengths, tgt_lengths=lengths.clone(),
                 cu_seqlens_src=cu, cu_seqlens_tgt=cu.clone(), index=torch.arange(n), max_src_len=max(lens),
                 max_tgt_len=max(lens), num_real_tokens=2 * tokens, num_target_tokens=tokens, src_pos=pos,
                 tgt_pos=pos.clone(), src_seg=seg_ids, tgt_seg=seg_ids.clone())


def build(args):
    """(config, a step function of one batch, the StepGraph or None, the step's description)."""
    from models import Transformer
    from train.compile import compile_for_training
    from train.config import PRESETS
    from train.loss import SummedCrossEntropy
    from train.optim import build_optimizer, build_scheduler
    from train.step import StepCounters, forward_backward, optimizer_step

    cfg = PRESETS[args.preset]()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model_changes = dict(SIZES[args.size] or {}, layout="packed", checkpointing=False)
    if device.type == "cpu":
        model_changes.update(attn_backend="auto")
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **model_changes),
        data=dataclasses.replace(cfg.data, batching="packed", max_tokens=TOKENS[args.size] or cfg.data.max_tokens,
                                 max_len=min(cfg.data.max_len, (TOKENS[args.size] or cfg.data.max_tokens) // 2)),
        run=dataclasses.replace(cfg.run, compile=args.compile,
                                compile_backend=args.backend, compile_scope=args.scope or cfg.run.compile_scope,
                                **({"step_graph": {"auto": None, "on": True, "off": False}[args.step_graph]}
                                   if hasattr(cfg.run, "step_graph") else {})))  # (a landed tree: none)
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    loss_module = SummedCrossEntropy(model, 0, cfg.optim.label_smoothing)
    optimizer, flat = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, 10**6)
    counters = StepCounters(device)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.run.precision)
    autocast = torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None)
    run = cfg.run
    plan = None
    try:
        from train.graph_step import NormalisedLoss, StepGraph, plan_step_graph

        plan = plan_step_graph(cfg, device.type, distributed=False)
    except ImportError:  # a tree without the static-buffer step: the eager step only
        pass
    compiled = bool(run.compile) if run.compile is not None else device.type == "cuda"
    step_module = NormalisedLoss(loss_module) if plan is not None and plan.on else loss_module
    if compiled:
        # the captured step brings its own CUDA graph; CUDA-graph modes mean nothing on the CPU
        mode = "default" if (plan is not None and plan.capture) or device.type == "cpu" else run.compile_mode
        step_module = compile_for_training(step_module, loss_module, scope=run.compile_scope, backend=run.compile_backend,
                                           mode=mode, dynamic=run.compile_dynamic)
    scaler = torch.amp.GradScaler(device.type, enabled=run.precision == "fp16")
    if plan is not None and plan.on:
        sg = StepGraph(step_module, optimizer, flat, counters, name=cfg.optim.name, device=device, autocast=autocast,
                       grad_clip=cfg.optim.grad_clip, guard=run.nonfinite_guard, capture=plan.capture,
                       compile_update=dict(backend=run.compile_backend, dynamic=False) if compiled else None)

        def step(batch):
            loss = sg(batch)
            scheduler.step()
            return loss

        return cfg, device, step, sg, plan.reason, compiled
    def step(batch):
        loss = forward_backward(step_module, [batch], device=device, autocast=autocast, scaler=scaler)
        optimizer_step(optimizer, flat, scheduler, scaler, counters, loss, grad_clip=cfg.optim.grad_clip,
                       guard=run.nonfinite_guard)
        return loss

    return cfg, device, step, None, plan.reason if plan is not None else "eager step (no train/graph_step.py)", compiled


def profile_counts(step, batches, device) -> dict[str, float]:
    """Regions, eager ops, host syncs and CUDA graph launches per step, from torch.profiler's event tree."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for b in batches:
            step(b)
        H.synchronize(device)
    regions = eager = syncs = graphs = 0
    names = collections.Counter()
    events = prof.events()
    for e in events:
        name = e.name
        if name.startswith("Torch-Compiled Region") or name == "CompiledFunctionBackward":
            if not _inside(e, ("Torch-Compiled Region", "CompiledFunctionBackward")):
                regions += 1
        elif name in ("aten::_local_scalar_dense", "aten::item"):
            syncs += name == "aten::_local_scalar_dense"
        if name == "cudaGraphLaunch":
            graphs += 1
        if name.startswith("aten::") and not _inside(e, ("aten::", "Torch-Compiled Region", "CompiledFunction")):
            eager += 1
            names[name] += 1
    n = len(batches)
    return {"regions_per_step": regions / n, "eager_ops_per_step": eager / n, "host_syncs_per_step": syncs / n,
            "graphs_per_step": graphs / n, "eager_ops": {k: v / n for k, v in names.most_common(12)}}


def _inside(event, prefixes) -> bool:
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith(prefixes):
            return True
        p = p.cpu_parent
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="fast", help="the preset whose structure is audited (default fast)")
    ap.add_argument("--size", choices=list(SIZES), default="small",
                    help="model and batch size: preset (the preset's own), small (CPU, default), toy (tests)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (the median is step_ms)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile, capture)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: quick, for tests)")
    ap.add_argument("--scope", choices=("blocks", "model"), default=None,
                    help="compile scope (default: the preset's)")
    ap.add_argument("--compile", type=lambda s: s.lower() in ("1", "true", "on"), default=True,
                    help="compile on/off (default: on, as the fast preset; the preset's own for others)")
    ap.add_argument("--step-graph", choices=("auto", "on", "off"), default="on",
                    help="run.step_graph: on (default; CPU: the static-buffer step run eagerly), off, auto")
    ap.add_argument("--json", action="store_true", help="print the JSON object only")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    cfg, device, step, sg, how, compiled = build(args)
    from models.flops import flops_per_token, mfu, run_peak

    tokens = cfg.data.max_tokens
    seg = min(32, cfg.model.max_positions)
    batches = [packed_batch(cfg.model.vocab_size, tokens, seg, s) for s in range(args.warmup + args.steps)]
    t0 = time.perf_counter()
    for b in batches[:args.warmup]:
        step(b)
    H.synchronize(device)
    warm_s = time.perf_counter() - t0
    times = []
    for b in batches[args.warmup:]:
        t = time.perf_counter()
        step(b)
        H.synchronize(device)
        times.append(time.perf_counter() - t)
    counts = profile_counts(step, batches[args.warmup:args.warmup + min(args.steps, 3)], device)
    step_s = statistics.median(times)
    flops = flops_per_token(cfg.model, seg, seg) * tokens
    peak, peak_dtype, peak_note = run_peak(device, cfg.run.precision, override=cfg.run.peak_flops)
    m = mfu(flops / step_s, peak)
    rec = {"preset": args.preset, "size": args.size, "device": device.type, "step": how, "compiled": compiled,
           "compile_backend": cfg.run.compile_backend, "compile_scope": cfg.run.compile_scope,
           "precision": cfg.run.precision, "tokens_per_batch": 2 * tokens, **counts,
           "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(2 * tokens / step_s, 1),
           "flops_per_step": flops, "mfu": None if m != m else round(m, 5), "peak_flops": peak,
           "peak_dtype": peak_dtype, "peak_note": peak_note, "warmup_s": round(warm_s, 2), "steps": args.steps,
           "captures": getattr(sg, "captures", 0), "torch": torch.__version__}
    if not args.json:
        for k, v in rec.items():
            print(f"{k:>22}: {v}")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
