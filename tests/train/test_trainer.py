"""The Trainer on CPU: step-skip logic, accumulation equivalence, error paths, signals, packed batches."""

from __future__ import annotations

import pytest
import torch

from tests.utils import (
    assert_close_by_name,
    first_batches,
    params,
    quiet,
    records,
    signal_after_step,
    tiny_config,
    tiny_trainer,
)
from train.loop import NonFiniteLossError, Trainer
from train.runs.checkpoint import load_checkpoint, step_checkpoints


def _infinite_losses(trainer):
    """Make every loss infinite (as an fp16 overflow would)."""
    good = trainer.step_module
    trainer.step_module = lambda *args, **kwargs: good(*args, **kwargs) * float("inf")
    return good


def test_fp16_scaler_skip_happens_on_the_device(toy_bundle, tmp_path):
    """An fp16 overflow: the GradScaler's flag skips the update on the device (no host sync), halves the
    scale and counts the skip; the schedule advances with every step taken or skipped."""
    # norm="torch": models' fused ResidualNorm rejects autocast's mixed dtypes (reported to models/)
    tr = tiny_trainer(toy_bundle, tmp_path, precision="fp16", model={"norm": "torch"})
    assert tr.scaler.is_enabled()
    b = first_batches(tr, 2)
    before, lr_before, scale = params(tr.model), tr.scheduler.get_last_lr()[0], tr.scaler.get_scale()
    good = _infinite_losses(tr)
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


def test_fp32_nonfinite_skips_then_stops_with_checkpoint(toy_bundle, tmp_path):
    """Non-finite steps are skipped on the device; the run stops at the logging step that sees the limit."""
    tr = tiny_trainer(toy_bundle, tmp_path, max_nonfinite=3, log_every=3)
    before = params(tr.model)
    _infinite_losses(tr)
    with pytest.raises(NonFiniteLossError, match="3 non-finite losses in a row"):
        tr.fit()
    assert (tr.step, tr.skipped_steps) == (3, 3)
    assert all(torch.equal(p, before[n]) for n, p in tr.model.named_parameters())
    ckpt = load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])
    assert ckpt["position"]["batch_index"] == 3 and ckpt["position"]["counters"]["skipped"] == 3


def test_unguarded_nonfinite_stops_without_saving_corrupted_weights(toy_bundle, tmp_path):
    """With the per-step guard off (no host sync per step), a non-finite loss is found at the next
    read-back; those steps were applied, so nothing is saved for --resume auto to pick up."""
    tr = tiny_trainer(toy_bundle, tmp_path, nonfinite_guard=False, log_every=2)
    _infinite_losses(tr)
    with pytest.raises(NonFiniteLossError, match="nonfinite_guard off.*nothing was saved.*No checkpoint was written"):
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


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # the test's capture
def test_accumulation_equals_one_big_batch(toy_bundle, tmp_path):
    """k micro-batches of different sizes give the gradient (and the update) of their union."""
    grads, weights = {}, {}
    for mode in ("accumulated", "merged"):
        tr = tiny_trainer(toy_bundle, tmp_path / mode, model={"dropout": 0.0}, optim={"grad_clip": None},
                          seed=3)
        micro = first_batches(tr, 3)
        assert len({b.src.shape for b in micro}) > 1 or len({len(b) for b in micro}) > 1
        captured = {}
        step = tr.optimizer.step

        def capture_then_step(tr=tr, captured=captured, step=step):
            captured.update({n: p.grad.clone() for n, p in tr.model.named_parameters()})
            step()

        tr.optimizer.step = capture_then_step
        loss = tr.train_step(micro if mode == "accumulated" else [_merge(micro)])
        grads[mode], weights[mode] = captured, params(tr.model)
        weights[mode]["loss"] = loss
    assert_close_by_name(grads["accumulated"], grads["merged"], rtol=1e-4, atol=1e-6)
    assert_close_by_name(weights["accumulated"], weights["merged"], rtol=1e-4, atol=1e-5)


def test_tokenizer_mismatch_and_bad_checkpoints(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path, max_steps=1)
    tr.fit()
    path = step_checkpoints(tr.run_dir / "checkpoints")[-1]
    ckpt = load_checkpoint(path)
    ckpt["tokenizer"]["key"] = "another-tokenizer"
    torch.save(ckpt, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="tokenizer mismatch.*'another-tokenizer'"):
        tiny_trainer(toy_bundle, tmp_path, resume=tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        tiny_trainer(toy_bundle, tmp_path, resume=tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="cannot read checkpoint"):
        tiny_trainer(toy_bundle, tmp_path, resume=tmp_path / "junk.pt")


def test_missing_data_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Trainer(tiny_config(tmp_path, data={"data_files": str(tmp_path / "missing.jsonl")}), log=quiet)


def test_sigint_stops_at_a_step_boundary_with_checkpoint(toy_bundle, tmp_path):
    import signal

    tr = tiny_trainer(toy_bundle, tmp_path)
    signal_after_step(tr, 2, signal.SIGINT)  # as Ctrl-C: handled, not raised
    # a background shell starts pytest with SIGINT ignored: install Python's handler for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert tr.fit()["stop_reason"] == "interrupted"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_checkpoint(step_checkpoints(tr.run_dir / "checkpoints")[-1])["position"]["step"] == 2


@pytest.mark.slow  # ~3 min here: one aot_eager compile per new shape class on 2 shared cores
def test_compiled_step_matches_eager(toy_bundle, tmp_path):
    """torch.compile (aot_eager on CPU) gives the eager losses; shapes and graphs are counted."""
    losses = {}
    for compiled in (False, True):
        tr = tiny_trainer(toy_bundle, tmp_path / str(compiled), model={"dropout": 0.0}, compile=compiled,
                          compile_backend="aot_eager")
        assert tr.compiled is compiled
        losses[compiled] = [tr.train_step(b).item() for b in first_batches(tr, 3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert len(tr.shapes_seen) >= 2


def test_out_of_memory_suggests_a_smaller_budget(toy_bundle, tmp_path):
    tr = tiny_trainer(toy_bundle, tmp_path)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    tr.step_module = oom
    with pytest.raises(torch.OutOfMemoryError, match=r"--data.max_tokens 256, with --optim.accum_steps 2"):
        tr.train_step(first_batches(tr, 1))


@pytest.mark.parametrize("batching, layout", [("token_bucket", "padded"), ("packed", "packed")])
def test_token_counts_and_packed_batches(toy_bundle, tmp_path, batching, layout):
    """The loss normaliser counts real target tokens (packed streams: not their dummy tail segments),
    and a packed run trains and evaluates end to end."""
    tr = tiny_trainer(toy_bundle, tmp_path, data={"batching": batching}, model={"layout": layout}, epochs=1,
                      max_batches_per_epoch=3)
    lengths = tr.data.splits["train"].tgt_lengths
    for b in first_batches(tr, 3):
        assert b.num_target_tokens == int(lengths[b.index.numpy()].sum())
    tr.fit()
    assert tr.history[-1]["valid_loss"] > 0 and tr.step == 3


def test_fresh_run_under_a_taken_name_gets_the_next_name_and_moves_nothing(toy_bundle, tmp_path):
    """A second fresh start named like an earlier run neither mixes its metrics into the old folder nor
    moves it: it runs in ``<name>-2`` and says so; --resume auto (test_resume.py) is the way to continue."""
    kw = dict(epochs=1, max_batches_per_epoch=2)
    first = tiny_trainer(toy_bundle, tmp_path, **kw)
    first.fit()
    before = {p.relative_to(first.run_dir): p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()}
    logs = []
    second = tiny_trainer(toy_bundle, tmp_path, log=logs.append, **kw)
    second.fit()
    assert second.run_dir == first.run_dir.with_name("t-2") and second.cfg.run.name == "t-2"
    assert any(f"this run is {second.run_dir}" in str(m) and "--resume auto --run.name t" in str(m) for m in logs)
    assert {p.relative_to(first.run_dir): p.read_bytes() for p in first.run_dir.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in first.run_dir.parent.iterdir()) == ["t", "t-2"]
    assert [r["kind"] for r in records(second.run_dir)] == ["epoch", "done"]  # its own epoch only
