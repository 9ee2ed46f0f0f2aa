"""The host driver (``spans="exact"`` on CPU tensors, the default there): ``device.LiveStream`` with the search on
the host. A step's tensor work is the model, the log-softmax and one top-2K; the rule (``rule.host_beam_step``) runs
in Python floats on what that top-k read, a sentence leaves at the step it is done, and every few steps the shared
caches keep only the slots a live beam attends to (``HostStream.compact``).
"""

from __future__ import annotations

import array
import math

import torch

from models.decoding.common import DecodeStats
from models.decoding.device import Group, LiveStream
from models.decoding.rule import Sentence, chain_tokens, greedy_answers, host_beam_step, length_limits
from models.decoding.state import LiveState


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of python ints (int64) or floats (float32) through an ``array`` (a few times faster than
    ``torch.tensor`` of a list: a step builds some of these)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    code = "q" if dtype == torch.long else "f"
    return torch.frombuffer(array.array(code, values), dtype=dtype).to(device)


class HostStream(LiveStream):
    """``LiveStream`` with the search on the host (``Decoder(host_search=...)``; the default for CPU tensors): a
    step's device work is the model, the log-softmax and one top-``2K`` over each sentence's candidates; the rule
    (``host_beam_step``, greedy: the argmax) runs in Python on what that top-k read, with no tensor work per rule
    (the device rule is some 40 small tensor operations a step, most of a CPU step's time on a small model). Every
    sentence leaves at the step it is done. The ancestry mask is one additive (rows, T*K) buffer per group, its
    rows gathered by parent (one ``index_select``, which also drops the rows that left); every ``COMPACT_EVERY``
    steps the caches of each group keep only the slots a live beam attends to (``compact``: a step's attention then
    reads far fewer slots than ``K * (t + 1)``, the cost that grows with the output's length)."""

    COMPACT_EVERY = 8  # steps

    def _search_buffers(self) -> None:
        """The host search's: the sentences decoding, the answers, each group's mask, the live scores."""
        self.sents: list[Sentence] = []
        self.answers: list[list[list[int]]] = [[[] for _ in range(size)] for size in self.sizes]
        self.masks: list[torch.Tensor] = []  # per group (rows, T_g*K): the additive ancestry mask (beam search)
        self.alive_t = torch.zeros(0, self.K, device=self.device)  # (n, K) float32: the live scores, for the step
        self.own: torch.Tensor | None = None  # (K, K): a step's own slots, 0 on the diagonal, -inf elsewhere

    def start(self) -> None:
        model, dec, K = self.dec.model, self.dec, self.K
        index, b = self.pending.popleft()
        B, bound = b.src.shape[0], self.bounds[index]
        state = model.start_live(b.src, b.src_lengths, bound, beams=K, host_lengths=b.host_lengths)
        self.groups.append(Group(state, bound, [(index, r) for r in range(B)]))
        limits = length_limits(model, b.src_lengths, dec.max_len_ratio, dec.max_len_extra).tolist()
        active = [True] * B if b.active is None else b.active.tolist()
        self.sents += [Sentence((index, r), limits[r], not active[r], K) for r in range(B)]
        self.tokens = torch.cat([self.tokens, torch.full((B * K,), self.ids["bos"], dtype=torch.long,
                                                         device=self.device)])
        if K > 1:
            like = state.caches[0][0]
            if self.own is None:
                self.own = torch.full((K, K), -math.inf, dtype=like.dtype, device=self.device).fill_diagonal_(0.0)
            self.masks.append(torch.empty(B * K, bound * K, dtype=like.dtype, device=self.device))
            self.alive_t = torch.cat([self.alive_t, host_tensor([a for s in self.sents[-B:] for a in s.alive],
                                                                  torch.float32, self.device).view(B, K)])

    def step(self) -> None:
        K, groups, eos = self.K, self.groups, self.ids["eos"]
        states, masks = [g.state for g in groups], []
        lengths = [g.state.t + 1 for g in groups for _ in g.rows]  # tokens generated with this step's, per sentence
        if K > 1:
            for g, mask in zip(groups, self.masks):
                u = g.state.slots
                rows = mask.view(-1, K, mask.shape[1])
                rows[:, :, u : u + K] = self.own  # this step's K slots: each beam sees its own
                masks.append(rows[:, :, : u + K].unsqueeze(1))  # (n_g, 1, K, u+K)
        logits = self.logits(states, masks if K > 1 else [None] * len(groups))
        if K == 1:
            for s, tok, length in zip(self.sents, logits.argmax(-1).tolist(), lengths):
                tok = self.ids["pad"] if s.done else tok
                s.hist[0].append(tok)
                s.done = s.done or tok == eos or length >= s.limit
            parents = None
        else:
            n, V = len(self.sents), logits.shape[1]
            cand = torch.log_softmax(logits, -1).view(n, K, V).add_(self.alive_t.unsqueeze(2))
            top_score, top_idx = cand.view(n, K * V).topk(min(2 * K, K * V), dim=-1)
            penalty = self.penalties
            parents = [host_beam_step(s, sc, ix, V, K, eos, length, penalty[length])
                       for s, sc, ix, length in zip(self.sents, top_score.tolist(), top_idx.tolist(), lengths)]
        self.leave_done(parents)

    def leave_done(self, parents: list[list[int]] | None) -> None:
        """The sentences done leave (their answers kept); every group's state and mask keep the others' rows, the
        mask's rows in the order of the survivors' parents; the next inputs from the survivors' last tokens."""
        K, start, groups, masks, sents = self.K, 0, [], [], []
        for gi, g in enumerate(self.groups):
            mine = self.sents[start : start + len(g.rows)]
            stay = [i for i, s in enumerate(mine) if not s.done]
            for s in mine:
                if s.done:
                    self.answers[s.where[0]][s.where[1]] = self.answer(s)
            if stay:
                if len(stay) < len(mine):  # each hole in the first rows takes one of the last rows: few move
                    m = len(stay)
                    order = list(range(m))
                    for hole, last in zip([i for i in range(m) if mine[i].done], [i for i in stay if i >= m]):
                        order[hole] = last
                    stay = order
                    g.state.keep(stay)
                    g.rows = [g.rows[i] for i in stay]
                if K > 1:
                    rows = [i * K + p for i in stay for p in parents[start + i]]
                    masks.append(self.masks[gi].index_select(0, host_tensor(rows, torch.long, self.device)))
                    if g.state.t % self.COMPACT_EVERY == 0:
                        self.compact(g.state, masks[-1])
                groups.append(g)
                sents += [mine[i] for i in stay]
            start += len(mine)
        self.groups, self.masks, self.sents = groups, masks, sents
        if K > 1:
            self.tokens = host_tensor([h[0] for s in sents for h in s.hist], torch.long, self.device)
            self.alive_t = host_tensor([a for s in sents for a in s.alive], torch.float32, self.device).view(-1, K)
        else:
            self.tokens = host_tensor([s.hist[0][-1] for s in sents], torch.long, self.device)

    def compact(self, state: LiveState, mask: torch.Tensor) -> None:
        """Keep in the caches only the slots some live beam of the sentence attends to (most slots die: each step
        adds K, and beams soon share their prefix; the group keeps its widest count), the mask's columns alike."""
        K, u = self.K, state.slots
        n = mask.shape[0] // K
        live = (mask[:, :u] == 0).view(n, K, u).any(1)  # (n, u)
        m = int(live.sum(1).max())
        if m > u * 3 // 4:  # not worth the copy
            return
        order = torch.sort(live.logical_not().to(torch.uint8), dim=1, stable=True).indices[:, :m]  # live first
        state.compact(order)
        mask[:, :m] = mask.view(n, K, -1)[:, :, :u].gather(2, order.unsqueeze(1).expand(n, K, m)).view(n * K, m)

    def answer(self, s: Sentence) -> list[int]:
        if self.K > 1:
            return chain_tokens(s.fin[0][1]) if s.fin else []
        return greedy_answers([s.hist[0]], self.ids)[0]

    def decode(self, stats: DecodeStats) -> list[list[list[int]]]:
        self.start()
        while self.groups:
            self.step()
            stats.steps += 1
            while self.pending and len(self.groups) < self.GROUPS and len(self.sents) <= self.start_below:
                self.start()
        return self.answers
