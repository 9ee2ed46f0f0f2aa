"""The time-to-quality record of a training run (``make train``'s run in the runbook).

Reads the run's ``metrics.jsonl`` and ``provenance.json``; writes ``<out>/quality-<gpu>.{md,csv}`` (``<out>``:
bench/results for a GPU run, the run folder for a CPU run), per epoch and in summary (time to each BLEU threshold, evaluation's share, test scores). See bench/README.md."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import cli
from bench import harness as H
from data.files import read_text
from train.runs.folder import PROVENANCE_MAX, read_record

SEED_GOAL = 1.8  # S18's stated goal: last-batch training loss < 1.8 within 18 epochs
THRESHOLDS = (20.0, 28.0, 35.0, 37.0, 37.6)  # when the run's config does not list its own
COLUMNS = ("epoch", "wall_seconds", "epoch_seconds", "eval_seconds", "train_loss_last_batch", "train_loss",
           "valid_loss", "bleu", "chrf", "tokens_per_second", "mfu", "padding_fraction", "peak_memory_gb")
HEADERS = ("epoch", "wall s (cum.)", "train s", "eval s", "last-batch loss (seeds)", "mean train loss",
           "valid loss", "valid BLEU", "valid chrF", "real tok/s", "MFU", "pad", "peak GiB")


def read_run(run: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    """(epoch records, test record or None, provenance) of a run folder; loud errors when missing. Older
    runs' epochs without ``wall_seconds`` get the running sum of epoch and evaluation seconds
    (``wall_from_epochs``)."""
    from train.runs.metrics import read_metrics

    metrics, prov_path = run / "metrics.jsonl", run / "provenance.json"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: give --run the folder of a training run (runs/<name>)")
    records = read_metrics(metrics)
    epochs = sorted((r for r in records if r.get("kind", "epoch") == "epoch"), key=lambda r: r["epoch"])
    # a resumed run may log an epoch twice: keep the last record of each
    epochs = list({r["epoch"]: r for r in epochs}.values())
    total = 0.0
    for r in epochs:
        total += float(r.get("epoch_seconds") or 0.0) + float(r.get("eval_seconds") or 0.0)
        if r.get("wall_seconds") is None:
            r["wall_seconds"], r["wall_from_epochs"] = total, True
    tests = [r for r in records if r.get("kind") == "test"]
    prov = read_record(run, "provenance.json", "provenance record", PROVENANCE_MAX) if prov_path.is_file() else {}
    return epochs, (tests[-1] if tests else None), prov


def corpus_label(prov: dict[str, Any]) -> str:
    """The run's data as results name it (``harness.corpus_label`` of its config and split record)."""
    files = ((prov.get("config") or {}).get("data") or {}).get("data_files") or []
    return cli.corpus_label(files, str((prov.get("data_split") or {}).get("source", "")))


def time_to_bleu(rows: Sequence[dict[str, Any]], thresholds: Sequence[float]) -> dict[str, dict[str, Any] | None]:
    """threshold -> {seconds, epoch, bleu} of the first epoch whose validation BLEU reached it, or None."""
    out: dict[str, dict[str, Any] | None] = {}
    for t in thresholds:
        hit = next((r for r in rows if _num(r.get("bleu")) >= t), None)
        out[f"{t:g}"] = {"seconds": hit["wall_seconds"], "epoch": hit["epoch"], "bleu": hit["bleu"]} if hit else None
    return out


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else math.nan


def summary(rows: Sequence[dict[str, Any]], test: dict[str, Any] | None, planned: int | None,
            thresholds: Sequence[float] = THRESHOLDS) -> dict[str, Any]:
    goal = next((r for r in rows if _num(r.get("train_loss_last_batch")) < SEED_GOAL), None)
    total = (rows[-1]["wall_seconds"] if rows else 0.0) + float((test or {}).get("eval_seconds") or 0.0)
    eval_s = sum(float(r.get("eval_seconds") or 0.0) for r in rows)
    best = max(rows, key=lambda r: _num(r.get("bleu")) if not math.isnan(_num(r.get("bleu"))) else -1.0,
               default=None)
    return {"epochs_done": len(rows), "epochs_planned": planned, "wall_seconds_total": total,
            "time_to_bleu": time_to_bleu(rows, thresholds), "eval_seconds_total": eval_s,
            "eval_share": eval_s / total if total > 0 else None,
            "first_epoch_train_seconds": rows[0].get("epoch_seconds") if rows else None,
            "goal_epoch": goal["epoch"] if goal else None, "goal_wall_seconds": goal["wall_seconds"] if goal else None,
            "best_valid_bleu": best.get("bleu") if best else None, "best_epoch": best["epoch"] if best else None,
            **{k: (test or {}).get(k) for k in ("test_loss", "test_bleu", "test_chrf", "test_sentences")}}


def read_gpu_samples(path: Path | None) -> list[tuple[float, float]]:
    """(seconds since the first sample, utilization 0..1) from ``nvidia-smi --query-gpu=timestamp,utilization.gpu
    --format=csv,noheader,nounits -lms 500`` output; [] without one."""
    import datetime as dt

    from data.files import LOG_MAX, read_bytes

    if path is None or not path.is_file():
        return []
    out, t0 = [], None
    for line in read_bytes(path, "GPU samples", limit=LOG_MAX).decode("utf-8", "replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            t = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            util = float(parts[1]) / 100.0
        except ValueError:
            continue
        t0 = t if t0 is None else t0
        out.append((t - t0, util))
    return out


def done_split(run: Path) -> dict[str, float | None]:
    """``setup_s``, ``compile_s``, ``train_s``, ``eval_s``, ``checkpoint_s`` from the run's ``done`` record
    (train/objective.py ``WallSplit``); each None when the run did not record it (cut before its end)."""
    from train.runs.metrics import read_metrics

    path = run / "metrics.jsonl"
    done = [r for r in (read_metrics(path) if path.is_file() else []) if r.get("kind") == "done"]
    split = (done[-1].get("time_split") if done else None) or {}
    split = split if isinstance(split, dict) else {}
    return {f"{k.rstrip('s')}_s": (float(split[k]) if isinstance(split.get(k), (int, float)) else None)
            for k in ("setup", "compile", "train", "eval", "checkpoints")}


def _median(values: Sequence[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(nums) if nums else None


def run_numbers(epochs: Sequence[dict[str, Any]], summ: dict[str, Any],
                samples: Sequence[tuple[float, float]] = (), split: dict[str, float | None] | None = None
                ) -> dict[str, Any]:
    """The numbers a packet reports of a training run (bench/README.md, packet ``quality``); "steady": the
    epochs after the first; ``samples``: nvidia-smi's utilization; ``split``: `done_split`. What the run did
    not record is None, never estimated."""
    first, last = epochs[0], epochs[-1]
    steady = epochs[1:]
    steady_s = sum(float(r.get("epoch_seconds") or 0.0) for r in steady)
    tps = sorted(float(r["tokens_per_second"]) for r in steady if r.get("tokens_per_second"))
    graphs = [r.get("compiled_graphs") for r in epochs]
    window = [u for t, u in samples if float(first["wall_seconds"]) <= t <= float(last["wall_seconds"])]
    peaks = [float(r["peak_memory_gb"]) for r in epochs if r.get("peak_memory_gb") is not None]
    split = split or {}
    steps_per_s = ((float(last["step"]) - float(first["step"])) / steady_s
                   if steady and steady_s > 0 and None not in (first.get("step"), last.get("step")) else None)
    busy = sum(window) / len(window) if window else None
    return {
        "time_to_bleu_s": {k: (v or {}).get("seconds") for k, v in summ["time_to_bleu"].items()},
        # the wall split's compile (every process's first compiled step), else the first step's seconds
        "compile_s": split.get("compile_s") if split.get("compile_s") is not None else first.get("first_step_seconds"),
        "setup_s": split.get("setup_s"), "train_s": split.get("train_s"), "eval_s": split.get("eval_s"),
        "checkpoint_s": split.get("checkpoint_s"), "compile_warm_s": None,  # a warm rerun's (the compile-warm packet)
        "step_ms": _median([r.get("step_ms") for r in steady]) if any(r.get("step_ms") is not None for r in steady)
        else (1000.0 / steps_per_s if steps_per_s else None),
        "host_ms_per_step": _median([r.get("host_ms_per_step") for r in steady]),
        "graphs_per_step": _median([r.get("graphs_per_step") for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "gpu_busy": busy,
        "epochs": len(epochs), "steps": last.get("step"),
        "steps_per_s": steps_per_s,
        "tokens_per_s": tps[len(tps) // 2] if tps else None,
        "compiled_graphs": graphs[-1],
        "recompiles_after_warmup": (graphs[-1] - graphs[0]) if None not in (graphs[0], graphs[-1]) else None,
        "graph_breaks": last.get("graph_breaks"),
        "gpu_busy_share": busy,
        "gpu_samples": len(window),
        "peak_memory_gb": max(peaks) if peaks else None,
        "best_valid_bleu": summ.get("best_valid_bleu"), "test_bleu": summ.get("test_bleu"),
        "test_chrf": summ.get("test_chrf"), "wall_s": summ.get("wall_seconds_total"),
    }


def unstable_graphs(numbers: dict[str, Any]) -> list[str]:
    """What makes a compiled run's graphs unstable: a graph compiled after the first epoch, or a graph break."""
    out = []
    if (numbers.get("recompiles_after_warmup") or 0) > 0:
        out.append(f"{numbers['recompiles_after_warmup']} graph(s) compiled after the first epoch (a recompile "
                   f"after warm-up: {numbers['compiled_graphs']} graphs in all)")
    if (numbers.get("graph_breaks") or 0) > 0:
        out.append(f"{numbers['graph_breaks']} graph break(s) in the compiled regions")
    return out


def quality_markdown(run: Path, rows, summ: dict[str, Any], prov: dict[str, Any]) -> str:
    gpu, sha = prov.get("gpu") or "cpu", prov.get("git_sha") or "unknown"
    name = ((prov.get("config") or {}).get("run") or {}).get("name", run.name)
    done, planned = summ["epochs_done"], summ["epochs_planned"]
    lines = [
        f"# Time to quality — `{name}` on {gpu}",
        "",
        f"- GPU: **{gpu}**; git `{sha}`; torch {prov.get('torch', '?')}, triton {prov.get('triton', '?')}, "
        f"CUDA {prov.get('cuda') or '-'}; started {prov.get('time', '?')}",
        f"- data: **{corpus_label(prov)}**; run folder `{run}`",
        f"- epochs: {done}" + (f" of {planned} planned" + (" (**incomplete run**)" if planned and done < planned else "")
                               if planned else ""),
        *[f"- time to valid BLEU {k}: " + (f"**{v['seconds']:.1f} s** (epoch {v['epoch']}, BLEU {v['bleu']:.2f})"
                                          if v else "not reached") for k, v in summ["time_to_bleu"].items()],
        f"- wall time incl. compile and evaluation: **{summ['wall_seconds_total']:.0f} s** "
        f"({summ['wall_seconds_total'] / 60:.1f} min); epoch 1 (with the compile) took "
        f"{H.fmt(summ['first_epoch_train_seconds'])} s of training; first step (compile + CUDA-graph capture) "
        f"{H.fmt(summ.get('first_step_seconds'))} s",
        f"- evaluation: {H.fmt(summ['eval_seconds_total'])} s in all, "
        + (f"**{100 * summ['eval_share']:.1f} %** of the wall time" if summ["eval_share"] is not None else "n/a"),
        "- seeds' goal, last-batch loss < 1.8: "
        + (f"met at epoch {summ['goal_epoch']} after {summ['goal_wall_seconds']:.0f} s"
           if summ["goal_epoch"] is not None else "not met"),
        f"- best validation BLEU {H.fmt(summ['best_valid_bleu'])} (epoch {H.fmt(summ['best_epoch'])}); "
        f"test: loss {H.fmt(summ['test_loss'])}, sacreBLEU **{H.fmt(summ['test_bleu'])}**, "
        f"chrF **{H.fmt(summ['test_chrf'])}** ({H.fmt(summ['test_sentences'])} sentences)",
        *numbers_lines(summ.get("numbers") or {}),
        "",
        H.markdown_table(rows, COLUMNS, HEADERS),
        "",
        "*last-batch loss (seeds)*: label-smoothed loss of the epoch's last training batch, the number the "
        "seed projects reported; *mean train loss*: label-smoothed, averaged over the epoch's target tokens; "
        "*valid loss*: unsmoothed. BLEU/chrF: sacreBLEU on beam-search translations of the validation "
        "split (capped by eval.max_sentences) and the test split. *wall s*: seconds since the run's process "
        "started (data, compile and evaluation included).",
    ]
    return "\n".join(lines) + "\n"


def numbers_lines(n: dict[str, Any]) -> list[str]:
    if not n:
        return []
    busy = n.get("gpu_busy_share")
    return [f"- steady epochs: {H.fmt(n['steps_per_s'])} steps/s, {H.fmt(n['tokens_per_s'])} real tokens/s (median); "
            f"graphs compiled {H.fmt(n['compiled_graphs'])}, after the first epoch {H.fmt(n['recompiles_after_warmup'])}; "
            f"graph breaks {H.fmt(n['graph_breaks'])}; peak memory {H.fmt(n['peak_memory_gb'])} GiB",
            "- GPU busy (nvidia-smi utilization.gpu over the steady epochs): "
            + (f"**{100 * busy:.0f} %** ({n['gpu_samples']} samples)" if busy is not None else "not sampled"),
            f"- step: {H.fmt(n.get('step_ms'))} ms, host {H.fmt(n.get('host_ms_per_step'))} ms, MFU "
            f"{H.fmt(n.get('mfu'))}, CUDA graphs {H.fmt(n.get('graphs_per_step'))} a step ('-': not recorded by the run)",
            f"- wall split (s): setup {H.fmt(n.get('setup_s'))}, compile {H.fmt(n.get('compile_s'))}, train "
            f"{H.fmt(n.get('train_s'))}, eval {H.fmt(n.get('eval_s'))}, checkpoints {H.fmt(n.get('checkpoint_s'))}"]


def write_quality(run: Path, out: Path, gpu_samples: Path | None = None,
                  add_thresholds: Sequence[float] = ()) -> dict[str, Path]:
    epochs, test, prov = read_run(run)
    if not epochs:
        raise ValueError(f"{run}/metrics.jsonl has no epoch records yet (the run has not finished an epoch)")
    rows = [{k: r.get(k) for k in COLUMNS} for r in epochs]
    cfg = prov.get("config") or {}
    planned = (cfg.get("run") or {}).get("epochs")
    thresholds = tuple(sorted({*((cfg.get("eval") or {}).get("bleu_thresholds") or THRESHOLDS), *add_thresholds}))
    summ = summary(rows, test, planned, thresholds)
    summ["first_step_seconds"] = epochs[0].get("first_step_seconds")
    summ["numbers"] = run_numbers(epochs, summ, read_gpu_samples(gpu_samples), done_split(run))
    who = {"run": str(run), "gpu": prov.get("gpu") or "cpu", "git_sha": prov.get("git_sha"),
           "corpus": corpus_label(prov)}
    extra = {**who, **{f"final_{k}": v for k, v in summ.items() if k not in ("time_to_bleu", "numbers")},
             **{f"time_to_bleu_{k}": (v or {}).get("seconds") for k, v in summ["time_to_bleu"].items()}}
    # one record per device: the latest run
    slug = H.gpu_slug(who["gpu"])
    paths = H.write_results(out, "quality", slug, [{**r, **extra} for r in rows], COLUMNS,
                            quality_markdown(run, rows, summ, prov))
    paths["json"] = out / f"quality-{slug}.json"  # the numbers a packet record carries
    paths["json"].write_text(json.dumps({**who, **summ["numbers"]}, indent=1, default=str))
    return paths


def best_by(rows: Sequence[dict[str, Any]], t: float) -> float | None:
    """The best validation BLEU a run had reached by wall second ``t`` (None: no evaluation yet)."""
    seen = [_num(r.get("bleu")) for r in rows if float(r["wall_seconds"]) <= t and not math.isnan(_num(r.get("bleu")))]
    return max(seen) if seen else None


def compare_runs(a: Path, b: Path, out: Path) -> dict[str, Path]:
    """Two runs side by side on the wall clock (fastmt's `make train` run against the HF baseline): seconds to
    each BLEU threshold, and each run's best validation BLEU at every epoch end of either, up to the shorter
    run's end."""
    runs = []
    for run in (a, b):
        epochs, test, prov = read_run(run)
        if not epochs:
            raise ValueError(f"{run}/metrics.jsonl has no epoch records")
        name = ((prov.get("config") or {}).get("run") or {}).get("name") or run.name
        runs.append((run, name, epochs, test, prov))
    thresholds = tuple(((runs[0][4].get("config") or {}).get("eval") or {}).get("bleu_thresholds") or THRESHOLDS)
    end = min(float(r[2][-1]["wall_seconds"]) for r in runs)
    times = sorted({float(e["wall_seconds"]) for r in runs for e in r[2] if float(e["wall_seconds"]) <= end})
    hits = [time_to_bleu(r[2], thresholds) for r in runs]
    label = [f"`{r[1]}` ({r[0].name})" for r in runs]
    gpu = runs[0][4].get("gpu") or "cpu"
    lines = [f"# {label[0]} against {label[1]} on {gpu}", "",
             f"- data: **{corpus_label(runs[0][4])}**; git `{runs[0][4].get('git_sha')}` / `{runs[1][4].get('git_sha')}`",
             "- seconds from each run's process start (data, compile, evaluation included); validation BLEU on the "
             "same sentences (``score_split``), the test split whole", "",
             "| valid BLEU reached | " + " | ".join(label) + " |", "|---|---|---|"]
    for t in thresholds:
        cells = [f"{h[f'{t:g}']['seconds']:.0f} s (epoch {h[f'{t:g}']['epoch']})" if h[f"{t:g}"] else "not reached"
                 for h in hits]
        lines.append(f"| >= {t:g} | " + " | ".join(cells) + " |")
    lines += ["| best valid BLEU | " + " | ".join(H.fmt(max((_num(e.get("bleu")) for e in r[2]), default=None))
                                                 for r in runs) + " |",
              "| test BLEU | " + " | ".join(H.fmt((r[3] or {}).get("test_bleu")) for r in runs) + " |",
              "", "Best validation BLEU reached by each wall time (the same clock for both):", "",
              "| wall s | " + " | ".join(label) + " |", "|---|---|---|"]
    rows = []
    for t in times:
        pair = [best_by(r[2], t) for r in runs]
        rows.append({"wall_seconds": t, "a_bleu": pair[0], "b_bleu": pair[1]})
        lines.append(f"| {t:.1f} | " + " | ".join(H.fmt(v) for v in pair) + " |")
    slug = H.gpu_slug(gpu)
    return H.write_results(out, "compare", slug, rows, ("wall_seconds", "a_bleu", "b_bleu"), "\n".join(lines) + "\n")


def default_out(run: Path) -> Path:
    """``bench/results`` for a run trained on a GPU (its provenance names one), else the run folder itself."""
    try:  # the one reader (a run folder: no link followed in it, a regular file, its size capped)
        gpu = read_record(run, "provenance.json", "provenance record", PROVENANCE_MAX).get("gpu") \
            if (run / "provenance.json").is_file() else None
    except (OSError, ValueError, AttributeError):
        gpu = None
    return H.RESULTS_DIR if gpu and H.gpu_slug(gpu) != "cpu" else run


def _thresholds(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BLEU values separated by commas, e.g. 10,15") from None
    if not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: BLEU thresholds lie in [0, 100]")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, help="run folder (runs/<name>) with metrics.jsonl")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("RUN_A", "RUN_B"),
                   help="two run folders side by side on the wall clock (fastmt's and the HF baseline's)")
    p.add_argument("--out", type=Path, help="output folder (default: bench/results for a GPU run, the run folder "
                                            "for a CPU run: CPU smoke runs never touch the committed results)")
    p.add_argument("--gpu-samples", type=Path, help="nvidia-smi utilization samples taken during the run "
                                                     "(bench/gpu_run.sh's train step): the GPU busy share")
    p.add_argument("--add-thresholds", type=_thresholds, default=(), metavar="B,B",
                   help="BLEU thresholds to time besides the run's own eval.bleu_thresholds (packet 1: 10,15)")
    p.add_argument("--require-stable-graphs", action="store_true",
                   help="exit 1 (after writing) on a graph compiled after the first epoch or a graph break")
    a = p.parse_args(argv)
    if (a.run is None) == (a.compare is None):
        p.error("give --run RUN or --compare RUN_A RUN_B")
    caught = (FileNotFoundError, ValueError, KeyError) if a.compare else (FileNotFoundError, ValueError)
    try:
        paths = compare_runs(*a.compare, a.out or default_out(a.compare[0])) if a.compare else \
            write_quality(a.run, a.out or default_out(a.run), a.gpu_samples, a.add_thresholds)
    except caught as e:
        print(f"bench.quality: {'--compare: ' if a.compare else ''}{e}", file=sys.stderr)
        return 2
    print(read_text(paths["md"], "comparison report" if a.compare else "quality report"))
    if a.compare:
        return 0
    for kind, path in paths.items():
        print(f"[quality] {kind}: {path}")
    if a.require_stable_graphs:
        from data.files import read_json

        problems = unstable_graphs(read_json(paths["json"], "quality record"))
        for line in problems:
            print(f"bench.quality: {a.run}: {line}", file=sys.stderr)
        if problems:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
