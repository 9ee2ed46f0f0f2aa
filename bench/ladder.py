"""The speedup ladder: one training technique at a time, every rung on the same data and device.

Each rung is the ``baseline`` preset plus named switches (``SWITCHES``), timed on a fresh ``Trainer`` after
untimed warm-up and compared with the rung without its technique (``compare``); a rung that fails becomes
a row saying so. Outputs ``<out>/ladder-<gpu>.{csv,md,png}``; protocol and columns: bench/README.md."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import cli, report
from bench import harness as H
from train import flush_denormals

# DataConfig fields that only change how batches are cut: rungs may differ in these, and in nothing
# else of the data config (tokenizer, cleaning and split must be the shared bundle's).
BATCHING_FIELDS = frozenset({"batching", "max_tokens", "batch_size", "seq_len", "overlong", "pad_multiple",
                             "seed", "num_workers", "pin_memory", "prefetch_factor"})


# -- Rungs -----------------------------------------------------------------------------------------
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
    "ffn_norm": {"model.ffn_norm": "true"},
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
    cuda_only: bool = False  # skipped (not an error) on CPU
    cpu_why: str = "CUDA only"  # the skip note of a cuda_only rung on a CPU: why it does not apply there

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
_FALLBACK = "CUDA only: on a CPU {} runs its PyTorch reference, so this rung would time nothing new"
RUNGS: tuple[Rung, ...] = (
    Rung("0", "baseline (fp32, fixed pad 350, eager, reference attn, torch LN)", (), None),
    Rung("1", "+ bf16 autocast", ("bf16",), "0"),
    Rung("2", "+ dynamic padding", ("bf16", "dynamic"), "1"),
    Rung("3", "+ token buckets", ("bf16", "token_bucket"), "2"),
    Rung("4", "+ SDPA attention", ("bf16", "token_bucket", "sdpa"), "3"),
    Rung("5", "+ torch.compile", ("bf16", "token_bucket", "sdpa", "compile"), "4"),
    Rung("6a", "+ varlen Triton attention", ("bf16", "token_bucket", "compile", "varlen"), "5", cuda_only=True,
         cpu_why=_FALLBACK.format("our Triton attention")),
    Rung("6b", "+ padding-free packing", ("bf16", "compile", "packed"), "6a"),
    Rung("7", "+ fused LayerNorm(+GELU)", _MAIN, "6b", cuda_only=True, cpu_why=_FALLBACK.format("the fused LayerNorm")),
    Rung("8", "side: sharing cycle_rev 3+3", (*_MAIN, "sharing"), "7"),
    Rung("9a", "side: compile reduce-overhead", (*_MAIN, "cudagraphs"), "7", cuda_only=True,
         cpu_why="CUDA only: CUDA graphs"),
    Rung("9b", "side: compile max-autotune-no-cudagraphs", (*_MAIN, "autotune"), "7", cuda_only=True,
         cpu_why="CUDA only: Inductor's autotuning benchmarks GPU kernels"),
    # the mid-FFN LayerNorm (off by default since CTranslate2 cannot take it): what it costs with its fused LN+GELU
    Rung("9c", "side: mid-FFN LayerNorm (ffn_norm, fused LN+GELU)", (*_MAIN, "ffn_norm"), "7", cuda_only=True,
         cpu_why=_FALLBACK.format("the fused LN+GELU")),
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


# -- Configuration of one rung ---------------------------------------------------------------------
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
    """Rung 0's Config: the ``baseline`` preset (smoke: a tiny twin) with the benchmark's fixed settings."""
    from data import DataConfig
    from models import get_preset
    from train.config import baseline

    cfg = baseline()
    if s.smoke:  # the baseline's shape of settings at toy scale: fixed padding to the longest allowed pair
        data = DataConfig(seq_len=32, batch_size=8, max_tokens=8 * 2 * 32, batching="fixed")
        model = get_preset("tiny", attn_backend="reference", norm="torch", layout="padded", max_positions=64)
        cfg = dataclasses.replace(cfg, data=data, model=model)
    # smoke: one graph per compiled rung (CPU compiles are slow); the GPU run keeps the presets' automatic
    # dynamic shapes
    cfg = cli.bench_config(cfg, "ladder", s.work_dir, s.data_files, smoke=s.smoke, nonfinite_guard=False,
                         device=s.device.type, compile_backend="aot_eager" if s.smoke else "inductor",
                         compile_dynamic=True if s.smoke else cfg.run.compile_dynamic)
    if s.max_tokens is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_tokens=s.max_tokens))
    return cfg


def rung_overrides(rung: Rung, ran: Collection[str], by_id: dict[str, Rung]) -> tuple[str | None, dict]:
    """(the rung it is compared with, its own overrides): ``rung.compare``, or when that did not run the
    nearest rung up the ``compare`` chain that did (``ran``: ids of the rungs measured so far)."""
    known = {**{r.id: r for r in RUNGS}, **by_id}  # the chain runs through the standard rungs too (--rungs)
    parent = rung.compare
    while parent is not None and parent not in ran:
        parent = known[parent].compare if parent in known else None
    return parent, rung.overrides()


def adapt_overrides(overrides: dict[str, str], base, device: torch.device) -> tuple[dict, list[str]]:
    """Fit a rung's overrides to the machine and model: on CPU "auto" (the reference) replaces our Triton
    attention (the interpreter: minutes); unique-block counts over the model's layers become half of them."""
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


def bundle_view(bundle, data_cfg):
    """The shared bundle with another batching configuration (same corpus, split, tokenizer, arrays)."""
    a, b = dataclasses.asdict(bundle.cfg), dataclasses.asdict(data_cfg)
    differ = sorted(k for k in a if a[k] != b[k] and k not in BATCHING_FIELDS)
    if differ:
        raise ValueError(f"a ladder rung may change only batching fields of the data config, not {differ}")
    view = copy.copy(bundle)
    view.cfg = data_cfg
    return view


# -- Measuring one rung ----------------------------------------------------------------------------
def free_memory(device: torch.device) -> None:
    """Between rungs: drop compiled code and cached blocks, and put the fp32 matmul precision back to
    "highest" (a bf16 rung's Trainer allows TF32)."""
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
    """The SDPA kernel torch picks for the model's encoder-self, decoder-self and cross calls at ``batch``'s
    shapes and the rung's dtype: one name when the three agree, else ``enc:... dec:... cross:...``."""
    from kernels.flash_attention import visibility_mask

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.run.precision, torch.float32)
    B, S, T = batch.src.shape[0], batch.src.shape[1], batch.tgt_in.shape[1]
    heads, D = cfg.model.n_heads, cfg.model.head_dim
    src_l, tgt_l = batch.src_lengths.to(device), batch.tgt_lengths.to(device)
    names = {}
    for part, (tq, tk, lq, lk, causal) in {"enc": (S, S, src_l, src_l, False), "dec": (T, T, tgt_l, tgt_l, True),
                                           "cross": (T, S, tgt_l, src_l, False)}.items():
        q = torch.randn(B, heads, tq, D, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, heads, tk, D, device=device, dtype=dtype, requires_grad=True)
        names[part] = H.sdpa_choice(q, k, k, visibility_mask(tq, tk, lq, lk, causal)).lower()
    same = len(set(names.values())) == 1
    return next(iter(names.values())) if same else " ".join(f"{k}:{v}" for k, v in names.items())


def measure_rung(cfg, bundle, s: LadderSettings, *, cap_s: float | None = None) -> dict[str, Any]:
    """Warm up, then time ``s.steps`` optimizer steps of a fresh Trainer; returns the metric columns. Past
    ``cap_s`` seconds from the call the rung stops at the next step boundary (``RungCapped``)."""
    from data.batching import plan_stats
    from models import flops_per_token
    from models.flops import mfu, run_peak
    from train.loop import Trainer

    t_call = time.perf_counter()

    def check_cap(where: str) -> None:
        if cap_s is not None and time.perf_counter() - t_call > cap_s:
            raise RungCapped(f"over its time cap of {cap_s:.0f} s {where}")

    view = bundle_view(bundle, cfg.data)
    batches = cli.train_batches(view, s.warmup + s.steps)
    warm, timed = batches[: s.warmup], batches[s.warmup:]
    dev, cuda = s.device, s.device.type == "cuda"
    stamps: list[Any] = []  # step boundaries: CUDA events, or the host clock on a CPU

    def stamp() -> None:
        stamps.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            stamps[-1].record()

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
        graphs_before = H.dynamo_counters()["graphs"]
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        stamp()
        for i, b in enumerate(timed):
            loss = trainer.train_step(b)
            stamp()
            check_cap(f"after timed step {i + 1}/{len(timed)}")  # host time only: no sync
        H.synchronize(dev)
        wall = time.perf_counter() - t0
        step_ms = [a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
        final_loss = float(loss)  # after the timed window: this sync is not measured
        counts = H.dynamo_counters()
        peak_gb = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else float("nan")
        model_cfg, params, compiled = trainer.cfg.model, dict(trainer.params), trainer.compiled
        sdpa = sdpa_backend(trainer.cfg, timed[0], dev) if model_cfg.attn_backend == "sdpa" else ""
    finally:
        del trainer
        free_memory(dev)

    real = sum(b.num_real_tokens for b in timed)
    computed = sum(b.num_padded_tokens for b in timed)
    tgt, sentences, flops = 0, 0, 0.0
    for b in timed:
        k = len(b)  # real pairs; packed batches list them first, then empty/dummy segments
        src_l, tgt_l = b.src_lengths[:k].double(), b.tgt_lengths[:k].double()
        tgt, sentences = tgt + int(tgt_l.sum()), sentences + k
        if k:
            flops += flops_per_token(model_cfg, float(src_l.mean()), float(tgt_l.mean())) * float(tgt_l.sum())
    train = view.splits["train"]
    epoch_real = int(train.src_lengths.sum()) + int(train.tgt_lengths.sum())
    stats = plan_stats(view.plan("train", epoch=0), train.src_lengths, train.tgt_lengths, view.spec())
    tps = real / wall
    p50, p20, p80 = H.quantiles(step_ms, H.QUANTILES)
    recompiles = counts["graphs"] - graphs_before if compiled else None
    n = len(timed)
    return {
        **timed_status(recompiles), "tokens_per_second": tps, "tgt_tokens_per_second": tgt / wall,
        "step_ms": wall * 1e3 / n, "step_ms_p50": p50, "step_ms_p20": p20, "step_ms_p80": p80,
        "epoch_seconds_projected": epoch_real / tps, "peak_memory_gb": peak_gb,
        "padding_fraction": 1.0 - real / computed if computed else 0.0,
        "epoch_padding_fraction": stats.padding_fraction, "model_tflops": flops / wall / 1e12,
        "mfu": mfu(flops / wall, peak), "peak_dtype": peak_dtype,
        "peak_tflops": peak / 1e12 if peak is not None else float("nan"), "mfu_note": peak_note,
        "sdpa_backend": sdpa, "graphs": counts["graphs"] if compiled else None,
        "graph_breaks": counts["graph_breaks"] if compiled else None, "recompiles_timed": recompiles,
        "warmup_s": warmup_s, "steps": n, "warmup": len(warm), "real_tokens_per_step": real / n,
        "sentences_per_step": sentences / n, "epoch_real_tokens": epoch_real, "epoch_batches": stats.batches,
        "final_loss": final_loss, "params_unique": params.get("unique"), "params_applied": params.get("applied"),
    }


def timed_status(recompiles: int | None) -> dict[str, str]:
    """A measured rung's status: ``invalid`` when graphs were compiled while it was timed."""
    if recompiles:
        return {"status": "invalid", "error": f"{recompiles} graph(s) compiled during the timed steps"}
    return {"status": "ok"}


def _pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, (int, float)) and not math.isnan(v) else "-"


# -- The ladder ------------------------------------------------------------------------------------
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
    """tokens/s over rung 0's (``speedup_vs_baseline``) and the parent's (``_vs_previous``); NaN: one did
    not run."""
    tps = {r["rung"]: r.get("tokens_per_second") for r in rows if r.get("status") == "ok"}
    base = tps.get("0")

    def ratio(a, b):
        return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else float("nan")

    for r in rows:
        mine = tps.get(r["rung"])
        r["speedup_vs_baseline"] = ratio(mine, base)
        r["speedup_vs_previous"] = ratio(mine, tps.get(r.get("parent") or ""))


def _failure(e: Exception) -> tuple[str, str]:
    """(status, error) of a rung that raised: capped, out of memory, an unsupported setting, or an error."""
    kind = ("capped" if isinstance(e, RungCapped) else "out of memory" if isinstance(e, torch.OutOfMemoryError)
            else "unsupported" if isinstance(e, (ValueError, TypeError, NotImplementedError)) else "error")
    return "capped" if kind == "capped" else "error", f"{kind}: {' '.join(f'{type(e).__name__}: {e}'.split())[:400]}"


def run_ladder(s: LadderSettings, rungs: Sequence[Rung] = RUNGS, log: Callable[[str], None] = print,
               on_row: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``rungs`` in order, never raising for a rung's failure; returns (rows, context), calling
    ``on_row(rows_so_far, context)`` after each. With ``s.budget_s`` a rung is skipped when the time spent
    plus its estimate (its cap, or the costliest earlier rung of its kind) would pass it; no cap reaches past
    it."""
    from data import build_data
    from train.config import apply_overrides

    t_start = time.perf_counter()
    torch.set_float32_matmul_precision("highest")
    prov = H.provenance(s.device)
    log(f"[ladder] device {prov['gpu']}, torch {prov['torch']}, git {prov['git_sha']}")
    peaks = H.measure_peaks(s.device)
    log(f"[ladder] measured ceilings: bf16 matmul {peaks.matmul_tflops:,.1f} TFLOP/s, copy {peaks.copy_gbps:,.0f} GB/s")
    base = base_config(s)
    bundle = build_data(base.data, log=lambda m: log(str(m)))
    corpus = cli.corpus_label(bundle.cfg.resolved_data_files(), str((bundle.split_record or {}).get("source", "")))
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
        rows.append(row)
        notes: list[str] = []
        try:
            parent, overrides = rung_overrides(rung, ran, by_id)
        except ValueError as e:  # an unknown switch name: this rung's error, not the ladder's
            row.update(parent="", status="error", error=f"unsupported: {e}")
            add_speedups(rows)
            continue
        row.update(parent=parent or "", overrides=json.dumps(overrides, sort_keys=True))
        if rung.compare is not None and parent != rung.compare:
            notes.append(f"compared with rung {parent or '-'}: rung {rung.compare} did not run")
        elapsed = time.perf_counter() - t_start
        compiled = overrides.get("run.compile", "false") == "true"
        cap = rung.cap_s if rung.cap_s is not None else s.cap_s * (2 if compiled else 1)  # compiled: twice
        estimate = min(cap, cost.get(compiled, max(cost.values(), default=0.0)))
        if rung.cuda_only and s.device.type != "cuda":
            row.update(status="skipped", note="; ".join(notes + [rung.cpu_why]))
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
                cfg = apply_overrides(copy.deepcopy(base), dict(eff))
                row.update(config_columns(cfg))
                row.update(measure_rung(cfg, bundle, s, cap_s=cap))
                if row["status"] == "ok":
                    ran.add(rung.id)
                else:
                    log(f"[ladder] rung {rung.id} {row['status'].upper()}: {row.get('error', '')}")
            except Exception as e:  # noqa: BLE001 - one rung's failure must never end the ladder
                status, error = _failure(e)
                row.update(status=status, error=error)
                log(f"[ladder] rung {rung.id} FAILED ({error})")
                if os.environ.get("FASTMT_LADDER_TRACEBACK"):
                    traceback.print_exc()
                free_memory(s.device)
            row["note"] = "; ".join(notes)
            row["rung_s"] = time.perf_counter() - t_rung
            cost[compiled] = max(cost.get(compiled, 0.0), row["rung_s"])
        if row.get("status") == "ok":
            log(f"[ladder] rung {rung.id}: {row['tokens_per_second']:,.0f} tok/s, step {row['step_ms']:.1f} ms, "
                f"pad {100 * row['padding_fraction']:.1f}%, MFU {_pct(row['mfu'])} of {row['peak_dtype']} "
                f"peak, warm-up {row['warmup_s']:.1f} s" + (f", SDPA {row['sdpa_backend']}" if row["sdpa_backend"] else ""))
        add_speedups(rows)
        ctx["wall_s"] = time.perf_counter() - t_start
        if on_row is not None:
            on_row(rows, ctx)
    return rows, ctx


def write_outputs(rows: list[dict[str, Any]], ctx: dict[str, Any], out: Path, *, smoke: bool,
                  plot: bool = True) -> dict[str, Path]:
    """``ladder-<gpu>.{csv,md,png}`` in ``out``: the latest ladder of this device (``bench.report``)."""
    title = f"fastmt speedup ladder — {ctx['prov']['gpu']} — {ctx['corpus']}"
    return H.write_results(out, "ladder", ctx["prov"]["gpu_slug"], rows, COLUMNS,
                           report.ladder_markdown(rows, ctx, smoke=smoke),
                           (lambda rows, path: report.ladder_plot(rows, path, title=title)) if plot else None)


# -- Command line ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ladder", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_cli_args(p, "tiny model on the toy corpus, CPU")
    p.add_argument("--steps", type=int, help="timed optimizer steps per rung (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed steps per rung, compile included (default 5; smoke 1)")
    p.add_argument("--rungs", help=f"comma-separated subset of {','.join(r.id for r in RUNGS)} (0 always runs)")
    p.add_argument("--max-tokens", type=int, help="padded-token budget per step (default: the baseline's 22400)")
    p.add_argument("--budget-s", type=float, help="start no rung after this many seconds (rest: skipped rows)")
    p.add_argument("--cap-s", type=float, help="time cap of an eager rung, compiled rungs twice this "
                                               "(default 120; a rung over it becomes a 'capped' row)")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite the README's ladder section")
    return p


def parse_settings(argv: Sequence[str] | None) -> tuple[LadderSettings, argparse.Namespace]:
    p = build_parser()
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fastmt-ladder-"))
    files = cli.cli_data_files(p, a, toy=lambda: work / "toy.jsonl")
    steps = a.steps if a.steps is not None else (2 if a.smoke else 20)
    warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 5)
    if steps < 1 or warmup < 0:
        p.error(f"--steps {steps} must be >= 1 and --warmup {warmup} >= 0")
    if a.cap_s is not None and not a.cap_s > 0:
        p.error(f"--cap-s {a.cap_s} must be > 0 seconds")
    s = LadderSettings(smoke=a.smoke, device=torch.device("cuda" if not a.smoke else "cpu"), data_files=tuple(files),
                       out=a.out or (work / "out" if a.smoke else H.RESULTS_DIR), steps=steps, warmup=warmup,
                       max_tokens=a.max_tokens, budget_s=a.budget_s, readme=not a.no_readme and not a.smoke,
                       work_dir=work, **({"cap_s": a.cap_s} if a.cap_s is not None else {}))
    return s, a


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    s, a = parse_settings(argv)
    if s.device.type == "cpu":
        flush_denormals()
    rungs = select_rungs(a.rungs)

    # partial outputs after every rung (no PNG: seconds each)
    rows, ctx = run_ladder(s, rungs, on_row=lambda r, c: write_outputs(r, c, s.out, smoke=s.smoke, plot=False))
    paths = write_outputs(rows, ctx, s.out, smoke=s.smoke, plot=not a.no_plot)
    print(report.ladder_table(rows, text=True), flush=True)
    for kind, path in paths.items():
        print(f"[ladder] {kind}: {path}")
    if s.readme and report.update_readme(rows, ctx, paths):
        print(f"[ladder] README results section updated ({report.README})")
    bad = [r["rung"] for r in rows if r.get("status") == "error"]
    if bad:
        print(f"[ladder] rungs with errors (recorded as rows): {', '.join(bad)}", flush=True)
    return 0 if any(r["rung"] == "0" and r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
