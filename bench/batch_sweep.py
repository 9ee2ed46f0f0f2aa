"""The batch that reaches validation BLEU soonest (issue 42 item 3): tokens a step x learning rate / warm-up.

Each setting is ``python -m train --auto --data.max_tokens T --optim.schedule cosine --optim.lr LR
--optim.warmup_steps W``, run by bench/frontier.py for the same wall budget on the same data. Writes
``<out>/batch-sweep-<gpu>.{csv,md}`` (seconds to BLEU 15 and 20, best BLEU, steps, real tokens/s); rows of
settings not run now are kept (the GPU packets run one batch size each: bench/packets.py ``BATCH_SWEEP``).

  python -m bench.batch_sweep --settings 4096:5e-4:250,4096:1e-3:400 --budget-s 105 --grace-s 15
  python -m bench.batch_sweep --smoke          the tiny model on the toy corpus on the CPU, 2 settings x 3 s
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import frontier as F
from bench import harness as H

THRESHOLDS = (15.0, 20.0)  # validation BLEU levels timed (issue 42)
SMOKE_SETTINGS = "256:3e-3:10,512:3e-3:20"
_SETTING = re.compile(r"(\d+):([0-9.]+(?:e-?\d+)?):(\d+)")


@dataclass(frozen=True)
class Setting:
    tokens: int  # --data.max_tokens: tokens a step
    lr: float  # --optim.lr: the peak learning rate
    warmup: int  # --optim.warmup_steps: the cosine schedule's linear warm-up

    @property
    def name(self) -> str:
        return f"t{self.tokens}-lr{self.lr:g}-w{self.warmup}"

    def contestant(self, smoke: bool) -> F.Contestant:
        args = ("--auto", "--data.max_tokens", str(self.tokens), "--optim.schedule", "cosine",
                "--optim.lr", f"{self.lr:g}", "--optim.warmup_steps", str(self.warmup),
                "--eval.bleu_thresholds", ",".join(f"{t:g}" for t in THRESHOLDS))
        if smoke:  # enough epochs for the budget to bind
            args += ("--epochs", "100")
        return F.Contestant(self.name, f"{self.tokens} tokens, lr {self.lr:g}, warm-up {self.warmup}", "train", args)


def parse_settings(text: str) -> list[Setting]:
    """``TOKENS:LR:WARMUP,...`` -> settings; ``ValueError`` naming the first that is not one."""
    out = []
    for item in text.split(","):
        m = _SETTING.fullmatch(item.strip())
        if not m or int(m[1]) < 1 or int(m[3]) < 1 or not float(m[2]) > 0:
            raise ValueError(f"--settings: {item.strip()!r} is not TOKENS:LR:WARMUP (e.g. 4096:5e-4:250)")
        out.append(Setting(int(m[1]), float(m[2]), int(m[3])))
    if len({s.name for s in out}) != len(out):
        raise ValueError(f"--settings {text!r} names a setting twice")
    return out


COLUMNS = ("setting", "tokens", "lr", "warmup", "status", "budget_s", *(f"time_to_{t:g}" for t in THRESHOLDS),
           "best_bleu", "best_wall_seconds", "steps", "tokens_per_second", "epochs", "run_seconds", "corpus",
           "command", "error", *H.PROVENANCE_COLUMNS, "timestamp")


def setting_row(s: Setting, frontier_rows: Sequence[Mapping[str, Any]], run_dir: Path) -> dict[str, Any]:
    """The table's row of one setting: its frontier rows (one per evaluation) and its run folder's records."""
    summ = F.summarize(frontier_rows, THRESHOLDS)[0]
    epochs = F.read_run(run_dir)[0] if (run_dir / "metrics.jsonl").is_file() else []
    steady = epochs[1:] or epochs
    tps = sorted(float(r["tokens_per_second"]) for r in steady if isinstance(r.get("tokens_per_second"), (int, float)))
    first = frontier_rows[0]
    return {"setting": s.name, "tokens": s.tokens, "lr": s.lr, "warmup": s.warmup, "status": summ["status"],
            "budget_s": summ["budget_s"], **{f"time_to_{t:g}": summ.get(f"time_to_{t:g}") for t in THRESHOLDS},
            "best_bleu": summ.get("best_bleu"), "best_wall_seconds": summ.get("best_wall_seconds"),
            "steps": epochs[-1].get("step") if epochs else None, "tokens_per_second": tps[len(tps) // 2] if tps else None,
            "epochs": len(epochs), "run_seconds": first.get("run_seconds"), "corpus": first.get("corpus"),
            "command": first.get("command"), "error": summ.get("error") or "",
            **{k: first.get(k) for k in H.PROVENANCE_COLUMNS}}


def sweep_markdown(rows: Sequence[Mapping[str, Any]], prov: Mapping[str, Any], *, smoke: bool) -> str:
    heads = ["tokens a step", "lr", "warm-up", "status", "budget s", *(f"s to BLEU {t:g}" for t in THRESHOLDS),
             "best valid BLEU", "at wall s", "steps", "real tok/s"]
    cols = ["tokens", "lr", "warmup", "status", "budget_s", *(f"time_to_{t:g}" for t in THRESHOLDS), "best_bleu",
            "best_wall_seconds", "steps", "tokens_per_second"]
    ordered = sorted(rows, key=lambda r: (int(float(r["tokens"])), float(r["lr"]), int(float(r["warmup"]))))
    lines = [f"# The batch sweep — {prov.get('gpu', '?')}" + (" (CPU smoke run: numbers mean nothing)" if smoke else ""),
             "", H.provenance_markdown(prov, None),
             "- each setting: `python -m train --auto` with the batch (`--data.max_tokens`), the peak learning rate "
             "and the cosine warm-up below, stopped at its wall budget; seconds from process start (data, compile "
             "and evaluation included) to validation BLEU 15 and 20 ('-': not reached in the budget)",
             f"- data: **{ordered[0].get('corpus') if ordered else '?'}**", "",
             H.markdown_table(ordered, cols, heads), ""]
    errors = [r for r in ordered if r.get("error")]
    if errors:
        lines += ["## Settings that did not finish", "", *(f"- {r['setting']}: {r['error']}" for r in errors), ""]
    lines += ["## Commands", "", *(f"- {r['setting']}: `{r.get('command', '')}`" for r in ordered)]
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict[str, Any]], prov: Mapping[str, Any], out: Path, *, smoke: bool) -> dict[str, Path]:
    """``batch-sweep-<gpu>.{csv,md}``: the rows of settings not in ``rows`` kept from an earlier table."""
    return H.write_results(out, "batch-sweep", prov["gpu_slug"], rows, COLUMNS,
                           lambda rows: sweep_markdown(rows, prov, smoke=smoke), keep="setting")


def build_parser() -> argparse.ArgumentParser:
    p = F.budget_parser("bench.batch_sweep", __doc__, "the tiny model on a toy corpus, 2 settings x 3 s",
                        "setting", "default 105; smoke 3", "default 15; smoke 120", plot=False, fresh=False)
    p.add_argument("--settings", help="TOKENS:LR:WARMUP,... (default: 4096:5e-4:250,4096:1e-3:400; smoke: "
                                      f"{SMOKE_SETTINGS})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        settings = parse_settings(a.settings or (SMOKE_SETTINGS if a.smoke else "4096:5e-4:250,4096:1e-3:400"))
    except ValueError as e:
        p.error(str(e))
    files, budget, grace = F.budget_args(p, a, "batch-sweep", toy_rows=600, budget=(3.0, 105.0),
                                         grace=lambda _: 120.0 if a.smoke else 15.0)
    by_name = {s.name: s for s in settings}
    import torch

    prov = H.provenance(torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu"))
    out = a.out or (F.work_dir(a, "fastmt-batch-sweep-") / "out" if a.smoke else H.RESULTS_DIR)
    rows: list[dict[str, Any]] = []

    def write(frontier_rows, run_dir, _plot):  # after each setting: a cut step keeps the finished ones
        if run_dir is not None:
            name = frontier_rows[-1]["contestant"]
            mine = [r for r in frontier_rows if r["contestant"] == name]
            rows.append(setting_row(by_name[name], mine, run_dir))
            if a.smoke and not a.data_files:  # not the stand-in corpus: the generated toy corpus
                rows[-1]["corpus"] = "toy corpus (data/toy.py, 600 rows)"
        return write_table(rows, prov, out, smoke=a.smoke)

    def conclude(_frontier_rows) -> str:
        return "\n".join(f"[batch-sweep] {r['setting']}: {r['status']}, BLEU 15 at {H.fmt(r['time_to_15'])} "
                         f"s, BLEU 20 at {H.fmt(r['time_to_20'])} s, best {H.fmt(r['best_bleu'])}, "
                         f"{H.fmt(r['steps'])} steps" for r in rows)

    return F.run_cli(a, [s.contestant(a.smoke) for s in settings], name="batch-sweep", budget=budget,
                     grace=grace, files=files, corpus=F.corpus_of(files), write=write, conclude=conclude,
                     header=f"{len(settings)} settings x {budget:g} s (+ up to {grace:g} s)")


if __name__ == "__main__":
    sys.exit(main())
