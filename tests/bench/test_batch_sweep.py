"""bench/batch_sweep.py (issue 42 item 3): the settings it parses, the table it keeps per device, and its smoke
form end to end on the CPU (one real `python -m train` run with the batch, lr and warm-up it names)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import batch_sweep as B

ROOT = Path(__file__).resolve().parents[2]


def test_settings_parse_and_bad_ones_are_named():
    [a, b] = B.parse_settings("4096:5e-4:250,8192:1.4e-3:250")
    assert (a.tokens, a.lr, a.warmup, b.tokens, b.lr) == (4096, 5e-4, 250, 8192, 1.4e-3)
    args = a.contestant(smoke=False).args
    for flag, value in (("--data.max_tokens", "4096"), ("--optim.lr", "0.0005"), ("--optim.warmup_steps", "250"),
                        ("--optim.schedule", "cosine"), ("--eval.bleu_thresholds", "15,20")):
        assert args[args.index(flag) + 1] == value, flag
    for bad in ("4096:5e-4", "x:1:2", "4096:0:10", "0:1e-3:10", "4096:1e-3:0", "4096:5e-4:250,4096:5e-4:250"):
        with pytest.raises(ValueError, match="settings"):
            B.parse_settings(bad)


def test_the_table_keeps_other_settings_and_replaces_a_rerun(tmp_path):
    prov = {"gpu": "NVIDIA H200", "gpu_slug": "h200"}

    def row(setting, tokens, t15):
        return {"setting": setting, "tokens": tokens, "lr": 1e-3, "warmup": 10, "status": "ok", "time_to_15": t15}

    B.write_table([row("t4096-lr0.001-w10", 4096, 30.0)], prov, tmp_path, smoke=False)
    paths = B.write_table([row("t8192-lr0.001-w10", 8192, 25.0)], prov, tmp_path, smoke=False)
    paths = B.write_table([row("t4096-lr0.001-w10", 4096, 28.0)], prov, tmp_path, smoke=False)
    rows = list(csv.DictReader(paths["csv"].open()))
    assert sorted((r["setting"], float(r["time_to_15"])) for r in rows) == [("t4096-lr0.001-w10", 28.0),
                                                                            ("t8192-lr0.001-w10", 25.0)]
    md = paths["md"].read_text()
    assert md.index("| 4096 |") < md.index("| 8192 |")  # by batch


def test_the_smoke_sweep_runs_train_with_its_setting_and_tabulates_the_run(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.batch_sweep", "--smoke", "--settings", "256:3e-3:10",
                        "--budget-s", "2", "--grace-s", "500", "--work-dir", str(work), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [row] = list(csv.DictReader((out / "batch-sweep-cpu.csv").open()))
    run = work / "batch-sweep-t256-lr0.003-w10"
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["max_tokens"] == 256 and config["optim"]["lr"] == 3e-3
    assert config["optim"]["warmup_steps"] == 10 and config["optim"]["schedule"] == "cosine"
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e.get("kind", "epoch") == "epoch"]
    assert row["status"] == "ok" and int(row["steps"]) == epochs[-1]["step"] and int(row["epochs"]) == len(epochs)
    reached = [e["wall_seconds"] for e in epochs if (e.get("bleu") or 0) >= 15]
    assert (float(row["time_to_15"]) if row["time_to_15"] else None) == (reached[0] if reached else None)
    assert row["corpus"].startswith("toy corpus")
    assert "| 256 | 0.003 | 10 | ok |" in (out / "batch-sweep-cpu.md").read_text()
