"""Batched greedy and beam-search decoding with a KV cache, kept on the device with static shapes.

Both encode each source once, precompute the cross-attention K/V (once per unique decoder block,
repeated for the beams), and feed one token per step through ``Transformer.decode_step`` (decoder
self-attention K/V go into a preallocated cache: the prefix is never re-run).

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
then finished as they are). The answer is the best finished hypothesis (on equal scores: the one
finished first, then the better-ranked candidate).
With ``beam_size=1`` this is greedy decoding (the first EOS ends the sentence).

How it runs, two ways (``spans``). "exact" (the default without CUDA graphs: the CPU, and eager CUDA) is the eager
path (``_LiveStream``, ``Transformer.live_step``): only the sentences still decoding are stepped (the finished ones
leave at each "all done?" read), once a quarter of a batch is left the next batch of the call starts beside it (each
batch at its own position, row-wise work shared), the K beams of a sentence write one cache under an ancestry mask
(reordering beams copies no prefix), attention is PyTorch's SDPA, and every answer is read in one host read per call.
On CPU tensors (``host_search``, the default there) the search itself runs on the host (``_HostStream``): the same
rule in Python floats on one top-2K read per step, a sentence leaving at the step it is done, and every few steps
the shared caches keep only the slots a live beam attends to.
"pow2"/"full" are the static paths: every buffer is allocated once per batch shape (rows, source width): the tokens,
the (B, K, T) histories of live and finished hypotheses, their scores, lengths and "done" flags; each step is tensor
work on them. The KV cache is never reordered: each row writes its own slot per position and ``DecodeState.rows``
keeps the ancestry (which row holds position j of the beam now in row r); attention gathers the filled positions from
there. "pow2" reads the next power of two >= 16 (a handful of shapes), "full" the whole cache (one shape); both keep
the position on the device and sync nothing, so ``cuda_graph=True`` captures one CUDA graph per (batch shape, span) --
a decode bucket -- kept with the ``Decoder`` and replayed across calls: a bucket is captured once per process (the
second time a step of it runs; the first runs eagerly on the capture stream), never again unless the
model's parameters move. Captures run in thread-local capture mode, so the DataLoader's worker and
pin-memory threads, alive during evaluation, cannot invalidate them; each still synchronises and empties
the allocator caches (``torch.cuda.graph``). A capture that fails twice turns the Decoder eager for good:
``DecodeStats`` counts the failures and the fall-back and keeps the reason, and the training records carry
them (``train/evaluate.py``). Both paths share one search rule (``_beam_update``, ``_greedy_update``).
Host syncs: one "all done?" read every ``check_every`` steps (default: 4 on CUDA, where a read waits
for the queued steps; every step on the CPU, where it costs nothing and stops at once), and one read
of the answers per batch (static) or per call (eager).
Decoding runs in ``torch.inference_mode`` with the model in eval mode (restored after), and with
torch.compile'd regions (``run.compile_scope="blocks"``) forced eager: it never compiles a variant.
"""

from __future__ import annotations

import array
import collections
import functools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from einops import rearrange

from models.transformer import DecodeState, LiveState, Transformer

SPANS = ("exact", "pow2", "full")


@dataclass
class DecodeStats:
    """Counters summed over decoding calls (pass one as ``stats=``)."""

    batches: int = 0  # decoded batches
    steps: int = 0  # decoder steps (each over all rows of a batch)
    host_syncs: int = 0  # reads of device values by the host ("all done?" checks, answers)
    graphs: int = 0  # CUDA graphs captured
    capture_failures: int = 0  # capture attempts that raised (a first capture in a process may; it is retried once)
    fallbacks: int = 0  # decoders that gave up capturing in these calls and decode eagerly from then on
    eager_reason: str | None = None  # why the last call's decoder decodes eagerly although graphs were asked for


def eager_compiled_regions():
    """``torch.compiler.set_stance("force_eager")``: every torch.compile'd region runs eagerly inside the block.
    Only where dynamo is loaded (something may be compiled): otherwise there is nothing to make eager, and
    importing dynamo would create torch's cache folders under the temp dir for nothing."""
    return torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else nullcontext()


@contextmanager
def _eval(model: Transformer):
    """Eval mode, inference mode, and every torch.compile'd region run eagerly: decoding never adds a
    compiled variant to the training regions (each would be an Inductor compile and, with CUDA graphs, a
    recording, inside time-to-BLEU; under inference mode, pytorch#135892 on the way back to training).
    Its speed comes from ``cuda_graph`` capture of whole steps instead."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), eager_compiled_regions():
            yield
    finally:
        model.train(was_training)


def _length_limits(model, src_lengths, max_len_ratio, max_len_extra) -> torch.Tensor:
    """int64 (B,) generated-token limit per sequence (EOS included), clamped to [1, max_positions-1]."""
    limits = torch.floor(src_lengths.double() * max_len_ratio + max_len_extra).long()
    return limits.clamp(1, model.cfg.max_positions - 1)


def _length_limit(model, src_len: int, max_len_ratio: float, max_len_extra: float) -> int:
    """``_length_limits`` of one host-side length (the same float64 arithmetic)."""
    return min(max(math.floor(src_len * max_len_ratio + max_len_extra), 1), model.cfg.max_positions - 1)


class Decoder:
    """Greedy (``beam_size=None``) or beam-search decoding of one model, reusable across calls.

    ``decoder(src (B, S), src_lengths int32 (B,), active=None, stats=None, host_lengths=None) -> B lists of
    token ids``. ``active`` (bool (B,)) marks real rows: the others (padding a batch to a fixed shape) are done
    from the start and decode to []. ``stats`` (a ``DecodeStats``) gets the call's counts added.
    ``host_lengths``: ``src_lengths`` as a list, when the caller has it (the eager path then skips the source
    padding: no mask for a batch without any, reading no device value).
    Buffers (and CUDA graphs) are kept per (B, S, autocast dtype) and reused, so padding batches to a
    few shapes pays their set-up once; graphs are dropped when a parameter of the model moves.
    ``check_every``: steps between "all done?" reads (None: 4 on CUDA, 1 on the CPU). ``spans``:
    "exact" | "pow2" | "full" (None: "pow2" with ``cuda_graph``, else "exact"). ``cuda_graph``:
    replay each step from a CUDA graph (CUDA tensors; a capture that fails twice falls back to eager
    decoding with a warning, counted in ``stats`` and kept in ``fallback_reason``). ``host_search`` ("exact"
    only; None: on for CPU tensors): the search runs on the host between the eager steps (``_HostStream``), the
    same rule in Python floats, every sentence leaving at the step it is done (``check_every`` has no use there:
    reading a CPU tensor waits for nothing); off, it is tensor work (``_LiveStream``). The model is held by a
    weak reference.
    """

    def __init__(self, model: Transformer, *, bos_id: int, eos_id: int, pad_id: int, beam_size: int | None = 4,
                 length_penalty: float = 0.6, max_len_ratio: float = 1.5, max_len_extra: int = 10,
                 check_every: int | None = None, spans: str | None = None, cuda_graph: bool = False,
                 host_search: bool | None = None):
        if beam_size is not None and beam_size < 1:
            raise ValueError(f"beam_size={beam_size} must be >= 1 (or None for greedy decoding)")
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1 (steps between 'all done?' reads)")
        if not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty={length_penalty} must be finite")
        spans = spans if spans is not None else ("pow2" if cuda_graph else "exact")
        if spans not in SPANS:
            raise ValueError(f"spans={spans!r} must be one of {SPANS}")
        if cuda_graph and spans == "exact":
            raise ValueError("cuda_graph=True needs static shapes: spans='pow2' or 'full', not 'exact'")
        if host_search and spans != "exact":
            raise ValueError(f"host_search=True runs the search on the host between eager steps: spans='exact', "
                             f"not {spans!r}")
        self._model = weakref.ref(model)  # a weak reference: a cache of decoders keyed by model can free both
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.ids = dict(bos=bos_id, eos=eos_id, pad=pad_id)
        self.max_len_ratio, self.max_len_extra = max_len_ratio, max_len_extra
        self.check_every, self.spans, self.cuda_graph = check_every, spans, cuda_graph
        self.host_search = host_search
        self._runs: dict[tuple, _Run] = {}
        self._params: tuple[int, ...] = ()
        self._graphs: StepGraphs | None = None  # the capture machinery, made at the first graph call
        self.fallback_reason: str | None = None  # why this decoder stopped capturing (None: it never did)

    @property
    def model(self) -> Transformer:
        model = self._model()
        if model is None:
            raise RuntimeError("Decoder: its model no longer exists")
        return model

    def __call__(self, src: torch.Tensor, src_lengths: torch.Tensor, *, active: torch.Tensor | None = None,
                 stats: DecodeStats | None = None, host_lengths: list[int] | None = None) -> list[list[int]]:
        return self.decode_batches([Batch(src, src_lengths, active, host_lengths)], stats=stats)[0]

    def decode_batches(self, batches: Sequence[Batch], stats: DecodeStats | None = None) -> list[list[list[int]]]:
        """The answers of each batch, batch by batch (each batch's rows in order). Static spans decode one batch
        after the other; "exact" lets the next batch start while the last sentences of the one before finish
        (``_LiveStream``)."""
        stats = stats if stats is not None else DecodeStats()
        if not batches:
            return []
        if any(b.src.shape[0] == 0 for b in batches):  # a batch of no sentence answers nothing, decodes nothing
            rest = iter(self.decode_batches([b for b in batches if b.src.shape[0]], stats))
            return [[] if b.src.shape[0] == 0 else next(rest) for b in batches]
        device = batches[0].src.device
        if self.cuda_graph and self._graphs is None:
            self._graphs = _make_step_graphs(device)  # before any work: refuses a CPU src
        check_every = self.check_every or (4 if device.type == "cuda" else 1)
        with _eval(self.model):
            if self.spans == "exact" and (self.host_search if self.host_search is not None else
                                          device.type == "cpu"):
                answers = _HostStream(self, batches, check_every).decode(stats)
            elif self.spans == "exact":
                answers = _LiveStream(self, batches, check_every).decode(stats)
                stats.host_syncs += 1
            else:
                answers = []
                for b in batches:
                    run = self._run_for(b.src)
                    run.load(b.src, b.src_lengths, b.active)
                    run.decode(stats, check_every)
                    answers.append(run.answers())
                    stats.host_syncs += 1
            stats.batches += len(batches)
            stats.eager_reason = self.fallback_reason
            return answers

    def _run_for(self, src: torch.Tensor) -> _Run:
        """The buffers of this batch shape (created on first use); with graphs, dropped when the
        model's parameters moved (a graph reads them at their captured addresses)."""
        if self.cuda_graph:
            params = tuple(p.data_ptr() for p in self.model.parameters())
            if params != self._params:
                self._runs.clear()
                self._params = params
        dev = src.device.type
        autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        key = (tuple(src.shape), autocast, src.device)
        if key not in self._runs:
            B, S = src.shape
            T = _length_limit(self.model, S, self.max_len_ratio, self.max_len_extra)
            kind = _GreedyRun if self.beam_size is None else _BeamRun
            self._runs[key] = kind(self, B, T, src.device)
        return self._runs[key]


class Batch(NamedTuple):
    """One batch for ``Decoder.decode_batches``: src (B, S) int, src_lengths int32 (B,), ``active`` bool (B,) or None
    (every row real), ``host_lengths``: src_lengths as a list when the caller has it (the eager path then reads the
    sources without padding: no mask when none is needed, no device value read)."""

    src: torch.Tensor
    src_lengths: torch.Tensor
    active: torch.Tensor | None = None
    host_lengths: list[int] | None = None


class _Group:
    """A batch decoding in a ``_LiveStream``: its ``LiveState`` (position ``state.t``), the step count after which
    every one of its sentences is done (``bound``: its length limit for its widest source), and the (batch, row)
    of each of its sentences still decoding."""

    def __init__(self, state: LiveState, bound: int, rows: list[tuple[int, int]]):
        self.state, self.bound, self.rows = state, bound, rows


class _LiveStream:
    """``spans="exact"``: batches decoded eagerly through ``Transformer.live_step``, no buffer of a static shape.
    At each "all done?" read the finished sentences leave (their answer rows set aside, every answer read in one
    host read at the end). When the sentences still decoding are at most a quarter of the largest batch, the next
    batch starts beside them as another group (at most ``GROUPS``): each group attends in its own caches at its own
    position, the row-wise work (projections, norms, FFN, the search) runs once for all, so the last sentences of
    a batch do not decode alone. The K beams of a sentence share one cache, where a beam's ancestry (``anc``: the
    beam slot that wrote each of its positions) is its attention mask: reordering beams copies no prefix."""

    GROUPS = 3  # batches decoding at once

    def __init__(self, dec: Decoder, batches: Sequence[Batch], check_every: int):
        model = dec.model
        self.dec, self.ids, self.check_every = dec, dec.ids, check_every
        self.K = K = 1 if dec.beam_size is None else dec.beam_size
        self.device = device = batches[0].src.device
        for b in batches:
            if b.host_lengths is not None and len(b.host_lengths) != b.src.shape[0]:
                raise ValueError(f"host_lengths: {len(b.host_lengths)} lengths for a batch of {b.src.shape[0]} sources")
        self.bounds = [_length_limit(model, b.src.shape[1], dec.max_len_ratio, dec.max_len_extra) for b in batches]
        self.pending = collections.deque(enumerate(batches))
        self.sizes = [b.src.shape[0] for b in batches]
        self.start_below = max(self.sizes) // 4  # the next batch starts when at most this many sentences decode
        self.groups: list[_Group] = []
        self.set_aside: list[tuple[list[tuple[int, int]], torch.Tensor]] = []  # (batch, row)s and answer rows
        T = self.T = max(self.bounds)  # the search buffers' positions
        self.forbidden = torch.tensor([self.ids["pad"], self.ids["bos"]], device=device)
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)  # the next inputs (n*K,)
        self.penalties = []  # beam search: the GNMT length penalty of every length 0..T, python's float64 arithmetic
        if K > 1:
            self.penalties = [((5.0 + n) / 6.0) ** dec.length_penalty for n in range(T + 1)]
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
        self.groups.append(_Group(state, bound, [(index, r) for r in range(B)]))
        limits = _length_limits(model, b.src_lengths, dec.max_len_ratio, dec.max_len_extra)
        done = torch.zeros(B, dtype=torch.bool, device=self.device) if b.active is None else ~b.active.to(self.device)
        self.limits, self.done = torch.cat([self.limits, limits]), torch.cat([self.done, done])
        self.tokens = torch.cat([self.tokens, torch.full((B * K,), self.ids["bos"], dtype=torch.long,
                                                         device=self.device)])
        for name, row in self.fresh.items():
            setattr(self, name, torch.cat([getattr(self, name), row.expand(B, *row.shape[1:])]))

    def answer_rows(self) -> torch.Tensor:
        """(n, T) generated tokens (greedy) or ``_best_finished`` rows (beam) of the sentences decoding."""
        return self.out if self.K == 1 else _best_finished(self.fin_score, self.fin_tok, self.fin_len)

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
            tok = _greedy_update(self.logits(states, [None] * len(groups)), self.done, self.limits, length, self.ids)
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
        s = _beam_update(logp, self.alive, self.hist, self.fin_score, self.fin_tok, self.fin_len, self.done,
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
        answers = (_greedy_answers(torch.cat(tensors).tolist(), self.ids) if self.K == 1  # host sync: once
                   else _beam_answers(tensors))
        out: list[list[list[int]]] = [[[] for _ in range(size)] for size in self.sizes]
        for (batch, row), answer in zip(order, answers):
            out[batch][row] = answer
        return out


class _Sentence:
    """One sentence's search on the host (``_HostStream``): where its answer goes (batch, row), its length limit,
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


def _chain_tokens(chain: tuple | None) -> list[int]:
    """The tokens of a ``_Sentence`` chain, first to last."""
    out = []
    while chain is not None:
        out.append(chain[0])
        chain = chain[1]
    return out[::-1]


def _score(entry: tuple[float, tuple | None]) -> float:
    return -entry[0]


def _host_beam_step(s: _Sentence, scores: list[float], ids: list[int], V: int, K: int, eos: int, length: int,
                    penalty: float) -> list[int]:
    """``_beam_update``'s rule for one sentence, on the host: ``scores``/``ids`` its best ``min(2K, K*V)``
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


def _host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of python ints (int64) or floats (float32) through an ``array`` (a few times faster than
    ``torch.tensor`` of a list: a step builds some of these)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    code = "q" if dtype == torch.long else "f"
    return torch.frombuffer(array.array(code, values), dtype=dtype).to(device)


class _HostStream(_LiveStream):
    """``_LiveStream`` with the search on the host (``Decoder(host_search=...)``; the default for CPU tensors): a
    step's device work is the model, the log-softmax and one top-``2K`` over each sentence's candidates; the rule
    (``_host_beam_step``, greedy: the argmax) runs in Python on what that top-k read, with no tensor work per rule
    (the device rule is some 40 small tensor operations a step, most of a CPU step's time on a small model). Every
    sentence leaves at the step it is done. The ancestry mask is one additive (rows, T*K) buffer per group, its
    rows gathered by parent (one ``index_select``, which also drops the rows that left); every ``COMPACT_EVERY``
    steps the caches of each group keep only the slots a live beam attends to (``compact``: a step's attention then
    reads far fewer slots than ``K * (t + 1)``, the cost that grows with the output's length)."""

    COMPACT_EVERY = 8  # steps

    def _search_buffers(self) -> None:
        """The host search's: the sentences decoding, the answers, each group's mask, the live scores."""
        self.sents: list[_Sentence] = []
        self.answers: list[list[list[int]]] = [[[] for _ in range(size)] for size in self.sizes]
        self.masks: list[torch.Tensor] = []  # per group (rows, T_g*K): the additive ancestry mask (beam search)
        self.alive_t = torch.zeros(0, self.K, device=self.device)  # (n, K) float32: the live scores, for the step
        self.own: torch.Tensor | None = None  # (K, K): a step's own slots, 0 on the diagonal, -inf elsewhere

    def start(self) -> None:
        model, dec, K = self.dec.model, self.dec, self.K
        index, b = self.pending.popleft()
        B, bound = b.src.shape[0], self.bounds[index]
        state = model.start_live(b.src, b.src_lengths, bound, beams=K, host_lengths=b.host_lengths)
        self.groups.append(_Group(state, bound, [(index, r) for r in range(B)]))
        limits = _length_limits(model, b.src_lengths, dec.max_len_ratio, dec.max_len_extra).tolist()
        active = [True] * B if b.active is None else b.active.tolist()
        self.sents += [_Sentence((index, r), limits[r], not active[r], K) for r in range(B)]
        self.tokens = torch.cat([self.tokens, torch.full((B * K,), self.ids["bos"], dtype=torch.long,
                                                         device=self.device)])
        if K > 1:
            like = state.caches[0][0]
            if self.own is None:
                self.own = torch.full((K, K), -math.inf, dtype=like.dtype, device=self.device).fill_diagonal_(0.0)
            self.masks.append(torch.empty(B * K, bound * K, dtype=like.dtype, device=self.device))
            self.alive_t = torch.cat([self.alive_t, _host_tensor([a for s in self.sents[-B:] for a in s.alive],
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
            parents = [_host_beam_step(s, sc, ix, V, K, eos, length, penalty[length])
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
                    masks.append(self.masks[gi].index_select(0, _host_tensor(rows, torch.long, self.device)))
                    if g.state.t % self.COMPACT_EVERY == 0:
                        self.compact(g.state, masks[-1])
                groups.append(g)
                sents += [mine[i] for i in stay]
            start += len(mine)
        self.groups, self.masks, self.sents = groups, masks, sents
        if K > 1:
            self.tokens = _host_tensor([h[0] for s in sents for h in s.hist], torch.long, self.device)
            self.alive_t = _host_tensor([a for s in sents for a in s.alive], torch.float32, self.device).view(-1, K)
        else:
            self.tokens = _host_tensor([s.hist[0][-1] for s in sents], torch.long, self.device)

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

    def answer(self, s: _Sentence) -> list[int]:
        if self.K > 1:
            return _chain_tokens(s.fin[0][1]) if s.fin else []
        return _greedy_answers([s.hist[0]], self.ids)[0]

    def decode(self, stats: DecodeStats) -> list[list[list[int]]]:
        self.start()
        while self.groups:
            self.step()
            stats.steps += 1
            while self.pending and len(self.groups) < self.GROUPS and len(self.sents) <= self.start_below:
                self.start()
        return self.answers


class _Run:
    """Static buffers of one batch shape (``spans`` "pow2"/"full"), the step that updates them, and the loop
    that drives it (eagerly, or by CUDA-graph replays)."""

    def __init__(self, dec: Decoder, B: int, T: int, rows: int, device: torch.device):
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
        self.limits.copy_(_length_limits(model, src_lengths, self.dec.max_len_ratio, self.dec.max_len_extra))
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
        with torch.cuda.stream(self.stream), _no_autocast_cache():
            step()
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, step):
        self.stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with _no_autocast_cache(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                    capture_error_mode=self.CAPTURE_MODE):
            step()
        return graph.replay


def _make_step_graphs(device: torch.device) -> StepGraphs:
    """The capture machinery for ``device`` (CUDA only)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs CUDA tensors, src is on {device}")
    return CudaStepGraphs(device)


@contextmanager
def _no_autocast_cache():
    """The current autocast, with its weight-cast cache off: a captured graph must cast the weights
    itself (a cached cast made outside it would be freed when autocast exits, and never refreshed)."""
    dev = "cuda"
    with torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), enabled=torch.is_autocast_enabled(dev),
                        cache_enabled=False):
        yield


class _GreedyRun(_Run):
    def __init__(self, dec: Decoder, B: int, T: int, device: torch.device):
        super().__init__(dec, B, T, B, device)
        self.out = torch.empty(B, T, dtype=torch.long, device=device)  # generated tokens, PAD after the end

    def load(self, src, src_lengths, active):
        super().load(src, src_lengths, active)
        self.out.fill_(self.dec.ids["pad"])

    def step(self, span):
        length = self.state.pos  # (1,) tokens generated so far, this one included
        tok = _greedy_update(self.logits(span), self.done, self.limits, length, self.dec.ids)  # (B,)
        self.out.index_copy_(1, length - 1, tok.unsqueeze(1))
        self.tokens.copy_(tok)

    def answers(self):
        return _greedy_answers(self.out.tolist(), self.dec.ids)  # host sync: once per batch


def _greedy_update(logits: torch.Tensor, done: torch.Tensor, limits: torch.Tensor, length: torch.Tensor,
                   ids: dict[str, int]) -> torch.Tensor:
    """Greedy decoding's step rule: the next token of each row (B,) (PAD for rows already done), and ``done``
    (bool (B,)) updated in place: EOS chosen, or ``length`` (int64 (1,), or (B, 1) per row: tokens generated with
    this one) at the row's limit."""
    tok = torch.where(done, ids["pad"], logits.argmax(-1))  # (B,)
    done |= (tok == ids["eos"]) | (length.view(-1) >= limits)
    return tok


def _greedy_answers(rows: list[list[int]], ids: dict[str, int]) -> list[list[int]]:
    """Each row of generated tokens (PAD after the end) up to its EOS, PAD dropped."""
    out = []
    for row in rows:
        if ids["eos"] in row:
            row = row[: row.index(ids["eos"])]
        out.append([tok for tok in row if tok != ids["pad"]])
    return out


class _BeamRun(_Run):
    def __init__(self, dec: Decoder, B: int, T: int, device: torch.device):
        K = dec.beam_size
        super().__init__(dec, B, T, B * K, device)
        self.K = K
        self.alive = torch.empty(B, K, device=device)  # cumulative log-probs of the live beams
        self.hist = torch.empty(B, K, T, dtype=torch.long, device=device)  # their tokens so far
        self.fin_score = torch.empty(B, K, dtype=torch.float64, device=device)  # best finished, sorted; -inf: none
        self.fin_tok = torch.empty(B, K, T, dtype=torch.long, device=device)
        self.fin_len = torch.empty(B, K, dtype=torch.long, device=device)
        # GNMT length penalty of every length 0..T, in float64 with python's arithmetic
        lp = dec.length_penalty
        self.penalty = torch.tensor([((5.0 + n) / 6.0) ** lp for n in range(T + 1)], dtype=torch.float64,
                                    device=device)
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
        s = _beam_update(logp, self.alive, self.hist, self.fin_score, self.fin_tok, self.fin_len, self.done,
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
        return _beam_answers([_best_finished(self.fin_score, self.fin_tok, self.fin_len)])


class _Search(NamedTuple):
    """What one step of beam search leaves: the K survivors of each sentence (scores, parent beam, token,
    histories) and its K best finished hypotheses (scores, tokens, lengths)."""

    alive: torch.Tensor  # (B, K) cumulative log-probs of the live beams
    parent: torch.Tensor  # (B, K) the beam each survivor continues
    tok: torch.Tensor  # (B, K) its new token
    hist: torch.Tensor  # (B, K, T) its tokens so far
    fin_score: torch.Tensor  # (B, K) float64, best first; -inf: none
    fin_tok: torch.Tensor  # (B, K, T)
    fin_len: torch.Tensor  # (B, K)


def _beam_update(logp, alive, hist, fin_score, fin_tok, fin_len, done, limits, length, penalty, rank,
                 eos: int) -> _Search:
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
    return _Search(alive, parent, tok, hist, fin_score, fin_tok, fin_len)


def _best_finished(fin_score: torch.Tensor, fin_tok: torch.Tensor, fin_len: torch.Tensor) -> torch.Tensor:
    """(B, 1 + T): each sentence's best finished hypothesis, its length first (0: none finished)."""
    n = torch.where(torch.isfinite(fin_score[:, 0]), fin_len[:, 0], 0)  # (B,)
    return torch.cat([n.unsqueeze(1), fin_tok[:, 0]], 1)


def _beam_answers(best: list[torch.Tensor]) -> list[list[int]]:
    """The token lists of ``_best_finished`` rows, read in one host sync."""
    rows = torch.cat(best).tolist()  # host sync: once per batch
    return [row[1 : 1 + row[0]] for row in rows]


def greedy_decode(model: Transformer, src: torch.Tensor, src_lengths: torch.Tensor, *, bos_id: int, eos_id: int,
                  pad_id: int, max_len_ratio: float = 1.5, max_len_extra: int = 10, check_every: int | None = None,
                  spans: str | None = None, cuda_graph: bool = False, active: torch.Tensor | None = None,
                  stats: DecodeStats | None = None, host_search: bool | None = None) -> list[list[int]]:
    """src (B, S) int, src_lengths int32 (B,) -> B lists of token ids (no BOS/EOS). ``check_every``,
    ``spans``, ``cuda_graph``, ``active``, ``stats``, ``host_search``: see ``Decoder`` (a fresh one per call)."""
    dec = Decoder(model, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, beam_size=None, max_len_ratio=max_len_ratio,
                  max_len_extra=max_len_extra, check_every=check_every, spans=spans, cuda_graph=cuda_graph,
                  host_search=host_search)
    return dec(src, src_lengths, active=active, stats=stats)


def beam_search(model: Transformer, src: torch.Tensor, src_lengths: torch.Tensor, *, bos_id: int, eos_id: int,
                pad_id: int, beam_size: int = 4, length_penalty: float = 0.6, max_len_ratio: float = 1.5,
                max_len_extra: int = 10, check_every: int | None = None, spans: str | None = None,
                cuda_graph: bool = False, active: torch.Tensor | None = None, stats: DecodeStats | None = None,
                host_search: bool | None = None) -> list[list[int]]:
    """src (B, S) int, src_lengths int32 (B,) -> B lists of token ids (no BOS/EOS), the best hypothesis each.
    ``check_every``, ``spans``, ``cuda_graph``, ``active``, ``stats``, ``host_search``: see ``Decoder`` (a fresh
    one per call)."""
    if beam_size is None or beam_size < 1:
        raise ValueError(f"beam_search: beam_size={beam_size} must be >= 1")
    dec = Decoder(model, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, beam_size=beam_size,
                  length_penalty=length_penalty, max_len_ratio=max_len_ratio, max_len_extra=max_len_extra,
                  check_every=check_every, spans=spans, cuda_graph=cuda_graph, host_search=host_search)
    return dec(src, src_lengths, active=active, stats=stats)
