"""What every decoding driver shares: the ``Batch`` a call decodes, the ``DecodeStats`` it counts into, and
``eval_mode`` (eval, inference mode, compiled regions forced eager) around every call."""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from models.transformer import Transformer


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


class Batch(NamedTuple):
    """One batch for ``Decoder.decode_batches``: src (B, S) int, src_lengths int32 (B,), ``active`` bool (B,) or None
    (every row real), ``host_lengths``: src_lengths as a list when the caller has it (the eager path then reads the
    sources without padding: no mask when none is needed, no device value read)."""

    src: torch.Tensor
    src_lengths: torch.Tensor
    active: torch.Tensor | None = None
    host_lengths: list[int] | None = None


def eager_compiled_regions():
    """``torch.compiler.set_stance("force_eager")``: every torch.compile'd region runs eagerly inside the block.
    Only where dynamo is loaded (something may be compiled): otherwise there is nothing to make eager, and
    importing dynamo would create torch's cache folders under the temp dir for nothing."""
    return torch.compiler.set_stance("force_eager") if "torch._dynamo" in sys.modules else nullcontext()


@contextmanager
def eval_mode(model: Transformer):
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
