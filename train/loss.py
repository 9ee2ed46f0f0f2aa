"""The training objective, in one place: summed label-smoothed cross-entropy over real target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SummedCrossEntropy(nn.Module):
    """Wraps the model: ``forward(tgt_out, **batch.model_inputs())`` returns the *summed* cross-entropy.

    Summed, not averaged: the step divides by the real target tokens of all its micro-batches, so k
    micro-batches give the gradient of one big batch. Pad positions (id ``pad_id``; packed tail padding
    too) are ignored. Compiling this wrapper rather than the bare model lets the compiler fuse the loss
    with the output projection; DDP wraps it so gradients reach shared parameters once. Validation uses
    the same module with ``label_smoothing=0``.
    """

    def __init__(self, model: nn.Module, pad_id: int, label_smoothing: float):
        super().__init__()
        self.model = model
        self.pad_id = pad_id
        self.label_smoothing = label_smoothing

    def forward(self, tgt_out: torch.Tensor, **model_inputs) -> torch.Tensor:
        logits = self.model(**model_inputs)  # (B, T, V); packed (1, C_tgt, V)
        return F.cross_entropy(logits.float().flatten(0, 1), tgt_out.long().flatten(), ignore_index=self.pad_id,
                               reduction="sum", label_smoothing=self.label_smoothing)
