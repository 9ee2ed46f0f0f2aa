"""The static driver (``spans`` "pow2"/"full"): every buffer allocated once per batch shape (rows, source width) --
the tokens, the (B, K, T) histories of live and finished hypotheses, their scores, lengths and "done" flags -- and
each step tensor work on them (``rule.beam_update``, ``rule.greedy_update``). The KV cache is never reordered: each
row writes its own slot per position and ``DecodeState.rows`` keeps the ancestry; attention gathers the filled
positions from there. "pow2" reads the next power of two >= 16 (a handful of shapes), "full" the whole cache (one
shape); both keep the position on the device and sync nothing, so ``cuda_graph=True`` captures one CUDA graph per
(batch shape, span) -- a decode bucket -- kept with the ``Decoder`` and replayed across calls: a bucket is captured
once per process (the second time a step of it runs; the first runs eagerly on the capture stream), never again
unless the model's parameters move. Captures run in thread-local capture mode, so the DataLoader's worker and
pin-memory threads, alive during evaluation, cannot invalidate them; each still synchronises and empties the
allocator caches (``torch.cuda.graph``). A capture that fails twice turns the Decoder eager for good: ``DecodeStats``
counts the failures and the fall-back and keeps the reason, and the training records carry them.
Host syncs: one "all done?" read every ``check_every`` steps and one read of the answers per batch.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
from einops import rearrange

from models.decoding.common import DecodeStats
from models.decoding.rule import (
    beam_answers,
    beam_update,
    best_finished,
    gnmt_penalties,
    greedy_answers,
    greedy_update,
    length_limits,
)
from models.decoding.state import DecodeState


class Run:
    """Static buffers of one batch shape (``spans`` "pow2"/"full"), the step that updates them, and the loop
    that drives it (eagerly, or by CUDA-graph replays)."""

    def __init__(self, dec, B: int, T: int, rows: int, device: torch.device):
        self.dec, self.B, self.T, self.device = dec, B, T, device
        self.state: DecodeState | None = None
        self.tokens = torch.empty(rows, dtype=torch.long, device=device)  # inputs of the next step
        self.limits = torch.empty(B, dtype=torch.long, device=device)
        self.done = torch.empty(B, dtype=torch.bool, device=device)
        self.forbidden = torch.tensor([dec.ids["pad"], dec.ids["bos"]], device=device)
        self.graphs: dict[int, Callable[[], None]] = {}  # span -> replay of its captured step
        self.warm: set[int] = set()

    def load(self, src, src_lengths, active):
        """Encode a batch into the state (in place after the first) and reset the search buffers."""
        repeat = 1 if self.dec.beam_size is None else self.dec.beam_size
        model = self.dec.model
        self.state = model.start_decoding(src, src_lengths, self.T, repeat=repeat, state=self.state)
        self.limits.copy_(length_limits(model, src_lengths, self.dec.max_len_ratio, self.dec.max_len_extra))
        if active is None:
            self.done.fill_(False)
        else:
            torch.logical_not(active, out=self.done)
        self.tokens.fill_(self.dec.ids["bos"])

    def logits(self, span: int | None) -> torch.Tensor:
        """decode_step with PAD and BOS made impossible: (rows, V) fp32."""
        logits = self.dec.model.decode_step(self.tokens, self.state, span).float()
        return logits.index_fill_(1, self.forbidden, -math.inf)

    def step(self, span: int | None):
        raise NotImplementedError

    def decode(self, stats: DecodeStats, check_every: int):
        for t in range(self.T):
            # "full": the whole cache; "pow2": the smallest power of two >= t+1 (at least 16)
            span = self.T if self.dec.spans == "full" else min(self.T, max(16, 1 << t.bit_length()))
            self._advance(span, stats)
            stats.steps += 1
            if (t + 1) % check_every == 0 and t + 1 < self.T:
                stats.host_syncs += 1
                if bool(self.done.all()):  # host sync: once per check_every steps
                    break

    def _advance(self, span: int | None, stats: DecodeStats):
        """One step: eager, or a CUDA graph per span. The first step of a span runs eagerly on the
        capture stream (lazy per-stream state, Triton compilation and autotuning happen there, not
        under capture); the second captures the graph (recording runs nothing) and replays it."""
        if not self.dec.cuda_graph:
            self.step(span)
            return
        replay = self.graphs.get(span)
        if replay is None:
            step = functools.partial(self.step, span)
            if span not in self.warm:
                self.warm.add(span)
                self.dec._graphs.warm(step)
                return
            replay = self._capture(step, stats)
            if replay is None:
                self.step(span)  # the failed capture ran nothing: this step runs eagerly
                return
            self.graphs[span] = replay
            stats.graphs += 1
        replay()

    def _capture(self, step: Callable[[], None], stats: DecodeStats) -> Callable[[], None] | None:
        """The replay of a captured ``step``; None (and eager decoding from then on, recorded in ``stats``)
        if capture fails twice (a first capture in a process can fail on some lazy initialisation)."""
        for attempt in (1, 2):
            try:
                return self.dec._graphs.capture(step)
            except Exception as err:  # noqa: BLE001 - any capture failure: retry once, then decode eagerly
                stats.capture_failures += 1
                reason = f"{type(err).__name__}: {err}"
                if attempt == 2:
                    warnings.warn(f"decoding: CUDA graph capture failed twice ({reason}); this Decoder decodes "
                                  f"eagerly from now on (cuda_graph=False skips the attempt)", stacklevel=4)
        self.dec.cuda_graph = False
        self.dec.fallback_reason = reason[:500]
        stats.fallbacks += 1
        return None

    def answers(self) -> list[list[int]]:
        raise NotImplementedError


class GreedyRun(Run):
    def __init__(self, dec, B: int, T: int, device: torch.device):
        super().__init__(dec, B, T, B, device)
        self.out = torch.empty(B, T, dtype=torch.long, device=device)  # generated tokens, PAD after the end

    def load(self, src, src_lengths, active):
        super().load(src, src_lengths, active)
        self.out.fill_(self.dec.ids["pad"])

    def step(self, span):
        length = self.state.pos  # (1,) tokens generated so far, this one included
        tok = greedy_update(self.logits(span), self.done, self.limits, length, self.dec.ids)  # (B,)
        self.out.index_copy_(1, length - 1, tok.unsqueeze(1))
        self.tokens.copy_(tok)

    def answers(self):
        return greedy_answers(self.out.tolist(), self.dec.ids)  # host sync: once per batch


class BeamRun(Run):
    def __init__(self, dec, B: int, T: int, device: torch.device):
        K = dec.beam_size
        super().__init__(dec, B, T, B * K, device)
        self.K = K
        self.alive = torch.empty(B, K, device=device)  # cumulative log-probs of the live beams
        self.hist = torch.empty(B, K, T, dtype=torch.long, device=device)  # their tokens so far
        self.fin_score = torch.empty(B, K, dtype=torch.float64, device=device)  # best finished, sorted; -inf: none
        self.fin_tok = torch.empty(B, K, T, dtype=torch.long, device=device)
        self.fin_len = torch.empty(B, K, dtype=torch.long, device=device)
        self.penalty = torch.tensor(gnmt_penalties(dec.length_penalty, T), dtype=torch.float64, device=device)
        self.own_row = torch.arange(B * K, device=device)  # (R,)
        self.first_row = rearrange(torch.arange(B, device=device) * K, "b -> b 1")  # (B, 1)
        self.col = torch.arange(T, device=device)  # (T,)
        self.rank = torch.arange(2 * K, device=device)  # (2K,) candidate order

    def load(self, src, src_lengths, active):
        super().load(src, src_lengths, active)
        if self.state.rows is None:
            self.state.rows = torch.empty(self.B * self.K, self.T, dtype=torch.long, device=self.device)
        self.state.rows.copy_(rearrange(self.own_row, "r -> r 1").expand(-1, self.T))
        self.alive.fill_(-math.inf)
        self.alive[:, 0] = 0.0  # only beam 0 is live at the start (the others are copies of it)
        self.hist.fill_(self.dec.ids["pad"])
        self.fin_score.fill_(-math.inf)
        self.fin_tok.fill_(self.dec.ids["pad"])
        self.fin_len.zero_()

    def step(self, span):
        logp = torch.log_softmax(self.logits(span), -1)  # (B*K, V)
        length = self.state.pos  # (1,) tokens generated so far, this step's included
        s = beam_update(logp, self.alive, self.hist, self.fin_score, self.fin_tok, self.fin_len, self.done,
                         self.limits, length, self.penalty[length], self.rank, self.dec.ids["eos"])
        self.fin_len.copy_(s.fin_len)
        self.fin_score.copy_(s.fin_score)
        self.fin_tok.copy_(s.fin_tok)
        # the survivors: scores, histories, next inputs, and where their cached positions live
        self.alive.copy_(s.alive)
        self.hist.copy_(s.hist)
        self.tokens.copy_(s.tok.view(-1))
        parent_row = (self.first_row + s.parent).view(-1)  # (R,)
        rows = self.state.rows.index_select(0, parent_row)  # positions <= t: the parent's
        self.state.rows.copy_(torch.where(self.col < length, rows, self.own_row.unsqueeze(1)))

    def answers(self):
        return beam_answers([best_finished(self.fin_score, self.fin_tok, self.fin_len)])


class StepGraphs:
    """How a ``Decoder`` records decoding steps and replays them: ``warm(step)`` runs a step where captures
    happen, ``capture(step)`` records it (running nothing) and returns its replay. One per Decoder."""

    def warm(self, step: Callable[[], None]) -> None:
        raise NotImplementedError

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        raise NotImplementedError


class CudaStepGraphs(StepGraphs):
    """CUDA graphs in one memory pool, captured on one side stream in thread-local capture mode: another
    thread's CUDA calls (the DataLoader's pin-memory thread allocating pinned memory, a worker) cannot
    invalidate a capture, as they can in the default global mode."""

    CAPTURE_MODE = "thread_local"

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def warm(self, step):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream), no_autocast_cache():
            step()
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, step):
        self.stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with no_autocast_cache(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                    capture_error_mode=self.CAPTURE_MODE):
            step()
        return graph.replay


def make_step_graphs(device: torch.device) -> StepGraphs:
    """The capture machinery for ``device`` (CUDA only)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs CUDA tensors, src is on {device}")
    return CudaStepGraphs(device)


@contextmanager
def no_autocast_cache():
    """The current autocast, with its weight-cast cache off: a captured graph must cast the weights
    itself (a cached cast made outside it would be freed when autocast exits, and never refreshed)."""
    dev = "cuda"
    with torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), enabled=torch.is_autocast_enabled(dev),
                        cache_enabled=False):
        yield
