"""The search rule of greedy and beam-search decoding, in its two forms: tensor work on B sentences at once
(``beam_update``, ``greedy_update``: the device drivers' step, static shapes, no host sync) and Python floats on one
sentence (``host_beam_step``: the host driver's). The two are the same comparisons in the same order, checked
against each other step by step and against the oracle (tests/models/test_host_search.py, tests/models/oracle.py).

Length limit per sequence: at most ``floor(max_len_ratio * src_len + max_len_extra)`` generated tokens, EOS included
(``src_len`` counts the source EOS), and never more than ``max_positions - 1`` (``length_limits``). PAD and BOS are
never generated (the drivers set their logits to -inf). Answers are token ids without BOS/EOS.

Beam search keeps ``beam_size`` (K) live hypotheses per sentence. At each step it takes the best ``2K`` continuations;
those ending in EOS among the first K are finished (scored ``logprob / ((5 + len) / 6) ** length_penalty``, GNMT,
``gnmt_penalties``; len counts the EOS), the best K others live on. Each sentence keeps its K best finished
hypotheses and is done when it has that many and the worst of them scores at least the best live hypothesis
normalised at the current length (with ``length_penalty > 0`` a longer live hypothesis could still overtake), or
when it reaches its length limit (its live hypotheses are then finished as they are). The answer is the best
finished hypothesis (on equal scores: the one finished first, then the better-ranked candidate). With
``beam_size=1`` this is greedy decoding (the first EOS ends the sentence).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def gnmt_penalties(length_penalty: float, T: int) -> list[float]:
    """The GNMT length penalty ``((5 + n) / 6) ** length_penalty`` of every length n = 0..T, in python's float64
    arithmetic (one list for both forms of the rule: the tensor form reads it as a float64 tensor)."""
    return [((5.0 + n) / 6.0) ** length_penalty for n in range(T + 1)]



def length_limits(model, src_lengths, max_len_ratio, max_len_extra) -> torch.Tensor:
    """int64 (B,) generated-token limit per sequence (EOS included), clamped to [1, max_positions-1]."""
    limits = torch.floor(src_lengths.double() * max_len_ratio + max_len_extra).long()
    return limits.clamp(1, model.cfg.max_positions - 1)


def length_limit(model, src_len: int, max_len_ratio: float, max_len_extra: float) -> int:
    """``length_limits`` of one host-side length (the same float64 arithmetic)."""
    return min(max(math.floor(src_len * max_len_ratio + max_len_extra), 1), model.cfg.max_positions - 1)


def greedy_update(logits: torch.Tensor, done: torch.Tensor, limits: torch.Tensor, length: torch.Tensor,
                   ids: dict[str, int]) -> torch.Tensor:
    """Greedy decoding's step rule: the next token of each row (B,) (PAD for rows already done), and ``done``
    (bool (B,)) updated in place: EOS chosen, or ``length`` (int64 (1,), or (B, 1) per row: tokens generated with
    this one) at the row's limit."""
    tok = torch.where(done, ids["pad"], logits.argmax(-1))  # (B,)
    done |= (tok == ids["eos"]) | (length.view(-1) >= limits)
    return tok


def greedy_answers(rows: list[list[int]], ids: dict[str, int]) -> list[list[int]]:
    """Each row of generated tokens (PAD after the end) up to its EOS, PAD dropped."""
    out = []
    for row in rows:
        if ids["eos"] in row:
            row = row[: row.index(ids["eos"])]
        out.append([tok for tok in row if tok != ids["pad"]])
    return out


class Search(NamedTuple):
    """What one step of beam search leaves: the K survivors of each sentence (scores, parent beam, token,
    histories) and its K best finished hypotheses (scores, tokens, lengths)."""

    alive: torch.Tensor  # (B, K) cumulative log-probs of the live beams
    parent: torch.Tensor  # (B, K) the beam each survivor continues
    tok: torch.Tensor  # (B, K) its new token
    hist: torch.Tensor  # (B, K, T) its tokens so far
    fin_score: torch.Tensor  # (B, K) float64, best first; -inf: none
    fin_tok: torch.Tensor  # (B, K, T)
    fin_len: torch.Tensor  # (B, K)


def beam_update(logp, alive, hist, fin_score, fin_tok, fin_len, done, limits, length, penalty, rank,
                 eos: int) -> Search:
    """Beam search's step rule (module docstring) on B sentences of K beams: ``logp`` (B*K, V) log-probs of the
    next token, the live beams (``alive`` (B, K), ``hist`` (B, K, T)), the finished ones (``fin_*``), ``done``
    (bool (B,), updated in place), ``limits`` (B,), ``length`` (int64 (1,), or (B, 1) per sentence: tokens generated
    with this one), ``penalty`` (float64, length's shape: its GNMT penalty), ``rank`` (arange(2K)). Tensor work only:
    no host sync, static shapes (the CUDA-graph step and the eager live step share it)."""
    B, K, T = hist.shape
    V = logp.shape[-1]
    cand = alive.unsqueeze(2) + logp.view(B, K, V)  # (B, K, V)
    n = min(2 * K, K * V)
    top_score, top_idx = cand.view(B, K * V).topk(n, dim=-1)  # (B, n)
    top_beam, top_tok = top_idx // V, top_idx % V
    is_eos = top_tok == eos
    live = ~done  # (B,)
    normed = top_score.double() / penalty  # (B, n) float64: each candidate's GNMT score at this length
    ended = length - 1  # this step's position in the histories
    # EOS candidates ranked within the first K finish (their history is the parent's)
    fresh = is_eos[:, :K] & torch.isfinite(top_score[:, :K]) & live.unsqueeze(1)
    eos_score = torch.where(fresh, normed[:, :K], -math.inf)  # (B, K)
    eos_tok = hist.gather(1, top_beam[:, :K].unsqueeze(2).expand(-1, -1, T))
    # the best K non-EOS candidates live on
    keep = (is_eos.long() * n + rank[:n]).topk(K, dim=-1, largest=False).indices  # (B, K) EOS last
    alive, alive_normed = top_score.gather(1, keep), normed.gather(1, keep)
    parent, tok = top_beam.gather(1, keep), top_tok.gather(1, keep)  # (B, K)
    hist = hist.gather(1, parent.unsqueeze(2).expand(-1, -1, T))
    hist.scatter_(2, ended.view(-1, 1, 1).expand(B, K, 1), tok.unsqueeze(2))
    # a sentence at its length limit finishes its live hypotheses as they are
    at_limit = (length.view(-1) >= limits) & live  # (B,)
    lim_score = torch.where(at_limit.unsqueeze(1) & torch.isfinite(alive), alive_normed, -math.inf)
    # keep the K best finished: earlier ones first on equal scores (a stable sort), then EOS, then limit
    score = torch.cat([fin_score, eos_score, lim_score], 1)  # (B, 3K)
    order = score.sort(dim=1, descending=True, stable=True).indices[:, :K]  # (B, K)
    fin_tok = torch.cat([fin_tok, eos_tok, hist], 1).gather(1, order.unsqueeze(2).expand(-1, -1, T))
    fin_len = torch.cat([fin_len, ended.expand(B, K), length.expand(B, K)], 1).gather(1, order)
    fin_score = score.gather(1, order)
    # done: at the limit, or K finished and the worst beats the best live one normalised now (the max of the
    # normalised scores: dividing by the positive penalty keeps their order)
    worst = fin_score[:, K - 1]
    done |= at_limit | (torch.isfinite(worst) & (worst >= alive_normed.max(1).values))
    return Search(alive, parent, tok, hist, fin_score, fin_tok, fin_len)


def best_finished(fin_score: torch.Tensor, fin_tok: torch.Tensor, fin_len: torch.Tensor) -> torch.Tensor:
    """(B, 1 + T): each sentence's best finished hypothesis, its length first (0: none finished)."""
    n = torch.where(torch.isfinite(fin_score[:, 0]), fin_len[:, 0], 0)  # (B,)
    return torch.cat([n.unsqueeze(1), fin_tok[:, 0]], 1)


def beam_answers(best: list[torch.Tensor]) -> list[list[int]]:
    """The token lists of ``best_finished`` rows, read in one host sync."""
    rows = torch.cat(best).tolist()  # host sync: once per batch
    return [row[1 : 1 + row[0]] for row in rows]


class Sentence:
    """One sentence's search on the host (``HostStream``): where its answer goes (batch, row), its length limit,
    whether it is done, per live hypothesis its cumulative log-prob (``alive``, python floats holding float32 values)
    and tokens (``hist``: a chain ``(last token, the chain before it)``, None when empty, so a step adds a token
    without copying the prefix; greedy: the token list), and ``fin``: its best finished hypotheses (normalised
    score, chain), best first, at most K, finite scores only."""

    __slots__ = ("where", "limit", "done", "alive", "hist", "fin")

    def __init__(self, where: tuple[int, int], limit: int, done: bool, K: int):
        self.where, self.limit, self.done = where, limit, done
        self.alive = [0.0] + [-math.inf] * (K - 1)  # only beam 0 is live at the start
        self.hist: list = [None] * K if K > 1 else [[]]
        self.fin: list[tuple[float, tuple | None]] = []


def chain_tokens(chain: tuple | None) -> list[int]:
    """The tokens of a ``Sentence`` chain, first to last."""
    out = []
    while chain is not None:
        out.append(chain[0])
        chain = chain[1]
    return out[::-1]


def _score(entry: tuple[float, tuple | None]) -> float:
    return -entry[0]


def host_beam_step(s: Sentence, scores: list[float], ids: list[int], V: int, K: int, eos: int, length: int,
                    penalty: float) -> list[int]:
    """``beam_update``'s rule for one sentence, on the host: ``scores``/``ids`` its best ``min(2K, K*V)``
    continuations (torch's topk over its (K*V,) candidates, flat index ``beam*V + token``), ``length`` the tokens
    generated with this one and ``penalty`` its GNMT penalty (python float64, as the device rule's float64
    tensors). Updates ``s``; returns the beam each survivor continues. The same comparisons in the same order:
    EOS among the first K finish (finite, the sentence live), the best K others live on (EOS last), at its limit
    a live sentence finishes its live hypotheses; the K best finished kept by a stable sort (earlier first on
    equal scores); done as the device rule says (``max(a) / p`` is ``max(a / p)``: dividing by the positive
    penalty keeps the order). Most steps of most sentences have no EOS among the first K and no limit: the first K
    live on and nothing finishes."""
    live, hist = not s.done, s.hist
    cand = [divmod(i, V) for i in ids]  # (beam, token) by rank
    finished = None
    if all(tok != eos for _, tok in cand[:K]):
        keep = range(K)
    else:
        finished = list(s.fin)
        if live:
            finished += [(scores[r] / penalty, hist[b]) for r, (b, tok) in enumerate(cand[:K])
                         if tok == eos and math.isfinite(scores[r])]
        keep = [r for r, (_, tok) in enumerate(cand) if tok != eos]
        if len(keep) < K:  # a vocabulary too small for K others: EOS candidates live on, by rank
            keep += [r for r, (_, tok) in enumerate(cand) if tok == eos]
        keep = keep[:K]
    parents = [cand[r][0] for r in keep]
    s.alive = alive = [scores[r] for r in keep]
    s.hist = [(cand[r][1], hist[cand[r][0]]) for r in keep]
    at_limit = live and length >= s.limit
    if at_limit:  # its live hypotheses finish as they are
        finished = list(s.fin) if finished is None else finished
        finished += [(a / penalty, h) for a, h in zip(alive, s.hist) if math.isfinite(a)]
    if finished is not None:
        finished.sort(key=_score)  # stable: on equal scores the earlier first
        s.fin = finished[:K]
    if at_limit or (len(s.fin) == K and s.fin[-1][0] >= max(alive) / penalty):
        s.done = True
    return parents
