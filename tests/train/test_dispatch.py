"""Every component chosen by name outside the model (optimizer, schedule, batching mode, split grouping, overlong
policy) has one registry whose names are the config's declared choices, and a name without an implementation is a
ValueError naming it and the choices: never a fallback (a schedule added to the choices without a branch used to train
at a constant rate)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.batching import PLANNERS, BatchSpec, plan_batches
from data.split import group_keys
from train.config import Config, OptimConfig
from train.fields import field_infos
from train.optim import OPTIMIZERS, SCHEDULES, build_optimizer, build_scheduler

CHOICES = {k: v.choices for k, v in field_infos(Config).items()}


@pytest.mark.parametrize("field, registry", [("optim.name", OPTIMIZERS), ("optim.schedule", SCHEDULES),
                                             ("data.batching", PLANNERS)])
def test_registry_names_are_the_declared_choices(field, registry):
    assert CHOICES[field] and set(registry) == set(CHOICES[field])


def _bypassed(cfg, **bad):
    """``cfg`` with ``bad`` set past its validation (as a caller that skips the config would)."""
    for k, v in bad.items():
        object.__setattr__(cfg, k, v)
    return cfg


def test_unknown_schedule_raises():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=rf"optim\.schedule='nope' is not one of {re.escape(repr(tuple(SCHEDULES)))}"):
        build_scheduler(opt, _bypassed(OptimConfig(), schedule="nope"), 100)
    for name in SCHEDULES:  # every registered one builds, short runs included
        for total in (1, 2, 100):
            build_scheduler(opt, OptimConfig(schedule=name, warmup_steps=10), total)


def test_unknown_optimizer_raises():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"optim\.name='sgd' is not one of \('lion', 'adamw', 'adam'\)"):
        build_optimizer(model, _bypassed(OptimConfig(), name="sgd"), torch.device("cpu"))
    kinds = {name: type(build_optimizer(torch.nn.Linear(3, 2), OptimConfig(name=name), torch.device("cpu"))[0]).__name__
             for name in OPTIMIZERS}
    assert kinds == {"lion": "Lion", "adamw": "AdamW", "adam": "Adam"}


def test_unknown_batching_mode_raises():
    lengths = np.array([3, 4, 5, 6])
    spec = _bypassed(BatchSpec("fixed", batch_size=2), mode="bucketed")
    with pytest.raises(ValueError, match=r"batching mode 'bucketed' has no planner; choose one of \('fixed'"):
        plan_batches(lengths, lengths, spec)
    with pytest.raises(ValueError, match=r"batching mode 'bucketed'; choose one of"):
        BatchSpec("bucketed")


def test_unknown_split_grouping_raises():
    h = np.array([1, 2, 2], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"split_grouping='target' is not one of \('source_target', 'source'\)"):
        group_keys(h, h, "target")
    for grouping in CHOICES["data.split_grouping"]:
        assert group_keys(h, h, grouping).tolist() == [1, 2, 2]


def test_unknown_overlong_policy_never_truncates(toy_bundle):
    """Any overlong value but "truncate" refuses over-long pairs (the safe side), as "error" does."""
    from data.pipeline import DataBundle

    short = dataclasses.replace(toy_bundle.cfg, seq_len=4)
    logs = []
    for policy, refused in (("error", True), ("drop", True), ("truncate", False)):
        bundle = SimpleNamespace(splits=toy_bundle.splits, cfg=_bypassed(dataclasses.replace(short), overlong=policy),
                                 log=logs.append)
        bundle.spec = lambda b, bundle=bundle: DataBundle.spec(bundle, b)
        if refused:
            with pytest.raises(ValueError, match="longer than seq_len=4"):
                DataBundle.collator(bundle, "train", "fixed")
        else:
            DataBundle.collator(bundle, "train", "fixed")
            assert any("truncating" in line for line in logs)
