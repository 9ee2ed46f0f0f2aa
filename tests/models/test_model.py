"""Transformer properties: padding invariance, causality, layouts, backends, norms, sharing, compile."""

from __future__ import annotations

import pytest
import torch

from models import Transformer
from tests.utils import (
    VOCAB,
    assert_same,
    build,
    clone_as,
    logits_and_grads,
    make_batch,
    model_inputs,
    small_cfg,
    tgt_mask,
)

SRC_LENS, TGT_LENS = [9, 4, 1, 6], [7, 7, 2, 1]  # ragged, incl. length-1 sequences


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_padded_positions_do_not_matter(layout):
    model = build(layout=layout).eval()
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=1)
    ref = model(**model_inputs(batch))[tgt_mask(batch)]
    noisy = dict(batch)
    g = torch.Generator().manual_seed(7)
    for key, lens in (("src", "src_lengths"), ("tgt_in", "tgt_lengths")):
        t = batch[key].clone()
        pad = torch.arange(t.shape[1])[None, :] >= batch[lens][:, None]
        t[pad] = torch.randint(4, VOCAB, (int(pad.sum()),), generator=g, dtype=t.dtype)
        noisy[key] = torch.cat([t, torch.randint(4, VOCAB, (t.shape[0], 3), generator=g, dtype=t.dtype)], 1)
    noisy["max_src_len"], noisy["max_tgt_len"] = noisy["src"].shape[1], noisy["tgt_in"].shape[1]
    out = model(**model_inputs(noisy))  # 3 extra columns of junk on both sides
    assert out.shape == (len(SRC_LENS), max(TGT_LENS) + 3, VOCAB)
    torch.testing.assert_close(out[:, : max(TGT_LENS)][tgt_mask(batch)], ref, atol=1e-6, rtol=1e-5)


def test_decoder_is_causal_and_reads_the_source():
    model = build().eval()
    batch = make_batch([6, 6], [8, 8], VOCAB, seed=2)
    ref = model(**model_inputs(batch))
    p = 4
    changed = dict(batch, tgt_in=batch["tgt_in"].clone())
    changed["tgt_in"][:, p:] = (changed["tgt_in"][:, p:] + 5) % (VOCAB - 4) + 4
    out = model(**model_inputs(changed))
    torch.testing.assert_close(out[:, :p], ref[:, :p], atol=1e-6, rtol=1e-5)
    assert (out[:, p] - ref[:, p]).abs().max() > 1e-3  # position p reads its own input token
    other_src = dict(batch, src=torch.roll(batch["src"], 1, dims=0))
    assert (model(**model_inputs(other_src))[:, 0] - ref[:, 0]).abs().max() > 1e-3  # cross-attention works


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="none-tied-sin"),
    pytest.param(dict(sharing="cycle_rev", enc_layers=4, dec_layers=4, enc_unique=2, dec_unique=2), id="cycle_rev"),
    pytest.param(dict(positions="learned", tie_embeddings=False, activation="relu"), id="learned-untied-relu"),
])
def test_varlen_layout_matches_padded(kw):
    model = build(**kw)
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=3)
    assert_same(logits_and_grads(model, batch), logits_and_grads(clone_as(model, layout="varlen"), batch))


def test_varlen_without_cu_seqlens_derives_them():
    model = build(layout="varlen").eval()
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=4)
    full = model(**model_inputs(batch))
    bare = model(batch["src"], batch["tgt_in"], batch["src_lengths"], batch["tgt_lengths"])
    torch.testing.assert_close(bare[tgt_mask(batch)], full[tgt_mask(batch)])


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_sdpa_backend_matches_reference(layout):
    model = build(attn_backend="reference", layout=layout)
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=5)
    assert_same(logits_and_grads(model, batch), logits_and_grads(clone_as(model, attn_backend="sdpa"), batch))


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_triton_kernels_match_reference(layout, monkeypatch, poison):
    """Our attention and LayerNorm(+residual)(+GELU) kernels (interpreter on CPU, outputs poisoned) inside
    the model."""
    model = build(attn_backend="reference", layout=layout, d_model=32, n_heads=2, d_ff=32)
    batch = make_batch([5, 3], [4, 2], VOCAB, seed=6)
    ref = logits_and_grads(model, batch)
    monkeypatch.setenv("FASTMT_NORM_BACKEND", "triton")  # norm="fused" modules use backend="auto"
    assert_same(ref, logits_and_grads(clone_as(model, attn_backend="triton"), batch), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("ffn_norm", [True, False])
def test_fused_norms_match_torch_modules(activation, ffn_norm):
    model = build(norm="fused", activation=activation, ffn_norm=ffn_norm)
    with torch.no_grad():  # non-trivial LN parameters, so a misplaced weight or bias would show
        for n, p in model.named_parameters():
            if ".ln." in n:
                p.add_(0.1 * torch.randn_like(p))
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=8)
    assert_same(logits_and_grads(model, batch), logits_and_grads(clone_as(model, norm="torch"), batch))


def test_activation_checkpointing_gives_same_grads():
    model = build(sharing="all", enc_layers=3, dec_layers=3)
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=9)
    ckpt = clone_as(model)
    ckpt.encoder.checkpointing = ckpt.decoder.checkpointing = True
    assert_same(logits_and_grads(model, batch), logits_and_grads(ckpt, batch))
    assert Transformer(small_cfg(checkpointing=True)).decoder.checkpointing


def test_shared_blocks_equal_unshared_copies_with_summed_grads():
    """cycle_rev with 2 unique blocks == 'none' with those blocks copied into layers [0, 1, 1, 0]."""
    shared = build(sharing="cycle_rev", enc_layers=4, dec_layers=4, enc_unique=2, dec_unique=2)
    assert shared.encoder.schedule == shared.decoder.schedule == [0, 1, 1, 0]
    plain = build(enc_layers=4, dec_layers=4)
    state = {k: v for k, v in shared.state_dict().items() if ".blocks." not in k}
    for stack in ("encoder", "decoder"):
        for layer, i in enumerate(getattr(shared, stack).schedule):
            for k, v in getattr(shared, stack).blocks[i].state_dict().items():
                state[f"{stack}.blocks.{layer}.{k}"] = v
    plain.load_state_dict(state)
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=10)
    (ls, gs), (lp, gp) = logits_and_grads(shared, batch), logits_and_grads(plain, batch)
    torch.testing.assert_close(ls, lp)
    for name, g in gs.items():
        if ".blocks." not in name:
            torch.testing.assert_close(g, gp[name])
            continue
        stack, _, i, rest = name.split(".", 3)
        uses = [j for j, u in enumerate(getattr(shared, stack).schedule) if u == int(i)]
        torch.testing.assert_close(g, sum(gp[f"{stack}.blocks.{j}.{rest}"] for j in uses), atol=1e-6, rtol=1e-5)


def test_tied_embeddings_are_one_parameter():
    tied, untied = build(), build(tie_embeddings=False)
    assert tied.tgt_embed is tied.src_embed and tied.lm_head is None
    assert untied.tgt_embed.weight is not untied.src_embed.weight
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert n(untied) - n(tied) == 2 * VOCAB * 32


def test_sequence_longer_than_max_positions_is_rejected():
    model = build(max_positions=8)
    batch = make_batch([9], [3], VOCAB)
    with pytest.raises(ValueError, match="max_positions=8"):
        model(**model_inputs(batch))


def test_compiled_forward_backward_has_no_graph_break_and_matches_eager():
    torch._dynamo.reset()
    model = build(sharing="all", enc_layers=2, dec_layers=1)  # a shared block called twice, kept small
    batch = make_batch(SRC_LENS, TGT_LENS, VOCAB, seed=11)
    eager = logits_and_grads(model, batch)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    assert_same(eager, logits_and_grads(model, batch, forward=compiled))
