"""Batched greedy and beam-search decoding with a KV cache.

Both encode the source once, precompute the cross-attention K/V (once per unique decoder block),
and feed one token per step through ``Transformer.decode_step`` (decoder self-attention K/V are
appended to a preallocated cache: the prefix is never re-run).

Length limit per sequence: at most ``floor(max_len_ratio * src_len + max_len_extra)`` generated
tokens, EOS included (``src_len`` counts the source EOS), and never more than
``max_positions - 1``. PAD and BOS are never generated (their logits are set to -inf). Outputs are
token ids without BOS/EOS.

Beam search keeps ``beam_size`` live hypotheses per sentence. At each step it takes the best
``2 * beam_size`` continuations; those ending in EOS among the first ``beam_size`` are finished
(scored ``logprob / ((5 + len) / 6) ** length_penalty``, GNMT; len counts the EOS), the best
``beam_size`` others live on. Each sentence keeps its ``beam_size`` best finished hypotheses and is
done when it has that many and the worst of them scores at least the best live hypothesis
normalised at the current length (the usual heuristic: with ``length_penalty > 0`` a longer live
hypothesis could still overtake), or when it reaches its length limit (its live hypotheses are
then finished as they are). The answer is the best finished hypothesis.
With ``beam_size=1`` this is greedy decoding (the first EOS ends the sentence).

Host syncs: one per step (the "all done?" check, and beam search's bookkeeping of finished
hypotheses). Decoding runs in ``torch.inference_mode`` with the model in eval mode (restored after).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from einops import rearrange, repeat

from models.transformer import Transformer


@contextmanager
def _eval(model: Transformer):
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _length_limits(model, src_lengths, max_len_ratio, max_len_extra) -> torch.Tensor:
    """int64 (B,) generated-token limit per sequence (EOS included), clamped to [1, max_positions-1]."""
    limits = torch.floor(src_lengths.double() * max_len_ratio + max_len_extra).long()
    return limits.clamp(1, model.cfg.max_positions - 1)


def _next_logits(model, tokens, state, forbidden: list[int]) -> torch.Tensor:
    """decode_step, with the ``forbidden`` ids (PAD, BOS) made impossible. (B, V) fp32."""
    logits = model.decode_step(tokens, state).float()
    logits[:, forbidden] = -math.inf
    return logits


def greedy_decode(model: Transformer, src: torch.Tensor, src_lengths: torch.Tensor, *, bos_id: int, eos_id: int,
                  pad_id: int, max_len_ratio: float = 1.5, max_len_extra: int = 10) -> list[list[int]]:
    """src (B, S) int, src_lengths int32 (B,) -> B lists of token ids (no BOS/EOS)."""
    B = src.shape[0]
    with _eval(model):
        limits = _length_limits(model, src_lengths, max_len_ratio, max_len_extra)  # (B,)
        steps = int(limits.max())
        state = model.start_decoding(src, src_lengths, steps)
        tokens = torch.full((B,), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        out = []
        for t in range(steps):
            logits = _next_logits(model, tokens, state, [pad_id, bos_id])  # (B, V)
            tokens = logits.argmax(-1)
            tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
            out.append(tokens)
            done = done | (tokens == eos_id) | (t + 1 >= limits)
            if bool(done.all()):  # host sync, once per step
                break
        rows = torch.stack(out, 1).tolist()  # (B, steps)
    return [_strip(row, eos_id, pad_id) for row in rows]


def _strip(row: list[int], eos_id: int, pad_id: int) -> list[int]:
    if eos_id in row:
        row = row[: row.index(eos_id)]
    return [tok for tok in row if tok != pad_id]


def beam_search(model: Transformer, src: torch.Tensor, src_lengths: torch.Tensor, *, bos_id: int, eos_id: int,
                pad_id: int, beam_size: int = 4, length_penalty: float = 0.6, max_len_ratio: float = 1.5,
                max_len_extra: int = 10) -> list[list[int]]:
    """src (B, S) int, src_lengths int32 (B,) -> B lists of token ids (no BOS/EOS), the best hypothesis each."""
    if beam_size < 1:
        raise ValueError(f"beam_search: beam_size={beam_size} must be >= 1")
    B, K, device = src.shape[0], beam_size, src.device

    def score(logprob: float, length: int) -> float:
        return logprob / (((5.0 + length) / 6.0) ** length_penalty)

    with _eval(model):
        limits = _length_limits(model, src_lengths, max_len_ratio, max_len_extra).tolist()  # B ints
        steps = max(limits)
        src_k = repeat(src, "b s -> (b k) s", k=K)  # every beam has its own row
        state = model.start_decoding(src_k, repeat(src_lengths, "b -> (b k)", k=K), steps)
        tokens = torch.full((B * K,), bos_id, dtype=torch.long, device=device)
        # cumulative log-probs; only beam 0 is live at the start (the others are copies of it)
        scores = torch.full((B, K), -math.inf, device=device)
        scores[:, 0] = 0.0
        history = torch.empty(B, K, 0, dtype=torch.long, device=device)  # (B, K, t) generated so far
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        done = [False] * B
        base = rearrange(torch.arange(B, device=device) * K, "b -> b 1")  # (B, 1) first row of each sentence
        for t in range(steps):
            logp = torch.log_softmax(_next_logits(model, tokens, state, [pad_id, bos_id]), -1)  # (B*K, V)
            V = logp.shape[-1]
            cand = rearrange(scores, "b k -> b k 1") + rearrange(logp, "(b k) v -> b k v", k=K)  # (B, K, V)
            top_scores, top_idx = rearrange(cand, "b k v -> b (k v)").topk(min(2 * K, K * V), dim=-1)  # (B, 2K)
            top_beam, top_tok = top_idx // V, top_idx % V
            is_eos = top_tok == eos_id
            # finish EOS candidates ranked within the first K (host bookkeeping, once per step)
            eos_hits = (is_eos[:, :K] & torch.isfinite(top_scores[:, :K])).nonzero().tolist()
            if eos_hits:
                hist_cpu, sc_cpu, beam_cpu = history.tolist(), top_scores.tolist(), top_beam.tolist()
                for b, j in eos_hits:
                    if not done[b]:
                        finished[b].append((score(sc_cpu[b][j], t + 1), hist_cpu[b][beam_cpu[b][j]]))
            # the best K non-EOS candidates live on
            rank = is_eos.long() * (2 * K) + torch.arange(top_idx.shape[1], device=device)  # EOS sorted last
            keep = rank.topk(K, dim=-1, largest=False).indices  # (B, K)
            scores = top_scores.gather(1, keep)
            beams, tokens = top_beam.gather(1, keep), top_tok.gather(1, keep)  # (B, K)
            history = torch.cat([history.gather(1, repeat(beams, "b k -> b k t", t=history.shape[2])),
                                 rearrange(tokens, "b k -> b k 1")], dim=2)
            state.reorder(rearrange(base + beams, "b k -> (b k)"))
            tokens = rearrange(tokens, "b k -> (b k)")
            best_live = scores.max(1).values.tolist()  # (B,) raw log-probs of the best live beam
            for b in range(B):
                if done[b]:
                    continue
                finished[b] = sorted(finished[b], key=lambda x: -x[0])[:K]
                if t + 1 >= limits[b]:  # out of length: finish the live hypotheses as they are
                    sc, hist = scores[b].tolist(), history[b].tolist()
                    finished[b].extend((score(s, t + 1), h) for s, h in zip(sc, hist) if math.isfinite(s))
                    done[b] = True
                elif len(finished[b]) >= K and finished[b][-1][0] >= score(best_live[b], t + 1):
                    done[b] = True
            if all(done):
                break
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]
