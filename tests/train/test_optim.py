"""No-decay groups, Lion on CPU, and the learning-rate schedules against their closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from train.config import OptimConfig
from train.optim import build_optimizer, build_scheduler, param_groups


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # tied: one parameter, no decay

    def forward(self, x):
        return self.out(self.norm(self.lin(self.emb(x))))


def test_param_groups_no_decay():
    groups = {g["group"]: g for g in param_groups(Toy(), 0.1)}
    assert groups["decay"]["names"] == ["lin.weight"]
    assert sorted(groups["no_decay"]["names"]) == ["emb.weight", "lin.bias", "norm.bias", "norm.weight"]
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0


def test_param_groups_transformer():
    from models import Transformer, get_preset

    model = Transformer(get_preset("tiny", vocab_size=50))
    groups = {g["group"]: g for g in param_groups(model, 0.1)}
    assert all(p.ndim >= 2 for p in groups["decay"]["params"])
    assert not any("embed" in n for n in groups["decay"]["names"])
    n_all = sum(1 for _ in model.parameters())
    assert len(groups["decay"]["params"]) + len(groups["no_decay"]["params"]) == n_all


@pytest.mark.parametrize("name", ["lion", "adamw", "adam"])
def test_optimizer_decay_only_matrices(name):
    """One step with zero gradients: only weight decay moves parameters, and only the decay group."""
    torch.manual_seed(0)
    model = Toy()
    opt, flat = build_optimizer(model, OptimConfig(name=name, lr=0.1, weight_decay=0.5), torch.device("cpu"))
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]  # one flat tensor per group
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    flat.gather_grads()
    opt.step()
    for n, p in model.named_parameters():
        if n == "lin.weight" and name != "adam":  # Adam's L2 decay only acts through the gradient
            assert not torch.equal(p, before[n]), n
        elif n != "lin.weight":
            assert torch.equal(p, before[n]), n


def _lrs(cfg, total, steps=None):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total)
    out = [sched.get_last_lr()[0]]
    for _ in range(steps or total - 1):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_onecycle_matches_seed_values():
    cfg = OptimConfig(lr=1e-4, pct_start=0.28, div_factor=100, final_div_factor=100, anneal="linear")
    lrs = _lrs(cfg, 100)  # warm-up ends at step pct_start * total - 1 = 27
    assert lrs[0] == pytest.approx(1e-6)  # start: 1e-4 / 100
    assert max(lrs) == pytest.approx(1e-4)
    assert lrs.index(max(lrs)) == 27  # peak after ~28 % of the steps
    assert lrs[-1] == pytest.approx(1e-8, rel=1e-3)  # end: 1e-6 / 100
    # linear warm-up: equal increments
    inc = [b - a for a, b in zip(lrs[:27], lrs[1:28])]
    assert max(inc) == pytest.approx(min(inc), rel=1e-6)


def test_onecycle_three_phase_and_cos():
    # phases end at steps pct * total - 1 = 24 (peak) and 2 * pct * total - 2 = 48 (back to the start)
    lrs = _lrs(OptimConfig(lr=1.0, pct_start=0.25, three_phase=True, div_factor=10, final_div_factor=10), 100)
    assert lrs[24] == pytest.approx(1.0) and lrs[48] == pytest.approx(0.1)
    assert lrs[99] == pytest.approx(0.01)
    cos = _lrs(OptimConfig(lr=1.0, pct_start=0.5, anneal="cos", div_factor=10), 10)  # warm-up ends at step 4
    assert cos[3] == pytest.approx(1.0 + (0.1 - 1.0) / 2 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-6)


def test_inverse_sqrt():
    lrs = _lrs(OptimConfig(lr=1.0, schedule="inverse_sqrt", warmup_steps=4), 12)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[15 - 4] == pytest.approx(math.sqrt(4 / 12))


def test_scheduler_total_steps_validated():
    with pytest.raises(ValueError, match="total_steps=0"):
        _lrs(OptimConfig(), 0)


@pytest.mark.parametrize("three_phase", [False, True])
def test_short_runs_never_break_the_schedule(three_phase):
    """OneCycle over a handful of steps (e.g. --max-steps 5 with 20 % warm-up: a zero-length phase that
    raised ZeroDivisionError): every lr is finite, positive and at most the peak; nothing raises."""
    for total in range(1, 12):
        lrs = _lrs(OptimConfig(lr=1.0, pct_start=0.2, three_phase=three_phase), total, steps=total - 1)
        assert all(0 < lr <= 1.0 for lr in lrs), (total, lrs)


def test_flat_params_gather_and_zero():
    """Gradients land in the group's flat buffer in parameter order, zeros for a parameter that got none (a
    stale value there would be applied), and zero_grad drops every parameter's own gradient."""
    from train.optim import FlatParams

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(2, 2))]
    flat = FlatParams([{"params": params}])
    flat.flat[0].grad.fill_(7.0)  # what a previous step left behind
    (params[0].sum() * 2 + params[2].square().sum()).backward()  # params[1] unused
    flat.gather_grads()
    want = torch.cat([torch.full((6,), 2.0), torch.zeros(4), (2 * params[2].detach()).reshape(-1)])
    torch.testing.assert_close(flat.grads()[0], want)
    assert params[0].data_ptr() == flat.flat[0].data_ptr()  # parameters are views of the buffer
    flat.zero_grad()
    assert all(p.grad is None for p in params)
    torch.testing.assert_close(flat.grads()[0], want)  # the flat gradient stays until the next gather
