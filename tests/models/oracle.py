"""The oracle of the decoding tests: greedy and beam search as implemented before the device-side rewrite (host
bookkeeping every step, a growing history, every cache reordered, ``Transformer.decode_step``), unchanged but for
names. With a model whose ``attn_backend`` is "reference" it is fastmt's decoding before issue 36 end to end."""

from __future__ import annotations

import math

import torch
from einops import rearrange, repeat

from models.decoding import eval_mode, length_limits


def _oracle_next_logits(model, tokens, state, forbidden):
    logits = model.decode_step(tokens, state).float()
    logits[:, forbidden] = -math.inf
    return logits


def _oracle_strip(row, eos_id, pad_id):
    if eos_id in row:
        row = row[: row.index(eos_id)]
    return [tok for tok in row if tok != pad_id]


def oracle_greedy_decode(model, src, src_lengths, *, bos_id, eos_id, pad_id, max_len_ratio=1.5, max_len_extra=10):
    B = src.shape[0]
    with eval_mode(model):
        limits = length_limits(model, src_lengths, max_len_ratio, max_len_extra)  # (B,)
        steps = int(limits.max())
        state = model.start_decoding(src, src_lengths, steps)
        tokens = torch.full((B,), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        out = []
        for t in range(steps):
            logits = _oracle_next_logits(model, tokens, state, [pad_id, bos_id])  # (B, V)
            tokens = logits.argmax(-1)
            tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
            out.append(tokens)
            done = done | (tokens == eos_id) | (t + 1 >= limits)
            if bool(done.all()):
                break
        rows = torch.stack(out, 1).tolist()  # (B, steps)
    return [_oracle_strip(row, eos_id, pad_id) for row in rows]


def oracle_beam_search(model, src, src_lengths, *, bos_id, eos_id, pad_id, beam_size=4, length_penalty=0.6,
                       max_len_ratio=1.5, max_len_extra=10):
    B, K, device = src.shape[0], beam_size, src.device

    def score(logprob, length):
        return logprob / (((5.0 + length) / 6.0) ** length_penalty)

    with eval_mode(model):
        limits = length_limits(model, src_lengths, max_len_ratio, max_len_extra).tolist()  # B ints
        steps = max(limits)
        src_k = repeat(src, "b s -> (b k) s", k=K)  # every beam has its own row
        state = model.start_decoding(src_k, repeat(src_lengths, "b -> (b k)", k=K), steps)
        tokens = torch.full((B * K,), bos_id, dtype=torch.long, device=device)
        scores = torch.full((B, K), -math.inf, device=device)
        scores[:, 0] = 0.0
        history = torch.empty(B, K, 0, dtype=torch.long, device=device)  # (B, K, t) generated so far
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
        done = [False] * B
        base = rearrange(torch.arange(B, device=device) * K, "b -> b 1")  # (B, 1) first row of each sentence
        for t in range(steps):
            logp = torch.log_softmax(_oracle_next_logits(model, tokens, state, [pad_id, bos_id]), -1)  # (B*K, V)
            V = logp.shape[-1]
            cand = rearrange(scores, "b k -> b k 1") + rearrange(logp, "(b k) v -> b k v", k=K)  # (B, K, V)
            top_scores, top_idx = rearrange(cand, "b k v -> b (k v)").topk(min(2 * K, K * V), dim=-1)  # (B, 2K)
            top_beam, top_tok = top_idx // V, top_idx % V
            is_eos = top_tok == eos_id
            eos_hits = (is_eos[:, :K] & torch.isfinite(top_scores[:, :K])).nonzero().tolist()
            if eos_hits:
                hist_cpu, sc_cpu, beam_cpu = history.tolist(), top_scores.tolist(), top_beam.tolist()
                for b, j in eos_hits:
                    if not done[b]:
                        finished[b].append((score(sc_cpu[b][j], t + 1), hist_cpu[b][beam_cpu[b][j]]))
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
