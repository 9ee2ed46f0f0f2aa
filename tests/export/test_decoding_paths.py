"""fastmt's own decoding, sped up for the CPU (issue 36, row 8), translates exactly as before: on the trained model
and 240 sentences, the eager path (finished sentences leave the batch, beams share one cache through an ancestry
mask, PyTorch's SDPA) gives token for token what the implementation before it gives (``tests/models/oracle.py``:
host bookkeeping, every cache reordered, the reference attention), greedy and beam search, and ``translate`` the
same texts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.toy import toy_rows
from models import Transformer
from models.decoding import Decoder
from tests.export.helpers import BOS, EOS, PAD, padded
from tests.models.oracle import oracle_beam_search, oracle_greedy_decode
from tests.utils import torch_threads
from train.cli.export import load_source
from train.evaluation.decode import encode_sources, translate

SENTENCES = 240  # toy sentences the model never saw (another seed than its corpus)
BATCH = 32


@pytest.mark.parametrize("beam,alpha", [(1, 0.0), (4, 0.6)], ids=["greedy", "beam4-gnmt0.6"])
def test_eager_path_translates_as_before(trained, beam, alpha):
    src = load_source(trained.ckpt)
    model, tok = src.model, src.tok
    old = Transformer(dataclasses.replace(model.cfg, attn_backend="reference")).eval()  # the attention used before
    old.load_state_dict(model.state_dict())
    sentences = [row["translation"]["en"] for row in toy_rows(SENTENCES, seed=36)]
    encoded = encode_sources(tok, sentences, model.cfg.max_positions)  # + EOS
    ids = [list(map(int, e[:-1])) for e in encoded]
    kw = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_ratio=1.5, max_len_extra=10)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # batches as translate makes them
    new_ids: list[list[int] | None] = [None] * len(ids)
    old_ids: list[list[int] | None] = [None] * len(ids)
    dec = Decoder(model, beam_size=None if beam == 1 else beam, length_penalty=alpha, **kw)
    assert dec.spans == "exact"  # the eager (live) path
    with torch_threads(1):
        for start in range(0, len(order), BATCH):
            part = order[start : start + BATCH]
            x, n = padded([ids[i] for i in part], [EOS])
            got = dec(x, n, host_lengths=n.tolist())
            if beam == 1:
                want = oracle_greedy_decode(old, x, n, **kw)
            else:
                want = oracle_beam_search(old, x, n, beam_size=beam, length_penalty=alpha, **kw)
            for i, g, w in zip(part, got, want):
                new_ids[i], old_ids[i] = g, w
        texts = translate(model, tok, sentences, torch.device("cpu"), beam_size=beam, batch_size=BATCH,
                          length_penalty=alpha, decode="greedy" if beam == 1 else "beam")
    assert len({tuple(h) for h in old_ids}) >= 50, "the trained model gives many different translations"
    assert sum(new == was for new, was in zip(new_ids, old_ids)) == SENTENCES
    assert texts == tok.decode(old_ids)
