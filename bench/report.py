"""The written results of ``bench.kernels`` (targets, markdown, PNG, console summary) and ``bench.ladder``
(markdown, PNG, the README's ladder section). The targets come from issues 3 and 11."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import registry
from bench.cases import GROUPS

FA2_FWD_BWD_TFLOPS = (215.0, 296.0)  # FlashAttention-2's published fwd+bwd, hd 64
MASKED_SPEEDUP_TARGET = 1.5  # ours vs the best SDPA backend that accepts a padding mask
CORPUS_SPEEDUP_TARGET = 2.0  # ours vs the best peer on packed corpus batches, kernel time
CORPUS_FLOOR_TARGET = 3.0  # ours within this factor of the memory floor
LN_TARGET_GBPS = 2000.0  # LayerNorm+GELU fwd+bwd, width 512, bf16
OURS_CORPUS = ("ours-sequence", "ours-stream")
CORPUS_PEERS = ("flex", "torch-varlen", "sdpa-padded")
SDPA_PROVIDERS = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")
_SHORT = {"unsupported": "n/a", "not-implemented": "not impl.", "oom": "OOM", "error": "error",
          "crash": "crash", "skipped": "skip"}

Table = tuple[str, list[dict[str, Any]], list[str]]


def _ok(r) -> bool:
    return r.get("status") == "ok"


def _val(r, key) -> float:
    v = r.get(key) if r else None
    return float(v) if isinstance(v, (int, float)) else float("nan")


def _met(ok: bool, value: float) -> str:
    return "-" if math.isnan(value) else ("yes" if ok else "no")


def _getter(rows):
    index = {(r["case"], r["provider"], r["mode"]): r for r in rows if _ok(r)}
    return lambda case, provider, mode="fwd+bwd": index.get((case, provider, mode))


def _cases(rows, pred) -> list[str]:
    return list(dict.fromkeys(r["case"] for r in rows if pred(r)))


def pivot(rows, bench: str, mode: str, metric: str, providers: Sequence[str], *, pct: str = "pct_peak",
          groups: Sequence[str] | None = None, scale: float = 1.0) -> tuple[list[dict], list[str]]:
    """(table, columns): rows = cases (in run order), columns = "case" and the providers; cells
    'value (pct%)' or a short status."""
    sel = [r for r in rows if r["bench"] == bench and r["mode"] == mode and (groups is None or r.get("group") in groups)]
    cases = list(dict.fromkeys(r["case"] for r in sel))
    present = [p for p in providers if any(r["provider"] == p for r in sel)]
    table = []
    for c in cases:
        line: dict[str, Any] = {"case": c}
        for r in sel:
            if r["case"] != c:
                continue
            if _ok(r):
                line[r["provider"]] = f"{H.fmt(_val(r, metric) * scale)} ({_val(r, pct):.0f}%)"
                if _val(r, "rel_err") > 2e-2:
                    line[r["provider"]] += " WRONG?"
            else:
                line[r["provider"]] = _SHORT.get(r["status"], r["status"])
        table.append(line)
    return table, ["case", *present]


def _best(get, case, providers, key="tflops", lowest=False):
    found = [r for r in (get(case, p) for p in providers) if r]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda r: _val(r, key))


def _stream_tiling(rows, case) -> str:
    """Did ours-stream run kernels of its own? From the Triton kernels each row launched."""
    k = {r["provider"]: r.get("triton_kernels") or "" for r in rows if r["case"] == case and r["mode"] == "fwd+bwd"}
    seq, stream = k.get("ours-sequence", ""), k.get("ours-stream", "")
    if not seq or not stream:
        return "unknown"
    return "same kernels as sequence" if seq == stream else "own kernels"


def _table(title: str, table: list[dict[str, Any]]) -> Table:
    """(title, rows, columns): the columns are the rows' keys, in order."""
    return title, table, list(table[0]) if table else []


def summary_tables(rows) -> list[Table]:
    """The target comparisons as (title, rows, columns)."""
    get = _getter(rows)
    lo, hi = FA2_FWD_BWD_TFLOPS
    fa2, masked, corpus, ln, host = [], [], [], [], []
    for case in _cases(rows, lambda r: r.get("group") == "long" and r.get("D") == 64):
        t_ours, t_flash = _val(get(case, "ours"), "tflops"), _val(get(case, "sdpa-flash"), "tflops")
        fa2.append({"case": case, "ours": t_ours, "sdpa-flash": t_flash, "ours/flash": t_ours / t_flash,
                    "target": f">= {lo:.0f}", "met": _met(t_ours >= lo, t_ours)})
    for case in _cases(rows, lambda r: r.get("group") == "train-ragged"):
        best_ours, best_sdpa = _best(get, case, ("ours", "ours-varlen")), _best(get, case, SDPA_PROVIDERS)
        speed = _val(best_ours, "tflops") / _val(best_sdpa, "tflops")
        masked.append({
            "case": case, "ours": _val(best_ours, "tflops"), "ours via": best_ours["provider"] if best_ours else "-",
            "best sdpa": _val(best_sdpa, "tflops"), "sdpa via": best_sdpa["provider"] if best_sdpa else "-",
            "torch-varlen": _val(get(case, "torch-varlen"), "tflops"), "speedup": speed,
            "met": _met(speed >= MASKED_SPEEDUP_TARGET, speed)})
    for case in _cases(rows, lambda r: r.get("group") == "corpus"):
        ours, peer = _best(get, case, OURS_CORPUS, "ms", lowest=True), _best(get, case, CORPUS_PEERS, "ms", lowest=True)
        speed = _val(peer, "ms") / _val(ours, "ms")
        x_floor = _val(ours, "ms") / _val(ours, "floor_ms")
        line = {"case": case, "ours µs": _val(ours, "ms") * 1e3, "ours via": ours["provider"] if ours else "-"}
        line |= {f"{p} µs": _val(get(case, p), "ms") * 1e3 for p in CORPUS_PEERS}
        corpus.append(line | {"speedup": speed, "x floor": x_floor, "stream tiling": _stream_tiling(rows, case),
                              "met": _met(speed >= CORPUS_SPEEDUP_TARGET and x_floor <= CORPUS_FLOOR_TARGET, speed)})
    for case in _cases(rows, lambda r: r.get("bench") == "layernorm" and r.get("width") == 512):
        ours, comp, eager = get(case, "ours"), get(case, "compile"), get(case, "eager")
        g, ratio = _val(ours, "gbps"), _val(comp, "ms") / _val(ours, "ms")
        ln.append({"case": case, "ours GB/s": g, "compile GB/s": _val(comp, "gbps"), "eager GB/s": _val(eager, "gbps"),
                   "ours vs compile": ratio, "met": _met(g >= LN_TARGET_GBPS and ratio > 1, g)})
    for case in _cases(rows, lambda r: r.get("bench") == "layernorm" and r.get("width") == 512 and "op_ms" in r):
        ours, comp = get(case, "ours"), get(case, "compile")
        ratio = _val(comp, "op_ms") / _val(ours, "op_ms")
        host.append({"case": case, "ours op ms": _val(ours, "op_ms"), "ours host ms": _val(ours, "host_ms"),
                     "ours host %": _val(ours, "host_pct"), "compile op ms": _val(comp, "op_ms"),
                     "compile host %": _val(comp, "host_pct"), "compile/ours": ratio, "met": _met(ratio >= 1, ratio)})
    return [
        _table(f"attention fwd+bwd TFLOP/s, hd 64, long (target: FlashAttention-2's published {lo:.0f}-{hi:.0f})", fa2),
        _table(f"padded train batches, fwd+bwd TFLOP/s on real tokens: ours vs best SDPA with a padding mask "
               f"(target >= {MASKED_SPEEDUP_TARGET}x)", masked),
        _table(f"packed corpus batches, fwd+bwd kernel time (CUDA graph): ours vs the best peer (target >= "
               f"{CORPUS_SPEEDUP_TARGET:g}x, and <= {CORPUS_FLOOR_TARGET:g}x the memory floor)", corpus),
        _table(f"LayerNorm+residual+GELU fwd+bwd, width 512 (target >= {LN_TARGET_GBPS:,.0f} GB/s and faster "
               f"than torch.compile)", ln),
        _table("LayerNorm+residual+GELU op time as the model calls it (eager, host included), fwd+bwd, width 512 "
               "(target: ours <= torch.compile)", host)]


def host_table(rows, bench: str, group: str | None = None) -> Table:
    """fwd+bwd op time (host included) per case and provider: 'op ms (host %)', cases timed that way."""
    split = {r["case"] for r in rows if "op_ms" in r}
    rows = [r for r in rows if r["case"] in split]
    table, cols = pivot(rows, bench, "fwd+bwd", "op_ms", registry.names(bench, group), pct="host_pct",
                        groups=None if group is None else (group,))
    return (f"{bench} op time fwd+bwd, ms (share of it that is host)", table, cols)


def first_call_table(rows) -> Table:
    """Per provider: the one-time cost of its first call (autotuning, compilation) over the cases."""
    by: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for r in rows:
        if r["mode"] == "fwd+bwd" and isinstance(r.get("first_call_s"), (int, float)):
            by.setdefault((r["bench"], r["provider"]), []).append((float(r["first_call_s"]), r["case"]))
    table = []
    for (bench, provider), vals in by.items():
        secs, worst = sorted(v for v, _ in vals), max(vals)
        table.append({"bench": bench, "provider": provider, "cases": len(vals), "median s": H.quantiles(secs, [0.5])[0],
                      "max s": worst[0], "slowest case": worst[1], "total s": sum(secs)})
    return _table("first call of each provider per case, fwd+bwd (autotuning, compilation; never in the medians)",
                  table)


def write_markdown(path: Path, rows, prov, peaks: H.Peaks, opts) -> None:
    parts = [
        f"# Kernel benchmarks: {prov.get('gpu')}",
        "",
        H.provenance_markdown(prov, peaks),
        "",
        "Written by `python -m bench.kernels` (bench/README.md). Times are "
        + ("`triton.testing.do_bench` medians (L2 flushed before each repetition, " if prov.get("gpu_slug") != "cpu"
           else "wall-clock medians of a CPU smoke run (")
        + f"warm-up {opts.warmup_ms:g} ms, {opts.rep_ms:g} ms of repetitions); cells are rate "
        "(% of the ceiling measured above). Packed corpus and LayerNorm width-512 cases time the kernels "
        "alone (one call captured in a CUDA graph and replayed; `kernel_timer` in the CSV says when a "
        "provider could not be captured) and the eager op with its host cost (`op_ms`). Attention TFLOP/s "
        "count real (unmasked) positions only, causal halved, bwd = 2.5x and fwd+bwd = 3.5x the forward "
        "(FlashAttention-2's convention). The attention memory floor reads q, k, v, o, dO once and writes "
        "dQ, dK, dV once (real tokens) at the copy rate above. LayerNorm GB/s count the minimal bytes. "
        "'WRONG?' marks a forward more than 2e-2 (relative) from the fp32 reference. Full rows: the CSV.",
        "",
        "## Targets",
    ]
    for title, table, cols in summary_tables(rows):
        parts += ["", f"**{title}**", "", H.markdown_table(table, cols) if table else "(no rows)"]
    corpus_src = sorted({str(r.get("lengths")) for r in rows if r.get("group") == "corpus" and r.get("lengths")})
    if corpus_src:
        parts += ["", "Corpus segment lengths: " + "; ".join(corpus_src)]
    padded = [g for g in GROUPS if g not in ("corpus", "ln")]
    sections: list[Table] = [
        *((f"Packed corpus attention {mode}: kernel µs (% of the memory floor)",
           *pivot(rows, "attention", mode, "ms", registry.names("attention", "corpus"), pct="pct_floor",
                  groups=("corpus",), scale=1e3)) for mode in opts.modes),
        host_table(rows, "attention", "corpus"), host_table(rows, "layernorm", "ln"),
        *((f"Attention {mode}: TFLOP/s", *pivot(rows, "attention", mode, "tflops", registry.names("attention"),
                                                groups=padded)) for mode in opts.modes),
        *((op.table[0].format(mode=mode), *pivot(rows, op.name, mode, op.table[1], registry.names(op.name)))
          for op in registry.ops() if op.table is not None for mode in opts.modes),
        first_call_table(rows),
        ("Rows that did not run", [r for r in rows if not _ok(r) and r["status"] != "skipped"],
         ["case", "provider", "mode", "status", "error"]),
    ]
    for title, table, cols in sections:
        if table:
            parts += ["", f"## {title[0].upper()}{title[1:]}", "", H.markdown_table(table, cols)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")


def _bars(rows, pred, providers, key, label, scale=1.0):
    sel = [r for r in rows if r["mode"] == "fwd+bwd" and _ok(r) and pred(r)]
    cats = list(dict.fromkeys(label(r) for r in sel))
    groups = {p: [float("nan")] * len(cats) for p in providers}
    for r in sel:
        if r["provider"] in groups:
            groups[r["provider"]][cats.index(label(r))] = _val(r, key) * scale
    return cats, groups


def _ln_label(r) -> str:
    return f"{r['width']}x{r['rows'] // 1024}k" if r["rows"] >= 1024 else f"{r['width']}x{r['rows']}"


def write_plot(path: Path, rows, prov, peaks: H.Peaks) -> Path:
    """The panels that have measured rows, in a grid of their number (a CPU smoke run has few: the Triton
    providers need CUDA); with none, one panel saying why."""
    sel = [r for r in rows if r["mode"] == "fwd+bwd" and _ok(r)]

    def attn_series(pred, suffix_causal: bool):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in sel:
            if r["bench"] == "attention" and pred(r):
                label = r["provider"] + (" (causal)" if suffix_causal and r["causal"] else "")
                series.setdefault(label, []).append((r["Tq"], _val(r, "tflops")))
        return {k: v for k, v in series.items() if any(not math.isnan(y) for _, y in v)}

    def line(series, title):
        def draw(ax):
            if "dim 64" in title:
                ax.axhspan(*FA2_FWD_BWD_TFLOPS, color="tab:green", alpha=0.12, label="FA2 published (target)")
            H.line_panel(ax, series, title=f"attention fwd+bwd: {title}", xlabel="sequence length T",
                         ylabel="TFLOP/s (real positions)")
        return bool(series), draw

    def bars(cats, groups, ceiling=False, **labels):
        def draw(ax):
            H.bar_panel(ax, cats, groups, **labels)
            if ceiling:
                ax.axhline(peaks.copy_gbps, color="gray", linestyle="--", linewidth=1)
                ax.text(0, peaks.copy_gbps, " copy ceiling", va="bottom", fontsize=7, color="gray")
        return bool(cats) and any(not math.isnan(v) for vals in groups.values() for v in vals), draw

    panels = [line(attn_series(pred, suffix), title) for pred, suffix, title in [
        (lambda r: r["group"] == "train-ragged" and not r["causal"], False, "padded batches, padding mask, full"),
        (lambda r: r["group"] == "train-ragged" and r["causal"], False, "padded batches, padding mask, causal"),
        (lambda r: r["group"] == "train-dense", True, "full batches (no mask)"),
        (lambda r: r["group"] == "long" and r["D"] == 64, True, "long, head dim 64"),
        (lambda r: r["group"] == "long" and r["D"] == 128, True, "long, head dim 128"),
    ]]
    is_ln = lambda r: r["bench"] == "layernorm"  # noqa: E731
    is_corpus = lambda r: r.get("group") == "corpus"  # noqa: E731
    short = lambda r: r["case"].removeprefix("corpus-")  # noqa: E731
    corpus_providers = registry.names("attention", "corpus")
    panels += [
        bars(*_bars(rows, is_ln, registry.names("layernorm"), "gbps", _ln_label), ceiling=True,
             title="LayerNorm+residual+GELU fwd+bwd", xlabel="width x rows", ylabel="GB/s"),
        bars(*_bars(rows, is_corpus, corpus_providers, "ms", short, 1e3),
             title="packed corpus attention fwd+bwd, kernel time", xlabel="tokens per batch - kind",
             ylabel="µs (lower is better)"),
        bars(*_bars(rows, is_corpus, corpus_providers, "op_ms", short),
             title="packed corpus attention fwd+bwd, op time (host included)", xlabel="tokens per batch - kind",
             ylabel="ms (lower is better)"),
        bars(*_bars(rows, lambda r: is_ln(r) and "op_ms" in r, registry.names("layernorm"), "op_ms", _ln_label),
             title="LayerNorm+GELU fwd+bwd, op time (host included)", xlabel="width x rows",
             ylabel="ms (lower is better)"),
    ]
    drawn = [draw for has_data, draw in panels if has_data]
    ncols = min(3, max(1, len(drawn)))
    fig, axes = H.new_figure(-(-max(1, len(drawn)) // ncols), ncols, height=4.3)
    for ax, draw in zip(axes.flat, drawn):
        draw(ax)
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_axis_off()
    if not drawn:
        why = ("no fwd+bwd row ran on this device" + (": the Triton providers need CUDA (--cpu-triton runs "
               "them in the interpreter)" if prov.get("gpu_slug") == "cpu" else ""))
        axes.flat[0].text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    sha = str(prov.get("git_sha", ""))[:10]
    return H.save_figure(fig, path, suptitle=f"fastmt kernels on {prov.get('gpu')} (torch {prov.get('torch')}, "
                                             f"triton {prov.get('triton')}, git {sha})")


def print_summary(rows, prov, peaks: H.Peaks, paths: Sequence[Path]) -> None:
    counts = Counter(r["status"] for r in rows)
    print()
    print(f"== bench.kernels summary: {prov.get('gpu')}, torch {prov.get('torch')}, triton {prov.get('triton')}, "
          f"git {str(prov.get('git_sha'))[:10]} ==")
    print(f"ceilings this run: copy {peaks.copy_gbps:,.0f} GB/s, {peaks.dtype} matmul {peaks.matmul_tflops:,.1f} TFLOP/s")
    more = [host_table(rows, "attention", "corpus"), host_table(rows, "layernorm", "ln"), first_call_table(rows)]
    for title, table, cols in [*summary_tables(rows), *more]:
        print(f"\n{title}")
        print(H.text_table(table, cols) if table else "(no rows)")
    print("\nrows by status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    bad = sorted({(r["provider"], r["status"], r.get("error", "")[:100]) for r in rows
                  if r["status"] in ("error", "crash", "oom", "not-implemented")})
    for provider, status, err in bad[:8]:
        print(f"  {provider}: {status}: {err}")
    for p in paths:
        print(f"wrote {p}")


# -- The speedup ladder (bench.ladder): markdown, PNG and the README's ladder section --------------
README = H.REPO_ROOT / "README.md"
README_START, README_END = "<!-- ladder:start -->", "<!-- ladder:end -->"
LADDER_TABLE = (
    ("rung", "rung"), ("technique", "technique"), ("tokens_per_second", "real tok/s"),
    ("speedup_vs_baseline", "× rung 0"), ("speedup_vs_previous", "× parent"), ("step_ms", "step ms"),
    ("epoch_seconds_projected", "epoch s (proj.)"), ("peak_memory_gb", "peak GiB"),
    ("padding_fraction_pct", "pad %"), ("mfu_pct", "MFU %"), ("peak_dtype", "MFU of"),
    ("sdpa_backend", "SDPA kernel"), ("graphs", "graphs"), ("recompiles_timed", "recompiles timed"),
    ("status_text", "status"),
)
README_TABLE = ("rung", "technique", "tokens_per_second", "speedup_vs_baseline", "epoch_seconds_projected",
                "mfu_pct", "peak_dtype", "padding_fraction_pct", "peak_memory_gb", "status_text")


def ladder_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = tuple(c for c, _ in LADDER_TABLE), *,
                 text: bool = False) -> str:
    """The ladder as a markdown (``text``: console) table of ``columns``, percentages and status filled in."""
    out = []
    for r in rows:
        d = dict(r)
        for k in ("padding_fraction", "mfu"):
            v = r.get(k)
            d[f"{k}_pct"] = 100 * v if isinstance(v, (int, float)) and not math.isnan(v) else None
        st = r.get("status", "")
        d["status_text"] = st if st == "ok" else f"{st}: {(r.get('error') or r.get('note') or '')[:60]}"
        out.append(d)
    return (H.text_table if text else H.markdown_table)(out, columns, [dict(LADDER_TABLE)[c] for c in columns])


def ladder_markdown(rows: Sequence[dict[str, Any]], ctx: dict[str, Any], *, smoke: bool) -> str:
    prov, base = ctx["prov"], ctx["base"]
    m, d = base.model, base.data
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
        ladder_table(rows),
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
        ok = r.get("status") == "ok"
        text = f"{v:.2f}×  ({r['tokens_per_second']:,.0f} tok/s)" if ok else f"{r.get('status')}"
        ax.text(v + vmax * 0.01, y, text, va="center", fontsize=8, color="black" if ok else "#c62828")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(ys, [f"{r['rung']}  {r['technique'][:44]}" for r in rows], fontsize=8)
    ax.set_xlim(0, vmax * 1.35)
    ax.set_xlabel("speedup vs rung 0 (real tokens/s)")
    ax.grid(True, axis="x", alpha=0.3)
    return H.save_figure(fig, path, suptitle=title)


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
    body = "\n".join([
        README_START,
        f"Speedup ladder on **{prov['gpu']}**, {ctx['corpus']}, git `{str(prov['git_sha'])[:12]}`, "
        f"{prov['timestamp']} (torch {prov['torch']}, triton {prov['triton']}); s18 model and Adam fixed, "
        f"only the technique changes. Details: [{rel(paths['md'])}]({rel(paths['md'])}).",
        "",
        ladder_table(rows, README_TABLE),
        "",
        *([f"![speedup ladder]({rel(paths['png'])})", ""] if "png" in paths else []),
        README_END,
    ])
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(pattern.sub(lambda _m: body, text, count=1))
    tmp.replace(readme)
    return True
