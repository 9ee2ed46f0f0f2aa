"""The Trainer's epoch ends and run end: the finiteness check, the epoch record, validation, checkpoints,
checkpoint averaging, the final test, the ``done`` record and the curves.

``EpochEnd`` is a mixin of ``train.loop.Trainer`` (it reads the Trainer's model, data, config, clocks and
records); it holds the code that runs between epochs, the loop itself stays in train/loop.py.
Invariant: no checkpoint (``step-*.pt`` or ``best.pt``) ever holds non-finite weights. Every write is
preceded by one check of all weights and buffers (one host sync per checkpoint, none per step); a failed
check raises ``NonFiniteLossError`` naming the newest checkpoint that loads with finite weights.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from train import ema
from train.distributed import barrier, gather_object
from train.errors import EXIT_NONFINITE
from train.evaluation.scores import DECODE_RECORD_KEYS, decoding_settings, record_fields
from train.runs.checkpoint import average_last_epochs, load_checkpoint, rng_state
from train.runs.folder import done_record
from train.runs.metrics import plot_curves
from train.runs.saving import atomic_save, best_record
from train.step import EpochStats


class NonFiniteLossError(RuntimeError):
    """Training stopped on non-finite values; the message names a checkpoint with finite weights (or none)."""

    exit_code = EXIT_NONFINITE


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _finite_state(model_state: dict[str, torch.Tensor]) -> bool:
    flags = [torch.isfinite(v).all() for v in model_state.values() if v.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


class EpochEnd:
    # ------------------------------------------------------------------------------------------
    # non-finite weights: one check per checkpoint write
    # ------------------------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        """All weights and floating buffers finite? One host sync (every rank holds the same weights)."""
        flags = [torch.isfinite(f).all() for f in self.flat.flat]
        flags += [torch.isfinite(b).all() for b in self.model.buffers() if b.is_floating_point()]
        return bool(torch.stack(flags).all())

    def newest_finite_checkpoint(self) -> Path | None:
        """The newest checkpoint of this run that loads and holds finite weights (read at failure only)."""
        for path in reversed(self.ckpts.own_checkpoints()):
            try:
                if _finite_state(load_checkpoint(path)["model"]):
                    return path
            except (RuntimeError, OSError):
                continue
        return None

    def _resume_hint(self, path: Path | None) -> str:
        lower = f"{self.cfg.optim.lr / 10:g}"
        if path is None:
            return f"No checkpoint was written before: start again with a lower learning rate (e.g. --optim.lr {lower})"
        step = load_checkpoint(path)["position"]["step"]
        return (f"The newest checkpoint with finite weights is {path} (step {step}): continue from it with a lower "
                f"learning rate, e.g. --resume auto --run.name {self.run_dir.name} --optim.lr {lower}")

    def nonfinite_weights_error(self) -> NonFiniteLossError:
        return NonFiniteLossError(
            f"non-finite weights at step {self.step} (epoch {self.epoch + 1}): an update overflowed, so nothing was "
            f"saved. " + self._resume_hint(self.newest_finite_checkpoint() if self.is_main else None))

    def save(self, metric: float | None, *, checked: bool = False) -> Path | None:
        """Write this step's checkpoint (rank 0) after checking the weights are finite (unless ``checked``)."""
        t0 = time.perf_counter()
        if not checked and not self.weights_finite():
            raise self.nonfinite_weights_error()
        # each rank's RNG (dropout draws as many numbers as its own batches hold): a DDP resume restores its own
        rank_rng = gather_object(rng_state()) if self.dist.distributed else None
        if not self.is_main:
            barrier()
            return None
        state = self.state_dict()
        if rank_rng is not None:
            state["rank_rng"] = rank_rng
        # waits for the previous write, copies the state to CPU memory and returns: the file is written by the
        # manager's thread (train/runs/snapshot.py); what the loop waited is the split's "checkpoints"
        path = self.ckpts.save(state, self.step, metric)
        self.checkpoint_waited(time.perf_counter() - t0, new_save=True)
        barrier()
        return path

    def checkpoint_waited(self, seconds: float, *, new_save: bool = False, final: bool = False) -> None:
        """The run waited ``seconds`` for checkpoints, all of it the split's "checkpoints": in the loop, a save
        (``new_save``: the check, the state, the wait for the previous write, the snapshot) or the copy awaited
        before the next optimizer step (the last save's); or (``final``) for a write to be on disk at the end of
        the run, on a stop signal or before checkpoint files are read."""
        self.split.add("checkpoints", seconds)
        c = self.__dict__.setdefault("_ckpt_waits", {"loop": 0.0, "last": 0.0, "max": 0.0, "saves": 0, "final": 0.0})
        if final:
            c["final"] += seconds
            return
        c["loop"] += seconds
        c["last"] = seconds if new_save else c["last"] + seconds
        c["saves"] += bool(new_save)
        c["max"] = max(c["max"], c["last"])

    def wait_for_checkpoints(self) -> None:
        """Wait until the checkpoint being written is on disk (fsynced and renamed): at the end of a run, on a
        stop signal, before anything reads the checkpoint files. Raises the write's error; the seconds waited
        count as the split's "checkpoints" (the run waited for them)."""
        self.checkpoint_waited(self.ckpts.wait(), final=True)

    def checkpoint_summary(self) -> dict[str, Any]:
        """This process's checkpoint figures: saves; ``checkpoint_s``, the seconds the loop was blocked by them
        (each save and the copy it finished before the next optimizer step) and ``checkpoint_max_s``, the longest
        save's; ``checkpoint_final_wait_s``, the seconds the run waited for writes to be on disk (its end, a stop
        signal); ``checkpoint_write_s``, the background thread's writing seconds (not the loop's)."""
        c = self.__dict__.get("_ckpt_waits") or {"loop": 0.0, "max": 0.0, "saves": 0, "final": 0.0}
        return {"checkpoint_saves": c["saves"], "checkpoint_s": c["loop"], "checkpoint_max_s": c["max"],
                "checkpoint_final_wait_s": c["final"], "checkpoint_write_s": self.ckpts.write_seconds}

    # ------------------------------------------------------------------------------------------
    # end of epoch: evaluation, metrics line, checkpoint
    # ------------------------------------------------------------------------------------------
    def end_epoch(self, epoch: int, partial: bool = False) -> Path | None:
        run, ev, st = self.cfg.run, self.cfg.eval, self.stats
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds = st.elapsed()
        if not self.weights_finite():  # before evaluating garbage; the checkpoint below relies on it
            raise self.nonfinite_weights_error()
        world = self.dist.world_size
        record: dict[str, Any] = {
            "kind": "epoch",
            "epoch": epoch + 1,  # 1-based in the records, as people count epochs
            "step": self.step,
            # host sync: once per epoch
            "train_loss": float(st.loss_sum) / max(st.tgt_tokens, 1),
            "train_loss_last_batch": float(st.last_loss) if st.last_loss is not None else None,
            "lr": self.scheduler.get_last_lr()[0],
            "epoch_seconds": train_seconds,
            # real (non-pad) src+tgt tokens/s over all ranks (every rank runs the same number of batches)
            "tokens_per_second": st.real_tokens * world / max(train_seconds, 1e-9),
            "tgt_tokens_per_second": st.tgt_tokens * world / max(train_seconds, 1e-9),
            "padding_fraction": 1 - st.real_tokens / max(st.padded_tokens, 1),
            "skipped_steps": self.skipped_steps,
            "micro_batches": st.micro_batches,
            "distinct_shapes": len(self.shapes_seen),
        }
        if partial:
            record["partial_epoch"] = True
        record["mfu"] = self._mfu(st, record["tgt_tokens_per_second"])
        # the step (issue 42): wall ms and the training thread's CPU ms per optimizer step, CUDA graphs replayed a step
        record["step_ms"] = 1000 * train_seconds / st.steps if st.steps else None
        record["host_ms_per_step"] = 1000 * st.host_seconds / st.steps if st.steps else None
        graph = getattr(self, "step_graph", None)
        record["graphs_per_step"] = graph.graphs_per_step() if graph is not None else 0
        record["peak_dtype"] = self.peak_dtype
        from train.compile import compiled_graphs, graph_breaks

        record["compiled_graphs"] = compiled_graphs() if self.compiled else None
        record["graph_breaks"] = graph_breaks() if self.compiled else None
        record["first_step_seconds"] = self.first_step_seconds
        if self.device.type == "cuda":
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            record["peak_memory_gb"] = None
            record["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux

        metric = None
        evaluate = (epoch + 1) % ev.every == 0 or epoch + 1 == run.epochs or partial
        if self.is_main and evaluate:
            with ema.applied(self.ema, self.model):  # optim.ema_decay: validation scores the average
                metric = self._evaluate(epoch, record)
        record["wall_seconds"] = self.clock.wall()  # the run's wall seconds (train/objective.py)
        if self.is_main:
            self.metrics.log(record)
            self.metrics.scalars({k: v for k, v in record.items() if k not in ("kind", "epoch")}, epoch + 1,
                                 prefix="epoch/")
        self.history.append(record)
        if not partial:
            self.epoch, self.batch_index = epoch + 1, 0
            self.stats = EpochStats.new(self.device)
        return self.save(metric=metric, checked=True)

    def _evaluate(self, epoch: int, record: dict[str, Any]) -> float | None:
        """Validation loss and BLEU into ``record``; updates the BLEU clock; returns the best-metric value."""
        ev = self.cfg.eval
        r = self._eval_split("valid", ev.decode, loss=ev.valid_loss)
        record.update(valid_loss=r["loss"], bleu=r["bleu"], chrf=r["chrf"], eval_sentences=r["sentences"],
                      eval_seconds=r["seconds"], **{k: r.get(k) for k in DECODE_RECORD_KEYS}, **record_fields(r))
        wall = self.clock.wall()
        for t in self.clock.update(record["bleu"], epoch + 1, wall):
            self.log(f"BLEU {t:g} reached at {wall:.1f} s (epoch {epoch + 1})")
        self.log(
            f"epoch {epoch + 1}/{self.cfg.run.epochs}: train_loss {record['train_loss']:.4f} "
            f"(last batch {_fmt(record['train_loss_last_batch'], '.4f')}) valid_loss {_fmt(record['valid_loss'], '.4f')} "
            f"BLEU {_fmt(record['bleu'], '.2f')} chrF {_fmt(record['chrf'], '.2f')} | {record['epoch_seconds']:.1f} s, "
            f"{record['tokens_per_second']:,.0f} tok/s, pad {100 * record['padding_fraction']:.1f}%, "
            f"eval {record['eval_seconds']:.1f} s, wall {wall:.1f} s"
            + (f", MFU {100 * record['mfu']:.1f}%" if record["mfu"] is not None else "")
        )
        for src, ref, hyp in r["samples"][: ev.num_samples]:
            self.log(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}")
        return record["bleu"] if ev.best_metric == "bleu" else record["valid_loss"]

    def _eval_split(self, split: str, decode: str, loss: bool = True) -> dict[str, Any]:
        from train.evaluation.scores import evaluate_split

        t0 = time.perf_counter()
        try:
            return evaluate_split(self.model, self.data, split, self.device, self.cfg.eval, autocast=self.autocast,
                                  decode=decode, loss=loss)
        finally:
            self.split.add("eval", time.perf_counter() - t0)

    def _mfu(self, st: EpochStats, tgt_tps: float) -> float | None:
        """Model FLOPs utilisation against the peak of the run's dtype; None where no peak exists (CPU)."""
        if self.peak_flops is None or st.sentences == 0:
            return None
        from models.flops import flops_per_token, mfu

        # FLOPs at the epoch's mean real lengths (src incl. EOS, tgt incl. BOS)
        src_len, tgt_len = st.src_tokens / st.sentences, st.tgt_tokens / st.sentences
        return mfu(flops_per_token(self.cfg.model, src_len, tgt_len) * tgt_tps,
                   self.peak_flops * self.dist.world_size)

    # ------------------------------------------------------------------------------------------
    # end of the run: averaging, test, done record, curves (rank 0)
    # ------------------------------------------------------------------------------------------
    def finish(self, stop_reason: str | None, summary: dict[str, Any]) -> None:
        if self.cfg.eval.average_last:
            self.wait_for_checkpoints()  # it reads the epoch checkpoints' files
            self._average_last(self.cfg.eval.average_last)
        if self.cfg.eval.test_at_end:  # (from the best weights in memory while the last checkpoint is written)
            summary["test"] = self._final_test()
            summary["decode_fallbacks"] = (summary.get("decode_fallbacks") or 0) + (summary["test"].get("decode_fallbacks") or 0)
        self.wait_for_checkpoints()  # the done record says the run's checkpoints are on disk
        test = summary.get("test") or {}
        wall = self.clock.wall()
        summary["wall_seconds"], summary["time_split"] = wall, self.split.split(wall)
        self.metrics.log(done_record(epoch=self.epoch, step=self.step, stop_reason=stop_reason or "done",
                                     wall_seconds=wall, time_split=summary["time_split"], best_bleu=self.clock.best,
                                     best_bleu_at=self.clock.best_at, time_to_bleu=self.clock.reached,
                                     test_bleu=test.get("test_bleu")))
        if self.cfg.run.plot and self.metrics.path.exists():
            summary["curves"] = plot_curves(self.metrics.path, self.run_dir / "curves.png")

    def _final_test(self) -> dict[str, Any]:
        """Test loss and beam-search BLEU with best.pt's weights (the checkpoint translate uses): the copy kept in
        memory when this process saved it (no read from disk), else the file (the best of an earlier process)."""
        best = self.ckpts.dir / "best.pt"
        source = "the last weights (no validation, so no best.pt)"
        if self.ckpts.best_state is not None:
            state = self.ckpts.best_state
            self.model.load_state_dict(state["model"])  # CPU copies into the model's (device) tensors
            source = f"best.pt (epoch {state['position']['epoch']}, from memory)"
        elif best.is_file():
            self.wait_for_checkpoints()
            state = load_checkpoint(best, map_location=self.device)
            self.model.load_state_dict(ema.inference_weights(state))  # its weight average when it kept one
            source = f"best.pt (epoch {state['position']['epoch']})"
        with ema.applied(None if best.is_file() else self.ema, self.model):
            r = self._eval_split("test", "beam")  # the whole test split (train.evaluation.scores.sentence_limit)
        rec = {"kind": "test", "epoch": self.epoch, "weights": source, "test_loss": r["loss"],
               "test_bleu": r["bleu"], "test_chrf": r["chrf"], "test_sentences": r["sentences"],
               **record_fields(r, "test_"), "decoding": decoding_settings(self.cfg.eval, "beam"),
               "beam_size": self.cfg.eval.beam_size, "eval_seconds": r["seconds"], "wall_seconds": self.clock.wall(),
               "decode_fallbacks": r.get("decode_fallbacks"), "decode_eager_reason": r.get("decode_eager_reason")}
        self.log(f"test ({source}): loss {_fmt(r['loss'], '.4f')} BLEU {_fmt(r['bleu'], '.2f')} "
                 f"chrF {_fmt(r['chrf'], '.2f')} ({r['sentences']} sentences, {r.get('truncated_sources', 0)} cut to "
                 f"the model's positions; beam {self.cfg.eval.beam_size}"
                 + (f"; BLEU|{r['bleu_signature']})" if r.get("bleu_signature") else ")"))
        self.metrics.log(rec)
        return rec

    def _average_last(self, k: int) -> None:
        """The average of the last ``k`` epoch checkpoints becomes best.pt if its validation BLEU beats the
        best single checkpoint's (that one is kept as best-single.pt)."""
        state = average_last_epochs(self.ckpts.dir, k, self.log, run_id=self.run_id)
        if state is None:
            return
        self.model.load_state_dict(state["model"])
        r = self._eval_split("valid", "beam", loss=False)
        better = r["bleu"] is not None and self.ckpts.is_better(r["bleu"])
        self.log(f"average of the last {k} epoch checkpoints: valid BLEU {_fmt(r['bleu'], '.2f')} (best single "
                 f"{_fmt(self.ckpts.best_value, '.2f')}){': kept as best.pt' if better else ''}")
        self.metrics.log({"kind": "average", "checkpoints": [Path(p).name for p in state["averaged_from"]],
                          "bleu": r["bleu"], "best_single_bleu": self.ckpts.best_value,
                          "wall_seconds": self.clock.wall()})
        if better:
            if (self.ckpts.dir / "best.pt").exists():
                os.replace(self.ckpts.dir / "best.pt", self.ckpts.dir / "best-single.pt")
            best = best_record(state)
            atomic_save(best, self.ckpts.dir / "best.pt")
            self.ckpts.best_value, self.ckpts.best_state = r["bleu"], best
