"""``Decoder``: one model's greedy or beam-search decoding, reusable across calls, and the one-call functions
``greedy_decode`` and ``beam_search``. It picks the driver: the host search (``host.HostStream``, CPU tensors), the
eager tensor search (``device.LiveStream``) or the static buffers with optional CUDA graphs (``static``)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from models.decoding.common import SPANS, Batch, DecodeStats, eval_mode
from models.decoding.device import LiveStream
from models.decoding.host import HostStream
from models.decoding.rule import length_limit
from models.decoding.static import BeamRun, GreedyRun, Run, StepGraphs, make_step_graphs

if TYPE_CHECKING:
    from models.transformer import Transformer


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
    only; None: on for CPU tensors): the search runs on the host between the eager steps (``HostStream``), the
    same rule in Python floats, every sentence leaving at the step it is done (``check_every`` has no use there:
    reading a CPU tensor waits for nothing); off, it is tensor work (``LiveStream``). The model is held by a
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
        self._runs: dict[tuple, Run] = {}
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
        (``LiveStream``)."""
        stats = stats if stats is not None else DecodeStats()
        if not batches:
            return []
        if any(b.src.shape[0] == 0 for b in batches):  # a batch of no sentence answers nothing, decodes nothing
            rest = iter(self.decode_batches([b for b in batches if b.src.shape[0]], stats))
            return [[] if b.src.shape[0] == 0 else next(rest) for b in batches]
        device = batches[0].src.device
        if self.cuda_graph and self._graphs is None:
            self._graphs = make_step_graphs(device)  # before any work: refuses a CPU src
        check_every = self.check_every or (4 if device.type == "cuda" else 1)
        with eval_mode(self.model):
            if self.spans == "exact" and (self.host_search if self.host_search is not None else
                                          device.type == "cpu"):
                answers = HostStream(self, batches, check_every).decode(stats)
            elif self.spans == "exact":
                answers = LiveStream(self, batches, check_every).decode(stats)
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

    def _run_for(self, src: torch.Tensor) -> Run:
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
            T = length_limit(self.model, S, self.max_len_ratio, self.max_len_extra)
            kind = GreedyRun if self.beam_size is None else BeamRun
            self._runs[key] = kind(self, B, T, src.device)
        return self._runs[key]


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
