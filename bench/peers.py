"""The Hugging Face baseline (../shared/gpu/PEERS.md §1), trained on fastmt's own data and split, and scored
as fastmt is.

``transformers.MarianMTModel`` at the preset's size with fastmt's tokenizer, the ``Seq2SeqTrainer`` recipe
(``PeerRecipe``) as a plain loop, rows in fastmt's ``metrics.jsonl`` format (bench/frontier.py reads both
alike), validation and test through ``train.evaluation.scores.score_split``. Only the search is ``generate``'s
(length penalty ``len ** alpha``, not GNMT's). Needs the ``peers`` extra (transformers, accelerate); details
in bench/README.md."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from train.evaluation.decode import encode_sources
from train.evaluation.scores import decoding_settings, record_fields, score_split, sentence_limit
from train.objective import BleuClock, process_seconds

NAME = "hf-marian"


@dataclass
class PeerRecipe:
    """The baseline's training settings (PEERS.md §1); the Trainer's defaults where it names none."""

    epochs: int = 18  # at most this many passes (the plan ends at the first of epochs, max_steps, the wall budget)
    batch_size: int = 128  # sentences per batch, grouped by length
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1  # of the plan: the steps planned, or the wall budget when that ends first
    label_smoothing: float = 0.1
    max_grad_norm: float = 1.0  # Seq2SeqTrainer's default
    # pad_to_multiple_of: a handful of shapes, so CUDA's attention picks a plan once per shape
    pad_multiple: int = 8
    # OPUS-MT's Marian configs; off, 0.02-RMS tokens sit under ~0.7-RMS sinusoidal positions in a post-LN model
    # (the H200 run of 2026-11-27 never left unigrams)
    scale_embedding: bool = True
    seed: int = 0
    max_steps: int | None = None  # stop after this many optimizer steps in all (smoke tests)
    max_wall_seconds: float | None = None  # stop at a step boundary after this many seconds since process start

    def __post_init__(self):
        for name, ok, rule in (("epochs", self.epochs >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
                               ("lr", self.lr > 0, "> 0"), ("warmup_ratio", 0 <= self.warmup_ratio < 1, "in [0, 1)"),
                               ("pad_multiple", self.pad_multiple >= 1, ">= 1"),
                               ("max_steps", self.max_steps is None or self.max_steps >= 1, ">= 1 or None"),
                               ("max_wall_seconds", self.max_wall_seconds is None or self.max_wall_seconds > 0,
                                "> 0 or None")):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} must be {rule}")


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SystemExit("bench.peers needs transformers and accelerate: pip install -e '.[peers]'") from e


# -- Model and data --------------------------------------------------------------------------------
def marian_model(model_cfg, tok, device: torch.device, *, scale_embedding: bool = True):
    """MarianMTModel from scratch with fastmt's model size and tokenizer ids, SDPA attention."""
    _require_transformers()
    from transformers import MarianConfig, MarianMTModel

    m = model_cfg
    config = MarianConfig(
        vocab_size=tok.vocab_size, decoder_vocab_size=tok.vocab_size, d_model=m.d_model,
        encoder_layers=m.enc_layers, decoder_layers=m.dec_layers, encoder_attention_heads=m.n_heads,
        decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, dropout=m.dropout,
        activation_function="relu", max_position_embeddings=m.max_positions,
        pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id,
        decoder_start_token_id=tok.bos_id, forced_eos_token_id=tok.eos_id,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, scale_embedding=scale_embedding,
    )
    config._attn_implementation = "sdpa"
    return MarianMTModel(config).to(device)


def encode_split(split, eos_id: int, max_positions: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(sources, labels) of an ``EncodedSplit``: subwords + EOS each, cut to ``max_positions`` (as fastmt's
    ``translate`` cuts sources)."""
    eos = np.array([eos_id], dtype=np.int64)

    def rows(ids, off):
        return [np.concatenate([ids[off[i]:off[i + 1]][: max_positions - 1].astype(np.int64), eos])
                for i in range(len(off) - 1)]

    return rows(split.src_ids, split.src_offsets), rows(split.tgt_ids, split.tgt_offsets)


def collate(pairs: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """input_ids/attention_mask (B, S) and labels (B, T) with -100 on padding, S and T rounded up to ``multiple``."""
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    S, T = up(max(len(s) for s, _ in pairs)), up(max(len(t) for _, t in pairs))
    src = torch.full((len(pairs), S), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), T), -100, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)] = torch.from_numpy(s)
        labels[i, : len(t)] = torch.from_numpy(t)
    return {"input_ids": src, "attention_mask": (src != pad_id).long(), "labels": labels}


def train_loader(src, tgt, recipe: PeerRecipe, pad_id: int, epoch: int):
    """Batches of ``recipe.batch_size`` sentences grouped by source length (the Trainer's sampler)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    g = torch.Generator().manual_seed(recipe.seed * 1000 + epoch)
    sampler = LengthGroupedSampler(recipe.batch_size, lengths=[len(s) for s in src], generator=g)
    return torch.utils.data.DataLoader(list(zip(src, tgt)), batch_size=recipe.batch_size, sampler=sampler,
                                       collate_fn=lambda b: collate(b, pad_id, recipe.pad_multiple),
                                       pin_memory=torch.cuda.is_available())


# -- Training and evaluation -----------------------------------------------------------------------
def _autocast(device: torch.device):
    cuda = device.type == "cuda"
    return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)


def sdpa_kernels(device: torch.device):
    """On CUDA, SDPA's flash and memory-efficient kernels only (no cuDNN plan per new shape, no math fallback)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


class PlannedSchedule:
    """Linear warm-up over ``warmup_ratio`` of the plan, then linear decay to 0 at its end; the plan's progress is
    the larger of steps / ``total_steps`` and training seconds / ``budget_s`` (the wall budget left at the start;
    None: steps only), so a run stopped by its budget ends its schedule there. ``factor``: the lr multiplier."""

    def __init__(self, total_steps: int, warmup_ratio: float, budget_s: float | None = None):
        if total_steps < 1 or (budget_s is not None and budget_s <= 0):
            raise ValueError(f"a schedule needs total_steps >= 1 and budget_s > 0 (got {total_steps}, {budget_s})")
        self.total_steps, self.warmup_ratio, self.budget_s = total_steps, warmup_ratio, budget_s

    def progress(self, step: int, seconds: float = 0.0) -> float:
        p = step / self.total_steps
        if self.budget_s is not None:
            p = max(p, seconds / self.budget_s)
        return min(p, 1.0)

    def factor(self, step: int, seconds: float = 0.0) -> float:
        p, w = self.progress(step, seconds), self.warmup_ratio
        if w > 0 and p < w:
            return max(p / w, 1.0 / max(1.0, w * self.total_steps))  # never 0 at step 0
        return max(0.0, (1.0 - p) / (1.0 - w))


def _loss(model, b: dict[str, torch.Tensor], tok, **options) -> torch.Tensor:
    """Cross-entropy of a collated batch (forward under autocast); ``options`` go to ``F.cross_entropy``."""
    from transformers.models.marian.modeling_marian import shift_tokens_right

    with _autocast(b["input_ids"].device):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       decoder_input_ids=shift_tokens_right(b["labels"], tok.pad_id, tok.bos_id)).logits
    return F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=-100, **options)


def _optimizer(model, recipe: PeerRecipe, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, weight decay on every weight matrix and embedding, none on biases and LayerNorms (1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, fused=device.type == "cuda")


def train_step(model, opt, b: dict[str, torch.Tensor], tok, recipe, lr: float) -> torch.Tensor:
    """One optimizer step at ``lr`` (the peer's run and the CPU race's): the label-smoothed loss, gradients clipped
    to the recipe's norm. Returns the loss (detached)."""
    for g in opt.param_groups:
        g["lr"] = lr
    with sdpa_kernels(b["input_ids"].device):
        loss = _loss(model, b, tok, label_smoothing=recipe.label_smoothing)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@torch.no_grad()
def valid_loss(model, src, tgt, tok, device: torch.device, batch_size: int) -> float | None:
    """Mean un-smoothed cross-entropy per real target token over the whole split."""
    if not src:
        return None
    was = model.training
    model.eval()
    order = sorted(range(len(src)), key=lambda i: len(src[i]))
    total, n = torch.zeros((), dtype=torch.float64, device=device), 0
    for start in range(0, len(order), batch_size):
        b = collate([(src[i], tgt[i]) for i in order[start:start + batch_size]], tok.pad_id)
        b = {k: v.to(device) for k, v in b.items()}
        total += _loss(model, b, tok, reduction="sum")
        n += int((b["labels"] != -100).sum())
    model.train(was)
    return float(total) / max(n, 1)


def _length_limit_processor(limits: torch.Tensor, eos_id: int):
    """A logits processor forcing EOS once a row has generated ``limit - 1`` tokens (EOS is the last)."""
    from transformers import LogitsProcessor

    class RowLengthLimit(LogitsProcessor):
        def __call__(self, input_ids, scores):
            done = input_ids.shape[1] - 1 >= limits - 1  # input_ids start with the decoder start token
            if bool(done.any()):
                scores = scores.masked_fill(done[:, None], -math.inf)
                scores[done, eos_id] = 0.0
            return scores

    return RowLengthLimit()


@torch.no_grad()
def translate(model, tok, sources: list[np.ndarray], device: torch.device, *, beam_size: int, batch_size: int,
              max_len_ratio: float, max_len_extra: int, length_penalty: float = 1.0) -> list[str]:
    """``generate``'s beam search over encoded sources, longest first, at most floor(a * len(src) + b) tokens
    each; ``length_penalty``: HF's alpha (scores / len ** alpha)."""
    from transformers import GenerationConfig

    was = model.training
    model.eval()
    cap = model.config.max_position_embeddings - 1
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    out: list[str] = [""] * len(sources)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        b = collate([(sources[i], sources[i]) for i in idx], tok.pad_id)
        lens = torch.tensor([len(sources[i]) for i in idx], dtype=torch.float64)
        limits = torch.floor(lens * max_len_ratio + max_len_extra).long().clamp(1, cap)
        beam = {"length_penalty": length_penalty} if beam_size > 1 else {}  # greedy has none (HF warns)
        gen = GenerationConfig(num_beams=beam_size, max_new_tokens=int(limits.max()), do_sample=False, **beam,
                               decoder_start_token_id=tok.bos_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                               pad_token_id=tok.pad_id, forced_eos_token_id=tok.eos_id,
                               suppress_tokens=[tok.pad_id, tok.bos_id])
        rows = limits.repeat_interleave(beam_size).to(device)
        with _autocast(device):
            seqs = model.generate(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                                  generation_config=gen, logits_processor=[_length_limit_processor(rows, tok.eos_id)])
        for i, text in zip(idx, tok.decode(seqs.cpu())):
            out[i] = text
    model.train(was)
    return out


def scores(model, bundle, split: str, device: torch.device, ev, max_positions: int, *,
           decode: str = "beam") -> dict[str, Any]:
    """fastmt's scoring of ``split`` (``score_split`` under the ``EvalConfig`` ``ev``) of this model's ``generate``
    translations; ``decode="greedy"``: beam size 1."""
    tok = bundle.tokenizer

    def fn(texts: list[str]) -> list[str]:
        return translate(model, tok, encode_sources(tok, texts, max_positions), device,
                         beam_size=1 if decode == "greedy" else ev.beam_size, batch_size=ev.batch_size,
                         max_len_ratio=ev.max_len_a, max_len_extra=ev.max_len_b, length_penalty=ev.length_penalty)

    if len(bundle.splits[split]) == 0:
        return {"bleu": None, "chrf": None, "sentences": 0, "samples": []}
    return score_split(bundle, split, fn, max_sentences=sentence_limit(split, ev), max_positions=max_positions)


# -- The run ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def claimed_folder(asked: Path, log: Callable[[str], None]):
    """A new run folder with a marker, as fastmt's runs: the next free name when one is taken (nothing is moved)."""
    from train.runs.folder import claim_run_folder

    asked = Path(asked)
    run_dir, lock = claim_run_folder(asked.parent, asked.name, uuid.uuid4().hex)
    if run_dir != asked:
        log(f"[peers] {asked} holds an earlier run, so this run is {run_dir}")
    try:
        yield run_dir
    finally:
        lock.release()


def train_peer(cfg, recipe: PeerRecipe, *, run_dir: Path, device: torch.device, bundle=None,
               clock: Callable[[], float] = process_seconds, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the baseline on ``cfg.data`` (or a built ``bundle``), logging fastmt-format rows to
    ``run_dir/metrics.jsonl``; ``clock()``: wall seconds of the run (default: since process start).
    Returns a summary (best BLEU, time to each BLEU threshold, epochs, steps, stop reason)."""
    from train.runs.folder import done_record
    from train.runs.metrics import MetricsLogger, plot_curves

    _require_transformers()
    with claimed_folder(run_dir, log) as run_dir:
        if bundle is None:
            from data import build_data

            bundle = build_data(cfg.data, log=lambda m: log(str(m)))
        metrics = MetricsLogger(run_dir, tensorboard=False)
        try:
            summary = _train(cfg, recipe, bundle, run_dir, metrics, device, clock, log)
            metrics.log(done_record(epoch=summary["epochs_done"], step=summary["steps"],
                                    stop_reason=summary["stop_reason"],
                                    **{k: summary.get(k) for k in ("best_bleu", "time_to_bleu", "wall_seconds")}))
        finally:
            metrics.close()
    plot_curves(metrics.path, run_dir / "curves.png")
    return {**summary, "run_dir": str(run_dir)}


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _train(cfg, recipe: PeerRecipe, bundle, run_dir: Path, metrics, device: torch.device,
           clock: Callable[[], float], log: Callable[[str], None]) -> dict[str, Any]:
    import transformers

    from train.runs.metrics import write_provenance

    ev, tok, max_pos = cfg.eval, bundle.tokenizer, cfg.model.max_positions
    torch.manual_seed(recipe.seed)
    model = marian_model(cfg.model, tok, device, scale_embedding=recipe.scale_embedding)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    train_src, train_tgt = encode_split(bundle.splits["train"], tok.eos_id, max_pos)
    valid_src, valid_tgt = encode_split(bundle.splits["valid"], tok.eos_id, max_pos)
    if not train_src:
        raise ValueError("the training split is empty: check --data-files and data.valid_size/test_size")
    steps_per_epoch = math.ceil(len(train_src) / recipe.batch_size)
    planned = recipe.epochs * steps_per_epoch
    total = planned if recipe.max_steps is None else min(planned, recipe.max_steps)
    opt = _optimizer(model, recipe, device)
    t_start = clock()
    budget = None if recipe.max_wall_seconds is None else max(recipe.max_wall_seconds - t_start, 1e-3)
    sched = PlannedSchedule(total, recipe.warmup_ratio, budget)
    t_train = 0.0  # training seconds so far (evaluation excluded): the wall plan's progress

    peer = {"model": "transformers.MarianMTModel", "transformers": transformers.__version__,
            "attention": "sdpa (CUDA: flash/efficient only)", "schedule": "linear warm-up/decay over the plan "
            f"({total} steps{'' if budget is None else f' or {budget:.0f} s, whichever ends first'})",
            "precision": "bf16" if device.type == "cuda" else "fp32", **dataclasses.asdict(recipe),
            "length_penalty_form": "generate: logprob / len ** alpha (fastmt: GNMT logprob / ((5 + len) / 6) ** alpha)"}
    config = {"data": cfg.data.to_dict(), "model": dataclasses.asdict(cfg.model), "eval": dataclasses.asdict(ev),
              "peer": peer}
    write_provenance(run_dir, config, bundle.split_record, {"params": params}, step=0,
                     log=lambda m: log(f"[peers] {m}"))
    metrics.log({"kind": "start", "params": params, "train_pairs": len(train_src), "steps_planned": total,
                 "device": str(device), "wall_seconds": t_start, **peer})
    log(f"[peers] MarianMTModel {params:,} trainable parameters, {len(train_src):,} train pairs, {total} steps "
        f"planned ({steps_per_epoch} per epoch), {device}")

    bleu_clock = BleuClock(ev.bleu_thresholds, patience=None)
    step, epoch, best_state, stop_reason = 0, 0, None, "done"
    model.train()
    for epoch in range(recipe.epochs):
        t_epoch = time.perf_counter()
        loss_sum, n_batches = torch.zeros((), dtype=torch.float64, device=device), 0
        for batch in train_loader(train_src, train_tgt, recipe, tok.pad_id, epoch):
            b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss_sum += train_step(model, opt, b, tok, recipe,
                                   recipe.lr * sched.factor(step, t_train + time.perf_counter() - t_epoch))
            n_batches, step = n_batches + 1, step + 1
            if step >= total:
                stop_reason = "done" if total == planned else "max_steps"
                break
            if recipe.max_wall_seconds is not None and clock() >= recipe.max_wall_seconds:
                stop_reason = "max_wall_seconds"
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_train += time.perf_counter() - t_epoch
        stop = step >= total or stop_reason != "done"
        record: dict[str, Any] = {"kind": "epoch", "epoch": epoch + 1, "step": step,
                                  "train_loss": float(loss_sum) / max(n_batches, 1), "lr": opt.param_groups[0]["lr"],
                                  "epoch_seconds": time.perf_counter() - t_epoch,
                                  **({"partial_epoch": True} if n_batches < steps_per_epoch else {})}
        if (epoch + 1) % ev.every == 0 or epoch + 1 == recipe.epochs or stop:
            t_eval = time.perf_counter()
            record["valid_loss"] = (valid_loss(model, valid_src, valid_tgt, tok, device, recipe.batch_size)
                                    if ev.valid_loss else None)
            sc = scores(model, bundle, "valid", device, ev, max_pos, decode=ev.decode)
            record.update(bleu=sc["bleu"], chrf=sc["chrf"], eval_sentences=sc["sentences"],
                          eval_seconds=time.perf_counter() - t_eval, **record_fields(sc))
            best_before, wall = bleu_clock.best, clock()
            for t in bleu_clock.update(sc["bleu"], epoch + 1, wall):
                log(f"[peers] BLEU {t:g} reached at {wall:.1f} s (epoch {epoch + 1})")
            if sc["bleu"] is not None and (best_before is None or sc["bleu"] > best_before):
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # for the test
        record["wall_seconds"] = clock()
        metrics.log(record)
        log(f"[peers] epoch {epoch + 1}/{recipe.epochs}: train_loss {record['train_loss']:.4f} valid_loss "
            f"{_fmt(record.get('valid_loss'), '.4f')} BLEU {_fmt(record.get('bleu'), '.2f')} | "
            f"{record['epoch_seconds']:.1f} s train, {_fmt(record.get('eval_seconds'), '.1f')} s eval, "
            f"wall {record['wall_seconds']:.1f} s")
        if stop:
            break

    summary: dict[str, Any] = {"best_bleu": bleu_clock.best, "epochs_done": epoch + 1, "steps": step,
                               "stop_reason": stop_reason, "params": params, "time_to_bleu": bleu_clock.reached}
    for line in bleu_clock.summary_lines():
        log(f"[peers] {line}")
    if ev.test_at_end and len(bundle.splits["test"]):
        t_eval, source = time.perf_counter(), "last"
        if best_state is not None:
            model.load_state_dict(best_state)
            source = "best valid BLEU"
        test_src, test_tgt = encode_split(bundle.splits["test"], tok.eos_id, max_pos)
        t_loss = valid_loss(model, test_src, test_tgt, tok, device, recipe.batch_size)
        sc = scores(model, bundle, "test", device, ev, max_pos, decode="beam")  # the whole split
        metrics.log({"kind": "test", "epoch": epoch + 1, "weights": source, "test_loss": t_loss,
                     "test_bleu": sc["bleu"], "test_chrf": sc["chrf"], "test_sentences": sc["sentences"],
                     **record_fields(sc, "test_"), "decoding": decoding_settings(ev, "beam"),
                     "eval_seconds": time.perf_counter() - t_eval, "wall_seconds": clock()})
        summary["test_bleu"] = sc["bleu"]
        log(f"[peers] test ({source}): loss {_fmt(t_loss, '.4f')} BLEU {_fmt(sc['bleu'], '.2f')} "
            f"({sc['sentences']} sentences)")
    summary["wall_seconds"] = clock()
    return summary


# -- Command line ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--data.x / --model.x / --eval.x VALUE override the preset (data, model size, "
                                       "validation protocol), as for python -m train.")
    p.add_argument("--peer", choices=("hf", "eole"), default="hf",
                   help="hf: MarianMTModel in this process; eole: eole's own CLI in its venv (bench/eole_peer.py)")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU race of fastmt, hf and eole (python -m bench.race; the flags after it are its own)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order seed")
    p.add_argument("--eole-save-every", type=int, default=500, help="eole: checkpoint (and score) every N steps")
    p.add_argument("--eole-peak-lr", type=float, default=3e-3, help="eole: the noam schedule's peak")
    p.add_argument("--preset", default="s18", help="fastmt preset giving the data, model size and validation "
                                                   "(its data, model and eval sections)")
    p.add_argument("--data-files", nargs="+", metavar="F", help="local jsonl/parquet/tsv files instead of the Hub")
    p.add_argument("--epochs", type=int, default=PeerRecipe.epochs)
    p.add_argument("--batch-size", type=int, default=PeerRecipe.batch_size, help="sentences per batch")
    p.add_argument("--lr", type=float, default=PeerRecipe.lr)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (smoke runs)")
    p.add_argument("--max-wall-seconds", type=float,
                   help="stop at a step boundary after S seconds since process start, then evaluate")
    p.add_argument("--name", default=NAME, help=f"run folder name (default {NAME})")
    p.add_argument("--out-dir", default="runs", help="parent folder of the run folder")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--no-test", action="store_true", help="skip the test-split evaluation at the end "
                                                          "(= --eval.test_at_end false)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from train.cli.flags import split_overrides
    from train.config import apply_overrides, get_config

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cpu" in argv:  # the race has its own flags
        from bench.race import main as race_main

        return race_main([a for a in argv if a != "--cpu"])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = split_overrides(rest, parser)
    if args.no_test:
        overrides["eval.test_at_end"] = "false"
    if args.data_files:
        missing = [f for f in args.data_files if not Path(f).is_file()]
        if missing:
            parser.error(f"--data-files: no such file(s) {missing} (give existing jsonl/parquet/tsv files)")
        overrides["data.data_files"] = ",".join(args.data_files)
    try:
        cfg = apply_overrides(get_config(args.preset), overrides)
        recipe = PeerRecipe(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_steps=args.max_steps,
                            max_wall_seconds=args.max_wall_seconds, seed=args.seed)
        if args.peer == "eole" and args.max_steps is None and args.max_wall_seconds is None:
            raise ValueError("--peer eole needs --max-steps or --max-wall-seconds (its noam schedule has no end)")
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    if args.peer == "eole":
        from bench import eole_peer as E

        try:
            E.eole_binary()
            E.recipe_for(cfg.model, steps=args.max_steps or 1, save_every=1, seed=0, tokens_per_step=8, max_len=8)
        except (E.EoleMissing, ValueError) as e:
            parser.error(str(e))
        summary = E.run_peer(cfg, run_dir=Path(args.out_dir) / (args.name if args.name != NAME else "eole"),
                             steps=args.max_steps, wall_s=args.max_wall_seconds, save_every=args.eole_save_every,
                             seed=args.seed, peak_lr=args.eole_peak_lr, test=cfg.eval.test_at_end,
                             clock=process_seconds)
    else:
        _require_transformers()
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        if device.type == "cpu":
            from train import flush_denormals

            flush_denormals()
        summary = train_peer(cfg, recipe, run_dir=Path(args.out_dir) / args.name, device=device)  # a free name
    print("summary: " + json.dumps(summary, default=str))
    if args.peer == "hf":
        print(f"run folder: {summary['run_dir']} (metrics.jsonl, provenance.json, curves.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
