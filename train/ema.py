"""Weight EMA (``optim.ema_decay``): an exponential moving average of the weights, updated after every optimizer
step and used for validation, best.pt and the test (and by ``translate`` through the checkpoint's ``ema``
entry), as eole's ``average_decay`` and Marian's ``exponential-smoothing`` do.

After update t (0-based): ``ema = d_t * ema + (1 - d_t) * w`` with ``d_t = min(decay, (1 + t) / (10 + t))``, the
warm-up Marian and OpenNMT use so the first averages are not dominated by the random initialisation. The average
is kept in fp32 whatever the weights' dtype, one tensor per floating parameter (buffers are not averaged); the
training weights are untouched (a checkpoint keeps them as ``model`` for the resume, the average as ``ema``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def ema_factor(decay: float, t: int) -> float:
    """The weight kept of the previous average at update ``t`` (0-based)."""
    return min(decay, (1.0 + t) / (10.0 + t))


class WeightEMA:
    """The average of ``model``'s floating parameters (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay={decay} must be in (0, 1) (0 turns the average off)")
        self.decay, self.updates = decay, 0
        self.names = [n for n, p in model.named_parameters() if p.is_floating_point()]
        params = dict(model.named_parameters())
        self.shadow = [params[n].detach().float().clone() for n in self.names]

    def _params(self, model: torch.nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        return [params[n] for n in self.names]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """One step of the average towards ``model``'s current weights (no host sync)."""
        w = 1.0 - ema_factor(self.decay, self.updates)
        params = [p.detach().float() for p in self._params(model)]
        torch._foreach_lerp_(self.shadow, params, w)
        self.updates += 1

    def weights(self) -> dict[str, torch.Tensor]:
        """name -> averaged tensor (fp32), the parameters' names."""
        return dict(zip(self.names, self.shadow))

    @contextmanager
    @torch.no_grad()
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """``model`` holds the averaged weights inside the block, its own again after it."""
        params = self._params(model)
        saved = [p.detach().clone() for p in params]
        for p, s in zip(params, self.shadow):
            p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            for p, s in zip(params, saved):
                p.copy_(s)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "weights": {k: v.clone() for k, v in self.weights().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state["weights"]
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise ValueError(f"the checkpoint's weight average lacks {missing[:3]}: not this model's")
        for s, n in zip(self.shadow, self.names):
            s.copy_(weights[n].to(s.device, torch.float32))
        self.updates = int(state["updates"])


def inference_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint translates with: the training weights with the average over them when the run
    kept one (``optim.ema_decay``). An average that does not fit the weights (a name the model lacks, another
    shape, not a float tensor: a damaged or forged file) is refused (``ValueError``, one line) before any is used."""
    model = dict(ckpt["model"])
    ema = ckpt.get("ema")
    if ema is None or (isinstance(ema, dict) and ema.get("weights") is None):
        return model
    if not (isinstance(ema, dict) and isinstance(ema.get("weights"), dict)):
        raise ValueError("its 'ema' entry is not the weight average fastmt writes: a damaged or forged checkpoint")
    for k, w in ema["weights"].items():
        v = model.get(k)
        if not (isinstance(w, torch.Tensor) and w.is_floating_point() and isinstance(v, torch.Tensor)
                and w.shape == v.shape):
            what = (f"a {type(w).__name__}" if not isinstance(w, torch.Tensor) else f"{w.dtype} {tuple(w.shape)}")
            want = "no such weight" if not isinstance(v, torch.Tensor) else f"the weight is {tuple(v.shape)}"
            raise ValueError(f"its weight average holds {k!r} as {what} ({want}): a damaged or forged checkpoint; "
                             f"translate another checkpoint of the run")
    # a tied weight is one parameter under two state-dict names (the embedding and the output projection): the
    # average is kept under the first, and every name whose tensor starts where that one does takes it too
    at = {(model[k].data_ptr(), tuple(model[k].shape)): k for k in ema["weights"] if k in model}
    for k, v in list(model.items()):
        src = k if k in ema["weights"] else at.get((v.data_ptr(), tuple(v.shape))) if v.numel() else None
        if src is not None:
            model[k] = ema["weights"][src].to(v.dtype)
    return model


# -- The Trainer's hooks (train/loop.py, train/epoch_end.py): one line each there --------------------------------
def after_step(ema: WeightEMA | None, model: torch.nn.Module, decay: float) -> WeightEMA | None:
    """The average after an optimizer step: started from the current weights at the first step of a run (or of
    a resume whose checkpoint kept none), updated after every step; None when ``decay`` is 0."""
    if not decay:
        return None
    if ema is None:
        ema = WeightEMA(model, decay)
    ema.decay = decay
    ema.update(model)
    return ema


def from_checkpoint(ckpt: dict[str, Any], model: torch.nn.Module, decay: float) -> WeightEMA | None:
    """The average a checkpoint kept (None: it kept none, or the average is off now; the next step starts one)."""
    if not decay or not isinstance(ckpt.get("ema"), dict):
        return None
    ema = WeightEMA(model, decay)
    ema.load_state_dict(ckpt["ema"])
    return ema


def applied(ema: WeightEMA | None, model: torch.nn.Module):
    """``ema.applied(model)``, or nothing when there is no average."""
    from contextlib import nullcontext

    return nullcontext() if ema is None else ema.applied(model)
