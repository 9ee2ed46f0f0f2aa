"""train/loss.py's LOSSES registry: the one entry is the summed CE over real targets, picked by name."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from train.loss import LOSSES, SummedCrossEntropy, summed_cross_entropy


class _Head(nn.Module):
    """A model stand-in: hidden = embedding of the source ids, output weight of its own."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, d), nn.Parameter(torch.randn(vocab, d))

    def forward(self, src, return_hidden):
        return self.emb(src)

    def output_weight(self):
        return self.out


def test_cross_entropy_is_summed_over_real_targets_and_picked_by_name():
    torch.manual_seed(0)
    model = _Head()
    src, tgt = torch.randint(0, 11, (2, 5)), torch.randint(1, 11, (2, 5))
    tgt[1, 3:] = 0  # pad
    loss = SummedCrossEntropy(model, pad_id=0, label_smoothing=0.1, loss="cross_entropy")
    assert loss.criterion is LOSSES["cross_entropy"] is summed_cross_entropy
    logits = model.emb(src) @ model.out.T
    real = tgt != 0
    expect = F.cross_entropy(logits[real], tgt[real], reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(loss(tgt, src=src), expect)


def test_unknown_loss_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"loss='focal' is not one of \('cross_entropy',\)"):
        SummedCrossEntropy(_Head(), pad_id=0, label_smoothing=0.0, loss="focal")
