"""The Trainer's start: what a run continues and what it continues *from* (``RunSetup``, a mixin of
``train.loop.Trainer``).

A run is continued from what it recorded. When a run resumes (``--resume auto`` / ``PATH``, in place or as a
branch) its checkpoint decides:

- **the tokenizer**: the SentencePiece model embedded in the checkpoint, never one rebuilt from the current
  data (a fine-tune's tokenizer came from another run; a retrained model could differ in its bytes);
- **a model field whose default changed** (``model.ffn_norm``), when the command leaves it at the new default:
  the checkpoint's value (``keep_changed_defaults``), so a run trained before the change continues as it was;
- **the data source**, when the command names none (no data files, no ``$FASTMT_DATA_FILES``, the default
  Hub dataset): the data files / dataset the run recorded in its config (``inherit_source``);
- **that the data is the same**: the checkpoint records the cleaned corpus' fingerprint and split digest
  (``data_record``), compared with what the data settings give now (``check_same_data``);
- **the rank count**: the schedule and the data order were planned for the checkpoint's number of DDP ranks;
  another count is refused in one line naming both (``check_world_size``).

Then the config changes are sorted (train/runs/resume.py), and only once all of that passed is the run folder
claimed or locked and written (``_open_run_folder``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from train.config import Config
from train.distributed import broadcast_object
from train.errors import UserError
from train.runs.checkpoint import load_checkpoint
from train.runs.folder import (
    claim_run_folder,
    cut_metrics,
    remove_stale_temp_files,
    write_marker,
    write_text_atomic,
)
from train.runs.metrics import MetricsLogger
from train.runs.plan import RunPlan, plan_run
from train.runs.resume import (
    ConfigChanges,
    ResumeConfigError,
    compare_configs,
    complete_checkpoint_config,
    refusal,
)

# the fields that say where a run's data comes from (a resume that names no data takes the run's own)
SOURCE_FIELDS = ("dataset", "dataset_config", "hf_split", "data_files", "toy_rows", "src_lang", "tgt_lang",
                 "valid_files", "test_files")
# the SentencePiece settings: a checkpoint's tokenizer was made with its run's values
TOKENIZER_FIELDS = ("vocab_size", "spm_model", "character_coverage", "spm_sample_pairs")


class DataMismatchError(UserError, ValueError):
    """A resume whose data settings give another corpus or split than the checkpoint's run trained on."""


def names_no_data(d) -> bool:
    """The command named no data: no files (nor ``$FASTMT_DATA_FILES``) and the default Hub dataset."""
    from data.config import DataConfig

    default = DataConfig()
    return (not d.resolved_data_files() and not d.is_toy()
            and (d.dataset, d.dataset_config, d.hf_split) == (default.dataset, default.dataset_config, default.hf_split))


def inherit_source(cfg: Config, saved: dict[str, Any], *, source: bool, tokenizer: bool, log) -> Config:
    """``cfg`` with (``source``) the checkpoint run's data source when ``cfg`` names no data, and
    (``tokenizer``: the checkpoint's tokenizer is used) its SentencePiece settings, so that config.json records
    the settings that made the tokenizer (a ``--data.vocab_size`` beside ``--init-from`` changes nothing)."""
    saved_data = saved.get("data") or {}
    changes: dict[str, Any] = {}
    if source and names_no_data(cfg.data):
        changes.update({k: saved_data[k] for k in SOURCE_FIELDS if k in saved_data})
    if tokenizer:
        changes.update({k: saved_data[k] for k in TOKENIZER_FIELDS if k in saved_data})
    differ = {k: v for k, v in changes.items() if json.dumps(getattr(cfg.data, k), default=str)
              != json.dumps(list(v) if isinstance(v, tuple) else v, default=str)}
    if not differ:
        return cfg
    shown = ", ".join(f"data.{k}={differ[k]!r}" for k in sorted(differ))
    log(f"using the checkpoint's own {shown} (what made its tokenizer, or its run's data source; config.json "
        f"records them)")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **differ))


def keep_changed_defaults(cfg: Config, saved: dict[str, Any], log) -> Config:
    """``cfg`` with the checkpoint's value of each model field whose default changed (declared with ``was=``:
    ``model.ffn_norm`` was on by default) when the checkpoint holds the old default and ``cfg`` the new one: a run
    trained before the change resumes, or is fine-tuned, with the architecture its weights have (its config.json
    says so; a command that leaves the field alone gets it too)."""
    from data.declare import declaration
    from models.config import ModelConfig

    fields = dataclasses.fields(ModelConfig)
    defaults = {f.name: f.default for f in fields}
    changed = {f.name: declaration(f).was[0] for f in fields if declaration(f) and declaration(f).was}
    saved_model = saved.get("model") or {}
    kept = {k: old for k, old in changed.items()
            if saved_model.get(k) == old and getattr(cfg.model, k) == defaults[k] != old}
    if not kept:
        return cfg
    log(f"using the checkpoint's own {', '.join(f'model.{k}={v!r}' for k, v in kept.items())} (its weights have it; "
        f"the default for new runs is now {', '.join(f'{k}={defaults[k]!r}' for k in kept)})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **kept))


def defaulted_line(defaulted: dict[str, Any]) -> str:
    """The one line that says which fields a checkpoint lacked and the declared defaults taken for them."""
    shown = ", ".join(f"{k}={v!r}" for k, v in sorted(defaulted.items()))
    return (f"the checkpoint was written by an earlier fastmt and lacks {shown}: taken as declared (the defaults, "
            f"what that fastmt did); recorded in metrics.jsonl")


def files_as_recorded(cfg: Config, log) -> Config:
    """``cfg`` with ``$FASTMT_DATA_FILES``'s paths written into ``data.data_files`` (when they are what it trains
    on), so that the run's config.json names them and its printed next commands work without the variable."""
    d = cfg.data
    if d.data_files or not d.files_from_env():
        return cfg
    files = d.resolved_data_files()
    log(f"data files from $FASTMT_DATA_FILES: {', '.join(files)} (recorded as data.data_files in config.json)")
    return dataclasses.replace(cfg, data=dataclasses.replace(d, data_files=tuple(files)))


def data_record(split_record: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a checkpoint keeps of its data: the cleaned corpus' fingerprint and the split's digest."""
    if not split_record or "fingerprint" not in split_record:
        return None
    return {"fingerprint": split_record["fingerprint"], "split_digest": split_record.get("split_digest"),
            "source": split_record.get("source")}


def check_same_data(ckpt: dict[str, Any], split_record: dict[str, Any] | None, path) -> None:
    """The data now is the data the checkpoint's run trained on (its recorded fingerprint and split)."""
    saved, now = ckpt.get("data") or {}, data_record(split_record) or {}
    keys = ("fingerprint", "split_digest")
    if not saved or not now or all(saved.get(k) == now.get(k) for k in keys):
        return
    what = "corpus" if saved.get("fingerprint") != now.get("fingerprint") else "train/valid/test split"
    raise DataMismatchError(
        f"data mismatch: checkpoint {path} was trained on {saved.get('source')} (fingerprint "
        f"{saved.get('fingerprint')}), but the current data settings give another {what} ({now.get('source')}, "
        f"fingerprint {now.get('fingerprint')}). Resume with the run's own data (drop the data flags: a resume "
        f"that names no data takes its config's), or start a new run from its weights: --init-from {path}")


def uses_own_tokenizer(ckpt: dict[str, Any], *, weights_only: bool) -> bool:
    """Whether a run continued from ``ckpt`` encodes with the checkpoint's tokenizer: always for a fine-tune's
    start and for a checkpoint that records its data (compared by ``check_same_data``); an older fastmt's
    checkpoint only when its run was a fine-tune (its tokenizer cannot be rebuilt from the data), else the
    tokenizer is rebuilt and its key compared (``check_tokenizer``)."""
    parent = ((ckpt.get("lineage") or {}).get("parent") or {})
    return weights_only or bool(ckpt.get("data")) or parent.get("how") == "init-from"


def check_world_size(ckpt: dict[str, Any], world_size: int, path) -> None:
    """The checkpoint's run was planned for its number of DDP ranks: another count is refused (the schedule's
    step count, the lr at this step and the data order all depend on the global batch)."""
    saved = ckpt["position"].get("world_size")
    if saved is None or saved == world_size:
        return
    raise ResumeConfigError(
        f"resuming from {path}: the checkpoint was written by a run of {saved} rank{'s' * (saved != 1)}, this run "
        f"has {world_size}: its schedule, lr and data order were planned for {saved}. Resume with {saved} "
        f"rank{'s' * (saved != 1)} (torchrun --nproc_per_node {saved}"
        + (" or a plain `python -m train`" if saved == 1 else "")
        + f"), or start a new run from its weights with a fresh schedule: --init-from {path}")


class RunSetup:
    """Planning, the checks against the checkpoint, and the first writes of a run (see the module docstring)."""

    def _plan(self, cfg: Config, resume, init_from) -> RunPlan:
        """Rank 0 plans (train/runs/plan.py); under DDP the other ranks follow its decision."""
        if self.is_main:
            plan = plan_run(cfg, resume=resume, init_from=init_from, log=self.log)
            if self.dist.distributed:
                broadcast_object({"mode": plan.mode, "run_id": plan.run_id, "ckpt_path": plan.ckpt_path,
                                  "weights_only": plan.weights_only})
            return plan
        d = broadcast_object(None)
        ckpt = load_checkpoint(d["ckpt_path"]) if d["ckpt_path"] is not None else None
        return RunPlan(d["mode"], self.run_dir, d["run_id"], ckpt_path=d["ckpt_path"], ckpt=ckpt,
                       weights_only=d["weights_only"])

    def _continued_config(self, cfg: Config, plan: RunPlan) -> tuple[Config, bool]:
        """``cfg`` with what the checkpoint decides (module docstring), and whether its tokenizer is used: a
        resume uses it when the checkpoint records its data (else, an older fastmt's checkpoint, the tokenizer
        is rebuilt and its key compared), a fine-tune (``--init-from``) always."""
        cfg = files_as_recorded(cfg, self.log)
        ckpt = plan.ckpt
        if ckpt is None:
            return cfg, False
        own = uses_own_tokenizer(ckpt, weights_only=plan.weights_only)
        # each field the checkpoint lacks by its provenance: what its run's config.json records, else refused unless
        # newer than the checkpoint (then compare_configs takes its default and records it); train/runs/resume.py
        ckpt["config"] = complete_checkpoint_config(ckpt, plan.ckpt_path, only={"model"} if plan.weights_only else None,
                                                    log=self.log)
        saved = ckpt.get("config") or {}
        if not plan.weights_only:
            check_world_size(ckpt, self.dist.world_size, plan.ckpt_path)
        cfg = keep_changed_defaults(cfg, saved, self.log)
        return inherit_source(cfg, saved, source=not plan.weights_only, tokenizer=own, log=self.log), own

    def _check_changes(self, cfg: Config, plan: RunPlan) -> ConfigChanges | None:
        """Every config field against the checkpoint's; refuses what cannot be applied (train/runs/resume.py)."""
        ckpt = plan.ckpt
        if ckpt is None:
            return None
        pos = ckpt["position"]
        if plan.weights_only:
            arch = compare_configs(ckpt["config"], cfg.to_dict(), epoch_boundary=True, only={"model"})
            if arch.defaulted:
                self.log(defaulted_line(arch.defaulted))
                self.defaulted = arch.defaulted  # recorded with the run's "init" record
            if arch.refused:
                raise refusal(arch, where=f"--init-from {plan.ckpt_path}", position=pos,
                              how="Its weights need the checkpoint's model: use its run's preset and model.* settings")
            return None
        changes = compare_configs(ckpt["config"], cfg.to_dict(), epoch_boundary=pos.get("batch_index", 0) == 0)
        if changes.refused:
            if any(k.startswith("model.") for k in changes.refused):  # the weights need the checkpoint's model
                how = ("Drop these flags (the run's settings are in its config.json); another architecture is a new "
                       "run trained from scratch (without --resume)")
            else:
                how = ("Drop these flags (the run's settings are in its config.json), or start a new run from its "
                       f"weights with a fresh optimizer: --init-from {plan.ckpt_path}")
            raise refusal(changes, where=f"resuming from {plan.ckpt_path}", position=pos, how=how)
        return changes

    def _open_run_folder(self, plan: RunPlan, changes: ConfigChanges | None, schedule: dict | None) -> None:
        """The first write of this run: claim a new folder (or mark, cut and clean the existing one), then
        config.json, the metrics file and the records of where this run came from."""
        asked = self.run_dir
        if plan.new_folder:
            self.run_dir, self.lock = claim_run_folder(asked.parent, asked.name, self.run_id, parent=self.parent)
            self._created = True
        else:
            if plan.adopt:
                write_marker(self.run_dir, self.run_id, adopted=True)
            pos = plan.ckpt["position"] if plan.ckpt is not None and not plan.weights_only else {"epoch": 0, "step": 0}
            cut_metrics(self.run_dir / "metrics.jsonl", keep=pos, log=self.log)
            remove_stale_temp_files(self.run_dir / "checkpoints", self.log)
            remove_stale_temp_files(self.run_dir, self.log)
        for note in plan.notes:
            self.log(note)
        if plan.mode == "fresh" and self.run_dir != asked:
            self.log(f"{asked} holds an earlier run, so this run is {self.run_dir} (nothing was moved; to continue "
                     f"{asked.name} instead: --resume auto --run.name {asked.name})")
        elif plan.mode in ("branch", "init"):
            p = self.parent
            self.log(f"{'initialised from' if plan.mode == 'init' else 'continuing from'} {p['checkpoint']} (run "
                     f"{p['run_id']}, step {p['step']}) in the new run folder {self.run_dir}")
        run = dataclasses.replace(self.cfg.run, name=self.run_dir.name)
        self.cfg = dataclasses.replace(self.cfg, run=run)
        # the resolved config, as --print-config prints it: a valid --config input
        write_text_atomic(self.run_dir / "config.json", json.dumps(self.cfg.record(), indent=2, default=str) + "\n")
        self.metrics = MetricsLogger(self.run_dir, tensorboard=run.tensorboard, enabled=True)
        if plan.ckpt is None:
            return
        pos = plan.ckpt["position"]
        origin = {"checkpoint": str(plan.ckpt_path), "step": pos["step"], "epoch": pos["epoch"]}
        if plan.mode in ("branch", "init"):
            defaulted = getattr(self, "defaulted", None) if plan.mode == "init" else None
            self.metrics.log({"kind": plan.mode, **origin, "parent": self.parent,
                              **({"defaulted": defaulted} if defaulted else {})})
        if plan.mode == "branch":  # the lineage's epochs so far, so the curves show the whole run
            for rec in plan.ckpt.get("history", []):
                self.metrics.log({**rec, "inherited_from": self.parent["run_id"]})
        if changes is not None and plan.mode != "init":
            self.metrics.log({"kind": "resume", "mode": plan.mode, **origin, **changes.record(),
                              "schedule": schedule})
            self._log_changes(plan, changes, schedule)

    def _log_changes(self, plan: RunPlan, changes: ConfigChanges, schedule: dict | None) -> None:
        from train.runs.report import where_stopped

        pos = plan.ckpt["position"]
        self.log(f"resumed from {plan.ckpt_path}: {where_stopped(pos)}")
        show = lambda d: ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(d.items()))  # noqa: E731
        if changes.defaulted:
            self.log(defaulted_line(changes.defaulted))
        if changes.safe:
            self.log(f"resume: applied (checkpoint -> now): {show(changes.safe)}")
        if schedule is not None:
            self.log(f"resume: re-planned {show(changes.replan) or 'the schedule'}: {schedule['total_steps']} steps "
                     f"in all (was {schedule['previous_total_steps']}), lr {schedule['lr']:.3g} at step {self.step}")
            if self.step >= self.total_steps or self.epoch >= self.cfg.run.epochs:
                self.log(f"resume: this plan ends at or before the checkpoint (step {self.step}, epoch {self.epoch}): "
                         f"the run ends now, with its final evaluation")

