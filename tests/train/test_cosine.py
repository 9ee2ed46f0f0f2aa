"""The cosine schedule with warm-up (``--optim.schedule cosine``, issue 38): its lr at every step of a run, as the
training loop steps it, and a resume that re-plans it continuing on the same curve."""

from __future__ import annotations

import math

import pytest
import torch

from train.config import OptimConfig
from train.optim import build_scheduler
from train.runs.resume import replan_scheduler


def _lrs(cfg: OptimConfig, total: int) -> list[float]:
    """The lr of each of ``total`` optimizer steps, the schedule stepped after every step but the last (the loop)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total)
    out = []
    for s in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if s < total - 1:
            sched.step()
    return out


@pytest.mark.parametrize("warmup, total", [(10, 100), (1, 7), (50, 20)])
def test_cosine_warms_up_linearly_then_decays_as_half_a_cosine(warmup, total):
    lr = 2e-3
    got = _lrs(OptimConfig(schedule="cosine", lr=lr, warmup_steps=warmup), total)
    w = min(warmup, total)  # a warm-up longer than the run is cut to it
    want = [lr * (s + 1) / w if s < w else lr * 0.5 * (1 + math.cos(math.pi * (s + 1 - w) / (total - w + 1)))
            for s in range(total)]
    assert got == pytest.approx(want, rel=1e-12)
    assert max(got) == pytest.approx(lr) and got.index(max(got)) == w - 1  # the peak ends the warm-up
    assert all(a > b for a, b in zip(got[w - 1:], got[w:]))  # then strictly down
    assert min(got) > 0  # no step at lr 0, first or last


def test_a_long_cosine_ends_near_zero_and_is_half_way_at_its_middle():
    got = _lrs(OptimConfig(schedule="cosine", lr=1.0, warmup_steps=100), 10_100)
    assert got[-1] < 1e-6 and got[100 + 5_000 - 1] == pytest.approx(0.5, abs=1e-3)


def test_a_resume_that_replans_the_cosine_continues_on_its_curve():
    cfg = OptimConfig(schedule="cosine", lr=1e-3, warmup_steps=5)
    whole = _lrs(cfg, 40)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = replan_scheduler(opt, cfg, 40, 17)  # a resume at step 17 of the same plan
    got = [opt.param_groups[0]["lr"]]
    for _ in range(40 - 17 - 1):
        opt.step()
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx(whole[17:], rel=1e-12)
