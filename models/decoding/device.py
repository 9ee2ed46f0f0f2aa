"""The eager tensor driver (``spans="exact"`` on CUDA tensors, ``Decoder(host_search=False)``): batches decoded
through ``Transformer.live_step`` with no buffer of a static shape, the search as tensor work (``rule.beam_update``)
and one "all done?" read every ``check_every`` steps.

Only the sentences still decoding are stepped (the finished ones leave at each read), once a quarter of a batch is
left the next batch of the call starts beside it (each batch at its own position, row-wise work shared), the K beams
of a sentence write one cache under an ancestry mask (reordering beams copies no prefix), attention is PyTorch's
SDPA, and every answer is read in one host read per call.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import torch

from models.decoding.common import Batch, DecodeStats
from models.decoding.rule import (
    beam_answers,
    beam_update,
    best_finished,
    gnmt_penalties,
    greedy_answers,
    greedy_update,
    length_limit,
    length_limits,
)
from models.decoding.state import LiveState


class Group:
    """A batch decoding in a ``LiveStream``: its ``LiveState`` (position ``state.t``), the step count after which
    every one of its sentences is done (``bound``: its length limit for its widest source), and the (batch, row)
    of each of its sentences still decoding."""

    def __init__(self, state: LiveState, bound: int, rows: list[tuple[int, int]]):
        self.state, self.bound, self.rows = state, bound, rows


class LiveStream:
    """``spans="exact"``: batches decoded eagerly through ``Transformer.live_step``, no buffer of a static shape.
    At each "all done?" read the finished sentences leave (their answer rows set aside, every answer read in one
    host read at the end). When the sentences still decoding are at most a quarter of the largest batch, the next
    batch starts beside them as another group (at most ``GROUPS``): each group attends in its own caches at its own
    position, the row-wise work (projections, norms, FFN, the search) runs once for all, so the last sentences of
    a batch do not decode alone. The K beams of a sentence share one cache, where a beam's ancestry (``anc``: the
    beam slot that wrote each of its positions) is its attention mask: reordering beams copies no prefix."""

    GROUPS = 3  # batches decoding at once

    def __init__(self, dec, batches: Sequence[Batch], check_every: int):
        model = dec.model
        self.dec, self.ids, self.check_every = dec, dec.ids, check_every
        self.K = K = 1 if dec.beam_size is None else dec.beam_size
        self.device = device = batches[0].src.device
        for b in batches:
            if b.host_lengths is not None and len(b.host_lengths) != b.src.shape[0]:
                raise ValueError(f"host_lengths: {len(b.host_lengths)} lengths for a batch of {b.src.shape[0]} sources")
        self.bounds = [length_limit(model, b.src.shape[1], dec.max_len_ratio, dec.max_len_extra) for b in batches]
        self.pending = collections.deque(enumerate(batches))
        self.sizes = [b.src.shape[0] for b in batches]
        self.start_below = max(self.sizes) // 4  # the next batch starts when at most this many sentences decode
        self.groups: list[Group] = []
        self.set_aside: list[tuple[list[tuple[int, int]], torch.Tensor]] = []  # (batch, row)s and answer rows
        T = self.T = max(self.bounds)  # the search buffers' positions
        self.forbidden = torch.tensor([self.ids["pad"], self.ids["bos"]], device=device)
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)  # the next inputs (n*K,)
        self.penalties = gnmt_penalties(dec.length_penalty, T) if K > 1 else []  # beam search: lengths 0..T
        self._search_buffers()

    def _search_buffers(self) -> None:
        """The tensor search's per-sentence buffers (each with the row a starting sentence gets) and constants."""
        K, T, device, pad = self.K, self.T, self.device, self.ids["pad"]
        self.length = torch.arange(T + 1, device=device)  # length[t + 1 : t + 2]: tokens generated at step t
        self.limits = torch.zeros(0, dtype=torch.long, device=device)
        self.done = torch.zeros(0, dtype=torch.bool, device=device)
        if K == 1:
            self.fresh = {"out": torch.full((1, T), pad, dtype=torch.long, device=device)}  # generated tokens
        else:
            alive = torch.full((1, K), -math.inf, device=device)  # cumulative log-probs of the live beams
            alive[:, 0] = 0.0  # only beam 0 is live at the start (the others are copies of it)
            self.fresh = {"alive": alive, "hist": torch.full((1, K, T), pad, dtype=torch.long, device=device),
                          "fin_score": torch.full((1, K), -math.inf, dtype=torch.float64, device=device),
                          "fin_tok": torch.full((1, K, T), pad, dtype=torch.long, device=device),
                          "fin_len": torch.zeros(1, K, dtype=torch.long, device=device),
                          "anc": torch.zeros(1, K, T, dtype=torch.long, device=device)}  # slot of each position
            self.penalty = torch.tensor(self.penalties, dtype=torch.float64, device=device)
            self.rank = torch.arange(2 * K, device=device)
            self.slots = torch.arange(K, device=device)  # (K,) beam slots
            self.bias = None  # SDPA's additive mask values, in the queries' dtype (made with the first state)
        for name, row in self.fresh.items():
            setattr(self, name, row[:0])

    # -- who decodes ------------------------------------------------------------------------------------
    def start(self) -> None:
        """The next pending batch starts decoding, as a group of its own."""
        model, dec, K = self.dec.model, self.dec, self.K
        index, b = self.pending.popleft()
        B, bound = b.src.shape[0], self.bounds[index]
        state = model.start_live(b.src, b.src_lengths, bound, beams=K, host_lengths=b.host_lengths)
        if K > 1 and self.bias is None:
            like = state.caches[0][0]
            self.bias = (torch.zeros((), dtype=like.dtype, device=self.device),
                         torch.full((), -math.inf, dtype=like.dtype, device=self.device))
        self.groups.append(Group(state, bound, [(index, r) for r in range(B)]))
        limits = length_limits(model, b.src_lengths, dec.max_len_ratio, dec.max_len_extra)
        done = torch.zeros(B, dtype=torch.bool, device=self.device) if b.active is None else ~b.active.to(self.device)
        self.limits, self.done = torch.cat([self.limits, limits]), torch.cat([self.done, done])
        self.tokens = torch.cat([self.tokens, torch.full((B * K,), self.ids["bos"], dtype=torch.long,
                                                         device=self.device)])
        for name, row in self.fresh.items():
            setattr(self, name, torch.cat([getattr(self, name), row.expand(B, *row.shape[1:])]))

    def answer_rows(self) -> torch.Tensor:
        """(n, T) generated tokens (greedy) or ``best_finished`` rows (beam) of the sentences decoding."""
        return self.out if self.K == 1 else best_finished(self.fin_score, self.fin_tok, self.fin_len)

    def leave(self, finished: list[bool]) -> None:
        """The ``finished`` sentences (one flag per sentence decoding, groups in order) leave: their answer rows set
        aside, every per-sentence tensor and each group's state cut."""
        gone = [i for i, f in enumerate(finished) if f]
        if not gone:
            return
        rows = [row for g in self.groups for row in g.rows]
        self.set_aside.append(([rows[i] for i in gone], self.answer_rows().index_select(
            0, torch.tensor(gone, dtype=torch.long, device=self.device))))
        start, groups = 0, []
        for g in self.groups:
            flags = finished[start : start + len(g.rows)]
            start += len(g.rows)
            stay = [i for i, f in enumerate(flags) if not f]
            if not stay:
                continue
            if len(stay) < len(flags):
                g.state.keep(stay)
                g.rows = [g.rows[i] for i in stay]
            groups.append(g)
        self.groups = groups
        keep = torch.tensor([i for i, f in enumerate(finished) if not f], dtype=torch.long, device=self.device)
        self.limits, self.done = self.limits.index_select(0, keep), self.done.index_select(0, keep)
        self.tokens = self.tokens.view(-1, self.K).index_select(0, keep).view(-1)
        for name in self.fresh:
            setattr(self, name, getattr(self, name).index_select(0, keep))

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        K, groups = self.K, self.groups
        if len(groups) == 1:
            t = groups[0].state.t
            length = self.length[t + 1 : t + 2]  # (1,) tokens generated so far, this one included
        else:  # (n, 1): each group's sentences at its own position
            length = torch.cat([self.length[g.state.t + 1 : g.state.t + 2].expand(len(g.rows)) for g in groups])
            length = length.unsqueeze(1)
        states = [g.state for g in groups]
        if K == 1:
            tok = greedy_update(self.logits(states, [None] * len(groups)), self.done, self.limits, length, self.ids)
            if len(groups) == 1:
                self.out[:, t] = tok
            else:
                self.out.scatter_(1, length - 1, tok.unsqueeze(1))
            self.tokens = tok
            return
        masks, start = [], 0
        for g in groups:
            t, n = g.state.t, len(g.rows)
            anc = self.anc if len(groups) == 1 else self.anc[start : start + n]
            anc[:, :, t] = self.slots  # position t: written by each beam itself
            seen = (anc[:, :, : t + 1].unsqueeze(3) == self.slots).view(n, 1, K, (t + 1) * K)  # slot j*K + k
            masks.append(torch.where(seen, *self.bias))  # SDPA's additive mask
            start += n
        logp = torch.log_softmax(self.logits(states, masks), -1)  # (n*K, V)
        penalty = self.penalty[length] if len(groups) > 1 else self.penalty[t + 1 : t + 2]
        s = beam_update(logp, self.alive, self.hist, self.fin_score, self.fin_tok, self.fin_len, self.done,
                         self.limits, length, penalty, self.rank, self.ids["eos"])
        self.alive, self.hist, self.fin_score, self.fin_tok, self.fin_len = (s.alive, s.hist, s.fin_score,
                                                                              s.fin_tok, s.fin_len)
        self.anc = self.anc.gather(1, s.parent.unsqueeze(2).expand(-1, -1, self.T))  # the parents' ancestry
        self.tokens = s.tok.view(-1)

    def logits(self, states: list[LiveState], masks: list) -> torch.Tensor:
        """live_step with PAD and BOS made impossible: (n*K, V) fp32."""
        logits = self.dec.model.live_step(self.tokens, states, masks)
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return logits.index_fill_(1, self.forbidden, -math.inf)

    # -- the loop ---------------------------------------------------------------------------------------
    def decode(self, stats: DecodeStats) -> list[list[list[int]]]:
        self.start()
        steps = 0
        while self.groups:
            self.step()
            stats.steps += 1
            steps += 1
            # a group at its bound is done without a read; the others are read every check_every steps
            bounded = [g.state.t >= g.bound for g in self.groups for _ in g.rows]
            if steps % self.check_every == 0 and not all(bounded):
                stats.host_syncs += 1
                finished = self.done.tolist()  # host sync: once per check_every steps
                self.leave([f or b for f, b in zip(finished, bounded)])
            else:
                self.leave(bounded)
            while self.pending and len(self.groups) < self.GROUPS and \
                    sum(len(g.rows) for g in self.groups) <= self.start_below:
                self.start()
        order = [row for rows, _ in self.set_aside for row in rows]
        tensors = [t for _, t in self.set_aside]
        answers = (greedy_answers(torch.cat(tensors).tolist(), self.ids) if self.K == 1  # host sync: once
                   else beam_answers(tensors))
        out: list[list[list[int]]] = [[[] for _ in range(size)] for size in self.sizes]
        for (batch, row), answer in zip(order, answers):
            out[batch][row] = answer
        return out
