"""Evaluation: un-smoothed loss over a split, and sacreBLEU BLEU / chrF (with their signatures) of beam-search
(or greedy) output, decoded in batches of a few fixed shapes (``train.evaluation.decode``).

The protocol (``score_split``, also what bench/peers.py scores the Hugging Face baseline with): validation
decodes ``eval.max_sentences`` sentences spread evenly over the valid split (``spread``); the test split is always
decoded and scored whole. Sources are the split's texts as given, encoded here and cut to the model's positions (counted as
``truncated_sources``, never dropped); references are the texts as given. Scores are sacreBLEU's defaults
(BLEU: 13a tokenizer, exponential smoothing; chrF2: 6 character n-grams), reported with their signatures.

``fastmt evaluate --ckpt CKPT --src FILE [--ref FILE]`` scores a checkpoint on any test set (train/cli/evaluate.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from train.evaluation.decode import encode_sources, translate
from train.loss import SummedCrossEntropy


@torch.no_grad()
def split_loss(model, bundle, split: str, device: torch.device, autocast) -> float:
    """Mean cross-entropy per real target token over ``split`` (no label smoothing, pad ignored)."""
    from models.decoding import eager_compiled_regions

    was_training = model.training
    model.eval()
    loss = SummedCrossEntropy(model, bundle.tokenizer.pad_id, label_smoothing=0.0)
    total = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    with eager_compiled_regions():  # compiled training regions run eagerly: no variant for no-grad (models/decoding/common.py)
        for batch in bundle.loader(split, shuffle=False):
            b = batch.to(device, non_blocking=True)
            with autocast:
                total += loss(b.tgt_out, **b.model_inputs())
            n_tokens += batch.num_target_tokens  # host-side count from the CPU batch
    model.train(was_training)
    return float(total) / max(n_tokens, 1)  # host sync: once per evaluation


# what an epoch record copies from ``evaluate_split``'s result: the decoding's cost and whether CUDA graphs held
DECODE_RECORD_KEYS = ("decode", "decode_seconds", "decode_steps", "host_syncs", "graphs_captured", "capture_failures",
                      "decode_fallbacks", "decode_eager_reason")


def sentence_limit(split: str, cfg) -> int | None:
    """How many sentences of ``split`` an evaluation decodes under an ``EvalConfig``: ``cfg.max_sentences`` of
    the validation split, spread over it (periodic validation is a cost paid every epoch); every sentence of any
    other split (None): a test set is scored whole."""
    return cfg.max_sentences if split == "valid" else None


def spread(n: int, k: int | None) -> list[int]:
    """``k`` of the indices 0..n-1 spread evenly over the range (the middle of each of k equal parts), in order;
    all of them when ``k`` is None or >= n.

    A split keeps its pairs in corpus order, and a corpus is often a concatenation of sources: the stand-in
    corpus is 74 % short Tatoeba sentences followed by news. Its validation split's *first* 500 sentences were
    all Tatoeba (mean 10 source tokens against 17 over the split), so validation BLEU read 27.8 where the test
    split, scored whole, read 15.8 (H200, 2026-11-27). Evenly spaced rows sample every part of the split."""
    if k is None or k >= n:
        return list(range(n))
    return [(2 * i + 1) * n // (2 * k) for i in range(k)]


def corpus_scores(hyps: list[str], refs: list[list[str]]) -> dict:
    """sacreBLEU's corpus BLEU and chrF (its defaults) of ``hyps`` against ``refs`` (one list per reference
    set, each as long as ``hyps``), with each metric's signature ("nrefs:1|case:mixed|eff:no|tok:13a|...")."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    out = {"bleu": bleu.corpus_score(hyps, refs).score, "chrf": chrf.corpus_score(hyps, refs).score}
    out["bleu_signature"] = str(bleu.get_signature())
    out["chrf_signature"] = str(chrf.get_signature())
    return out


def score_split(bundle, split: str, translate_fn: Callable[..., list[str]], *, max_sentences: int | None,
                max_positions: int, takes_encoded: bool = False) -> dict:
    """Translate ``max_sentences`` (None: all) sources of ``bundle.splits[split]``, spread over it (``spread``), with
    ``translate_fn`` (texts in, one translation each out; ``takes_encoded``: it also takes the texts' encoder
    inputs, tokenised here once, which count the sources cut too) and score them against their references:
    {bleu, chrf, bleu_signature, chrf_signature, sentences, truncated_sources (sources longer than
    ``max_positions``, cut to fit), max_positions, loss_truncated_pairs (the data layer's count of pairs whose
    token arrays, the loss's input, were cut; None if it keeps none), decode_seconds, samples}."""
    sp = bundle.splits[split]
    rows = spread(len(sp), max_sentences)
    n = len(rows)
    src, refs = [sp.src_text[i] for i in rows], [sp.tgt_text[i] for i in rows]
    cut: list[tuple[int, int]] = []
    encoded = encode_sources(bundle.tokenizer, src, max_positions, cut)  # the one tokenisation of the sources
    t0 = time.perf_counter()
    hyps = translate_fn(src, encoded) if takes_encoded else translate_fn(src)
    seconds = time.perf_counter() - t0
    if len(hyps) != n:
        raise RuntimeError(f"score_split: {len(hyps)} translations for {n} sources")
    truncated = (getattr(bundle, "split_record", None) or {}).get("truncated")
    return {**corpus_scores(hyps, [refs]), "sentences": n, "truncated_sources": len(cut),
            "max_positions": max_positions,
            "loss_truncated_pairs": truncated.get(split) if isinstance(truncated, dict) else None,
            "decode_seconds": seconds, "samples": list(zip(src, refs, hyps))}


def bleu_chrf(model, bundle, split: str, device: torch.device, *, max_sentences: int | None, beam_size: int,
              batch_size: int, max_len_ratio: float, max_len_extra: int, autocast=None, length_penalty: float = 0.6,
              decode: str = "beam", fixed_shapes: bool | None = None, cuda_graph: bool | None = None) -> dict:
    """``score_split`` of this model's translations (decoding options: ``translate``), with the decoding's
    cost: ``decode_seconds`` (wall, the host waits for the answers), ``decode_steps``, ``host_syncs``,
    ``decode_batches``, ``graphs_captured`` (CUDA graphs made by this call), ``capture_failures`` (capture
    attempts that raised), ``decode_fallbacks`` (decoders that gave up CUDA graphs in this call) and
    ``decode_eager_reason`` (why decoding runs eagerly although graphs were asked for; None otherwise)."""
    from models.decoding import DecodeStats

    stats = DecodeStats()

    def fn(src: list[str], encoded) -> list[str]:
        return translate(model, bundle.tokenizer, src, device, beam_size=beam_size, batch_size=batch_size,
                         max_len_ratio=max_len_ratio, max_len_extra=max_len_extra, autocast=autocast,
                         length_penalty=length_penalty, decode=decode, fixed_shapes=fixed_shapes,
                         cuda_graph=cuda_graph, stats=stats, encoded=encoded)

    out = score_split(bundle, split, fn, max_sentences=max_sentences, max_positions=model.cfg.max_positions,
                      takes_encoded=True)
    out.update(decode=decode, decode_steps=stats.steps, host_syncs=stats.host_syncs, decode_batches=stats.batches,
               graphs_captured=stats.graphs, capture_failures=stats.capture_failures,
               decode_fallbacks=stats.fallbacks, decode_eager_reason=stats.eager_reason)
    return out


def decoding_settings(cfg, decode: str) -> dict:
    """The decoding a record's BLEU was measured with (an ``EvalConfig`` and the mode)."""
    beam = decode == "beam"
    return {"decode": decode, "beam_size": cfg.beam_size if beam else 1,
            "length_penalty": cfg.length_penalty if beam else None, "max_len_a": cfg.max_len_a,
            "max_len_b": cfg.max_len_b}


def record_fields(r: dict, prefix: str = "") -> dict:
    """What a metrics record carries about how its BLEU/chrF were measured, from an ``evaluate_split`` result:
    the sacreBLEU signatures and the number of sources cut to the model's positions (``prefix``: "test_")."""
    keys = ("bleu_signature", "chrf_signature", "truncated_sources", "loss_truncated_pairs")
    return {prefix + k: r.get(k) for k in keys}


def evaluate_split(model, bundle, split: str, device: torch.device, cfg, *, autocast, decode: str,
                   loss: bool = True) -> dict:
    """Loss and BLEU/chrF of ``split`` under an ``EvalConfig`` (``sentence_limit``: validation's first
    ``cfg.max_sentences``, the test split whole): {loss, bleu, chrf, bleu_signature, chrf_signature, sentences,
    truncated_sources, samples, decode, decode_seconds, decode_steps, host_syncs, graphs_captured, seconds}.
    An empty split gives Nones."""
    t0 = time.perf_counter()
    if len(bundle.splits[split]) == 0:
        return {"loss": None, "bleu": None, "chrf": None, "sentences": 0, "samples": [], "seconds": 0.0}
    out = {"loss": split_loss(model, bundle, split, device, autocast) if loss else None}
    out.update(bleu_chrf(model, bundle, split, device, max_sentences=sentence_limit(split, cfg),
                         beam_size=cfg.beam_size, batch_size=cfg.batch_size, max_len_ratio=cfg.max_len_a,
                         max_len_extra=cfg.max_len_b, autocast=autocast, length_penalty=cfg.length_penalty,
                         decode=decode, cuda_graph=cfg.cuda_graphs and device.type == "cuda"))
    out["seconds"] = time.perf_counter() - t0
    return out
