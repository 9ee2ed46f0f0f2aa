"""Where a run writes and what it continues from, decided before anything is written (``plan_run``).

=====================  ==========================================================================
command                plan
=====================  ==========================================================================
(no --resume)          ``fresh``: a new folder ``<name>`` (``<name>-2``, ... when taken by a run)
--resume auto          the run folder ``<name>``: ``continue`` from its newest checkpoint of its own
                       lineage; ``extend`` a finished run when the config asks for more (epochs,
                       steps, wall time); ``restart`` at step 0 when it never wrote a checkpoint;
                       ``fresh`` when there is no such folder yet. Finished with nothing more to do:
                       ``RunFinishedError`` (exit 0). Checkpoints that exist but none loads: refused.
--resume PATH          the newest point of run ``<name>`` itself: as ``auto``; any other checkpoint
                       (another run's, or an earlier point of this run: a roll-back): ``branch``, a new
                       folder whose lineage records the run and step it branched from
--init-from PATH       ``init``: a new folder, the checkpoint's weights and tokenizer, step 0, a fresh
                       optimizer and schedule
--init-from PATH       the fine-tune's own folder when it exists (the same command continues it), as
--resume auto          ``--resume auto``; its folder must record PATH as its origin. No folder yet:
                       ``init``; a folder without a checkpoint: ``restart`` from PATH's weights
=====================  ==========================================================================

A name that holds anything but a fastmt run is refused (``RunFolderError``). Only ``plan_run`` reads the
file system here; the Trainer claims a new folder (``train.runs.folder.claim_run_folder``) once every setting
has been checked. An existing run folder is locked while planning (its checkpoints are read under the lock); a run
continued in place is first checked for anything planted in its folder (``check_run_files``: a link or a
non-regular file at the folder, ``checkpoints/``, a checkpoint or a record), before the lock file is made, a
checkpoint read or anything cut or written.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.errors import UserError
from train.runs.checkpoint import (
    file_lineage_id,
    latest_loadable_checkpoint,
    lineage_id,
    read_checkpoint,
    step_checkpoints,
)
from train.runs.folder import (
    RunLock,
    check_run_files,
    check_usable,
    folder_state,
    new_run_id,
    read_marker,
    run_finished,
)

NEW_FOLDER_MODES = ("fresh", "branch", "init")


class RunFinishedError(UserError):
    """``--resume auto`` on a run that already ended, with nothing more to do (the message says how it ended
    and how to extend it). Not a mistake: the command exits 0."""

    exit_code = 0


@dataclass
class RunPlan:
    mode: str  # "fresh" | "continue" | "extend" | "restart" | "branch" | "init" (see the module docstring)
    run_dir: Path  # the existing run folder, or the folder a new run will claim (its name may still change)
    run_id: str  # this run's id: the existing folder's, or a new one
    parent: dict[str, Any] | None = None  # lineage: {"run_id", "step", "epoch", "checkpoint", "how"} or None
    ckpt_path: Path | None = None  # the checkpoint continued from (or initialised from)
    ckpt: dict[str, Any] | None = None  # that checkpoint, loaded on the CPU
    lock: RunLock | None = None  # held: the existing run folder (continue / extend / restart)
    adopt: bool = False  # a run folder of an earlier fastmt (no run.json): mark it before writing
    weights_only: bool = False  # ckpt gives weights and tokenizer only (a fine-tune's start: --init-from)
    notes: list[str] = field(default_factory=list)  # what to tell the user once the run is set up

    @property
    def new_folder(self) -> bool:
        return self.mode in NEW_FOLDER_MODES


def _home_run(path: Path) -> Path | None:
    """The run folder a checkpoint file lives in (``<run>/checkpoints/<file>``), if it is one."""
    home = path.resolve().parent.parent
    return home if path.resolve().parent.name == "checkpoints" and folder_state(home) == "run" else None


def _source_run_id(ckpt: dict[str, Any], path: Path) -> str | None:
    """The run id of the run that wrote a checkpoint: its lineage, else (older checkpoints) its folder's marker."""
    if lineage_id(ckpt) is not None:
        return lineage_id(ckpt)
    home = _home_run(path)
    return (read_marker(home) or {}).get("run_id") if home is not None else None


def _parent(ckpt: dict[str, Any], path: Path, run_id: str | None, how: str) -> dict[str, Any]:
    pos = ckpt["position"]
    return {"run_id": run_id, "step": pos["step"], "epoch": pos["epoch"], "batch_index": pos.get("batch_index", 0),
            "checkpoint": str(path), "how": how}


def more_to_do(cfg, ckpt: dict[str, Any]) -> bool:
    """Whether ``cfg`` asks for more than the checkpoint's (finished) run did: epochs, steps, wall time or
    patience (an early-stopped run goes on when ``eval.patience`` allows more evaluations)."""
    pos, run = ckpt["position"], cfg.run
    clock = pos.get("clock") or {}
    patience = cfg.eval.patience
    return (pos["epoch"] < run.epochs and (run.max_steps is None or pos["step"] < run.max_steps)
            and (run.max_wall_seconds is None or float(clock.get("offset", 0.0)) < run.max_wall_seconds)
            and (patience is None or int(clock.get("evals_since_best", 0)) < patience))


def _finished_message(run_dir: Path, finished: dict[str, Any], ckpt: dict[str, Any] | None, cfg) -> str:
    done = (f"{finished.get('stop_reason', 'done')} at step {finished.get('step')}, epoch {finished.get('epoch')}"
            + (f", test BLEU {finished['test_bleu']:.2f}" if finished.get("test_bleu") is not None else ""))
    if ckpt is None:
        return f"--resume auto: run {run_dir} already finished ({done}) and has no checkpoint to continue from"
    from train.runs.report import longer_flag

    longer = longer_flag(finished.get("stop_reason", "done"), cfg, ckpt["position"]["step"])
    return (f"--resume auto: run {run_dir} already finished ({done}) and this config asks for nothing more "
            f"(--epochs {cfg.run.epochs}" + (f", --max-steps {cfg.run.max_steps}" if cfg.run.max_steps else "")
            + f"). To train it longer: --resume auto {longer}; to translate: its checkpoints/best.pt")


def _adopted_id(run_dir: Path) -> str:
    """The id of a run folder without a readable marker: its newest checkpoint's lineage (a lost or damaged
    run.json), or a new id (a run folder of an earlier fastmt, whose checkpoints carry no lineage)."""
    for path in reversed(step_checkpoints(run_dir / "checkpoints")):
        found = file_lineage_id(path)
        if isinstance(found, str):
            return found
        if found is None:
            break
    return new_run_id()


def _in_place(cfg, run_dir: Path, lock: RunLock, path: Path | None, ckpt: dict[str, Any] | None,
              log: Callable[[str], Any]) -> RunPlan:
    """Continue (or extend, or restart) the run in its own folder, whose lock is held."""
    check_run_files(run_dir)  # again under the lock: nothing is read through a link planted there
    marker = read_marker(run_dir)
    run_id = marker["run_id"] if marker else _adopted_id(run_dir)
    plan = RunPlan("continue", run_dir, run_id, lock=lock, adopt=marker is None)
    if path is None:  # older folders (no marker): their checkpoints carry no lineage, all are the run's
        path, ckpt = latest_loadable_checkpoint(run_dir / "checkpoints", log,
                                                run_id=run_id if marker is not None else None)
    if marker is not None and marker.get("parent"):
        plan.parent = marker["parent"]
    finished = run_finished(run_dir)
    if finished is not None:
        if ckpt is None or not more_to_do(cfg, ckpt):
            raise RunFinishedError(_finished_message(run_dir, finished, ckpt, cfg))
        plan.mode = "extend"
        pos = ckpt["position"]
        plan.notes.append(f"extending the finished run {run_dir} ({finished.get('stop_reason', 'done')} at epoch "
                          f"{pos['epoch']}, step {pos['step']}) to --epochs {cfg.run.epochs}"
                          + (f", --max-steps {cfg.run.max_steps}" if cfg.run.max_steps else ""))
    elif ckpt is None:
        plan.mode = "restart"
        plan.notes.append(f"--resume auto: {run_dir} holds no checkpoint yet (it stopped before its first one): "
                          f"training it from step 0")
    plan.ckpt_path, plan.ckpt = path, ckpt
    return plan


def plan_run(cfg, *, resume: str | os.PathLike | None = None, init_from: str | os.PathLike | None = None,
             log: Callable[[str], Any] = print) -> RunPlan:
    """Decide what this run continues and where it writes (see the module docstring); reads, never writes.

    Raises ``RunFolderError`` (the name holds something else), ``RunLockedError`` (a live run holds it),
    ``RunFinishedError``, ``CheckpointReadError`` / ``CheckpointNotFoundError`` (a bad checkpoint), or
    ``UserError`` (``--resume`` with ``--init-from``).
    """
    target = Path(cfg.run.out_dir) / cfg.run.name
    if resume is not None and init_from is not None and str(resume) != "auto":
        raise UserError("give --resume PATH (continue a run) or --init-from (a new run from a checkpoint's weights), "
                        "not both (--init-from with --resume auto continues the fine-tune it started)")
    if init_from is not None:
        path = Path(init_from)
        if resume is not None and check_usable(target) == "run":
            return _continue_fine_tune(cfg, target, path, log)
        ckpt = read_checkpoint(path, "--init-from")
        check_usable(target)
        parent = _parent(ckpt, path, _source_run_id(ckpt, path), "init-from")
        return RunPlan("init", target, new_run_id(), parent=parent, ckpt_path=path, ckpt=ckpt, weights_only=True)
    if resume is None:
        check_usable(target)
        return RunPlan("fresh", target, new_run_id())
    if str(resume) == "auto":
        state = check_usable(target)
        if state != "run":
            plan = RunPlan("fresh", target, new_run_id())
            plan.notes.append(f"--resume auto: no run {target} yet: starting it")
            return plan
        check_run_files(target)  # before the lock file is made: a refusal writes nothing
        lock = RunLock(target).acquire()
        try:
            return _in_place(cfg, target, lock, None, None, log)
        except BaseException:
            lock.release()
            raise
    return _plan_resume_path(cfg, Path(resume), target, log)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _same_origin(origin: dict[str, Any], path: Path) -> bool:
    """``path`` is the checkpoint a fine-tune recorded as its origin: the same file, or (moved, copied, named
    from another folder) a checkpoint of the same run at the same step."""
    if _same_file(origin.get("checkpoint", ""), path):
        return True
    if not path.is_file():
        return False
    ckpt = read_checkpoint(path, "--init-from")
    return (origin.get("run_id") is not None and _source_run_id(ckpt, path) == origin["run_id"]
            and ckpt["position"]["step"] == origin.get("step"))


def _continue_fine_tune(cfg, target: Path, init_from: Path, log: Callable[[str], Any]) -> RunPlan:
    """``--init-from PATH --resume auto`` on an existing run folder: the fine-tune PATH started, continued as
    ``--resume auto`` continues any run (its own checkpoints, tokenizer and data); one without a checkpoint yet
    starts again from PATH's weights."""
    origin = ((read_marker(target) or {}).get("parent") or {})
    if origin.get("how") != "init-from" or not _same_origin(origin, init_from):
        came = (f"it was initialised from {origin['checkpoint']}" if origin.get("how") == "init-from" else
                "it was not started by --init-from")
        raise UserError(f"--init-from {init_from} --resume auto: run {target} is not a fine-tune of {init_from} "
                        f"({came}); drop --init-from to continue it, or give another --run.name for a new fine-tune")
    check_run_files(target)
    lock = RunLock(target).acquire()
    try:
        plan = _in_place(cfg, target, lock, None, None, log)
        if plan.ckpt is None:  # stopped before its first checkpoint: the fine-tune starts again from its origin
            plan.ckpt_path, plan.ckpt = init_from, read_checkpoint(init_from, "--init-from")
            plan.weights_only = True
        return plan
    except BaseException:
        lock.release()
        raise


def _plan_resume_path(cfg, path: Path, target: Path, log: Callable[[str], Any]) -> RunPlan:
    ckpt = read_checkpoint(path)
    home = _home_run(path)
    src_id = _source_run_id(ckpt, path)
    state = check_usable(target)
    step = ckpt["position"]["step"]
    if state == "run":
        marker = read_marker(target)
        same_run = (home is not None and home == target.resolve()) or (
            marker is not None and src_id is not None and marker["run_id"] == src_id)
        if same_run:
            check_run_files(target)
            lock = RunLock(target).acquire()
            try:
                newest = step_checkpoints(target / "checkpoints")
                newest_step = int(newest[-1].name[5:-3]) if newest else None
                if newest_step is None or step >= newest_step:  # the newest point of the run: continue in place
                    return _in_place(cfg, target, lock, path, ckpt, log)
            except BaseException:
                lock.release()
                raise
            lock.release()
            why = (f"{path} is step {step} of run {target}, whose newest checkpoint is step {newest_step}: a "
                   f"roll-back starts a new run folder so that both histories stay whole")
        else:
            why = f"{path} is not a checkpoint of run {target} (run id {src_id}), which is left untouched"
    else:
        why = None
    plan = RunPlan("branch", target, new_run_id(), parent=_parent(ckpt, path, src_id, "resume"), ckpt_path=path,
                   ckpt=ckpt)
    if why:
        plan.notes.append(f"--resume {path}: {why}")
    return plan
