"""The end of a run, for a person: a short block of plain lines (``summary_lines``) and the next commands.

The same facts, as JSON, are in the run folder: the ``done`` record of ``metrics.jsonl`` (wall seconds and
their split, best BLEU and where, time to each threshold, test BLEU) and ``config.json`` (the resolved
config, a valid ``--config`` input). ``wall_seconds`` is the run's wall clock (train/objective.py).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any


def python_command() -> str:
    """How to call this interpreter from a fresh shell in the current folder: ``.venv/bin/python`` style when
    it lives below it (a project venv), its absolute path when it is another virtual environment's (a fresh
    shell has not activated it), else ``python``."""
    exe = Path(sys.executable)
    try:
        return os.fspath(exe.relative_to(Path.cwd()))
    except ValueError:
        return shlex.quote(os.fspath(exe)) if sys.prefix != sys.base_prefix else "python"


def translation_checkpoint(run_dir: Path) -> Path | None:
    """``best.pt`` if the run has one, else its newest step checkpoint (a run that never validated)."""
    from train.runs.checkpoint import latest_checkpoint

    best = run_dir / "checkpoints" / "best.pt"
    return best if best.is_file() else latest_checkpoint(run_dir / "checkpoints")


def longer_flag(stop_reason: str, cfg, step: int) -> str:
    """The flag that lets a finished run go on: twice the epochs, steps, wall budget or patience that ended it."""
    if stop_reason == "max_steps":
        return f"--max-steps {2 * step}"
    if stop_reason == "wall_budget":
        return f"--run.max_wall_seconds {2 * cfg.run.max_wall_seconds:g}"
    if stop_reason == "early_stop":
        return f"--eval.patience {2 * cfg.eval.patience}"
    return f"--epochs {2 * cfg.run.epochs}"


def launcher(world_size: int) -> str:
    """How to start ``train`` with ``world_size`` ranks again: ``python -m train``, or for a DDP run torchrun with
    the same rank count (a resume refuses another count: train/runs/start.py ``check_world_size``)."""
    py = python_command()
    if world_size <= 1:
        return f"{py} -m train"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nodes = (f"--nnodes {world_size // per_node} RENDEZVOUS_FLAGS " if per_node != world_size  # your cluster's
             else "--standalone ")
    return f"{py} -m torch.distributed.run {nodes}--nproc_per_node {per_node} -m train"


def next_commands(run_dir: Path, *, stop_reason: str, longer: str, world_size: int = 1) -> dict[str, str]:
    """The translate / evaluate / continue commands for this run folder, ready to paste: an interrupted run
    resumes; a finished one trains longer (``longer``: see ``longer_flag``), with the run's rank count."""
    py, q = python_command(), shlex.quote
    out: dict[str, str] = {}
    ckpt = translation_checkpoint(run_dir)
    if ckpt is not None:
        out["translate"] = f'{py} -m train.translate --ckpt {q(str(ckpt))} "The cat sleeps."'
        out["evaluate"] = f"{py} -m train.evaluate --ckpt {q(str(ckpt))} --src SOURCE_FILE --ref REFERENCE_FILE"
    resume = f"{launcher(world_size)} --config {q(str(run_dir / 'config.json'))} --resume auto"
    if stop_reason == "interrupted":
        out["resume"] = resume
    else:
        out["train longer"] = f"{resume} {longer}"
    return out


def where_stopped(pos: dict[str, Any]) -> str:
    """Where a run stands, from its position (a checkpoint's ``position``: ``epoch`` = the 0-based epoch in
    progress or next, ``batch_index`` = its micro-batches done, ``step``): the one wording of the stop line,
    the summary and the resume line. ``"at step 56 (the end of epoch 2)"`` or ``"at step 30 (epoch 2, after
    batch 10)"``; epochs counted from 1, as the epoch records count them."""
    epoch, batch = int(pos.get("epoch", 0)), int(pos.get("batch_index", 0))
    where = f"the end of epoch {epoch}" if batch == 0 and epoch > 0 else f"epoch {epoch + 1}, after batch {batch}"
    return f"at step {pos.get('step', 0)} ({where})"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s:.0f} s ({s / 3600:.2f} h)"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The human block printed at the end of ``python -m train`` (see the module docstring)."""
    run_dir = Path(summary["run_dir"])
    files = ["config.json", "metrics.jsonl", "provenance.json", "checkpoints/"]
    if summary.get("curves"):
        files.append("curves.png")
    if (run_dir / "tensorboard").is_dir():
        files.append("tensorboard/")
    lines = [f"run folder:  {run_dir}  ({', '.join(files)})"]
    reason = summary["stop_reason"]
    if reason == "interrupted":
        pos = summary.get("position") or {"epoch": summary["epochs_done"], "step": summary["steps"]}
        lines.append(f"stopped:     by {summary.get('signal') or 'request'} {where_stopped(pos)}; checkpoint "
                     f"{summary.get('checkpoint')}")
    else:
        lines.append(f"finished:    {reason} after {summary['epochs_done']} epoch(s), {summary['steps']} steps"
                     + (f" ({summary['skipped_steps']} skipped as non-finite)" if summary.get("skipped_steps") else ""))
    best, at = summary.get("best_bleu"), summary.get("best_bleu_at") or {}
    if best is None:
        lines.append("best BLEU:   none (no validation BLEU was computed)")
    else:
        lines.append(f"best BLEU:   {best:.2f} (validation) at epoch {at.get('epoch')}, {_seconds(at.get('seconds', 0.0))}")
    test = summary.get("test")
    if test:
        lines.append(f"test BLEU:   {test['test_bleu']:.2f}, chrF {test['test_chrf']:.2f} ({test['test_sentences']} "
                     f"sentences, beam {test.get('beam_size')}, weights: {test['weights']})"
                     if test.get("test_bleu") is not None else "test BLEU:   none (empty test split)")
    lines += summary.get("time_to_bleu_lines", [])
    split = summary.get("time_split")
    if split:
        lines.append(f"wall time:   {_seconds(summary['wall_seconds'])} = " + " + ".join(
            f"{name} {split[name]:.1f}" for name in ("setup", "compile", "train", "eval", "checkpoints"))
            + " s (since the run's first process started)")
    if summary.get("compile_s") is not None:
        cache = summary.get("compile_cache")
        lines.append(f"compile:     {summary['compile_s']:.1f} s in this process (every graph dynamo compiled, "
                     f"recompiles included" + (f"; Inductor mega-cache {cache}" if cache else "") + ")")
    if summary.get("checkpoint_saves"):
        lines.append(f"checkpoints: {summary['checkpoint_saves']} saved; the loop waited "
                     f"{summary['checkpoint_s']:.2f} s for them (longest save {1000 * summary['checkpoint_max_s']:.0f} "
                     f"ms); written in the background in {summary['checkpoint_write_s']:.1f} s, of which the run's "
                     f"end waited {summary.get('checkpoint_final_wait_s') or 0.0:.2f} s")
    if summary.get("cpu_threads"):
        lines.append(summary["cpu_threads"])
    commands = summary.get("commands") or {}
    if commands:
        lines.append("next:")
        width = max(map(len, commands))
        lines += [f"  {name + ':':<{width + 1}} {cmd}" for name, cmd in commands.items()]
    return lines
