"""Validation: un-smoothed loss over a split, and sacreBLEU / chrF of beam-search (or greedy) output on its
first N sentences, decoded in batches of a few fixed shapes (``models.decoding``)."""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from train.loss import SummedCrossEntropy


@torch.no_grad()
def split_loss(model, bundle, split: str, device: torch.device, autocast) -> float:
    """Mean cross-entropy per real target token over ``split`` (no label smoothing, pad ignored)."""
    from train.compile import eager_regions

    was_training = model.training
    model.eval()
    loss = SummedCrossEntropy(model, bundle.tokenizer.pad_id, label_smoothing=0.0)
    total = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    with eager_regions():  # compiled training regions run eagerly here: no variant for no-grad (train/compile.py)
        for batch in bundle.loader(split, shuffle=False):
            b = batch.to(device, non_blocking=True)
            with autocast:
                total += loss(b.tgt_out, **b.model_inputs())
            n_tokens += batch.num_target_tokens  # host-side count from the CPU batch
    model.train(was_training)
    return float(total) / max(n_tokens, 1)  # host sync: once per evaluation


DECODE_MODES = ("beam", "greedy")
# what an epoch record copies from ``evaluate_split``'s result: the decoding's cost and whether CUDA graphs held
DECODE_RECORD_KEYS = ("decode", "decode_seconds", "decode_steps", "host_syncs", "graphs_captured", "capture_failures",
                      "decode_fallbacks", "decode_eager_reason")
# source widths a batch is padded to (8 and 12 times powers of two): a validation set meets a handful
_SRC_WIDTHS = sorted({8 << k for k in range(16)} | {12 << k for k in range(16)})
_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings: Decoder}


def _src_width(longest: int, max_positions: int) -> int:
    return min(next(w for w in _SRC_WIDTHS if w >= longest), max_positions)


def _decoder(model, tokenizer, decode: str, beam_size: int, length_penalty: float, max_len_ratio: float,
             max_len_extra: int, cuda_graph: bool, keep: bool):
    """A Decoder for these settings; with ``keep`` the model's one for them, kept between calls: its
    per-shape buffers and CUDA graphs are built at the first evaluation and reused at the next ones."""
    from models.decoding import Decoder

    def make():
        return Decoder(model, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       beam_size=beam_size if decode == "beam" else None, length_penalty=length_penalty,
                       max_len_ratio=max_len_ratio, max_len_extra=max_len_extra, cuda_graph=cuda_graph)

    if not keep:
        return make()
    key = (decode, beam_size if decode == "beam" else None, length_penalty, max_len_ratio, max_len_extra, cuda_graph,
           tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    per_model = _decoders.setdefault(model, {})
    if key not in per_model:
        per_model[key] = make()
    return per_model[key]


def translate(model, tokenizer, sentences: list[str], device: torch.device, *, beam_size: int = 4,
              batch_size: int = 64, max_len_ratio: float = 1.5, max_len_extra: int = 10, autocast=None,
              length_penalty: float = 0.6, decode: str = "beam", fixed_shapes: bool | None = None,
              cuda_graph: bool | None = None, stats=None) -> list[str]:
    """Translations of ``sentences`` by beam search (``decode="beam"``) or greedy decoding, batched
    longest first.

    ``fixed_shapes`` (None: on for CUDA devices) gives every batch one of a handful of shapes:
    ``batch_size`` rows (the last batch padded with inactive rows; fewer sentences than that: the
    next power of two, if smaller) and sources padded to the next of 8, 12, 16, 24, 32, 48, ... tokens, so that
    kernels tune, and the decoders allocate and capture, once per shape, and the model's decoder is
    kept between calls. Off, each batch is as small as its sentences allow (on the CPU, padding
    only costs). ``cuda_graph`` (None: on for CUDA devices; needs ``fixed_shapes``) replays each
    decoding step from a CUDA graph. ``stats``: a ``models.decoding.DecodeStats`` that this call's
    batches, steps and host syncs are added to.
    """
    if decode not in DECODE_MODES:
        raise ValueError(f"translate: decode={decode!r} must be one of {DECODE_MODES}")
    if beam_size < 1 or batch_size < 1:
        raise ValueError(f"translate: beam_size={beam_size} and batch_size={batch_size} must be >= 1")
    fixed_shapes = device.type == "cuda" if fixed_shapes is None else fixed_shapes
    cuda_graph = fixed_shapes and device.type == "cuda" if cuda_graph is None else cuda_graph
    if cuda_graph and not fixed_shapes:
        raise ValueError("translate: cuda_graph=True needs fixed_shapes=True (one graph per batch shape)")
    if not sentences:
        return []
    max_src = model.cfg.max_positions
    encoded = [ids[: max_src - 1] for ids in tokenizer.encode(sentences)]
    encoded = [np.append(ids, np.int32(tokenizer.eos_id)) for ids in encoded]  # + EOS, as in training
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    rows = min(batch_size, 1 << (len(order) - 1).bit_length())  # fewer sentences: a power of two
    decoder = _decoder(model, tokenizer, decode, beam_size, length_penalty, max_len_ratio, max_len_extra,
                       cuda_graph, keep=fixed_shapes)
    out: list[str | None] = [None] * len(sentences)
    ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
    with ctx:
        for start in range(0, len(order), rows):
            idx = order[start : start + rows]
            lens = [len(encoded[i]) for i in idx]
            n_rows, width = (rows, _src_width(max(lens), max_src)) if fixed_shapes else (len(idx), max(lens))
            src = torch.full((n_rows, width), tokenizer.pad_id, dtype=torch.int32)
            src[len(idx) :, 0] = tokenizer.eos_id  # padding rows: an empty source, decoded to nothing
            for row, i in enumerate(idx):
                src[row, : lens[row]] = torch.from_numpy(encoded[i])
            src_lengths = torch.tensor(lens + [1] * (n_rows - len(idx)), dtype=torch.int32)
            active = torch.arange(n_rows) < len(idx)
            hyps = decoder(src.to(device, non_blocking=True), src_lengths.to(device, non_blocking=True),
                           active=active.to(device, non_blocking=True), stats=stats)
            for i, text in zip(idx, tokenizer.decode(hyps[: len(idx)])):
                out[i] = text
    return out  # type: ignore[return-value]


def bleu_chrf(model, bundle, split: str, device: torch.device, *, max_sentences: int | None, beam_size: int,
              batch_size: int, max_len_ratio: float, max_len_extra: int, autocast=None, length_penalty: float = 0.6,
              decode: str = "beam", fixed_shapes: bool | None = None, cuda_graph: bool | None = None) -> dict:
    """sacreBLEU and chrF of the decoded first N sentences of ``split`` against their references (decoding
    options: ``translate``), with the decoding's cost: ``decode_seconds`` (wall, the host waits for the answers), ``decode_steps``,
    ``host_syncs``, ``decode_batches``, ``graphs_captured`` (CUDA graphs made by this call), ``capture_failures``
    (capture attempts that raised), ``decode_fallbacks`` (decoders that gave up CUDA graphs in this call) and
    ``decode_eager_reason`` (why decoding runs eagerly although graphs were asked for; None otherwise)."""
    import sacrebleu

    from models.decoding import DecodeStats

    sp = bundle.splits[split]
    n = len(sp) if max_sentences is None else min(len(sp), max_sentences)
    src, refs = list(sp.src_text[:n]), list(sp.tgt_text[:n])
    stats = DecodeStats()
    t0 = time.perf_counter()
    hyps = translate(model, bundle.tokenizer, src, device, beam_size=beam_size, batch_size=batch_size,
                     max_len_ratio=max_len_ratio, max_len_extra=max_len_extra, autocast=autocast,
                     length_penalty=length_penalty, decode=decode, fixed_shapes=fixed_shapes, cuda_graph=cuda_graph,
                     stats=stats)
    seconds = time.perf_counter() - t0
    return {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
        "sentences": n,
        "decode": decode,
        "decode_seconds": seconds,
        "decode_steps": stats.steps,
        "host_syncs": stats.host_syncs,
        "decode_batches": stats.batches,
        "graphs_captured": stats.graphs,
        "capture_failures": stats.capture_failures,
        "decode_fallbacks": stats.fallbacks,
        "decode_eager_reason": stats.eager_reason,
        "samples": list(zip(src, refs, hyps)),
    }


def evaluate_split(model, bundle, split: str, device: torch.device, cfg, *, autocast, decode: str,
                   loss: bool = True) -> dict:
    """Loss and BLEU/chrF of ``split`` under an ``EvalConfig``: {loss, bleu, chrf, sentences, samples,
    decode, decode_seconds, decode_steps, host_syncs, graphs_captured, seconds}. An empty split gives Nones."""
    t0 = time.perf_counter()
    if len(bundle.splits[split]) == 0:
        return {"loss": None, "bleu": None, "chrf": None, "sentences": 0, "samples": [], "seconds": 0.0}
    out = {"loss": split_loss(model, bundle, split, device, autocast) if loss else None}
    out.update(bleu_chrf(model, bundle, split, device, max_sentences=cfg.max_sentences, beam_size=cfg.beam_size,
                         batch_size=cfg.batch_size, max_len_ratio=cfg.max_len_a, max_len_extra=cfg.max_len_b,
                         autocast=autocast, length_penalty=cfg.length_penalty, decode=decode,
                         cuda_graph=cfg.cuda_graphs and device.type == "cuda"))
    out["seconds"] = time.perf_counter() - t0
    return out

