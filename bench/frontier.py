"""The time-to-quality frontier: validation BLEU against wall seconds, every contestant on the same data
for the same wall-clock budget.

Each contestant (``CONTESTANTS``) trains in its own process until the first step boundary after
``--budget-s`` seconds, then evaluates; its points are its ``metrics.jsonl`` epoch rows, a failure is a
row saying so. Outputs ``<out>/frontier-<gpu>.{csv,md,png}``; details: bench/README.md."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import cli
from bench import harness as H
from bench.harness import run_in_group
from bench.quality import read_run
from train.runs.folder import free_run_name, read_marker

THRESHOLDS = (20.0, 28.0, 35.0, 37.0, 37.6)  # valid BLEU levels reported as "time to BLEU X"


@dataclass(frozen=True)
class Contestant:
    name: str  # csv `contestant` column
    label: str  # legend
    module: str  # "bench.peers" or "train"
    args: tuple[str, ...]  # preset and overrides (CLI syntax)


SEEDS_RECIPE = ("--run.precision", "fp16", "--data.batching", "dynamic", "--data.batch_size", "32",
                "--optim.name", "lion", "--optim.lr", "1e-4", "--optim.schedule", "onecycle",
                "--run.compile", "false")
CONTESTANTS: dict[str, Contestant] = {c.name: c for c in (
    Contestant("hf", "HF Marian baseline (bench.peers)", "bench.peers", ("--preset", "s18")),
    Contestant("eole", "eole 0.6.4, its WMT17 recipe at this size (bench/eole_peer.py)", "bench.peers",
               ("--peer", "eole", "--preset", "s18")),
    Contestant("seeds", "seeds' recipe (fp16, dynamic pad, Lion 1e-4, eager)", "train",
               ("--preset", "s18", *SEEDS_RECIPE)),
    Contestant("s18", "fastmt s18 preset", "train", ("--preset", "s18")),
    Contestant("default", "fastmt default (--auto)", "train", ("--auto",)),
)}
# smoke: the tiny preset everywhere, toy-corpus data settings, a small HF batch
SMOKE_PRESET = {"s18": "tiny"}
SMOKE_OVERRIDES = (*(x for k, v in cli.SMOKE_DATA.items() for x in (f"--data.{k}", str(v))),
                   "--eval.max_sentences", "20")


def seeded(c: Contestant, seed: int) -> Contestant:
    """``c`` with its initialisation and data-order seed set (name ``<name>-s<seed>``)."""
    flags = ("--seed", str(seed)) if c.module == "bench.peers" else ("--run.seed", str(seed), "--data.seed", str(seed))
    return Contestant(f"{c.name}-s{seed}", f"{c.label}, seed {seed}", c.module, (*c.args, *flags))


def command(c: Contestant, *, budget_s: float, run_name: str, out_dir: Path, data_files: Sequence[str],
            smoke: bool, cache_dir: Path | None = None) -> list[str]:
    """The contestant's command line (``sys.executable -m ...``) for one budgeted run."""
    args = list(c.args)
    if smoke:
        args = [SMOKE_PRESET.get(a, a) for a in args]
    cmd = [sys.executable, "-m", c.module, *args]
    if data_files:
        cmd += ["--data-files", *data_files]
    extra = list(SMOKE_OVERRIDES) if smoke else []
    if cache_dir is not None:
        extra += ["--data.cache_dir", str(cache_dir)]
    if c.module == "bench.peers":
        cmd += ["--max-wall-seconds", f"{budget_s:g}", "--no-test", "--name", run_name, "--out-dir", str(out_dir)]
        if smoke:
            cmd += ["--batch-size", "16"]
    else:
        cmd += ["--run.max_wall_seconds", f"{budget_s:g}", "--eval.test_at_end", "false", "--run.name", run_name,
                "--run.out_dir", str(out_dir), "--run.tensorboard", "false", "--run.progress", "false"]
    return cmd + extra


# -- Running one contestant ------------------------------------------------------------------------
class Stopped(Exception):
    """SIGTERM reached the frontier (the runbook step's time limit): the contestant in flight was killed."""


def _raise_stopped(signum, _frame):
    raise Stopped(f"signal {signum}")


def run_contestant(c: Contestant, cmd: list[str], log_path: Path, *, timeout_s: float,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cmd`` in its own process group (output to ``log_path``); returns status, returncode, seconds.
    The group dies at ``timeout_s``, with the contestant, and with this process: a SIGTERM (the runbook
    step's limit) or Ctrl-C kills it and raises (``Stopped``, ``KeyboardInterrupt``)."""
    log(f"[frontier] {c.name}: {' '.join(cmd[1:])}")
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if main_thread else None
    t0, status, rc = time.perf_counter(), "ok", 0
    try:
        run_in_group(cmd, log_path, timeout_s=timeout_s, cwd=H.REPO_ROOT,
                     env=H.child_env(PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1"))
    except TimeoutError:
        status, rc = "timeout", None
    except RuntimeError as e:  # "<cmd> exited <rc>: <log tail>"
        status, rc = "error", next((int(m[1]) for m in re.finditer(r" exited (-?\d+):", str(e))), None)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return {"status": status, "returncode": rc, "run_seconds": time.perf_counter() - t0}


def run_folders(work: Path, run_name: str) -> set[str]:
    """The names under ``work`` a run asking for ``run_name`` may claim: it, or ``<run_name>-<n>``."""
    if not work.is_dir():
        return set()
    return {p.name for p in work.iterdir() if p.is_dir()
            and (p.name == run_name or (p.name.startswith(run_name + "-") and p.name[len(run_name) + 1:].isdigit()))}


def claimed_run_dir(work: Path, run_name: str, before: set[str]) -> Path:
    """The one run folder (with fastmt's marker) that appeared under ``work`` during the run; else (none, or
    several: another writer beside it) ``work/run_name``."""
    new = sorted(n for n in run_folders(work, run_name) - before if read_marker(work / n) is not None)
    return work / new[0] if len(new) == 1 else work / run_name


def contestant_rows(c: Contestant, result: Mapping[str, Any], run_dir: Path, log_path: Path, *, budget_s: float,
                    cmd: Sequence[str]) -> list[dict[str, Any]]:
    """One row per epoch point; one error row when the run produced none or failed."""
    epochs = read_run(run_dir)[0] if (run_dir / "metrics.jsonl").is_file() else []
    common = {"contestant": c.name, "label": c.label, "budget_s": budget_s, "run_seconds": result["run_seconds"],
              "returncode": result["returncode"], "command": " ".join(["python", *cmd[1:]])}
    status = result["status"]
    if status == "ok" and not epochs:
        status = "error"
    error = "" if status == "ok" else (
        f"{status}: exit {result['returncode']}, {len(epochs)} epoch rows; log: {H.tail(log_path)}")
    rows = [{**common, "status": status, "epoch": r.get("epoch"), "wall_seconds": r["wall_seconds"],
             "bleu": r.get("bleu"), "valid_loss": r.get("valid_loss"), "epoch_seconds": r.get("epoch_seconds"),
             "eval_seconds": r.get("eval_seconds"), "partial_epoch": bool(r.get("partial_epoch")),
             "wall_from_epochs": r.get("wall_from_epochs", False), "error": error} for r in epochs]
    return rows or [{**common, "status": status, "error": error}]


# -- Summaries, writers ----------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def series(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """contestant -> [(wall seconds, valid BLEU)] sorted by time (rows without both are left out)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        x, y = _num(r.get("wall_seconds")), _num(r.get("bleu"))
        out.setdefault(str(r["contestant"]), [])
        if x is not None and y is not None:
            out[str(r["contestant"])].append((x, y))
    return {k: sorted(v) for k, v in out.items()}


def summarize(rows: Sequence[Mapping[str, Any]], thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, Any]]:
    """Per contestant: best BLEU and when, last point, first wall time at each BLEU threshold."""
    pts = series(rows)
    out = []
    for name, p in pts.items():
        mine = [r for r in rows if str(r["contestant"]) == name]
        s: dict[str, Any] = {"contestant": name, "label": mine[0].get("label", name),
                             "status": ",".join(sorted({str(r.get("status")) for r in mine})),
                             "budget_s": _num(mine[0].get("budget_s")), "points": len(p)}
        if p:
            best = max(p, key=lambda xy: (xy[1], -xy[0]))
            s.update(best_bleu=best[1], best_wall_seconds=best[0], last_wall_seconds=p[-1][0], last_bleu=p[-1][1])
        for t in thresholds:
            s[f"time_to_{t:g}"] = next((x for x, y in p if y >= t), None)
        s["error"] = next((str(r.get("error")) for r in mine if r.get("error")), "")
        out.append(s)
    return out


def frontier_plot(rows: Sequence[Mapping[str, Any]], path: Path, *, title: str) -> Path:
    """Validation BLEU against wall seconds since process start, one line per contestant."""
    fig, axes = H.new_figure(1, 1, width=8.5, height=5.0)
    ax = axes[0][0]
    labels = {str(r["contestant"]): str(r.get("label") or r["contestant"]) for r in rows}
    pts = {labels[k]: v for k, v in series(rows).items()}
    H.line_panel(ax, pts, title="validation BLEU vs wall-clock time", xlabel="wall seconds since process start",
                 ylabel="valid BLEU (sacreBLEU)", logx=False)
    ax.set_xlim(left=0)
    for b in sorted({v for v in (_num(r.get("budget_s")) for r in rows) if v is not None}):
        ax.axvline(b, color="gray", linestyle="--", linewidth=0.8)
        ax.text(b, ax.get_ylim()[1], f" budget {b:g} s", va="top", fontsize=7, color="gray")
    failed = sorted({labels[str(r["contestant"])] for r in rows if r.get("status") not in ("ok", None)})
    if failed:
        ax.text(0.01, 0.01, "not finished: " + "; ".join(failed), transform=ax.transAxes, fontsize=7,
                color="#c62828", va="bottom")
    return H.save_figure(fig, path, suptitle=title)


def frontier_markdown(rows: Sequence[Mapping[str, Any]], prov: Mapping[str, Any], corpus: str, *,
                      smoke: bool) -> str:
    summ = summarize(rows)
    cols = ["label", "status", "budget_s", "points", "best_bleu", "best_wall_seconds", "last_bleu",
            "last_wall_seconds", *[f"time_to_{t:g}" for t in THRESHOLDS]]
    heads = ["contestant", "status", "budget s", "epochs", "best valid BLEU", "at wall s", "last BLEU", "last wall s",
             *[f"s to BLEU {t:g}" for t in THRESHOLDS]]
    lines = [f"# Time-to-quality frontier — {prov.get('gpu', '?')}"
             + (" (CPU smoke run: numbers mean nothing)" if smoke else ""), "",
             H.provenance_markdown(prov, None),
             f"- data: **{corpus}**; every contestant trains in its own process on the same files and is stopped "
             f"at the first step boundary after its budget, then evaluated; wall seconds count from process "
             f"start (data, compile and evaluation included)", "",
             H.markdown_table(summ, cols, heads), ""]
    errors = [f"- {s['contestant']}: {s['error']}" for s in summ if s["error"]]
    lines += ["## Contestants that did not finish", "", *errors, ""] if errors else []
    seen = {str(r["contestant"]): r.get("command", "") for r in reversed(rows)}
    order = dict.fromkeys(str(r["contestant"]) for r in rows)
    lines += ["## Commands", "", *(f"- {k}: `{seen[k]}`" for k in order)]
    return "\n".join(lines) + "\n"


COLUMNS = ("contestant", "label", "status", "epoch", "wall_seconds", "bleu", "valid_loss", "epoch_seconds",
           "eval_seconds", "partial_epoch", "wall_from_epochs", "budget_s", "run_seconds", "returncode", "corpus",
           "command", "error", *H.PROVENANCE_COLUMNS, "timestamp")


def write_outputs(rows: list[dict[str, Any]], prov: Mapping[str, Any], corpus: str, out: Path, *, smoke: bool,
                  fresh: bool = False, plot: bool = True, name: str = "frontier",
                  markdown: Callable[..., str] | None = None) -> dict[str, Path]:
    """Write ``<name>-<gpu>.csv`` (keeping the rows of contestants not in ``rows`` unless ``fresh``), ``.md``
    (``markdown(rows, prov, corpus, smoke=...)``, default the frontier's) and ``.png``."""
    title = f"fastmt {'time-to-quality ' if name == 'frontier' else ''}{name} — {prov['gpu']} — {corpus}"
    return H.write_results(out, name, prov["gpu_slug"], rows, COLUMNS, lambda rows: (markdown or frontier_markdown)(
        rows, prov, corpus, smoke=smoke), keep=None if fresh else "contestant", plot=(
        lambda rows, path: frontier_plot(rows, path, title=title)) if plot else None)


# -- The frontier ----------------------------------------------------------------------------------
def corpus_of(data_files: Sequence[str]) -> str:
    """The label of the contestants' data: the files given, else ``$FASTMT_DATA_FILES``, else the Hub's."""
    files = list(data_files) or [f for f in os.environ.get("FASTMT_DATA_FILES", "").split(os.pathsep) if f]
    return cli.corpus_label(files) if files else "OPUS Books en-it (Hub)"


def run_frontier(names: Sequence[str | Contestant], *, budget_s: float, grace_s: float, data_files: Sequence[str],
                 work: Path, smoke: bool, log: Callable[[str], None] = print,
                 on_row: Callable[[list[dict[str, Any]], Path], None] | None = None,
                 prefix: str = "frontier") -> list[dict[str, Any]]:
    """Run the contestants (names in ``CONTESTANTS``, or ``Contestant`` objects) in order, each for
    ``budget_s``, never raising for a contestant's failure. Run folders ``<work>/<prefix>-<name>`` (``-2``,
    ... when taken), logs ``<work>/<prefix>-logs/<name>.log``."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    prov = H.provenance(device)
    corpus = corpus_of(data_files)
    cache = work / "cache" if smoke else None  # smoke: one tokenizer cache for all, off the repo
    rows: list[dict[str, Any]] = []
    for c in names:
        c = CONTESTANTS[c] if isinstance(c, str) else c
        name = c.name
        run_name = free_run_name(work, f"{prefix}-{name}")  # the folder the run will claim (never moves one)
        cmd = command(c, budget_s=budget_s, run_name=run_name, out_dir=work, data_files=data_files,
                      smoke=smoke, cache_dir=cache)
        log_path = work / f"{prefix}-logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        before = run_folders(work, run_name)
        try:
            result = run_contestant(c, cmd, log_path, timeout_s=budget_s + grace_s, log=log)
        except OSError as e:  # the command could not start at all
            result = {"status": "error", "returncode": None, "run_seconds": 0.0}
            log_path.write_text(f"{type(e).__name__}: {e}\n")
        run_dir = claimed_run_dir(work, run_name, before)  # where it wrote, whatever name it was given
        new = contestant_rows(c, result, run_dir, log_path, budget_s=budget_s, cmd=cmd)
        for r in new:
            r.update(corpus=corpus, **prov)
        rows += new
        s = summarize(new)[0]
        log(f"[{prefix}] {name}: {s['status']}, {s['points']} points, best BLEU "
            f"{H.fmt(s.get('best_bleu'))} at {H.fmt(s.get('best_wall_seconds'))} s, ran {result['run_seconds']:.0f} s"
            + (f" -- {s['error'][:300]}" if s["error"] else ""))
        if on_row is not None:
            on_row(rows, run_dir)
    return rows


def budget_parser(prog: str, doc: str, smoke: str, what: str, budget: str, grace: str, *,
                  plot: bool = True, fresh: bool = True) -> argparse.ArgumentParser:
    """The command line the frontier and the sweeps share: ``cli.add_cli_args``, a wall budget and grace per
    ``what``, the work dir and ``--fresh``."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_cli_args(p, smoke, plot=plot)
    p.add_argument("--budget-s", type=float, help=f"wall seconds per {what} ({budget})")
    p.add_argument("--grace-s", type=float, help=f"extra seconds before a {what} is killed ({grace})")
    p.add_argument("--work-dir", type=Path, help="parent of the run folders and logs (default runs/; smoke: a "
                                                 "temp dir)")
    if fresh:
        p.add_argument("--fresh", action="store_true", help=f"drop the csv's rows of {what}s not run now")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = budget_parser("bench.frontier", __doc__, "tiny preset on a toy corpus", "contestant",
                      "default 120; smoke 8", "default max(60, budget/2)")
    p.add_argument("--contestants", default=",".join(CONTESTANTS),
                   help=f"comma-separated subset of {','.join(CONTESTANTS)}, run in that order")
    p.add_argument("--seeds", help="comma-separated seeds: every contestant once per seed (<name>-s<seed>)")
    return p


def work_dir(a: argparse.Namespace, prefix: str) -> Path:
    """``--work-dir``, else (chosen once) a temp dir in smoke runs and runs/ otherwise."""
    a.work_dir = a.work_dir or (Path(tempfile.mkdtemp(prefix=prefix)) if a.smoke else H.REPO_ROOT / "runs")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    return a.work_dir


def budget_args(p: argparse.ArgumentParser, a: argparse.Namespace, name: str, *, toy_rows: int,
                budget: tuple[float, float], grace: Callable[[float], float]
                ) -> tuple[list[str], float, float]:
    """(data files, absolute: the runs start at the repo root; budget; grace) from the shared flags;
    ``budget``: the (smoke, GPU) defaults, ``grace(budget)`` the default grace."""
    files = cli.cli_data_files(p, a, toy_rows=toy_rows,
                               toy=lambda: work_dir(a, f"fastmt-{name}-") / "toy.jsonl")
    b = a.budget_s if a.budget_s is not None else budget[0 if a.smoke else 1]
    g = a.grace_s if a.grace_s is not None else grace(b)
    if not b > 0 or g < 0:
        p.error(f"--budget-s {b} must be > 0" if not b > 0 else f"--grace-s {g} must be >= 0")
    return [str(Path(f).resolve()) for f in files], b, g


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    names: list = cli.choose(p, "--contestants", a.contestants, CONTESTANTS)
    if a.seeds:
        try:
            seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds {a.seeds!r}: give comma-separated integers, e.g. 0,1,2")
        names = [seeded(CONTESTANTS[n], s) for s in seeds for n in names]
    files, budget, grace = budget_args(p, a, "frontier", toy_rows=600, budget=(8.0, 120.0),
                                       grace=lambda b: max(60.0, b / 2))
    cols = ("contestant", "status", "points", "best_bleu", "best_wall_seconds", "last_wall_seconds")
    return run_cli(a, names, name="frontier", budget=budget, grace=grace, files=files, corpus=corpus_of(files),
                   header=f"{len(names)} contestants x {budget:g} s (+ up to {grace:g} s each to finish)",
                   conclude=lambda rows: H.text_table(summarize(rows), cols), plot=not a.no_plot)


def run_cli(a: argparse.Namespace, contestants: Sequence[str | Contestant], *, name: str, budget: float,
            grace: float, files: Sequence[str], corpus: str, header: str, conclude: Callable[[list], str],
            plot: bool = True, markdown: Callable[..., str] | None = None,
            write: Callable[[list, Path | None, bool], dict[str, Path]] | None = None) -> int:
    """The shared end of the frontier's and the sweeps' command lines: run the contestants, rewrite the
    outputs after each (no PNG until the end), print ``conclude(rows)`` and the paths. ``write(rows, run_dir,
    plot)`` (``run_dir``: the folder of the contestant just run, None at the end) replaces the frontier's
    outputs."""
    work = work_dir(a, f"fastmt-{name}-")
    out = a.out or (work / "out" if a.smoke else H.RESULTS_DIR)
    prov = H.provenance(torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu"))
    print(f"[{name}] {header}, {corpus}, work dir {work}", flush=True)
    write = write or (lambda rows, _dir, plot: write_outputs(
        rows, prov, corpus, out, smoke=a.smoke, fresh=a.fresh, plot=plot, name=name, markdown=markdown))
    try:
        rows = run_frontier(contestants, budget_s=budget, grace_s=grace, data_files=files, work=work,
                            smoke=a.smoke, on_row=lambda r, run_dir: write(r, run_dir, False), prefix=name)
    except Stopped as e:  # the finished contestants' rows are written (on_row); the one in flight was killed
        print(f"[{name}] stopped by {e}: the contestant in flight and its children were killed", flush=True)
        return 128 + signal.SIGTERM
    paths = write(rows, None, plot)
    print(conclude(rows), flush=True)
    for kind, path in paths.items():
        print(f"[{name}] {kind}: {path}")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
