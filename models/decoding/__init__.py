"""Batched greedy and beam-search decoding with a KV cache: one search rule, three drivers.

Every driver encodes each source once, precomputes the cross-attention K/V (once per unique decoder block) and feeds
one token per step through the model (decoder self-attention K/V go into a cache: the prefix is never re-run).

- ``rule``: the search rule (length limits, GNMT scores, greedy and beam steps), as tensor work (``beam_update``) and
  as Python floats on one sentence (``host_beam_step``): the same comparisons in the same order;
- ``state``: what the model fills and steps (``KVCache``, ``DecodeState``, ``LiveState``);
- ``common``: ``Batch``, ``DecodeStats``, ``eval_mode``;
- the drivers, each in its module: ``host`` (CPU tensors: the search on the host between eager steps, the default
  there), ``device`` (eager tensor search: "exact" spans on CUDA), ``static`` (static shapes, "pow2"/"full" spans,
  CUDA-graph replays);
- ``decoder``: ``Decoder`` (picks the driver) and the one-call ``greedy_decode`` / ``beam_search``.

Host syncs: one "all done?" read every ``check_every`` steps (default: 4 on CUDA, where a read waits for the queued
steps; every step on the CPU, where it costs nothing and stops at once), and one read of the answers per batch
(static) or per call (eager). Decoding runs in ``torch.inference_mode`` with the model in eval mode (restored after),
and with torch.compile'd regions (``run.compile_scope="blocks"``) forced eager: it never compiles a variant.
"""

from models.decoding.common import SPANS, Batch, DecodeStats, eager_compiled_regions, eval_mode
from models.decoding.decoder import Decoder, beam_search, greedy_decode
from models.decoding.rule import length_limit, length_limits
from models.decoding.static import CudaStepGraphs, StepGraphs

__all__ = ["SPANS", "Batch", "CudaStepGraphs", "DecodeStats", "Decoder", "StepGraphs", "beam_search",
           "eager_compiled_regions", "eval_mode", "greedy_decode", "length_limit", "length_limits"]
