"""The training objective, in one place: summed label-smoothed cross-entropy over real target tokens.

``LOSSES`` maps a loss name to ``loss(hidden, weight, tgt_out, pad_id, label_smoothing) -> summed loss`` (the
output projection included, so a fused kernel may take it whole), beside models/components.py's ``NORMS`` and
``ACTIVATIONS``; ``SummedCrossEntropy(..., loss=name)`` picks one with the same ``pick``. Adding a loss: one
function with that signature and one entry here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.components import pick


def summed_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, tgt_out: torch.Tensor, pad_id: int,
                         label_smoothing: float) -> torch.Tensor:
    """Output projection + label-smoothed CE, summed over non-pad targets. hidden (..., d), weight (V, d),
    tgt_out (...) int. One function so a compiler sees the projection, the fp32 upcast and the loss
    together (the (tokens, V) fp32 logits need never be materialised)."""
    logits = F.linear(hidden, weight)  # (..., V) in autocast's dtype
    return F.cross_entropy(logits.float().flatten(0, -2), tgt_out.long().flatten(), ignore_index=pad_id,
                           reduction="sum", label_smoothing=label_smoothing)


# name -> loss(hidden, weight, tgt_out, pad_id, label_smoothing), summed over non-pad targets
LOSSES = {"cross_entropy": summed_cross_entropy}


class SummedCrossEntropy(nn.Module):
    """Wraps the model: ``forward(tgt_out, **batch.model_inputs())`` returns the *summed* cross-entropy.

    Summed, not averaged: the step divides by the real target tokens of all its micro-batches, so k
    micro-batches give the gradient of one big batch. Pad positions (id ``pad_id``; packed tail padding
    too) are ignored. DDP wraps this module so gradients reach shared parameters once; regional
    compilation compiles ``self.criterion`` (projection + loss) as its own region. Validation uses the
    same module with ``label_smoothing=0``. ``loss``: the name of the objective in ``LOSSES``.
    """

    def __init__(self, model: nn.Module, pad_id: int, label_smoothing: float, loss: str = "cross_entropy"):
        super().__init__()
        self.model = model
        self.pad_id = pad_id
        self.label_smoothing = label_smoothing
        self.criterion = pick(LOSSES, "loss", loss)

    def forward(self, tgt_out: torch.Tensor, **model_inputs) -> torch.Tensor:
        hidden = self.model(**model_inputs, return_hidden=True)  # (B, T, d); packed (1, C_tgt, d)
        return self.criterion(hidden, self.model.output_weight(), tgt_out, self.pad_id, self.label_smoothing)
