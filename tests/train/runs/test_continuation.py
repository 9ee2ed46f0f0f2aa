"""Issue 30: every run can be continued however it was started, from what it recorded.

The continuation matrix: a run started each way (fresh, ``--init-from`` on other data, a ``--resume PATH``
branch, ``$FASTMT_DATA_FILES``, ``--config``, DDP with 2 ranks) is stopped by SIGTERM (exit 75), continued with
the command its summary prints, and must end with the very weights of the same run left uninterrupted (the
README: a resume continues bit for bit). The fine-tune is also continued by its own command plus ``--resume
auto``. In-process runs (``train.cli.train.main``) on the toy data, 2 epochs of 3 batches, SIGTERM after step 4.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.toy import toy_corpus
from tests.train.runs_helpers import train_argv
from train.cli.train import main
from train.errors import EXIT_INTERRUPTED, EXIT_OK
from train.loop import Trainer
from train.runs.checkpoint import load_checkpoint, step_checkpoints

ROOT = Path(__file__).resolve().parents[3]
SHORT = ["--epochs", "2", "--run.max_batches_per_epoch", "3", "--run.keep_last", "9"]
STOP_AT = 4  # mid-epoch 2


def no_toy(argv: list[str]) -> list[str]:
    """``argv`` without ``--data.dataset toy`` (a run on files names them instead)."""
    i = argv.index("--data.dataset")
    return argv[:i] + argv[i + 2:]


def run(argv: list[str], capsys, monkeypatch, stop_at: int | None = None) -> tuple[int, str]:
    """``python -m train argv`` in this process; ``stop_at``: SIGTERM to itself after that step (as a cluster's
    preemption). Returns (exit code, stdout + stderr)."""
    step = Trainer.train_step

    def step_then_sigterm(self, batches):
        loss = step(self, batches)
        if self.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", step_then_sigterm)
        capsys.readouterr()
        code = main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def printed(out: str, name: str) -> str:
    """The ``next:`` command ``name`` ("resume", "train longer") of a summary."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(f"{name}:")]
    assert lines, out[-3000:]
    return lines[-1].split(":", 1)[1].strip()


def train_args(cmd: str) -> list[str]:
    """The arguments after ``-m train`` of a printed command."""
    words = shlex.split(cmd)
    i = words.index("train", words.index("-m"))
    return words[i + 1:]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = load_checkpoint(step_checkpoints(run_dir / "checkpoints")[-1])
    assert ckpt["position"]["epoch"] == 2, ckpt["position"]
    return ckpt["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.fixture(scope="module")
def parent(toy_bundle, tmp_path_factory):
    """A finished tiny run (its best.pt and a step checkpoint) and an "other" corpus file for fine-tunes."""
    tmp = tmp_path_factory.mktemp("parent")
    cache = toy_bundle.cfg.cache_dir
    code = main(train_argv(cache, tmp, *SHORT, name="A"))
    assert code == EXIT_OK
    lines = toy_corpus(cache, 1200).read_text().splitlines()
    other = tmp / "other.jsonl"
    other.write_text("\n".join(lines[200:1100]) + "\n")  # another corpus the same tokenizer reads
    run_dir = tmp / "runs" / "A"
    return {"best": run_dir / "checkpoints" / "best.pt", "step": step_checkpoints(run_dir / "checkpoints")[0],
            "other": other, "cache": cache}


def start_argv(how: str, parent: dict, out: Path, name: str, capsys) -> list[str]:
    """The command that starts a run ``how``."""
    base = train_argv(parent["cache"], out, *SHORT, name=name)
    if how in ("fresh", "env"):
        return base if how == "fresh" else no_toy(base)
    if how == "init-from":
        return [*no_toy(base), "--init-from", str(parent["best"]), "--data-files", str(parent["other"])]
    if how == "branch":
        return [*base, "--resume", str(parent["step"])]
    if how == "config":  # a config file written by --print-config, and nothing else
        capsys.readouterr()
        assert main([*base, "--print-config"]) == EXIT_OK
        path = out / f"{name}.json"
        path.write_text(capsys.readouterr().out)
        return ["--config", str(path)]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["fresh", "init-from", "branch", "env", "config"])
def test_a_stopped_run_continues_with_its_printed_command_as_if_never_stopped(how, parent, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    if how == "env":  # the files come from the environment only: the continuation runs without it
        monkeypatch.setenv("FASTMT_DATA_FILES", str(parent["other"]))
    ref_argv, cut_argv = (start_argv(how, parent, tmp_path, n, capsys) for n in ("ref", "cut"))
    assert run(ref_argv, capsys, monkeypatch)[0] == EXIT_OK
    code, out = run(cut_argv, capsys, monkeypatch, stop_at=STOP_AT)
    assert code == EXIT_INTERRUPTED, out[-3000:]
    where = f"at step {STOP_AT} (epoch 2, after batch 1)"  # row 9: one wording, the same position everywhere
    assert f"stopped (interrupted) {where}" in out and f"stopped:     by SIGTERM {where}" in out
    resume = printed(out, "resume")
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    code, out = run(train_args(resume), capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert f": {where}" in out  # the resume line
    runs = tmp_path / "runs"
    assert_same_weights(runs / "ref", runs / "cut")
    assert sorted(p.name for p in runs.iterdir()) == ["cut", "ref"]  # continued in place, no new folder
    if how == "env":  # row 7: config.json names the files
        assert json.loads((runs / "cut" / "config.json").read_text())["data"]["data_files"] == [str(parent["other"])]


def test_an_interrupted_fine_tune_continues_with_the_same_command_and_resume_auto(parent, tmp_path, capsys,
                                                                                 monkeypatch):
    """Row 1: the command that started the fine-tune, plus ``--resume auto`` (was: "not both"; without
    --init-from: "tokenizer mismatch")."""
    monkeypatch.delenv("FASTMT_DATA_FILES", raising=False)
    ref = start_argv("init-from", parent, tmp_path, "ref", capsys)
    cut = start_argv("init-from", parent, tmp_path, "ft", capsys)
    assert run(ref, capsys, monkeypatch)[0] == EXIT_OK
    assert run(cut, capsys, monkeypatch, stop_at=STOP_AT)[0] == EXIT_INTERRUPTED
    code, out = run([*cut, "--resume", "auto"], capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert_same_weights(tmp_path / "runs" / "ref", tmp_path / "runs" / "ft")
    code, more = run(train_args(printed(out, "train longer")), capsys, monkeypatch)  # its other printed hint
    assert code == EXIT_OK and "extending the finished run" in more, more[-3000:]
    from train.runs.folder import read_marker

    marker = read_marker(tmp_path / "runs" / "ft")  # the lineage is kept: still the child of A's best.pt
    assert marker["parent"]["how"] == "init-from" and marker["parent"]["checkpoint"] == str(parent["best"])
    # a resume that names no data (no --data-files, no --init-from) continues on the fine-tune's own files
    longer = [*no_toy(train_argv(parent["cache"], tmp_path, "--epochs", "5", *SHORT[2:], name="ft")), "--resume", "auto"]
    code, out = run(longer, capsys, monkeypatch)
    assert code == EXIT_OK, out[-3000:]
    assert f"data.data_files=('{parent['other']}',)" in out and "extending the finished run" in out


def test_a_fine_tune_resume_auto_refuses_a_folder_of_another_origin(parent, tmp_path, capsys, monkeypatch):
    argv = start_argv("fresh", parent, tmp_path, "x", capsys)
    assert run(argv, capsys, monkeypatch, stop_at=2)[0] == EXIT_INTERRUPTED
    code, out = run([*no_toy(argv), "--data-files", str(parent["other"]), "--init-from", str(parent["best"]),
                     "--resume", "auto"], capsys, monkeypatch)
    assert code == 2 and "is not a fine-tune of" in out and "it was not started by --init-from" in out
    # a copy of the origin (the same run, the same step) names the same origin: the fine-tune continues
    ft = start_argv("init-from", parent, tmp_path, "ft", capsys)
    assert run(ft, capsys, monkeypatch, stop_at=2)[0] == EXIT_INTERRUPTED
    import shutil

    copy = shutil.copy(parent["best"], tmp_path / "copy.pt")
    code, out = run([*ft[:ft.index("--init-from") + 1], str(copy), *ft[ft.index("--init-from") + 2:], "--resume",
                     "auto"], capsys, monkeypatch)
    assert code == EXIT_OK and "resumed from" in out, out[-2000:]


@pytest.mark.slow
def test_a_ddp_run_stopped_by_sigterm_continues_with_its_printed_torchrun_command(parent, tmp_path):
    """DDP (2 gloo ranks on CPU): SIGTERM to the launcher's group after the first epoch; the printed command
    relaunches 2 ranks and the continuation ends with the uninterrupted DDP run's weights."""
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("FASTMT_DATA_FILES", None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train"]
    flags = ["--epochs", "2", "--run.max_batches_per_epoch", "40", "--run.log_every", "1"]
    ref = subprocess.run([*launcher, *train_argv(parent["cache"], tmp_path, *flags, name="ref")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    proc = subprocess.Popen([*launcher, *train_argv(parent["cache"], tmp_path, *flags, name="cut")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = tmp_path / "runs" / "cut" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not metrics.is_file() or '"kind": "epoch"' not in metrics.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no first epoch under torchrun"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    resume = printed(out, "resume")
    assert "torch.distributed.run" in resume and "--nproc_per_node 2" in resume
    again = subprocess.run(shlex.split(resume), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert_same_weights(tmp_path / "runs" / "ref", tmp_path / "runs" / "cut")
    # one process on that checkpoint: refused in one line naming both rank counts (row 2)
    longer = ["--epochs", "3", *flags[2:], "--resume", "auto"]
    one = subprocess.run([sys.executable, "-m", "train", *train_argv(parent["cache"], tmp_path, *longer, name="cut")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert one.returncode == 2 and "a run of 2 ranks, this run has 1" in one.stderr, one.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# the other rows of issue 30, one test each
# ----------------------------------------------------------------------------------------------
def test_a_resume_under_another_rank_count_is_refused_naming_both(parent, tmp_path, capsys, monkeypatch):
    """Row 2 (refusal chosen): a checkpoint written by 2 ranks, resumed by one process, is refused in one line
    naming 2 and 1, before anything is written (the DDP half is in the slow DDP test above)."""
    argv = train_argv(parent["cache"], tmp_path, *SHORT, name="w")
    assert run(argv, capsys, monkeypatch, stop_at=2)[0] == EXIT_INTERRUPTED
    path = step_checkpoints(tmp_path / "runs" / "w" / "checkpoints")[-1]
    ckpt = load_checkpoint(path)
    ckpt["position"]["world_size"] = 2  # as a 2-rank run writes it
    torch.save(ckpt, path)
    before = {p: p.read_bytes() for p in (tmp_path / "runs" / "w").rglob("*") if p.is_file()}
    code, out = run([*argv, "--resume", "auto"], capsys, monkeypatch)
    assert code == 2 and "written by a run of 2 ranks, this run has 1" in out and "--nproc_per_node 2" in out
    assert {p: p.read_bytes() for p in (tmp_path / "runs" / "w").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("flag, a, b", [("--preset", "tiny", "s18"), ("--epochs", "1", "2"), ("--max-steps", "3", "4"),
                                        ("--config", "a.json", "b.json"), ("--resume", "auto", "x.pt"),
                                        ("--init-from", "a.pt", "b.pt")])
def test_a_flag_that_takes_one_value_given_twice_is_an_error(flag, a, b, capsys):
    """Row 3: like a field given twice (argparse kept the last value silently)."""
    with pytest.raises(SystemExit) as e:
        from train.cli.flags import resolve_config

        resolve_config(["--preset", "tiny", flag, a, flag, b] if flag != "--preset" else [flag, a, flag, b],
                       machine=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag} given twice" in err and a in err and b in err


def test_data_files_given_twice_accumulates_like_its_field(tmp_path, capsys):
    """Row 3: --data-files a --data-files b trains on a and b (was: b alone), as --data.data_files does; a file
    named twice is read twice, with a warning."""
    from train.cli.flags import resolve_config

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("{}\n"), b.write_text("{}\n")
    for argv in (["--data-files", str(a), "--data-files", str(b)], ["--data.data_files", str(a),
                                                                     "--data.data_files", str(b)]):
        cfg, _ = resolve_config(["--preset", "tiny", *argv], machine=False)
        assert cfg.data.data_files == (str(a), str(b))
    capsys.readouterr()
    cfg, _ = resolve_config(["--preset", "tiny", "--data-files", str(a), "--data-files", str(a)], machine=False)
    assert cfg.data.data_files == (str(a), str(a)) and "given more than once" in capsys.readouterr().err


def test_stats_reads_the_data_as_a_fine_tune_or_a_resume_would(parent, tmp_path, capsys):
    """Row 5: ``stats --init-from CKPT`` encodes with the checkpoint's tokenizer (its vocabulary, not one trained
    on these files); ``stats --resume auto`` works and reads the run's own data."""
    from train.cli.stats import main as stats

    def vocab(*argv) -> int:
        capsys.readouterr()
        assert stats(["--preset", "tiny", "--data.cache_dir", parent["cache"], "--data.vocab_size", "330",
                      "--data.num_workers", "0", "--data.valid_size", "60", "--data.test_size", "60", "--json",
                      *argv]) == 0
        return json.loads(capsys.readouterr().out)["vocab_size"]

    ckpt_vocab = load_checkpoint(parent["best"])["config"]["model"]["vocab_size"]
    assert vocab("--data-files", str(parent["other"])) <= 330 < ckpt_vocab
    assert vocab("--data-files", str(parent["other"]), "--init-from", str(parent["best"])) == ckpt_vocab
    runs = parent["best"].parents[2]
    assert vocab("--run.out_dir", str(runs), "--run.name", "A", "--resume", "auto") == ckpt_vocab


def test_a_reused_cache_entry_names_the_files_this_run_read(tmp_path):
    """Row 6: an entry found by content (the same bytes under another name) reports and records this run's
    file names: the cleaning report's examples and the split record (provenance.json's data split)."""
    from data import build_data
    from tests.utils import quiet, toy_data

    rows = [json.dumps({"translation": {"en": f"the cat number {i} sleeps", "it": f"il gatto numero {i} dorme"}})
            for i in range(400)]
    first = tmp_path / "first.jsonl"
    first.write_text("\n".join(rows[:10] + ["not json"] + rows[10:]) + "\n")
    d = dict(valid_size=20, test_size=20, vocab_size=300)
    b1 = build_data(toy_data(tmp_path, data_files=str(first), **d), log=quiet)
    assert any("first.jsonl:11" in e for ex in b1.report.examples.values() for e in ex)
    moved = tmp_path / "sub" / "moved.jsonl"
    moved.parent.mkdir()
    first.rename(moved)
    b2 = build_data(toy_data(tmp_path, data_files=str(moved), **d), log=quiet)
    assert b2.split_record["cache"] == b1.split_record["cache"]  # the same entry, reused by content
    examples = [e for ex in b2.report.examples.values() for e in ex]
    assert any(e.startswith(f"{moved}:11") for e in examples) and not any("first.jsonl" in e for e in examples)
    assert b2.split_record["source"] == f"files:{moved}" and b2.split_record["paths"] == [str(moved)]
    assert b2.split_record["cache_built_from"] == f"files:{first}"


def test_evaluate_never_overwrites_what_it_reads(parent, tmp_path, capsys):
    """Row 8: ``--src out/h.hyp --out out/h.hyp`` (h.hyp written by an earlier evaluate) is refused before
    decoding, the file unchanged; ``--ckpt <run folder>`` takes its best.pt."""
    from train.cli.evaluate import main as evaluate

    src = tmp_path / "src.txt"
    src.write_text("the cat sleeps\nthe dog eats\n")
    hyp = tmp_path / "out" / "h.hyp"
    run_dir = parent["best"].parents[1]
    assert evaluate(["--ckpt", str(run_dir), "--src", str(src), "--out", str(hyp), "--beam", "1"]) == 0
    before = hyp.read_bytes()
    capsys.readouterr()
    assert evaluate(["--ckpt", str(parent["best"]), "--src", str(hyp), "--out", str(hyp)]) == 2
    assert "would overwrite --src" in capsys.readouterr().err and hyp.read_bytes() == before
    assert evaluate(["--ckpt", str(parent["best"]), "--src", str(src), "--ref", str(hyp), "--out", str(hyp)]) == 2
    assert hyp.read_bytes() == before


def test_a_stop_at_an_epoch_end_is_said_the_same_way_everywhere(parent, tmp_path, capsys, monkeypatch):
    """Row 9: the stop line, the summary and the resume line name one position (was: "epoch 2, after batch
    28/28" beside "(epoch 3)", and a resume's 0-based "epoch 2")."""
    argv = train_argv(parent["cache"], tmp_path, *SHORT, name="e")
    code, out = run(argv, capsys, monkeypatch, stop_at=3)  # the last step of epoch 1
    where = "at step 3 (the end of epoch 1)"
    assert code == EXIT_INTERRUPTED and f"stopped (interrupted) {where}" in out and f"by SIGTERM {where}" in out
    code, out = run(train_args(printed(out, "resume")), capsys, monkeypatch)
    assert code == EXIT_OK and f": {where}" in out


def test_fastmt_data_files_naming_no_path_is_an_error(monkeypatch, capsys):
    """``FASTMT_DATA_FILES=:`` named no file and fell back to the Hub."""
    from train.cli.flags import resolve_config

    monkeypatch.setenv("FASTMT_DATA_FILES", ":")
    with pytest.raises(SystemExit):
        resolve_config(["--preset", "tiny"], machine=False)
    assert "names no file" in capsys.readouterr().err


def test_init_from_records_the_tokenizer_settings_it_really_used(parent, tmp_path, capsys, monkeypatch):
    """``--init-from`` with ``--data.vocab_size 2000``: the checkpoint's tokenizer is used, and config.json says
    the vocabulary size that made it (was: 2000, a value nothing used)."""
    argv = [*no_toy(train_argv(parent["cache"], tmp_path, "--max-steps", "1", name="v")), "--init-from",
            str(parent["best"]), "--data-files", str(parent["other"])]
    argv[argv.index("--data.vocab_size") + 1] = "2000"
    code, out = run(argv, capsys, monkeypatch)
    assert code == EXIT_OK, out[-2000:]
    saved = load_checkpoint(parent["best"])["config"]["data"]["vocab_size"]
    assert json.loads((tmp_path / "runs" / "v" / "config.json").read_text())["data"]["vocab_size"] == saved
    assert "data.vocab_size=" in out


def test_a_run_without_held_out_rows_prints_no_empty_signature(parent, tmp_path, capsys, monkeypatch):
    """A run with no validation and no test rows said "BLEU|None" in its test line."""
    argv = train_argv(parent["cache"], tmp_path, "--max-steps", "2", "--eval.test_at_end", "true", name="nv")
    for flag in ("--data.valid_size", "--data.test_size"):
        argv[argv.index(flag) + 1] = "0"
    code, out = run(argv, capsys, monkeypatch)
    assert code == EXIT_OK and "loss n/a BLEU n/a" in out and "BLEU|None" not in out, out[-2000:]


def test_config_and_data_file_mistakes_of_the_smaller_items(tmp_path, capsys):
    """``"optim": 5`` in a config says the section must be an object (was: "no value for optim.name"); one file
    as both validation and test set passes with a warning (best.pt would be chosen on the test set)."""
    from train.cli.flags import resolve_config

    bad = tmp_path / "c.json"
    bad.write_text('{"optim": 5}')
    with pytest.raises(SystemExit):
        resolve_config(["--config", str(bad)], machine=False)
    assert "optim must be an object of fields, got int: 5" in capsys.readouterr().err
    f = tmp_path / "held.jsonl"
    f.write_text("{}\n")
    resolve_config(["--preset", "tiny", "--data.valid_files", str(f), "--data.test_files", str(f)], machine=False)
    assert "is both data.valid_files and data.test_files" in capsys.readouterr().err
