"""The speedup ladder: one technique at a time, every rung on the same data and device, in one process.

    python -m bench.ladder [--smoke] [--data-files F ...] [--steps N] [--warmup N] [--out DIR]
                           [--rungs 0,1,2,...] [--budget-s S] [--cap-s S] [--max-tokens N] [--no-readme]

Rungs are independent: each is the baseline plus a named set of switches (``SWITCHES``), built from
scratch, so a rung's configuration never depends on which other rungs ran. Each is compared with the
rung that has the same switches minus its own technique (``compare``, the csv's ``parent``):
  0   baseline: the ``baseline`` preset -- fp32, fixed padding to 350, eager, reference attention,
      torch LayerNorm (the seeds' way)
  1   bf16                                     run.precision=bf16
  2   bf16 + dynamic padding                   data.batching=dynamic (32 sentences, padded to the longest)
  3   bf16 + token buckets                     data.batching=token_bucket (max_tokens padded src+tgt)
  4   3 + SDPA attention                       model.attn_backend=sdpa
  5   4 + torch.compile                        run.compile=true (inductor, automatic dynamic shapes)
  6a  5 with our varlen attention              model.layout=varlen, model.attn_backend=triton
  6b  bf16 + compile + padding-free packing    data.batching=packed, model.layout=packed
  7   6b + fused LayerNorm(+GELU)              model.norm=fused
  8   side: 7 + parameter sharing              model.sharing=cycle_rev, 3+3 unique blocks applied 6+6
  9a  side: 7 + CUDA graphs                    run.compile_mode=reduce-overhead          (CUDA only)
  9b  side: 7 + GEMM autotuning                run.compile_mode=max-autotune-no-cudagraphs (CUDA only)

Fixed across rungs, so only the technique changes: the data (one built bundle: same corpus, split,
tokenizer, and the same padded-token budget per step, 32 x 2 x 350 = 22,400 = the baseline's fixed
batch), the model shape (s18: 6+6 x 512, d_ff 2048, 8 heads; rung 8 keeps it and only ties blocks),
the optimizer (the baseline preset's Adam 1e-4, no clipping), the seed, torch's fp32 matmul
precision ("highest" at the start of every rung; a bf16 rung's Trainer allows TF32 for what runs
outside autocast), and the measurement protocol.

Protocol per rung: build a fresh ``Trainer`` on the shared bundle; take the first ``warmup + steps``
batches of epoch 0's shuffled plan (pre-collated, pinned: the loader is not timed); run ``warmup``
untimed optimizer steps (compilation and recompiles land here); then ``steps`` timed steps between
two device synchronisations, with CUDA events around each step for the spread. The non-finite guard
is off (the rungs measure techniques, not the guard). Each rung has a time cap (``cap_s``; default
``--cap-s`` for eager rungs, twice that for compiled ones): a rung over its cap stops at the next step
boundary and becomes a ``capped`` row. Reported per rung:
  tokens_per_second      real (non-pad) src+tgt tokens / timed wall seconds
  step_ms (p20, p80)     mean wall ms per optimizer step (event-timed percentiles)
  epoch_seconds_projected  real tokens of one training epoch / tokens_per_second
  peak_memory_gb         max allocated GiB during the timed steps (CUDA; empty on CPU)
  padding_fraction       1 - real / computed token positions over the timed batches
                         (epoch_padding_fraction: the same over the whole epoch-0 plan)
  mfu, peak_dtype        model FLOPs (models.flops_per_token at each batch's mean real lengths x its
                         real target tokens) per second / the peak of the dtype the rung's matmuls ran
                         in (fp32, tf32, bf16, fp16: ``models.flops.run_peak``; NVIDIA's datasheet,
                         dense, or a matmul measured in this run). Empty on CPU (``mfu_note`` says why)
  sdpa_backend           rungs with SDPA: the kernel torch's dispatcher picks for the rung's masked
                         calls (``torch._fused_sdp_choice`` on the first timed batch's shapes and dtype)
  graphs, graph_breaks, recompiles_timed   dynamo counters (compiled rungs); recompiles_timed > 0
                         means a compile landed inside the timed window: the rung is ``invalid``
  speedup_vs_baseline / speedup_vs_previous   tokens_per_second ratios vs rung 0 / vs the rung this
                         one is compared with (``parent``: ``compare``, or its nearest ancestor that ran)
A rung that raises (out of memory, an unsupported setting, a kernel error) becomes an error row and
the ladder goes on; only rows with status ``ok`` get speedups.

``--smoke`` (automatic without CUDA): the tiny model on a generated toy corpus (or ``--data-files``),
2 timed steps per rung, torch.compile through ``aot_eager`` with ``dynamic=True``, CUDA-only rungs skipped, Triton
attention replaced by the "auto" backend (the reference on CPU); written to ``--out`` (default a
temp dir), never to the README. Outputs: ``<out>/ladder-<gpu>.{csv,md,png}``; a full run also
rewrites the README between ``<!-- ladder:start -->`` and ``<!-- ladder:end -->``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from bench import harness as H
from train import flush_denormals

README = H.REPO_ROOT / "README.md"
README_START, README_END = "<!-- ladder:start -->", "<!-- ladder:end -->"
# DataConfig fields that only change how batches are cut: rungs may differ in these, and in nothing
# else of the data config (tokenizer, cleaning and split must be the shared bundle's).
BATCHING_FIELDS = frozenset({"batching", "max_tokens", "batch_size", "seq_len", "overlong", "pad_multiple",
                             "seed", "num_workers", "pin_memory", "prefetch_factor"})


# ----------------------------------------------------------------------------------------------
# Rungs
# ----------------------------------------------------------------------------------------------
# Named switches: each a set of overrides (CLI syntax) on top of the baseline preset.
SWITCHES: dict[str, dict[str, str]] = {
    "bf16": {"run.precision": "bf16"},
    "dynamic": {"data.batching": "dynamic"},
    "token_bucket": {"data.batching": "token_bucket"},
    "sdpa": {"model.attn_backend": "sdpa"},
    "compile": {"run.compile": "true"},
    "varlen": {"model.layout": "varlen", "model.attn_backend": "triton"},
    "packed": {"data.batching": "packed", "model.layout": "packed", "model.attn_backend": "triton"},
    "fused_norm": {"model.norm": "fused"},
    "sharing": {"model.sharing": "cycle_rev", "model.enc_unique": "3", "model.dec_unique": "3"},
    "cudagraphs": {"run.compile_mode": "reduce-overhead"},
    "autotune": {"run.compile_mode": "max-autotune-no-cudagraphs"},
}


@dataclass(frozen=True)
class Rung:
    id: str  # "0", "1", ..., "6a", "9b": the csv `rung` column
    name: str  # the technique this rung adds, for tables and the plot
    # names in SWITCHES, or raw "section.field=value" overrides, applied in order (a later one wins)
    switches: tuple[str, ...]
    compare: str | None  # the rung it is compared with (same switches minus this technique); None: baseline
    cap_s: float | None = None  # time cap (warm-up + timed steps); None: the ladder's default for its kind
    branch: bool = False  # side branch (drawn lighter)
    cuda_only: bool = False  # skipped (not an error) on CPU

    def overrides(self) -> dict[str, str]:
        """The rung's full set of overrides on the baseline (unknown switch names fail, naming them)."""
        out: dict[str, str] = {}
        for sw in self.switches:
            if "=" in sw:
                key, value = sw.split("=", 1)
                out[key.strip()] = value.strip()
            elif sw in SWITCHES:
                out.update(SWITCHES[sw])
            else:
                raise ValueError(f"rung {self.id}: unknown switch {sw!r}; known: {sorted(SWITCHES)} "
                                 f"or 'section.field=value'")
        return out


_MAIN = ("bf16", "compile", "packed", "fused_norm")  # rung 7's switches, the side branches' base
RUNGS: tuple[Rung, ...] = (
    Rung("0", "baseline (fp32, fixed pad 350, eager, reference attn, torch LN)", (), None),
    Rung("1", "+ bf16 autocast", ("bf16",), "0"),
    Rung("2", "+ dynamic padding", ("bf16", "dynamic"), "1"),
    Rung("3", "+ token buckets", ("bf16", "token_bucket"), "2"),
    Rung("4", "+ SDPA attention", ("bf16", "token_bucket", "sdpa"), "3"),
    Rung("5", "+ torch.compile", ("bf16", "token_bucket", "sdpa", "compile"), "4"),
    Rung("6a", "+ varlen Triton attention", ("bf16", "token_bucket", "compile", "varlen"), "5"),
    Rung("6b", "+ padding-free packing", ("bf16", "compile", "packed"), "6a"),
    Rung("7", "+ fused LayerNorm(+GELU)", _MAIN, "6b"),
    Rung("8", "side: sharing cycle_rev 3+3", (*_MAIN, "sharing"), "7", branch=True),
    Rung("9a", "side: compile reduce-overhead", (*_MAIN, "cudagraphs"), "7", branch=True, cuda_only=True),
    Rung("9b", "side: compile max-autotune-no-cudagraphs", (*_MAIN, "autotune"), "7", branch=True,
         cuda_only=True),
)


def select_rungs(spec: str | None, rungs: Sequence[Rung] = RUNGS) -> list[Rung]:
    """``"0,1,5"`` -> those rungs (rung 0 is always kept: every speedup is relative to it)."""
    if not spec:
        return list(rungs)
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    known = {r.id for r in rungs}
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(f"--rungs: unknown rung(s) {unknown}; known: {[r.id for r in rungs]}")
    return [r for r in rungs if r.id in wanted or r.id == "0"]


# ----------------------------------------------------------------------------------------------
# Configuration of one rung
# ----------------------------------------------------------------------------------------------
@dataclass
class LadderSettings:
    """Everything a run holds fixed; built once from the command line."""

    smoke: bool
    device: torch.device
    data_files: tuple[str, ...]
    out: Path
    steps: int
    warmup: int
    max_tokens: int | None = None
    budget_s: float | None = None
    cap_s: float = 120.0  # default time cap of an eager rung (compiled rungs: twice this)
    readme: bool = True
    work_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fastmt-ladder-")))


def base_config(s: LadderSettings):
    """Rung 0's Config: the ``baseline`` preset (or a tiny twin of it in smoke mode) with the fixed
    benchmark settings: non-finite guard off, no logging side outputs, runs under a temp dir."""
    from data import DataConfig
    from models import get_preset
    from train.config import baseline

    cfg = baseline()
    run = dataclasses.replace(cfg.run, name="ladder", out_dir=str(s.work_dir / "runs"), nonfinite_guard=False,
                              tensorboard=False, progress=False, plot=False,
                              device=s.device.type, compile_backend="aot_eager" if s.smoke else "inductor",
                              # smoke: one graph per compiled rung (a CPU compile costs 5-15 s; the GPU run
                              # keeps the presets' automatic dynamic shapes)
                              compile_dynamic=True if s.smoke else cfg.run.compile_dynamic)
    data = cfg.data
    if s.smoke:
        # the baseline's shape of settings at toy scale: fixed padding to the longest allowed pair
        data = DataConfig(vocab_size=400, max_len=32, seq_len=32, batch_size=8, max_tokens=8 * 2 * 32,
                          batching="fixed", valid_size=40, test_size=40, num_workers=0)
        model = get_preset("tiny", attn_backend="reference", norm="torch", layout="padded", max_positions=64)
        cfg = dataclasses.replace(cfg, model=model)
    data = dataclasses.replace(data, data_files=tuple(s.data_files), num_workers=0,
                               cache_dir=str(s.work_dir / "cache") if s.smoke else data.cache_dir)
    if s.max_tokens is not None:
        data = dataclasses.replace(data, max_tokens=s.max_tokens)
    return dataclasses.replace(cfg, data=data, run=run, eval=dataclasses.replace(cfg.eval, test_at_end=False))


def rung_overrides(rung: Rung, ran: Collection[str], by_id: dict[str, Rung]) -> tuple[str | None, dict]:
    """(the rung it is compared with, its overrides). The overrides are the rung's own, whatever ran;
    the comparison is ``rung.compare``, or -- when that did not run -- the nearest rung up the
    ``compare`` chain that did (``ran``: ids of the rungs measured so far)."""
    known = {**{r.id: r for r in RUNGS}, **by_id}  # the chain runs through the standard rungs too (--rungs)
    parent = rung.compare
    while parent is not None and parent not in ran:
        parent = known[parent].compare if parent in known else None
    return parent, rung.overrides()


def adapt_overrides(overrides: dict[str, str], base, device: torch.device) -> tuple[dict, list[str]]:
    """Fit a rung's overrides to the machine and model: on CPU our Triton attention would run in the
    interpreter (minutes), so "auto" (the reference) replaces it; unique-block counts larger than the
    base model's layers (the tiny smoke model has 2+2) become half its layers."""
    out, notes = dict(overrides), []
    if device.type != "cuda" and out.get("model.attn_backend") == "triton":
        out["model.attn_backend"] = "auto"
        notes.append("cpu: attn_backend triton -> auto (reference)")
    for side in ("enc", "dec"):
        key, layers = f"model.{side}_unique", getattr(base.model, f"{side}_layers")
        if key in out and int(out[key]) > layers:
            out[key] = str(max(1, layers // 2))
            notes.append(f"{side}_unique -> {out[key]} ({layers} layers)")
    return out, notes


def build_rung_config(base, overrides: dict[str, str]):
    from train.config import apply_overrides

    return apply_overrides(copy.deepcopy(base), dict(overrides))


def bundle_view(bundle, data_cfg):
    """The shared bundle with another batching configuration (same corpus, split, tokenizer, arrays)."""
    a, b = dataclasses.asdict(bundle.cfg), dataclasses.asdict(data_cfg)
    differ = sorted(k for k in a if a[k] != b[k] and k not in BATCHING_FIELDS)
    if differ:
        raise ValueError(f"a ladder rung may change only batching fields of the data config, not {differ}")
    view = copy.copy(bundle)
    view.cfg = data_cfg
    return view


# ----------------------------------------------------------------------------------------------
# Measuring one rung
# ----------------------------------------------------------------------------------------------
def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def free_memory(device: torch.device) -> None:
    """Between rungs: drop compiled code and cached blocks so a rung never inherits the last one's,
    and put torch's fp32 matmul precision back to "highest" (a bf16 rung's Trainer allows TF32)."""
    from torch._dynamo.utils import counters

    gc.collect()
    torch._dynamo.reset()
    counters.clear()
    torch.set_float32_matmul_precision("highest")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class RungCapped(RuntimeError):
    """A rung passed its time cap (raised at a step boundary)."""


def sdpa_backend(cfg, batch, device: torch.device) -> str:
    """The SDPA kernel torch's dispatcher picks for this model's masked attention calls on ``batch``.

    ``kernels.attention(..., backend="sdpa")`` passes a boolean (B, 1, Tq, Tk) mask whenever lengths
    are given (padded batches always give them); this asks ``torch._fused_sdp_choice`` -- the choice
    ``F.scaled_dot_product_attention`` itself makes -- for the encoder-self, decoder-self and cross
    calls at the batch's padded shapes, the rung's compute dtype and inputs that need gradients.
    One name when all three agree ("flash_attention", "efficient_attention", "cudnn_attention",
    "math"), else ``enc:... dec:... cross:...``.
    """
    from torch.nn.attention import SDPBackend

    from kernels.flash_attention import visibility_mask

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.run.precision, torch.float32)
    B, S, T = batch.src.shape[0], batch.src.shape[1], batch.tgt_in.shape[1]
    H, D = cfg.model.n_heads, cfg.model.head_dim
    src_l, tgt_l = batch.src_lengths.to(device), batch.tgt_lengths.to(device)
    names = {}
    for part, (tq, tk, lq, lk, causal) in {"enc": (S, S, src_l, src_l, False), "dec": (T, T, tgt_l, tgt_l, True),
                                           "cross": (T, S, tgt_l, src_l, False)}.items():
        q = torch.randn(B, H, tq, D, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, H, tk, D, device=device, dtype=dtype, requires_grad=True)
        mask = visibility_mask(tq, tk, lq, lk, causal)
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False)
        names[part] = SDPBackend(int(choice)).name.lower()
    if len(set(names.values())) == 1:
        return next(iter(names.values()))
    return " ".join(f"{k}:{v}" for k, v in names.items())


def measure_rung(cfg, bundle, s: LadderSettings, *, cap_s: float | None = None) -> dict[str, Any]:
    """Warm up, then time ``s.steps`` optimizer steps of a fresh Trainer; returns the metric columns.

    ``cap_s``: wall seconds from the start of this call after which the rung stops at the next step
    boundary (``RungCapped``)."""
    from data.batching import plan_stats
    from models import flops_per_token
    from models.flops import mfu, run_peak
    from train.loop import Trainer

    t_call = time.perf_counter()

    def check_cap(where: str) -> None:
        if cap_s is not None and time.perf_counter() - t_call > cap_s:
            raise RungCapped(f"over its time cap of {cap_s:.0f} s {where}")

    view = bundle_view(bundle, cfg.data)
    batches = list(islice(iter(view.loader("train", epoch=0)), s.warmup + s.steps))
    if len(batches) < s.warmup + s.steps:
        raise ValueError(f"the training split gives {len(batches)} batches; need warmup + steps = "
                         f"{s.warmup + s.steps} (lower --steps/--warmup or use more data)")
    warm, timed = batches[: s.warmup], batches[s.warmup:]
    dev = s.device
    trainer = Trainer(cfg, data=view, log=lambda *a, **k: None)
    try:
        # the rung's compute dtype, read after the Trainer has set torch's matmul precision
        peak, peak_dtype, peak_note = run_peak(dev, cfg.run.precision)
        t0 = time.perf_counter()
        for i, b in enumerate(warm):
            trainer.train_step(b)
            check_cap(f"after warm-up step {i + 1}/{len(warm)}")
        H.synchronize(dev)
        warmup_s = time.perf_counter() - t0
        counts_before = _dynamo_counts()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(timed) + 1)]
        step_ms: list[float] = []
        H.synchronize(dev)
        t0 = time.perf_counter()
        t_prev = t0
        for i, b in enumerate(timed):
            if dev.type == "cuda":
                events[i].record()
            loss = trainer.train_step(b)
            if dev.type != "cuda":
                now = time.perf_counter()
                step_ms.append((now - t_prev) * 1e3)
                t_prev = now
            check_cap(f"after timed step {i + 1}/{len(timed)}")  # host time only: no sync
        if dev.type == "cuda":
            events[-1].record()
        H.synchronize(dev)
        wall = time.perf_counter() - t0
        if dev.type == "cuda":
            step_ms = [events[i].elapsed_time(events[i + 1]) for i in range(len(timed))]
        final_loss = float(loss)  # after the timed window: this sync is not measured
        counts_after = _dynamo_counts()
        peak_gb = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
        model_cfg = trainer.cfg.model
        params = dict(trainer.params)
        compiled = trainer.compiled
        sdpa = sdpa_backend(trainer.cfg, timed[0], dev) if model_cfg.attn_backend == "sdpa" else ""
    finally:
        del trainer
        free_memory(dev)

    real = sum(b.num_real_tokens for b in timed)
    computed = sum(b.num_padded_tokens for b in timed)
    tgt = 0
    flops = 0.0
    sentences = 0
    for b in timed:
        k = len(b)  # real pairs; packed batches list them first, then empty/dummy segments
        src_l, tgt_l = b.src_lengths[:k].double(), b.tgt_lengths[:k].double()
        n_tgt = float(tgt_l.sum())
        tgt += int(n_tgt)
        sentences += k
        if k:
            flops += flops_per_token(model_cfg, float(src_l.mean()), float(tgt_l.mean())) * n_tgt
    train = view.splits["train"]
    epoch_real = int(train.src_lengths.sum()) + int(train.tgt_lengths.sum())
    spec = view.spec()
    stats = plan_stats(view.plan("train", epoch=0), train.src_lengths, train.tgt_lengths, spec)
    tps = real / wall
    p50, p20, p80 = H.quantiles(step_ms, H.QUANTILES)
    model_tflops = flops / wall / 1e12
    recompiles = counts_after["graphs"] - counts_before["graphs"] if compiled else None
    out = {
        "status": "invalid" if recompiles else "ok",
        "tokens_per_second": tps,
        "tgt_tokens_per_second": tgt / wall,
        "step_ms": wall * 1e3 / len(timed),
        "step_ms_p50": p50,
        "step_ms_p20": p20,
        "step_ms_p80": p80,
        "epoch_seconds_projected": epoch_real / tps,
        "peak_memory_gb": peak_gb,
        "padding_fraction": 1.0 - real / computed if computed else 0.0,
        "epoch_padding_fraction": stats.padding_fraction,
        "model_tflops": model_tflops,
        "mfu": mfu(flops / wall, peak),
        "peak_dtype": peak_dtype,
        "peak_tflops": peak / 1e12 if peak is not None else float("nan"),
        "mfu_note": peak_note,
        "sdpa_backend": sdpa,
        "graphs": counts_after["graphs"] if compiled else None,
        "graph_breaks": counts_after["graph_breaks"] if compiled else None,
        "recompiles_timed": recompiles,
        "warmup_s": warmup_s,
        "steps": len(timed),
        "warmup": len(warm),
        "real_tokens_per_step": real / len(timed),
        "sentences_per_step": sentences / len(timed),
        "epoch_real_tokens": epoch_real,
        "epoch_batches": stats.batches,
        "final_loss": final_loss,
        "params_unique": params.get("unique"),
        "params_applied": params.get("applied"),
    }
    if recompiles:
        out["error"] = f"invalid: {recompiles} graph(s) compiled during the timed steps"
    return out


# ----------------------------------------------------------------------------------------------
# The ladder
# ----------------------------------------------------------------------------------------------
COLUMNS = (
    "rung", "technique", "parent", "status", "tokens_per_second", "speedup_vs_baseline", "speedup_vs_previous",
    "step_ms", "step_ms_p20", "step_ms_p80", "epoch_seconds_projected", "peak_memory_gb", "padding_fraction",
    "epoch_padding_fraction", "mfu", "peak_dtype", "peak_tflops", "mfu_note", "model_tflops",
    "tgt_tokens_per_second", "sdpa_backend", "graphs", "graph_breaks", "recompiles_timed", "warmup_s", "rung_s",
    "cap_s", "steps", "warmup", "real_tokens_per_step", "sentences_per_step",
    "precision", "batching", "max_tokens", "attn_backend", "norm", "layout", "compile", "compile_mode",
    "sharing", "params_unique", "params_applied", "final_loss", "switches", "overrides", "note", "error",
    "corpus", *H.PROVENANCE_COLUMNS, "timestamp",
)


def config_columns(cfg) -> dict[str, Any]:
    return {"precision": cfg.run.precision, "batching": cfg.data.batching, "max_tokens": cfg.data.max_tokens,
            "attn_backend": cfg.model.attn_backend, "norm": cfg.model.norm, "layout": cfg.model.layout,
            "compile": bool(cfg.run.compile), "compile_mode": cfg.run.compile_mode if cfg.run.compile else "",
            "sharing": cfg.model.sharing}


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_baseline = tokens/s / rung 0's; speedup_vs_previous = / the parent rung's (NaN when
    either side did not run)."""
    tps = {r["rung"]: r.get("tokens_per_second") for r in rows if r.get("status") == "ok"}
    base = tps.get("0")

    def ratio(a, b):
        return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else float("nan")

    for r in rows:
        mine = tps.get(r["rung"])
        r["speedup_vs_baseline"] = ratio(mine, base)
        r["speedup_vs_previous"] = ratio(mine, tps.get(r.get("parent") or ""))


def corpus_label(bundle) -> str:
    source = str((bundle.split_record or {}).get("source", ""))
    if "opus_books" in source.lower() or "opus-books" in source.lower():
        return "OPUS Books " + f"{bundle.cfg.src_lang}-{bundle.cfg.tgt_lang}"
    names = ",".join(Path(p).name for p in bundle.cfg.resolved_data_files()) or source
    return f"stand-in corpus ({names})"


def rung_cap(rung: Rung, overrides: dict[str, str], s: LadderSettings) -> float:
    """The rung's own cap, else ``s.cap_s`` for an eager rung and twice that for a compiled one."""
    if rung.cap_s is not None:
        return rung.cap_s
    return s.cap_s * (2 if overrides.get("run.compile", "false") == "true" else 1)


def run_ladder(s: LadderSettings, rungs: Sequence[Rung] = RUNGS, log: Callable[[str], None] = print,
               on_row: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``rungs`` in order; never raises for a rung's failure. Returns (rows, context).

    ``on_row(rows_so_far, context)`` runs after every rung (the CLI rewrites the outputs each time, so a
    run killed by a time limit keeps what it measured). With ``s.budget_s``, a rung is skipped when
    the time spent plus its estimated cost (its cap, or less: the costliest earlier rung of the same
    kind, compiled or eager) would pass the budget, and no rung's cap reaches past the budget."""
    from data import build_data

    t_start = time.perf_counter()
    torch.set_float32_matmul_precision("highest")
    prov = H.provenance(s.device)
    log(f"[ladder] device {prov['gpu']}, torch {prov['torch']}, git {prov['git_sha']}")
    peaks = H.measure_peaks(s.device)
    log(f"[ladder] measured ceilings: bf16 matmul {peaks.matmul_tflops:,.1f} TFLOP/s, copy {peaks.copy_gbps:,.0f} GB/s")
    base = base_config(s)
    bundle = build_data(base.data, log=lambda m: log(str(m)))
    corpus = corpus_label(bundle)
    log(f"[ladder] data: {corpus}, train {len(bundle.splits['train']):,} pairs, vocab {bundle.tokenizer.vocab_size}")

    ctx = {"prov": prov, "peaks": peaks, "corpus": corpus, "base": base, "wall_s": 0.0,
           "bundle_sizes": {k: len(v) for k, v in bundle.splits.items()}}
    cost: dict[bool, float] = {}  # compiled? -> the longest rung so far (seconds)
    by_id = {r.id: r for r in rungs}
    ran: set[str] = set()  # rungs measured with status ok (what others may be compared with)
    rows: list[dict[str, Any]] = []
    for rung in rungs:
        row: dict[str, Any] = {"rung": rung.id, "technique": rung.name, "switches": " ".join(rung.switches),
                               "corpus": corpus, **prov}
        notes: list[str] = []
        try:
            parent, overrides = rung_overrides(rung, ran, by_id)
        except ValueError as e:  # an unknown switch name: this rung's error, not the ladder's
            row.update(parent="", status="error", error=f"unsupported: {e}")
            rows.append(row)
            add_speedups(rows)
            continue
        row.update(parent=parent or "", overrides=json.dumps(overrides, sort_keys=True))
        if rung.compare is not None and parent != rung.compare:
            notes.append(f"compared with rung {parent or '-'}: rung {rung.compare} did not run")
        elapsed = time.perf_counter() - t_start
        compiled = overrides.get("run.compile", "false") == "true"
        cap = rung_cap(rung, overrides, s)
        estimate = min(cap, cost.get(compiled, max(cost.values(), default=0.0)))
        if rung.cuda_only and s.device.type != "cuda":
            row.update(status="skipped", note="; ".join(notes + ["CUDA only"]))
        elif s.budget_s is not None and elapsed + estimate > s.budget_s:
            row.update(status="skipped", note="; ".join(
                notes + [f"time budget: {elapsed:.0f} s spent + ~{estimate:.0f} s > --budget-s {s.budget_s:.0f}"]))
        else:
            if s.budget_s is not None:
                cap = min(cap, s.budget_s - elapsed)
            row["cap_s"] = cap
            t_rung = time.perf_counter()
            eff, subs = adapt_overrides(overrides, base, s.device)
            notes += subs
            log(f"[ladder] rung {rung.id}: {rung.name} {json.dumps(eff, sort_keys=True)} (cap {cap:.0f} s)")
            try:
                cfg = build_rung_config(base, eff)
                row.update(config_columns(cfg))
                row.update(measure_rung(cfg, bundle, s, cap_s=cap))
                if row["status"] == "ok":
                    ran.add(rung.id)
                else:
                    log(f"[ladder] rung {rung.id} {row['status'].upper()}: {row.get('error', '')}")
            except Exception as e:  # noqa: BLE001 - one rung's failure must never end the ladder
                if isinstance(e, RungCapped):
                    status, kind = "capped", "capped"
                elif isinstance(e, torch.OutOfMemoryError):
                    status, kind = "error", "out of memory"
                elif isinstance(e, (ValueError, TypeError, NotImplementedError)):
                    status, kind = "error", "unsupported"
                else:
                    status, kind = "error", "error"
                msg = " ".join(f"{type(e).__name__}: {e}".split())
                row.update(status=status, error=f"{kind}: {msg[:400]}")
                log(f"[ladder] rung {rung.id} FAILED ({kind}): {msg[:400]}")
                if os.environ.get("FASTMT_LADDER_TRACEBACK"):
                    traceback.print_exc()
                free_memory(s.device)
            row["note"] = "; ".join(notes)
            row["rung_s"] = time.perf_counter() - t_rung
            cost[compiled] = max(cost.get(compiled, 0.0), row["rung_s"])
        if row.get("status") == "ok":
            log(f"[ladder] rung {rung.id}: {row['tokens_per_second']:,.0f} tok/s, step {row['step_ms']:.1f} ms, "
                f"pad {100 * row['padding_fraction']:.1f}%, MFU {_pct(row['mfu'])} of {row['peak_dtype']} peak, "
                f"warm-up {row['warmup_s']:.1f} s" + (f", SDPA {row['sdpa_backend']}" if row["sdpa_backend"] else ""))
        rows.append(row)
        add_speedups(rows)
        ctx["wall_s"] = time.perf_counter() - t_start
        if on_row is not None:
            on_row(rows, ctx)
    return rows, ctx


def _pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) and not math.isnan(v) else "-"


# ----------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------
TABLE = (
    ("rung", "rung"), ("technique", "technique"), ("tokens_per_second", "real tok/s"),
    ("speedup_vs_baseline", "× rung 0"), ("speedup_vs_previous", "× parent"), ("step_ms", "step ms"),
    ("epoch_seconds_projected", "epoch s (proj.)"), ("peak_memory_gb", "peak GiB"),
    ("padding_fraction_pct", "pad %"), ("mfu_pct", "MFU %"), ("peak_dtype", "MFU of"),
    ("sdpa_backend", "SDPA kernel"), ("graphs", "graphs"), ("recompiles_timed", "recompiles timed"),
    ("status_text", "status"),
)


def _display_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d = dict(r)
        for k in ("padding_fraction", "mfu"):
            v = r.get(k)
            d[f"{k}_pct"] = 100 * v if isinstance(v, (int, float)) and not math.isnan(v) else None
        st = r.get("status", "")
        d["status_text"] = st if st == "ok" else f"{st}: {(r.get('error') or r.get('note') or '')[:60]}"
        out.append(d)
    return out


def ladder_markdown(rows: Sequence[dict[str, Any]], ctx: dict[str, Any], *, smoke: bool) -> str:
    prov, base = ctx["prov"], ctx["base"]
    m, d = base.model, base.data
    cols, heads = zip(*TABLE)
    lines = [
        f"# Speedup ladder — {prov['gpu']}" + (" (CPU smoke run: numbers mean nothing)" if smoke else ""),
        "",
        H.provenance_markdown(prov, ctx["peaks"]),
        f"- data: **{ctx['corpus']}**, splits {ctx['bundle_sizes']}; every rung trains on the first "
        f"batches of the same epoch-0 plan of this one bundle",
        f"- fixed across rungs: model {m.enc_layers}+{m.dec_layers} x {m.d_model}, d_ff {m.d_ff}, {m.n_heads} heads, "
        f"optimizer {base.optim.name} lr {base.optim.lr:g} (clip {base.optim.grad_clip}), padded-token budget per "
        f"step {d.max_tokens:,} (fixed: {d.batch_size} x {d.seq_len}; dynamic: {d.batch_size} sentences), "
        f"seed {base.run.seed}; fp32 matmul precision 'highest' at the start of every rung (no TF32 in fp32 rungs)",
        f"- protocol: per rung a fresh model, untimed warm-up steps (compile included), then timed optimizer "
        f"steps between device syncs; ladder wall time {ctx['wall_s']:.0f} s",
        "",
        H.markdown_table(_display_rows(rows), cols, heads),
        "",
        "*real tok/s*: non-pad source+target tokens per second. *× parent*: vs the rung it is compared with "
        "(same switches minus its technique). *epoch s (proj.)*: real tokens of one training epoch / real tok/s. "
        "*MFU*: model FLOPs (`models.flops_per_token`, real tokens only) per second / the dense peak of the "
        "dtype the rung's matmuls ran in (*MFU of*: fp32, tf32, bf16 or fp16; NVIDIA's datasheet, or measured "
        "in this run for a GPU not in `models.flops.PEAK_TABLE`; none on CPU). *SDPA kernel*: what torch's "
        "dispatcher picks for the rung's masked SDPA calls. *recompiles timed*: graphs compiled during the "
        "timed steps (a rung with any is `invalid`).",
    ]
    problems = [r for r in rows if r.get("status") != "ok"]
    if problems:
        lines += ["", "## Rungs that did not run", ""]
        lines += [f"- rung {r['rung']} ({r['technique']}): {r.get('status')}: {r.get('error') or r.get('note')}"
                  for r in problems]
    noted = [r for r in rows if r.get("status") == "ok" and r.get("note")]
    if noted:
        lines += ["", "## Notes", ""] + [f"- rung {r['rung']}: {r['note']}" for r in noted]
    return "\n".join(lines) + "\n"


def ladder_plot(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """Horizontal bars: speedup vs rung 0 per rung, top to bottom in ladder order, labelled."""
    n = len(rows)
    fig, axes = H.new_figure(1, 1, width=9.0, height=0.45 * n + 1.6)
    ax = axes[0][0]
    ys = list(range(n))[::-1]
    vals = [r.get("speedup_vs_baseline") for r in rows]
    vals = [v if isinstance(v, (int, float)) and not math.isnan(v) else 0.0 for v in vals]
    colors = ["#9e9e9e" if r["rung"] == "0" else ("#8fbbe0" if "side" in r["technique"] else "#1f77b4")
              for r in rows]
    ax.barh(ys, vals, color=colors)
    vmax = max(vals + [1.0])
    for y, v, r in zip(ys, vals, rows):
        if r.get("status") == "ok":
            text = f"{v:.2f}×  ({r['tokens_per_second']:,.0f} tok/s)"
        else:
            text = f"{r.get('status')}"
        ax.text(v + vmax * 0.01, y, text, va="center", fontsize=8,
                color="black" if r.get("status") == "ok" else "#c62828")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(ys, [f"{r['rung']}  {r['technique'][:44]}" for r in rows], fontsize=8)
    ax.set_xlim(0, vmax * 1.35)
    ax.set_xlabel("speedup vs rung 0 (real tokens/s)")
    ax.grid(True, axis="x", alpha=0.3)
    return H.save_figure(fig, path, suptitle=title)


def write_outputs(rows: list[dict[str, Any]], ctx: dict[str, Any], out: Path, *, smoke: bool,
                  plot: bool = True) -> dict[str, Path]:
    slug = ctx["prov"]["gpu_slug"]
    out.mkdir(parents=True, exist_ok=True)
    csv_path = H.result_path(out, "ladder", slug, "csv")
    if csv_path.exists():
        csv_path.unlink()  # one table per device: the latest ladder (git keeps the history)
    H.append_csv(csv_path, rows, COLUMNS)
    md_path = H.result_path(out, "ladder", slug, "md")
    md_path.write_text(ladder_markdown(rows, ctx, smoke=smoke))
    paths = {"csv": csv_path, "md": md_path}
    if plot:
        title = f"fastmt speedup ladder — {ctx['prov']['gpu']} — {ctx['corpus']}"
        paths["png"] = ladder_plot(rows, H.result_path(out, "ladder", slug, "png"), title=title)
    return paths


def update_readme(rows: list[dict[str, Any]], ctx: dict[str, Any], paths: dict[str, Path],
                  readme: Path = README) -> bool:
    """Replace the text between the ladder markers (and nothing else) with a summary of this run."""
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        print(f"[ladder] {readme} has no {README_START} ... {README_END} markers; not updated")
        return False

    def rel(p: Path) -> str:
        try:
            return p.resolve().relative_to(readme.resolve().parent).as_posix()
        except ValueError:
            return p.as_posix()

    prov = ctx["prov"]
    cols = ("rung", "technique", "tokens_per_second", "speedup_vs_baseline", "epoch_seconds_projected",
            "mfu_pct", "peak_dtype", "padding_fraction_pct", "peak_memory_gb", "status_text")
    heads = ("rung", "technique", "real tok/s", "× rung 0", "epoch s (proj.)", "MFU %", "MFU of", "pad %",
             "peak GiB", "status")
    body = "\n".join([
        README_START,
        f"Speedup ladder on **{prov['gpu']}**, {ctx['corpus']}, git `{str(prov['git_sha'])[:12]}`, "
        f"{prov['timestamp']} (torch {prov['torch']}, triton {prov['triton']}); s18 model and Adam fixed, "
        f"only the technique changes. Details: [{rel(paths['md'])}]({rel(paths['md'])}).",
        "",
        H.markdown_table(_display_rows(rows), cols, heads),
        "",
        *([f"![speedup ladder]({rel(paths['png'])})", ""] if "png" in paths else []),
        README_END,
    ])
    new = pattern.sub(lambda _m: body, text, count=1)
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(readme)
    return True


# ----------------------------------------------------------------------------------------------
# Toy corpus for smoke runs (tests must not depend on shared data)
# ----------------------------------------------------------------------------------------------
_EN = ("the cat dog house red big small eats sees runs sleeps green tree water bread man woman child black "
       "white old new book table under over near far quick slow blue sun moon").split()
_IT = ("il gatto cane casa rosso grande piccolo mangia vede corre dorme verde albero acqua pane uomo donna "
       "bambino nero bianco vecchio nuovo libro tavolo sotto sopra vicino lontano veloce lento blu sole luna").split()


def write_toy_corpus(path: Path, n: int = 1500, seed: int = 0) -> Path:
    """``n`` jsonl rows ``{"translation": {"en", "it"}}``: a word-for-word toy pair, 2-12 words."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            idx = [rng.randrange(len(_EN)) for _ in range(rng.randint(2, 12))]
            f.write(json.dumps({"id": str(i), "translation": {"en": " ".join(_EN[j] for j in idx),
                                                              "it": " ".join(_IT[j] for j in idx)}}) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ladder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny CPU version (automatic without CUDA)")
    p.add_argument("--data-files", nargs="+", metavar="F", help="local jsonl/parquet/tsv files instead of the Hub")
    p.add_argument("--steps", type=int, help="timed optimizer steps per rung (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed steps per rung, compile included (default 5; smoke 1)")
    p.add_argument("--out", type=Path, help="output folder (default bench/results; a temp dir with --smoke)")
    p.add_argument("--rungs", help=f"comma-separated subset of {','.join(r.id for r in RUNGS)} (0 always runs)")
    p.add_argument("--max-tokens", type=int, help="padded-token budget per step (default: the baseline's 22400)")
    p.add_argument("--budget-s", type=float, help="start no rung after this many seconds (rest: skipped rows)")
    p.add_argument("--cap-s", type=float, help="time cap of an eager rung, compiled rungs twice this "
                                               "(default 120; a rung over it becomes a 'capped' row)")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite the README's ladder section")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def parse_settings(argv: Sequence[str] | None) -> tuple[LadderSettings, argparse.Namespace]:
    p = build_parser()
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not a.smoke:
        print("bench.ladder: no CUDA device: running the --smoke configuration", flush=True)
        a.smoke = True
    files = tuple(a.data_files or ())
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        p.error(f"--data-files: no such file(s) {missing}")
    steps = a.steps if a.steps is not None else (2 if a.smoke else 20)
    warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 5)
    if steps < 1 or warmup < 0:
        p.error(f"--steps {steps} must be >= 1 and --warmup {warmup} >= 0")
    if a.cap_s is not None and not a.cap_s > 0:
        p.error(f"--cap-s {a.cap_s} must be > 0 seconds")
    work = Path(tempfile.mkdtemp(prefix="fastmt-ladder-"))
    out = a.out or (work / "out" if a.smoke else H.RESULTS_DIR)
    if a.smoke and not files:
        files = (str(write_toy_corpus(work / "toy.jsonl")),)
    s = LadderSettings(smoke=a.smoke, device=torch.device("cuda" if cuda and not a.smoke else "cpu"),
                       data_files=files, out=Path(out), steps=steps, warmup=warmup, max_tokens=a.max_tokens,
                       budget_s=a.budget_s, readme=not a.no_readme and not a.smoke, work_dir=work,
                       **({"cap_s": a.cap_s} if a.cap_s is not None else {}))
    return s, a


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    s, a = parse_settings(argv)
    if s.device.type == "cpu":
        flush_denormals()
    rungs = select_rungs(a.rungs)

    def checkpoint(rows_so_far, ctx_so_far):  # partial outputs after every rung (no PNG: seconds each)
        write_outputs(rows_so_far, ctx_so_far, s.out, smoke=s.smoke, plot=False)

    rows, ctx = run_ladder(s, rungs, on_row=checkpoint)
    paths = write_outputs(rows, ctx, s.out, smoke=s.smoke, plot=not a.no_plot)
    cols, heads = zip(*TABLE)
    print(H.text_table(_display_rows(rows), cols, heads), flush=True)
    for kind, path in paths.items():
        print(f"[ladder] {kind}: {path}")
    if s.readme:
        if update_readme(rows, ctx, paths):
            print(f"[ladder] README results section updated ({README})")
    bad = [r["rung"] for r in rows if r.get("status") == "error"]
    if bad:
        print(f"[ladder] rungs with errors (recorded as rows): {', '.join(bad)}", flush=True)
    return 0 if any(r["rung"] == "0" and r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
