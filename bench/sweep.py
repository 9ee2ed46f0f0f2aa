"""The optimiser sweep, judged on wall time to validation BLEU (issue 16 §2): Lion beside AdamW.

Every setting is ``python -m train --auto`` plus a few overrides, run by bench/frontier.py for the same
wall-clock budget on the same data. Outputs ``<out>/sweep-<gpu>.{csv,md,png}`` and the decision rule's
verdict: Lion stays the default if its best setting comes within ``LION_MARGIN`` BLEU of the best AdamW
setting in the same wall time; otherwise AdamW is the default and Lion one switch away."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import cli
from bench import frontier as F
from bench import harness as H

LION_MARGIN = 0.3  # BLEU
SMOKE_TOY_ROWS = 3000  # the CPU smoke run's toy corpus: the tiny model reaches BLEU ~40 in ~30 s


def _setting(name: str, label: str, *overrides: str) -> F.Contestant:
    return F.Contestant(name, label, "train", ("--auto", *overrides))


def _lion(name: str, label: str, lr: str, *overrides: str, wd: str = "0.1") -> F.Contestant:
    return _setting(name, label, "--optim.name", "lion", "--optim.lr", lr, "--optim.weight_decay", wd,
                    *overrides)


SETTINGS: dict[str, F.Contestant] = {c.name: c for c in (
    # AdamW around the best setting measured in ../shared/gpu/PEERS.md (the default)
    _setting("adamw-base", "AdamW 5e-4 (the default)"),
    _setting("adamw-8e-4", "AdamW 8e-4", "--optim.lr", "8e-4"),
    _setting("adamw-3e-4", "AdamW 3e-4", "--optim.lr", "3e-4"),
    _setting("adamw-warm5", "AdamW 5e-4, warm-up 5 %", "--optim.pct_start", "0.05"),
    _setting("adamw-2k", "AdamW 3.5e-4, 2k tokens", "--data.max_tokens", "2048", "--optim.lr", "3.5e-4"),
    _setting("adamw-8k", "AdamW 7e-4, 8k tokens", "--data.max_tokens", "8192", "--optim.lr", "7e-4"),
    # Lion: lr 3-10x below AdamW's and more weight decay (its authors' advice), around PEERS.md's best Lion
    _lion("lion-1e-4", "Lion 1e-4, wd 0.1", "1e-4"),
    _lion("lion-1.5e-4", "Lion 1.5e-4, wd 0.1", "1.5e-4"),
    _lion("lion-7e-5", "Lion 7e-5, wd 0.1", "7e-5"),
    _lion("lion-wd0.3", "Lion 1e-4, wd 0.3", "1e-4", wd="0.3"),
    _lion("lion-b0.95", "Lion 1e-4, betas 0.95/0.98", "1e-4", "--optim.betas", "0.95,0.98"),
    _lion("lion-warm5", "Lion 1e-4, warm-up 5 %", "1e-4", "--optim.pct_start", "0.05"),
    _lion("lion-2k", "Lion 7e-5, 2k tokens", "7e-5", "--data.max_tokens", "2048"),
    _lion("lion-8k", "Lion 1.5e-4, 8k tokens", "1.5e-4", "--data.max_tokens", "8192"),
    # beyond the optimiser: regularisation, the model over-fits the stand-in corpus
    _setting("adamw-drop0.2", "AdamW 5e-4, dropout 0.2", "--model.dropout", "0.2"),
    _setting("adamw-ls0.2", "AdamW 5e-4, label smoothing 0.2", "--optim.label_smoothing", "0.2"),
    _setting("adamw-lp1.0", "AdamW 5e-4, length penalty 1.0", "--eval.length_penalty", "1.0"),
    _setting("adamw-avg3", "AdamW 5e-4, average of the last 3 epochs", "--eval.average_last", "3",
             "--run.keep_last", "3"),
)}


def family(name: str) -> str:
    return name.split("-", 1)[0]


def decision(summary: Sequence[Mapping[str, Any]], margin: float = LION_MARGIN) -> str:
    """What the measured table says about the default optimiser (the rule in the module docstring)."""
    best: dict[str, Mapping[str, Any]] = {}
    for s in summary:
        f = family(str(s["contestant"]))
        if s.get("best_bleu") is not None and (f not in best or s["best_bleu"] > best[f]["best_bleu"]):
            best[f] = s
    if "lion" not in best or "adamw" not in best:
        return "not decided: the table lacks a finished Lion or AdamW setting"
    lion, adamw = best["lion"], best["adamw"]
    gap = adamw["best_bleu"] - lion["best_bleu"]
    verdict = "Lion stays the default" if gap <= margin else "AdamW is the default (Lion one switch away)"
    return (f"best Lion `{lion['contestant']}` {lion['best_bleu']:.2f} vs best AdamW `{adamw['contestant']}` "
            f"{adamw['best_bleu']:.2f} in the same budget: gap {gap:+.2f} BLEU (margin {margin}) -> **{verdict}**")


def sweep_markdown(rows: Sequence[Mapping[str, Any]], prov: Mapping[str, Any], corpus: str, *, smoke: bool) -> str:
    summ = sorted(F.summarize(rows), key=lambda s: -(s.get("best_bleu") or -1))
    th = [f"time_to_{t:g}" for t in F.THRESHOLDS]
    cols = ["contestant", "label", "status", "best_bleu", "best_wall_seconds", "points", *th]
    heads = ["setting", "what", "status", "best valid BLEU", "at wall s", "epochs", *[f"s to BLEU {t:g}" for t in
                                                                                   F.THRESHOLDS]]
    lines = [f"# Optimiser sweep on wall time to BLEU — {prov.get('gpu', '?')}"
             + (" (CPU smoke run on the tiny model: the numbers say nothing about the GPU recipe)" if smoke else ""),
             "", H.provenance_markdown(prov, None),
             f"- data: **{corpus}**; each setting = `python -m train --auto` + its overrides, its own process, the "
             f"same wall budget; wall seconds from process start (data, compile, evaluation included)"
             + ("; on CPU `--auto` is the `tiny` preset (AdamW 3e-3), which the settings' overrides change"
                if smoke else ""), "",
             ("Decision (CPU smoke run, tiny model: shown to exercise the rule, **not** a decision about the GPU "
              f"recipe): {decision(summ)}" if smoke else f"Decision: {decision(summ)}"),
             "", H.markdown_table(summ, cols, heads), ""]
    errors = [s for s in summ if s["error"]]
    if errors:
        lines += ["## Settings that did not finish", ""] + [f"- {s['contestant']}: {s['error']}" for s in errors] + [""]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = F.budget_parser("bench.sweep", __doc__, "the tiny model on a toy corpus", "setting",
                        "default 90; smoke 45", "default 60", plot=False)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    names = cli.choose(p, "--settings", a.settings, SETTINGS)
    files, budget, grace = F.budget_args(p, a, "sweep", toy_rows=SMOKE_TOY_ROWS, budget=(45.0, 90.0),
                                         grace=lambda _: 60.0)
    settings = [SETTINGS[n] for n in names]
    toy = a.smoke and not a.data_files
    corpus = f"toy corpus (data/toy.py, {SMOKE_TOY_ROWS:,} rows)" if toy else cli.corpus_label(files)
    if a.smoke:  # the tiny model on a corpus it can learn in a minute; enough epochs for the budget to bind
        settings = [F.Contestant(c.name, c.label, c.module, (*c.args, "--epochs", "100")) for c in settings]
    return F.run_cli(a, settings, name="sweep", budget=budget, grace=grace, files=files, corpus=corpus,
                     header=f"{len(names)} settings x {budget:g} s", markdown=sweep_markdown,
                     conclude=lambda rows: decision(F.summarize(rows)))


if __name__ == "__main__":
    sys.exit(main())
