"""Honest resumes: every config field is compared with the checkpoint's, and each change is either applied
for real or refused.

Each field declares its class beside its type (``declare(default, SAFE | REPLAN | EPOCH | DERIVED | refused(why))``,
data/declare.py); ``classify`` reads it:

- **safe**: evaluation, logging, patience, wall limits, compilation, workers, ... — applied from the next
  step or evaluation on, and listed in the log and the ``resume`` record of ``metrics.jsonl``;
- **re-planned**: the optimizer's hyper-parameters (``optim.lr``, ``weight_decay``, ``betas``, ``eps``),
  the schedule's settings and the run's length (``run.epochs``, ``run.max_steps``,
  ``run.max_batches_per_epoch``, ``optim.accum_steps``): written into the optimizer's parameter groups and
  the schedule rebuilt for the new plan, continuing at the current step (``replan_scheduler``); the new
  lr and plan are logged and recorded. Batching settings join them at an epoch boundary;
- **refused**: what the weights, the optimizer state or the position depend on (the architecture, the
  optimizer kind, ``run.seed``, fp16 <-> another precision, ``eval.best_metric``, batching mid-epoch):
  ``ResumeConfigError`` names each field with its old and new value.

Data source fields (files, dataset, languages, split, vocabulary) are checked through the tokenizer's key,
which hashes the cleaned data, the split and the SentencePiece settings (``check_tokenizer``).

A field the checkpoint's config lacks is judged by the config format it was written in (data/declare.py: field
provenance): first ``complete_checkpoint_config`` takes a value the run's ``config.json`` records (a value recorded
anywhere in the run wins over a default; where both record one, the checkpoint's is the old value and the
config.json's, as the command's, the new one: judged by the rules above); then a field newer than the checkpoint's
format held its declared default: it is compared as that value, said in one line and recorded
(``ConfigChanges.defaulted``); a field that existed when the checkpoint was written and that no record holds is refused
in one line.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.errors import UserError


class ResumeConfigError(UserError):
    """A resume asked for a change that cannot be applied to the checkpoint's run."""


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, default=str, sort_keys=True) == json.dumps(b, default=str, sort_keys=True)


def _info(name: str):
    from train.config import Config
    from train.fields import field_infos

    return field_infos(Config).get(name)


def classify(name: str, old: Any, new: Any, *, epoch_boundary: bool) -> str:
    """"safe", "replan" or "refuse" for a change of field ``name`` (``section.field``) from ``old`` to ``new``: its
    declared resume class (data/declare.py). A name no field has is refused."""
    info = _info(name)
    if info is None or info.resume is None:
        return "refuse"
    return info.resume.classify(old, new, epoch_boundary=epoch_boundary)


@dataclass
class ConfigChanges:
    """The fields that differ between a checkpoint's config and this run's: ``{name: (old, new)}`` each."""

    safe: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    replan: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    refused: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # fields the checkpoint's config lacks (an older fastmt): {name: the declared default taken for it}
    defaulted: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """JSON-ready: ``{"applied": {name: [old, new]}, "replanned": {...}}`` (+ ``"defaulted": {name: value}``)."""
        out = {"applied": {k: list(v) for k, v in self.safe.items()},
               "replanned": {k: list(v) for k, v in self.replan.items()}}
        if self.defaulted:
            out["defaulted"] = dict(self.defaulted)
        return out


def compare_configs(saved: dict[str, Any], now: dict[str, Any], *, epoch_boundary: bool,
                    only: set[str] | None = None) -> ConfigChanges:
    """Every field of ``now`` (``Config.to_dict()``) against ``saved`` (the checkpoint's), sorted into
    ``ConfigChanges``. Fields declared ``DERIVED`` are skipped; ``only``: compare these sections only. A field
    the checkpoint does not know (written by an older fastmt) held its declared default (``changes.defaulted``),
    so adding a field never strands a run."""
    from train.config import Config
    from train.fields import json_value, missing_default, record_format

    try:
        version = record_format(Config, saved, "the checkpoint's config")
    except ValueError as e:
        raise ResumeConfigError(str(e)) from None
    changes = ConfigChanges()
    for section, fields in now.items():
        if only is not None and section not in only:
            continue
        old_section = saved.get(section) or {}
        for key, new in fields.items():
            name = f"{section}.{key}"
            info = _info(name)
            if info is not None and info.resume is not None and info.resume.kind == "derived":
                continue
            if key in old_section:
                old = old_section[key]
            elif info is not None and info.since > version:  # newer than the checkpoint: what that fastmt did
                old = changes.defaulted[name] = json_value(missing_default(Config, name))
            else:  # (complete_checkpoint_config took what the run recorded; nothing did)
                raise ResumeConfigError(f"the checkpoint's config (config format {version}) lacks {name}, which that "
                                        f"format always records: a damaged or hand-edited checkpoint, not taken as a "
                                        f"default")
            if _same(old, new):
                continue
            kind = classify(name, old, new, epoch_boundary=epoch_boundary)
            getattr(changes, {"safe": "safe", "replan": "replan", "refuse": "refused"}[kind])[name] = (old, new)
    return changes


def complete_checkpoint_config(ckpt: dict[str, Any], ckpt_path: str | Path, *, only: Iterable[str] | None = None,
                               fill_new: bool = False, log=None) -> dict[str, Any]:
    """The checkpoint's config with each field it lacks taken by its provenance (``train.fields.provenance``): from
    its run's ``config.json`` when that records it; else, a field newer than the checkpoint, its declared default
    (``fill_new``; else left for `compare_configs`, which records it); else ``ResumeConfigError``, one line naming the
    file, the fields and the fix. ``only``: these sections only (a fine-tune reads the model's)."""
    from train.config import Config
    from train.fields import provenance
    from train.runs.records import run_config_json, run_folder_of

    run = run_folder_of(ckpt_path)
    others = run_config_json(run)
    fix = (f"add the run's values to {others[0][0]}, which fastmt reads for what a checkpoint lacks" if others else
           "keep the checkpoint in its run folder (<run>/checkpoints/) beside the run's config.json that records them")
    try:
        return provenance(Config, ckpt["config"], f"checkpoint {ckpt_path}", others=others, only=only,
                          fill_new=fill_new, fix=fix, log=log)
    except ValueError as e:
        raise ResumeConfigError(" ".join(str(e).split())) from None


def refusal(changes: ConfigChanges, *, where: str, position: dict[str, Any], how: str) -> ResumeConfigError:
    """One line naming each refused field with its old and new value, why, and what to do instead."""
    parts = []
    for name, (old, new) in sorted(changes.refused.items()):
        info = _info(name)
        why = info.resume.why if info is not None and info.resume is not None else "no such field"
        if info is not None and info.resume is not None and info.resume.kind == "epoch":
            why = f"the checkpoint is mid-epoch (batch {position.get('batch_index')}): the position indexes this plan"
        parts.append(f"{name} {old!r} -> {new!r}" + (f" ({why})" if why else ""))
    return ResumeConfigError(f"{where}: cannot change " + "; ".join(parts) + f". {how}")


def apply_hyperparameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module, cfg) -> None:
    """Write ``cfg`` (an ``OptimConfig``)'s betas, eps and weight decay into the optimizer's parameter groups
    (``load_state_dict`` restored the saved ones); the decay group gets ``cfg.weight_decay``, the
    no-decay group keeps 0 (the groups of ``train.optim.build_optimizer``, in its order)."""
    from train.optim import param_groups

    groups = [g for g in param_groups(model, cfg.weight_decay) if g["params"]]
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(f"apply_hyperparameters: {len(optimizer.param_groups)} optimizer groups, "
                           f"{len(groups)} expected")
    for spec, group in zip(groups, optimizer.param_groups):
        group["weight_decay"] = spec["weight_decay"]
        if "betas" in group:
            group["betas"] = tuple(cfg.betas)
        if "eps" in group:
            group["eps"] = cfg.eps


def scheduler_position(step: int, total_steps: int) -> int:
    """The schedule's ``last_epoch`` after ``step`` optimizer steps of a ``total_steps`` plan: the loop steps
    the schedule after every optimizer step but the last (OneCycle has no value past its plan)."""
    return max(min(step, total_steps - 1), 0)


def saved_total_steps(ckpt: dict[str, Any]) -> int | None:
    """The run length a checkpoint's schedule was planned over (None: not recorded)."""
    return ckpt["position"].get("total_steps", ckpt["scheduler"].get("total_steps"))


def schedule_replanned(ckpt: dict[str, Any] | None, changes, total_steps: int, *, weights_only: bool) -> bool:
    """Whether a start plans its schedule afresh from the checkpoint's step (``replan_scheduler``) instead of
    loading the saved one: a resume whose schedule settings changed (``changes.replan``) or whose length did.
    Decided once, before anything is built, so that the schedule is built once."""
    if ckpt is None or weights_only:
        return False
    saved = saved_total_steps(ckpt)
    return bool(changes.replan) or (saved is not None and saved != total_steps)


def replan_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int, step: int):
    """A new schedule for ``cfg`` (an ``OptimConfig``) over ``total_steps``, positioned at ``step``: the lr
    is what the schedule would give there had the run been planned this way from its start (as nanoGPT's
    and Hugging Face Trainer's extended runs do). The optimizer's groups get that lr at once."""
    from train.optim import build_scheduler

    for group in optimizer.param_groups:  # the saved schedule's bookkeeping would win over cfg.lr
        group["lr"] = cfg.lr
        for key in ("initial_lr", "max_lr", "min_lr"):
            group.pop(key, None)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scheduler.last_epoch = scheduler_position(step, total_steps)
    with warnings.catch_warnings():  # get_lr outside step() warns; it is the closed form at last_epoch
        warnings.simplefilter("ignore")
        lrs = scheduler.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports
    return scheduler
