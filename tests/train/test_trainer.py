"""The Trainer on CPU: step-skip logic, accumulation equivalence, exact resume, error paths, end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.train.helpers import tiny_config
from train.checkpoint import load_checkpoint, step_checkpoints
from train.loop import NonFiniteLossError, Trainer


def _trainer(bundle, corpus, tmp_path, *, optim=None, model=None, **run):
    cfg = tiny_config(corpus, tmp_path, **run)
    if optim:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **optim))
    if model:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    return Trainer(cfg, data=bundle, log=lambda *a: None)


def _first_batches(trainer, n):
    it = iter(trainer.data.loader("train", epoch=0))
    return [next(it) for _ in range(n)]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _poison(trainer):
    """Make every loss infinite (as an fp16 overflow would)."""
    good = trainer.step_module
    trainer.step_module = lambda *args, **kwargs: good(*args, **kwargs) * float("inf")
    return good


def test_fp16_scaler_skip_happens_on_the_device(bundle, corpus, tmp_path):
    """An fp16 overflow: the GradScaler's flag skips the update on the device (no host sync), halves the
    scale and counts the skip; the schedule advances with every step taken or skipped."""
    # norm="torch": models' fused ResidualNorm rejects autocast's mixed dtypes (reported to models/)
    tr = _trainer(bundle, corpus, tmp_path, precision="fp16", model={"norm": "torch"})
    assert tr.scaler.is_enabled()
    b = _first_batches(tr, 2)
    before, lr_before, scale = _params(tr.model), tr.scheduler.get_last_lr()[0], tr.scaler.get_scale()
    good = _poison(tr)
    tr.train_step(b[0])
    assert (tr.step, tr.skipped_steps, tr.scheduler.last_epoch) == (1, 1, 1)
    assert tr.scaler.get_scale() == scale / 2  # the scaler backed off
    assert all(torch.equal(p, before[n]) for n, p in tr.model.named_parameters())
    assert all(p.grad is None for p in tr.model.parameters())  # gradients dropped (set to None)
    tr.step_module = good
    tr.train_step(b[1])
    assert (tr.step, tr.skipped_steps, tr.scheduler.last_epoch) == (2, 1, 2)
    assert tr.scheduler.get_last_lr()[0] > lr_before
    assert any(not torch.equal(p, before[n]) for n, p in tr.model.named_parameters())


def test_fp32_nonfinite_skips_then_stops_with_checkpoint(bundle, corpus, tmp_path):
    """Non-finite steps are skipped on the device; the run stops at the logging step that sees the limit."""
    tr = _trainer(bundle, corpus, tmp_path, max_nonfinite=3, log_every=3)
    before = _params(tr.model)
    _poison(tr)
    with pytest.raises(NonFiniteLossError, match="3 non-finite losses in a row"):
        tr.fit()
    assert (tr.step, tr.skipped_steps) == (3, 3)
    assert all(torch.equal(p, before[n]) for n, p in tr.model.named_parameters())
    ckpt = load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    assert ckpt["position"]["batch_index"] == 3 and ckpt["position"]["counters"]["skipped"] == 3


def test_unguarded_nonfinite_stops_without_saving_corrupted_weights(bundle, corpus, tmp_path):
    """With the per-step guard off (no host sync per step), a non-finite loss is found at the next
    read-back; those steps were applied, so nothing is saved for --resume auto to pick up."""
    tr = _trainer(bundle, corpus, tmp_path, nonfinite_guard=False, log_every=2)
    _poison(tr)
    with pytest.raises(NonFiniteLossError, match="nonfinite_guard off.*nothing was saved.*none yet"):
        tr.fit()
    assert tr.step == 2 and not step_checkpoints(tr.run_dir / "checkpoints")


def _merge(batches):
    """One Batch holding the rows of ``batches``, padded to the widest."""
    from data import Batch

    S = max(b.src.shape[1] for b in batches)
    T = max(b.tgt_in.shape[1] for b in batches)

    def cat(name, width):
        return torch.cat([torch.nn.functional.pad(getattr(b, name), (0, width - getattr(b, name).shape[1]))
                          for b in batches])

    src_len = torch.cat([b.src_lengths for b in batches])
    tgt_len = torch.cat([b.tgt_lengths for b in batches])
    zero = torch.zeros(1, dtype=torch.int32)
    return Batch(src=cat("src", S), tgt_in=cat("tgt_in", T), tgt_out=cat("tgt_out", T),
                 src_lengths=src_len, tgt_lengths=tgt_len,
                 cu_seqlens_src=torch.cat([zero, src_len.cumsum(0).int()]),
                 cu_seqlens_tgt=torch.cat([zero, tgt_len.cumsum(0).int()]),
                 index=torch.cat([b.index for b in batches]), max_src_len=int(src_len.max()),
                 max_tgt_len=int(tgt_len.max()), num_real_tokens=sum(b.num_real_tokens for b in batches),
                 num_target_tokens=sum(b.num_target_tokens for b in batches))


def test_accumulation_equals_one_big_batch(bundle, corpus, tmp_path):
    """k micro-batches of different sizes give the gradient (and the update) of their union."""
    grads, params = {}, {}
    for mode in ("accumulated", "merged"):
        tr = _trainer(bundle, corpus, tmp_path / mode, model={"dropout": 0.0}, optim={"grad_clip": None},
                      seed=3)
        micro = _first_batches(tr, 3)
        assert len({b.src.shape for b in micro}) > 1 or len({len(b) for b in micro}) > 1
        captured = {}
        step = tr.optimizer.step

        def capture_then_step(tr=tr, captured=captured, step=step):
            captured.update({n: p.grad.clone() for n, p in tr.model.named_parameters()})
            step()

        tr.optimizer.step = capture_then_step
        loss = tr.train_step(micro if mode == "accumulated" else [_merge(micro)])
        grads[mode], params[mode] = captured, _params(tr.model)
        params[mode]["loss"] = loss
    for n, g in grads["merged"].items():
        torch.testing.assert_close(grads["accumulated"][n], g, rtol=1e-4, atol=1e-6, msg=n)
    for n, p in params["merged"].items():
        torch.testing.assert_close(params["accumulated"][n], p, rtol=1e-4, atol=1e-5, msg=n)


class Recording(Trainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.losses = []

    def train_step(self, batches):
        loss = super().train_step(batches)
        self.losses.append(loss.item())
        return loss


def test_resume_is_exact(bundle, corpus, tmp_path):
    """Interrupted mid-epoch and resumed (dropout on, across an epoch end with evaluation), the run
    continues with bit-identical losses and ends with identical parameters."""
    kw = dict(epochs=2, max_batches_per_epoch=4, keep_last=5)
    full = Recording(tiny_config(corpus, tmp_path / "a", **kw), data=bundle, log=lambda *a: None)
    assert full.cfg.model.dropout > 0
    full.fit()
    assert len(full.losses) == 8

    first = Recording(tiny_config(corpus, tmp_path / "b", **kw), data=bundle, log=lambda *a: None)
    summary = first.fit(stop_after=3)
    assert summary["stop_reason"] == "interrupted" and first.losses == full.losses[:3]
    ckpt = step_checkpoints(first.run_dir / "checkpoints")[-1]

    resumed = Recording(tiny_config(corpus, tmp_path / "b", **kw), data=bundle, resume="auto",
                        log=lambda *a: None)
    assert (resumed.epoch, resumed.batch_index, resumed.step) == (0, 3, 3)
    assert load_checkpoint(ckpt)["position"]["step"] == 3
    resumed.fit()
    assert resumed.losses == full.losses[3:]  # exact float equality, including the first one
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n
    a = [json.loads(x) for x in (full.run_dir / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    a, b = ([r for r in rows if r["kind"] == "epoch"] for rows in (a, b))
    assert len(a) == len(b) == 2
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]  # epoch means survive the resume too
    assert [r["bleu"] for r in a] == [r["bleu"] for r in b]


def test_tokenizer_mismatch_and_bad_checkpoints(bundle, corpus, tmp_path):
    tr = _trainer(bundle, corpus, tmp_path, max_steps=1)
    tr.fit()
    path = step_checkpoints(tr.run_dir / "checkpoints")[-1]
    ckpt = load_checkpoint(path)
    ckpt["tokenizer"]["key"] = "another-tokenizer"
    torch.save(ckpt, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="tokenizer mismatch.*'another-tokenizer'"):
        Trainer(tiny_config(corpus, tmp_path), data=bundle, resume=tmp_path / "other.pt", log=lambda *a: None)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        Trainer(tiny_config(corpus, tmp_path), data=bundle, resume=tmp_path / "nope.pt", log=lambda *a: None)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="cannot read checkpoint"):
        Trainer(tiny_config(corpus, tmp_path), data=bundle, resume=tmp_path / "junk.pt", log=lambda *a: None)


def test_missing_data_file(tmp_path):
    from tests.train.helpers import tiny_config as cfg_for

    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Trainer(cfg_for(tmp_path / "missing.jsonl", tmp_path), log=lambda *a: None)


def test_sigint_stops_at_a_step_boundary_with_checkpoint(bundle, corpus, tmp_path):
    import os
    import signal

    tr = Recording(tiny_config(corpus, tmp_path), data=bundle, log=lambda *a: None)
    step = tr.train_step

    def step_then_ctrl_c(batches):
        loss = step(batches)
        if tr.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: handled, not raised
        return loss

    tr.train_step = step_then_ctrl_c
    # a background shell starts pytest with SIGINT ignored: install Python's handler for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert tr.fit()["stop_reason"] == "interrupted"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])["position"]["step"] == 2


@pytest.mark.slow  # ~3 min here: one aot_eager compile per new shape class on 2 shared cores
def test_compiled_step_matches_eager(bundle, corpus, tmp_path):
    """torch.compile (aot_eager on CPU) gives the eager losses; shapes and graphs are counted."""
    losses = {}
    for compiled in (False, True):
        tr = _trainer(bundle, corpus, tmp_path / str(compiled), model={"dropout": 0.0}, compile=compiled,
                      compile_backend="aot_eager")
        assert tr.compiled is compiled
        losses[compiled] = [tr.train_step(b).item() for b in _first_batches(tr, 3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert len(tr.shapes_seen) >= 2


def test_out_of_memory_suggests_a_smaller_budget(bundle, corpus, tmp_path):
    tr = _trainer(bundle, corpus, tmp_path)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    tr.step_module = oom
    with pytest.raises(torch.OutOfMemoryError, match=r"--data.max_tokens 256, with --optim.accum_steps 2"):
        tr.train_step(_first_batches(tr, 1))


@pytest.mark.parametrize("batching, layout", [("token_bucket", "padded"), ("packed", "packed")])
def test_token_counts_and_packed_batches(bundle, corpus, tmp_path, batching, layout):
    """The loss normaliser counts real target tokens (packed streams: not their dummy tail segments),
    and a packed run trains and evaluates end to end."""
    cfg = tiny_config(corpus, tmp_path, epochs=1, max_batches_per_epoch=3)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batching=batching),
                              model=dataclasses.replace(cfg.model, layout=layout))
    from data import build_data

    data = bundle if batching == "token_bucket" else build_data(cfg.data, log=lambda *a: None)
    tr = Trainer(cfg, data=data, log=lambda *a: None)
    lengths = data.splits["train"].tgt_lengths
    for b in _first_batches(tr, 3):
        assert b.num_target_tokens == int(lengths[b.index.numpy()].sum())
    tr.fit()
    assert tr.history[-1]["valid_loss"] > 0 and tr.step == 3


def test_fresh_run_moves_an_earlier_run_of_the_same_name_aside(bundle, corpus, tmp_path):
    """A second fresh start named like an earlier run neither mixes its metrics into the old file nor
    deletes anything: the old folder is renamed; --resume auto (tested above) is the way to continue."""
    kw = dict(epochs=1, max_batches_per_epoch=2)
    first = Trainer(tiny_config(corpus, tmp_path, **kw), data=bundle, log=lambda *a: None)
    first.fit()
    old_lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    logs = []
    second = Trainer(tiny_config(corpus, tmp_path, **kw), data=bundle, log=logs.append)
    second.fit()
    moved = [p for p in first.run_dir.parent.iterdir() if p.name.startswith(f"{first.run_dir.name}.prev-")]
    assert len(moved) == 1 and any("moved to" in str(m) and "--resume auto" in str(m) for m in logs)
    assert (moved[0] / "metrics.jsonl").read_text().splitlines() == old_lines
    assert any((moved[0] / "checkpoints").iterdir())
    kinds = [json.loads(x)["kind"] for x in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["epoch", "done"]  # its own epoch only
