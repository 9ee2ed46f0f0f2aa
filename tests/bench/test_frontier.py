"""bench/frontier.py: contestant commands, failure handling, the summary, csv/md/png writers; a slow smoke run."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from bench import frontier as FR
from bench import harness as H

PROV = {"gpu": "cpu", "gpu_slug": "cpu", "torch": "2", "triton": "3", "cuda": "", "driver": "", "python": "3",
        "git_sha": "abc", "git_dirty": "no", "timestamp": "t"}


def _rows(name: str, points, budget=60.0, status="ok"):
    return [{"contestant": name, "label": f"label {name}", "status": status, "epoch": i + 1, "wall_seconds": x,
             "bleu": y, "budget_s": budget, **PROV} for i, (x, y) in enumerate(points)]


def test_summary_best_and_time_to_thresholds():
    rows = (_rows("a", [(30.0, 10.0), (50.0, 29.0), (70.0, 36.0), (90.0, 35.5)])
            + _rows("b", [(20.0, 21.0), (40.0, 21.0)])
            + [{"contestant": "c", "label": "c", "status": "error", "error": "error: exit 1", "budget_s": 60.0}])
    by = {s["contestant"]: s for s in FR.summarize(rows, thresholds=(20, 28, 35, 37))}
    a = by["a"]
    assert (a["best_bleu"], a["best_wall_seconds"], a["last_bleu"], a["last_wall_seconds"]) == (36.0, 70.0, 35.5, 90.0)
    assert (a["time_to_20"], a["time_to_28"], a["time_to_35"], a["time_to_37"]) == (50.0, 50.0, 70.0, None)
    assert by["b"]["best_wall_seconds"] == 20.0  # a tie is reached first at the earlier time
    assert by["c"]["points"] == 0 and by["c"]["status"] == "error" and by["c"]["error"] == "error: exit 1"
    assert FR.series(rows)["a"] == [(30.0, 10.0), (50.0, 29.0), (70.0, 36.0), (90.0, 35.5)]


def test_outputs_keep_other_contestants_rows_unless_fresh(tmp_path):
    first = _rows("hf", [(100.0, 20.0), (200.0, 30.0)]) + _rows("s18", [(50.0, 25.0)])
    paths = FR.write_outputs(first, PROV, "stand-in corpus (toy.jsonl)", tmp_path, smoke=True)
    assert set(paths) == {"csv", "md", "png"} and paths["png"].read_bytes()[:4] == b"\x89PNG"
    table = H.read_csv(paths["csv"])
    assert [(r["contestant"], r["epoch"]) for r in table] == [("hf", "1"), ("hf", "2"), ("s18", "1")]
    assert list(table[0])[:6] == list(FR.COLUMNS[:6])
    md = paths["md"].read_text()
    assert "stand-in corpus" in md and "label hf" in md and "s to BLEU 28" in md
    # a later call measuring s18 again replaces s18's rows and keeps hf's
    FR.write_outputs(_rows("s18", [(40.0, 27.0), (80.0, 31.0)]), PROV, "stand-in corpus", tmp_path, smoke=True,
                     plot=False)
    table = H.read_csv(paths["csv"])
    assert [(r["contestant"], r["wall_seconds"]) for r in table] == [("hf", "100"), ("hf", "200"), ("s18", "40"),
                                                                      ("s18", "80")]
    FR.write_outputs(_rows("s18", [(40.0, 27.0)]), PROV, "stand-in corpus", tmp_path, smoke=True, fresh=True,
                     plot=False)
    assert [r["contestant"] for r in H.read_csv(paths["csv"])] == ["s18"]


def test_contestant_rows_from_a_run_folder_and_from_failures(tmp_path):
    c = FR.CONTESTANTS["s18"]
    run = tmp_path / "frontier-s18"
    run.mkdir()
    recs = [{"kind": "start"},
            {"kind": "epoch", "epoch": 1, "bleu": 5.0, "valid_loss": 3.0, "epoch_seconds": 10.0, "eval_seconds": 2.0},
            {"kind": "epoch", "epoch": 2, "bleu": 9.0, "valid_loss": 2.5, "epoch_seconds": 8.0, "eval_seconds": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = tmp_path / "s18.log"
    log.write_text("line 1\nTraceback (most recent call last):\nRuntimeError: boom\n")
    ok = {"status": "ok", "returncode": 0, "run_seconds": 25.0}
    rows = FR.contestant_rows(c, ok, run, log, budget_s=20.0, cmd=[sys.executable, "-m", "train"])
    # no wall_seconds in these rows: the running sum of epoch + eval seconds stands in, and says so
    assert [(r["epoch"], r["wall_seconds"], r["wall_from_epochs"]) for r in rows] == [(1, 12.0, True), (2, 22.0, True)]
    assert all(r["status"] == "ok" and r["error"] == "" and r["command"] == "python -m train" for r in rows)
    (run / "metrics.jsonl").write_text(json.dumps({**recs[1], "wall_seconds": 31.5}) + "\n")
    assert FR.contestant_rows(c, ok, run, log, budget_s=20.0, cmd=["x"])[0]["wall_seconds"] == 31.5
    # a crash with no rows, and a clean exit that wrote none: one error row each, with the log's tail
    for result in ({"status": "error", "returncode": 1, "run_seconds": 3.0}, ok):
        [row] = FR.contestant_rows(c, result, tmp_path / "missing", log, budget_s=20.0, cmd=["x"])
        assert row["status"] == "error" and "RuntimeError: boom" in row["error"] and "epoch" not in row
    # a killed run keeps the rows it wrote
    killed = {"status": "timeout", "returncode": -9, "run_seconds": 80.0}
    rows = FR.contestant_rows(c, killed, run, log, budget_s=20.0, cmd=["x"])
    assert rows[0]["status"] == "timeout" and rows[0]["bleu"] == 5.0 and rows[0]["error"].startswith("timeout")


def test_run_contestant_kills_past_its_limit(tmp_path):
    c = FR.Contestant("sleeper", "sleeper", "x", ())
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    res = FR.run_contestant(c, cmd, tmp_path / "s.log", timeout_s=1.0, log=lambda *_: None)
    assert res["status"] == "timeout" and res["returncode"] != 0 and res["run_seconds"] < 60
    res = FR.run_contestant(c, [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "e.log", timeout_s=30,
                            log=lambda *_: None)
    assert res["status"] == "error" and res["returncode"] == 3


def test_seeds_recipe_is_the_s18_preset_with_the_seeds_settings(tmp_path):
    """The seeds' contestant, parsed by fastmt's own CLI: fp16 (GradScaler), dynamic padding of 32 sentences,
    Lion 1e-4 OneCycle, eager -- and s18's model."""
    from train.cli.flags import resolve_config
    from train.config import RunConfig, get_config

    cmd = FR.command(FR.CONTESTANTS["seeds"], budget_s=90, run_name="frontier-seeds", out_dir=tmp_path,
                     data_files=["a.jsonl"], smoke=False)
    assert cmd[:3] == [sys.executable, "-m", "train"]
    args = cmd[3:]
    i = args.index("--run.max_wall_seconds")
    assert args[i + 1] == "90"
    if "max_wall_seconds" not in {f.name for f in dataclasses.fields(RunConfig)}:
        del args[i:i + 2]  # the training loop's wall budget is not in this checkout yet
    args[args.index("--data-files") + 1] = str(tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").write_text("")
    cfg, _ = resolve_config(args, log=lambda *_: None)
    s18 = get_config("s18")
    assert cfg.model == s18.model
    assert (cfg.run.precision, cfg.run.compile, cfg.eval.test_at_end) == ("fp16", False, False)
    assert (cfg.data.batching, cfg.data.batch_size) == ("dynamic", 32)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.schedule) == ("lion", 1e-4, "onecycle")
    assert cfg.run.name == "frontier-seeds" and cfg.run.out_dir == str(tmp_path)
    hf = FR.command(FR.CONTESTANTS["hf"], budget_s=90, run_name="frontier-hf", out_dir=tmp_path, data_files=[],
                    smoke=False)
    assert hf[1:3] == ["-m", "bench.peers"] and "--max-wall-seconds" in hf and "--no-test" in hf
    assert FR.command(FR.CONTESTANTS["default"], budget_s=5, run_name="d", out_dir=tmp_path, data_files=[],
                      smoke=True)[3] == "--auto"


@pytest.mark.slow
def test_smoke_frontier(tmp_path):
    """Every contestant for a few seconds on a toy corpus (the HF one needs transformers)."""
    pytest.importorskip("transformers")
    from train.config import RunConfig

    out = tmp_path / "out"
    assert FR.main(["--smoke", "--budget-s", "4", "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 0
    table = H.read_csv(out / "frontier-cpu.csv")
    by = {}
    for r in table:
        by.setdefault(r["contestant"], []).append(r)
    assert list(by) == list(FR.CONTESTANTS)
    hf = by["hf"]
    assert all(r["status"] == "ok" for r in hf) and float(hf[0]["wall_seconds"]) > 0
    assert 0 <= float(hf[0]["bleu"]) <= 100 and hf[0]["partial_epoch"] == "true"
    has_budget = "max_wall_seconds" in {f.name for f in dataclasses.fields(RunConfig)}
    for name in ("seeds", "s18", "default"):
        if has_budget:
            assert all(r["status"] == "ok" and math.isfinite(float(r["bleu"])) for r in by[name]), by[name]
        else:  # fastmt without the wall budget: an error row that names it, and the frontier went on
            assert by[name][0]["status"] == "error" and "max_wall_seconds" in by[name][0]["error"]
    assert (out / "frontier-cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_rows_come_from_the_folder_the_contestant_claimed(tmp_path):
    """The frontier reads the run folder the child actually claimed (a marked folder that appeared during its
    run), not the name it guessed beforehand: a writer beside it may have taken that name first."""
    from train.runs.folder import write_marker

    work = tmp_path / "runs"
    (work / "frontier-s18").mkdir(parents=True)  # taken before the run (another writer)
    before = FR.run_folders(work, "frontier-s18")
    claimed = work / "frontier-s18-2"
    claimed.mkdir()
    write_marker(claimed, "run-1")
    (work / "frontier-s18-x").mkdir()  # not a name the run could claim
    assert FR.claimed_run_dir(work, "frontier-s18", before) == claimed
    assert FR.claimed_run_dir(work, "frontier-s18", before | {"frontier-s18-2"}) == work / "frontier-s18"  # none new
    unmarked = work / "frontier-s18-3"
    unmarked.mkdir()  # a folder without fastmt's marker is not a run
    assert FR.claimed_run_dir(work, "frontier-s18", before) == claimed


def test_eole_contestant_and_seeded_contestants(tmp_path):
    """eole runs through bench.peers --peer eole under the same wall budget; --seeds repeats a contestant with its
    seed flags, which each command line parses (fastmt's: run and data seeds)."""
    from train.cli.flags import resolve_config

    eole = FR.command(FR.seeded(FR.CONTESTANTS["eole"], 2), budget_s=60, run_name="frontier-eole-s2",
                      out_dir=tmp_path, data_files=[], smoke=False)
    assert eole[1:3] == ["-m", "bench.peers"] and eole[eole.index("--peer") + 1] == "eole"
    assert eole[eole.index("--seed") + 1] == "2" and eole[eole.index("--max-wall-seconds") + 1] == "60"
    args = P_parser().parse_known_args(eole[3:])[0]
    assert (args.peer, args.seed, args.max_wall_seconds, args.no_test) == ("eole", 2, 60.0, True)
    s18 = FR.seeded(FR.CONTESTANTS["s18"], 3)
    assert s18.name == "s18-s3"
    cmd = FR.command(s18, budget_s=60, run_name="x", out_dir=tmp_path, data_files=[str(tmp_path / "a.jsonl")],
                     smoke=False)
    (tmp_path / "a.jsonl").write_text("")
    cfg, _ = resolve_config(cmd[3:], log=lambda *_: None)
    assert (cfg.run.seed, cfg.data.seed) == (3, 3)


def P_parser():
    from bench.peers import build_parser

    return build_parser()
