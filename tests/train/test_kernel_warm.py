"""The Trainer's warm start of our Triton kernels (``Trainer._warm_kernels``, CUDA only in a run): the step it hands
to ``kernels.warm_compile`` is one forward and backward of the run's first batch that leaves every parameter's
``.grad`` and every weight as they were, and a failure there is one line, never the run's end."""

from __future__ import annotations

import torch

import kernels
from tests.utils import tiny_trainer


def test_the_warm_step_runs_forward_and_backward_and_touches_no_gradient(toy_bundle, tmp_path, monkeypatch):
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=1, max_steps=1)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    seen = {}

    class Handle:
        def wait(self):
            return {"kernels": 0, "failed": 0, "errors": [], "compile_seconds": 0.0, "seconds": 0.0}

    def fake_warm_compile(step):
        calls = []
        real = torch.autograd.grad

        def counting_grad(*a, **k):
            out = real(*a, **k)
            calls.append(sum(g is not None for g in out))
            return out

        monkeypatch.setattr(torch.autograd, "grad", counting_grad)
        step()
        seen["grads"] = calls
        return Handle()

    monkeypatch.setattr(kernels, "warm_compile", fake_warm_compile)
    assert isinstance(tr._warm_kernels(), Handle)
    assert seen["grads"] and seen["grads"][0] > 0  # a backward ran: gradients of the parameters came back
    for n, p in tr.model.named_parameters():
        assert p.grad is None, n  # ...and none was left on a parameter (the first real step starts clean)
        assert torch.equal(p.detach(), before[n]), n
    tr.close()


def test_a_failed_warm_start_is_one_line(toy_bundle, tmp_path, monkeypatch):
    lines = []
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=1, max_steps=1, log=lines.append)

    def broken(step):
        raise RuntimeError("no\nworkers")

    monkeypatch.setattr(kernels, "warm_compile", broken)
    assert tr._warm_kernels() is None
    assert len(lines) >= 1 and lines[-1].startswith("kernels: no warm compile (RuntimeError: no workers)")
    tr.close()
