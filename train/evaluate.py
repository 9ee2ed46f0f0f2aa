"""Validation: un-smoothed loss over a split, and sacreBLEU / chrF from beam search on its first N sentences."""

from __future__ import annotations

import time

import numpy as np
import torch

from train.loss import SummedCrossEntropy


@torch.no_grad()
def split_loss(model, bundle, split: str, device: torch.device, autocast) -> float:
    """Mean cross-entropy per real target token over ``split`` (no label smoothing, pad ignored)."""
    was_training = model.training
    model.eval()
    loss = SummedCrossEntropy(model, bundle.tokenizer.pad_id, label_smoothing=0.0)
    total = torch.zeros((), dtype=torch.float64, device=device)
    n_tokens = 0
    for batch in bundle.loader(split, shuffle=False):
        b = batch.to(device, non_blocking=True)
        with autocast:
            total += loss(b.tgt_out, **b.model_inputs())
        n_tokens += batch.num_target_tokens  # host-side count from the CPU batch
    model.train(was_training)
    return float(total) / max(n_tokens, 1)  # host sync: once per evaluation


def translate(model, tokenizer, sentences: list[str], device: torch.device, *, beam_size: int = 4,
              batch_size: int = 64, max_len_ratio: float = 1.5, max_len_extra: int = 10,
              autocast=None) -> list[str]:
    """Beam-search translations of ``sentences`` (batched, longest first to limit padding)."""
    from models.decoding import beam_search

    if not sentences:
        return []
    max_src = model.cfg.max_positions
    encoded = [ids[: max_src - 1] for ids in tokenizer.encode(sentences)]
    encoded = [np.append(ids, np.int32(tokenizer.eos_id)) for ids in encoded]  # + EOS, as in training
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    out: list[str | None] = [None] * len(sentences)
    ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        lens = [len(encoded[i]) for i in idx]
        src = torch.full((len(idx), max(lens)), tokenizer.pad_id, dtype=torch.int32)
        for row, i in enumerate(idx):
            src[row, : lens[row]] = torch.from_numpy(encoded[i])
        src_lengths = torch.tensor(lens, dtype=torch.int32)
        with ctx:
            hyps = beam_search(model, src.to(device), src_lengths.to(device), bos_id=tokenizer.bos_id,
                               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, beam_size=beam_size,
                               max_len_ratio=max_len_ratio, max_len_extra=max_len_extra)
        for i, text in zip(idx, tokenizer.decode(hyps)):
            out[i] = text
    return out  # type: ignore[return-value]


def bleu_chrf(model, bundle, split: str, device: torch.device, *, max_sentences: int | None, beam_size: int,
              batch_size: int, max_len_ratio: float, max_len_extra: int, autocast=None) -> dict:
    """sacreBLEU and chrF of beam-search output against the references of ``split``'s first N pairs."""
    import sacrebleu

    sp = bundle.splits[split]
    n = len(sp) if max_sentences is None else min(len(sp), max_sentences)
    src, refs = list(sp.src_text[:n]), list(sp.tgt_text[:n])
    t0 = time.perf_counter()
    hyps = translate(model, bundle.tokenizer, src, device, beam_size=beam_size, batch_size=batch_size,
                     max_len_ratio=max_len_ratio, max_len_extra=max_len_extra, autocast=autocast)
    return {
        "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
        "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
        "sentences": n,
        "decode_seconds": time.perf_counter() - t0,
        "samples": list(zip(src, refs, hyps)),
    }
