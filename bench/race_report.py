"""The CPU race's report (bench/race.py): the summary over seeds, the markdown tables, the frontier plot. Reads only
the race's record, so ``python -m bench.race --report-from RECORD`` rewrites a report without training."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from bench import harness as H


def _mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:.2f} (1 seed)"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f} (n={len(xs)})"


def time_to(points: list[dict], threshold: float) -> float | None:
    """Training seconds at the first kept step whose validation BLEU >= ``threshold`` (None: never)."""
    return next((p["train_seconds"] for p in points if p.get("valid_bleu") is not None
                 and p["valid_bleu"] >= threshold), None)


def summarize(record: dict) -> list[dict[str, Any]]:
    rc = record["config"]
    out = []
    for system in rc["systems"]:
        every = [r for r in record["runs"] if r["system"] == system]
        runs = [r for r in every if r.get("status") == "ok"]
        row: dict[str, Any] = {"system": system, "seeds_ok": len(runs), "seeds_failed": len(every) - len(runs)}
        for s in sorted({p["step"] for r in runs for p in r["points"]}):
            pts = [p for r in runs for p in r["points"] if p["step"] == s]
            row[f"valid@{s}"] = _mean_sd([p.get("valid_bleu") for p in pts])
            row[f"secs@{s}"] = _mean_sd([p.get("train_seconds") for p in pts])
        last = [r["points"][-1] for r in runs if r["points"]]
        row.update({k: _mean_sd([p.get(k) for p in last]) for k in ("valid_chrf", "test_bleu", "test_chrf")})
        tt = [time_to(r["points"], rc["threshold"]) for r in runs]
        reached = [t for t in tt if t is not None]
        row["time_to_threshold"] = (_mean_sd(reached) + (f", {len(tt) - len(reached)} never" if len(reached) < len(tt)
                                                         else "")) if reached else f"never ({len(tt)} runs)"
        out.append(row)
    return out


def averages_table(record: dict) -> list[str]:
    """The report's lines on checkpoint averaging (none when no run was averaged)."""
    averaged = [(r, k, a) for r in record["runs"] for k, a in sorted((r.get("averaged") or {}).items())]
    if not averaged:
        return []
    lines = ["", "## Checkpoint averaging (fastmt's eval.average_last, on the race's kept weights)", "",
             "| seed | averaged | valid BLEU (last single) | valid BLEU (average) | test BLEU (last single) | "
             "test BLEU (average) |", "|---|---|---|---|---|---|"]
    for r, k, a in averaged:
        last = r["points"][-1]
        lines.append(f"| {r['seed']} | last {k}: {', '.join(a['checkpoints'])} | {last['valid_bleu']:.2f} | "
                     f"{a['valid_bleu']:.2f} | {last.get('test_bleu', float('nan')):.2f} | {a['test_bleu']:.2f} |")
    return lines


def cell(v: Any) -> str:
    """A report's cell: floats to 2 decimals, none as ''."""
    return "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def markdown(record: dict, command: str) -> str:
    rc = record["config"]
    summ = summarize(record)
    steps = sorted({p["step"] for r in record["runs"] for p in r.get("points", [])})
    heads = ["system", "seeds ok", *[f"valid BLEU @ {s}" for s in steps], *[f"train s @ {s}" for s in steps],
             "valid chrF (last)", "test BLEU (last)", "test chrF (last)", f"train s to valid BLEU {rc['threshold']:g}"]
    keys = ["system", "seeds_ok", *[f"valid@{s}" for s in steps], *[f"secs@{s}" for s in steps], "valid_chrf",
            "test_bleu", "test_chrf", "time_to_threshold"]
    stand_in = "stand-in corpus" if any("opus_mt_testsets" in f for f in rc["data_files"]) else ""
    lines = ["# The CPU race: fastmt, the HF baseline, eole" + (f" ({stand_in})" if stand_in else ""), ""]
    lines += [f"- data: **{stand_in} "
              f"({', '.join(rc['data_files'])})**, fastmt's leakage-free split exported as files "
              f"(data/export_split.py); every system reads the same rows: train "
              f"{record['split']['splits']['train']['pairs']:,} / valid {record['split']['splits']['valid']['pairs']} / "
              f"test {record['split']['splits']['test']['pairs']} pairs, pair hashes "
              + ", ".join(f"{s} `{v['rows_sha256'][:16]}`" for s, v in record["split"]["splits"].items())
              + f"; shared SentencePiece {record['split']['vocab_size']} pieces `{record['split']['spm_sha256'][:16]}`",
              f"- size: d_model 128, 2+2 layers, 4 heads, ffn 512; fastmt batches of 4,096 padded src+tgt tokens "
              f"({record['tokens_per_batch_fastmt']:.0f} real tokens a batch on average), HF "
              f"{next((r.get('batch_sentences') for r in record['runs'] if r.get('batch_sentences')), '?')} sentences a "
              f"batch (the same real tokens), eole batch_size {record.get('eole_batch_tokens')} tokens as eole counts them "
              f"(about the longer side of each pair, sized for the same real tokens; eole's log says how many it got)",
              f"- {rc['steps']} optimizer steps per run, weights kept every {rc['eval_every']}; seeds "
              f"{', '.join(map(str, rc['seeds']))}; {rc['threads']} thread each, "
              + ("runs one after another" if rc.get("jobs", 1) == 1
                 else f"{rc['jobs']} runs at once (each its own thread; the load columns show the machine)"),
              "- scoring: one function (`bench.race.score` = fastmt's `corpus_scores`), greedy decoding by each "
              "system's own decoder, the whole validation split at each kept step and the whole test split at the "
              "last; signature `" + next((p["bleu_signature"] for r in record["runs"] for p in r.get("points", [])),
                                          "n/a") + "`",
              "- train s: seconds inside each system's own training loop (fastmt: its epochs' `epoch_seconds`; HF: "
              "the step loop; eole: its log's elapsed seconds), startup, model build and every evaluation excluded",
              f"- versions: {', '.join(f'{k} {v}' for k, v in record['versions'].items())}",
              f"- machine: {platform.machine()}, {os.cpu_count()} logical CPUs shared with other work; /proc/loadavg "
              f"(1, 5, 15 min) before and after each run: {'; '.join(record['load'])}",
              f"- started {record['started']}, finished {record.get('finished', 'NOT FINISHED (partial record)')}",
              "", "## Results (mean ± sd over seeds)", "", H.markdown_table(summ, keys, heads, cell=cell)]
    runs = [{"system": r["system"], "seed": r["seed"], "status": r.get("status", "")[:120], **{k: p.get(k) for k in (
        "step", "train_seconds", "valid_bleu", "test_bleu")}, "process_seconds": r.get("process_seconds"),
        "load": f"{r.get('load_before')} → {r.get('load_after')}"} for r in record["runs"] for p in r.get("points") or [{}]]
    lines += ["", "## Runs", "", H.markdown_table(runs, list(runs[0]) if runs else [], [
        "system", "seed", "status", "step", "train s", "valid BLEU", "test BLEU", "process s", "load before → after"],
        cell=cell)]
    lines += averages_table(record)
    if record.get("lr_check"):
        lc = record["lr_check"]
        table = [{"lr": f"{row['lr']:g}", **{k: "n/a" if row["train_loss"].get(str(k)) is None else
                                              f"{row['train_loss'][str(k)]:.3f}" for k in lc["steps"]},
                  "seconds": row.get("seconds", "n/a")} for row in lc["rows"]]
        lines += ["", "## The HF baseline's learning-rate check", "", lc.get("how", ""), "", H.markdown_table(
            table, ["lr", *lc["steps"], "seconds"], ["peak lr", *(f"train loss @ {k}" for k in lc["steps"]), "train s"],
            cell=str)]
    if record.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in record["notes"]]
    lines += ["", "## Commands", "", f"- the race (rerun it as is; `fastmt bench peers --cpu ...` is the same): "
              f"`{command}`", "- this report from its record: `python -m bench.race --report-from "
              "bench/results/peers-cpu.json`"]
    for r in record["runs"]:
        if r.get("command") and r["seed"] == rc["seeds"][0]:
            lines.append(f"- {r['system']} (seed {r['seed']}): `{r['command']}`")
    return "\n".join(lines) + "\n"


def frontier_rows(record: dict) -> list[dict[str, Any]]:
    """bench.frontier's rows of a race: validation BLEU against training seconds, one line per system and seed."""
    return [{"contestant": f"{r['system']}-s{r['seed']}", "label": f"{r['system']} seed {r['seed']}",
             "status": "ok" if r.get("status") == "ok" else "error", "wall_seconds": p.get("train_seconds"),
             "bleu": p.get("valid_bleu"), "budget_s": None} for r in record["runs"] for p in r.get("points") or []]


def write_report(record: dict, command: str, out: Path, *, plot: bool = True) -> None:
    from bench.frontier import frontier_plot

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    out.write_text(markdown(record, command))
    if plot and (rows := frontier_rows(record)):
        frontier_plot(rows, out.with_suffix(".png"), title="CPU race (x: training seconds, evaluation excluded)")
