"""optim.ema_decay (train/ema.py): the weight average's arithmetic against a float64 reference, its use by
validation, best.pt, the test and translate, and its place in a checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.utils import tiny_trainer
from train.ema import WeightEMA, applied, ema_factor, inference_weights
from train.runs.checkpoint import load_checkpoint, step_checkpoints


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))


def test_average_matches_a_float64_reference():
    """ema_t = d_t ema_{t-1} + (1 - d_t) w_t, d_t = min(decay, (1 + t) / (10 + t)), from the initial weights."""
    model, decay = _model(), 0.9
    ref = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ema = WeightEMA(model, decay)
    g = torch.Generator().manual_seed(1)
    for t in range(25):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        ema.update(model)
        d = min(decay, (1 + t) / (10 + t))
        for n, p in model.named_parameters():
            ref[n] = d * ref[n] + (1 - d) * p.detach().double()
    assert ema_factor(decay, 0) == pytest.approx(0.1) and ema_factor(decay, 1000) == decay
    for n, v in ema.weights().items():
        torch.testing.assert_close(v.double(), ref[n], rtol=1e-6, atol=1e-6)
    assert ema.updates == 25


def test_applied_swaps_the_average_in_and_restores_the_weights_exactly():
    model = _model()
    ema = WeightEMA(model, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with applied(ema, model):
        for n, p in model.named_parameters():
            assert torch.equal(p, ema.weights()[n]) and not torch.equal(p, trained[n])
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n])
    with applied(None, model):  # no average: nothing changes
        assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    assert not any(torch.equal(before[n], trained[n]) for n in before)


def test_state_round_trip_and_inference_weights():
    model = _model()
    ema = WeightEMA(model, 0.99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    other = WeightEMA(_model(), 0.99)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and all(torch.equal(a, b) for a, b in zip(other.shadow, ema.shadow))
    ckpt = {"model": model.state_dict(), "ema": ema.state_dict()}
    w = inference_weights(ckpt)
    assert all(torch.equal(w[n], ema.weights()[n]) for n in ema.names)
    assert inference_weights({"model": model.state_dict()}).keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"updates": 1, "weights": {}})
    with pytest.raises(ValueError, match="ema_decay"):
        WeightEMA(model, 1.0)


def test_a_forged_average_is_refused_before_any_weight_is_used():
    """A weight average that does not fit the model (another shape, a name it lacks, not a float tensor, not a
    dict) is refused in one line naming the weight, not a size-mismatch traceback at load_state_dict."""
    model = _model()
    good = WeightEMA(model, 0.99).state_dict()
    name, first = next(iter(good["weights"].items()))
    for forged, says in (({name: torch.zeros(3, 1)}, f"{name!r} as torch.float32 (3, 1)"),
                         ({"nope.weight": first}, "'nope.weight'"),
                         ({name: first.long()}, "torch.int64"),
                         ({name: [1.0]}, "as a list")):
        with pytest.raises(ValueError, match="damaged or forged") as e:
            inference_weights({"model": model.state_dict(), "ema": {"updates": 1, "weights": forged}})
        assert says in str(e.value), e.value
    with pytest.raises(ValueError, match="'ema' entry"):
        inference_weights({"model": model.state_dict(), "ema": [1, 2]})
    assert inference_weights({"model": model.state_dict(), "ema": None}).keys() == model.state_dict().keys()


def test_config_declares_the_switch_off_by_default():
    from train.config import OptimConfig

    assert OptimConfig().ema_decay == 0.0
    with pytest.raises(ValueError, match="ema_decay"):
        OptimConfig(ema_decay=1.0)


def test_trainer_keeps_the_average_in_checkpoints_and_translates_with_it(toy_bundle, tmp_path):
    """With optim.ema_decay on, every step updates the average, the checkpoint keeps the training weights as
    ``model`` (the resume) and the average as ``ema``, and loading for inference takes the average."""
    from train.evaluation.load import load_for_inference

    tr = tiny_trainer(toy_bundle, tmp_path, optim={"ema_decay": 0.9}, epochs=1, max_steps=4)
    tr.fit()
    assert tr.ema is not None and tr.ema.updates == tr.step == 4
    ckpt = load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    assert ckpt["ema"]["updates"] == 4
    for n, p in tr.model.named_parameters():
        assert torch.equal(ckpt["model"][n], p.detach())  # the training weights, for the resume
    model, _, _ = load_for_inference(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    got = dict(model.named_parameters())
    differs = 0
    for n, v in ckpt["ema"]["weights"].items():
        torch.testing.assert_close(got[n].detach().float(), v)
        differs += not torch.equal(v, ckpt["model"][n].float())
    assert differs > 0
    off = tiny_trainer(toy_bundle, tmp_path / "off", epochs=1, max_steps=2)
    off.fit()
    assert off.ema is None and "ema" not in load_checkpoint(step_checkpoints(off.run_dir / "checkpoints")[-1])
