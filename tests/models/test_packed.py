"""layout="packed": the fixed-shape token streams of data batching="packed" (docs/ARCHITECTURE.md
"Packed batches") give the padded layout's logits and gradients on the same sentences; tail padding
and other segments are invisible; the forward compiles to one graph; decoding still works."""

from __future__ import annotations

import pytest
import torch

from models.decoding import beam_search, greedy_decode
from tests.utils import (
    BOS,
    EOS,
    PAD,
    VOCAB,
    assert_same,
    build,
    clone_as,
    logits_and_grads,
    make_batch,
    model_inputs,
    pack_batch,
    small_cfg,
    tgt_mask,
)

# 3 real pairs (incl. a length-1 target), 1 empty slot, and tails cut into dummies: src 21 + 11 pad
# tokens (segments of 9 + 2), tgt 14 + 10 pad tokens (9 + 1); max_len 9 bounds every segment.
SRC_LENS, TGT_LENS = [9, 5, 7], [6, 7, 1]
CAPACITY, SLOTS, MAX_LEN = (32, 24), 6, 9


def packed_batch(seed: int, src_lens=SRC_LENS, tgt_lens=TGT_LENS, capacity=CAPACITY, slots=SLOTS, max_len=MAX_LEN):
    padded = make_batch(src_lens, tgt_lens, VOCAB, seed=seed)
    return padded, pack_batch(padded, capacity, slots, max_len)


def real_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(batch))[tgt_mask(batch)]  # (n_real, V) in sentence order


def test_packed_batch_helper_follows_the_contract():
    _, b = packed_batch(0)
    assert b["src"].shape == (1, 32) and b["tgt_in"].shape == b["tgt_out"].shape == b["tgt_pos"].shape == (1, 24)
    assert b["src_lengths"].tolist() == [9, 5, 7, 0, 9, 2] and b["tgt_lengths"].tolist() == [6, 7, 1, 0, 9, 1]
    assert b["cu_seqlens_src"][-1] == 32 and b["cu_seqlens_tgt"][-1] == 24
    assert b["tgt_pos"][0, :15].tolist() == list(range(6)) + list(range(7)) + [0, 0]  # tail positions are 0


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="none-tied-sin-fusednorm"),
    pytest.param(dict(sharing="cycle_rev", enc_layers=4, dec_layers=4, enc_unique=2, dec_unique=2, norm="torch"),
                 id="cycle_rev-torchnorm"),
    pytest.param(dict(sharing="all", positions="learned", tie_embeddings=False, activation="relu"),
                 id="all-learned-untied-relu"),
])
def test_packed_matches_padded_logits_and_grads(kw):
    model = build(**kw)
    padded, packed = packed_batch(seed=1)
    assert_same(logits_and_grads(model, padded), logits_and_grads(clone_as(model, layout="packed"), packed))


def test_tail_padding_does_not_change_real_tokens():
    model = build(layout="packed").eval()
    _, batch = packed_batch(seed=2)
    ref = real_logits(model, batch)
    g = torch.Generator().manual_seed(3)
    noisy = dict(batch)
    for side, keys in (("src", ("src",)), ("tgt", ("tgt_in",))):
        used = int(batch[f"cu_seqlens_{side}"][batch["real_pairs"]])
        for key in keys + (f"{side}_pos",):
            t = batch[key].clone()
            hi = MAX_LEN if key.endswith("_pos") else VOCAB
            t[0, used:] = torch.randint(1, hi, (t.shape[1] - used,), generator=g, dtype=t.dtype)
            noisy[key] = t
    assert not torch.equal(noisy["tgt_pos"], batch["tgt_pos"])
    torch.testing.assert_close(real_logits(model, noisy), ref, atol=0, rtol=0)


def test_causal_within_a_segment_and_segments_isolated():
    model = build(layout="packed").eval()
    _, batch = packed_batch(seed=4)
    cu = batch["cu_seqlens_tgt"].tolist()  # segment k's targets: [cu[k], cu[k+1])
    with torch.no_grad():
        ref = model(**model_inputs(batch))[0]  # (C_tgt, V)

        p = cu[1] + 3  # segment 1, position 3: later tokens of segment 1 changed
        later = dict(batch, tgt_in=batch["tgt_in"].clone())
        later["tgt_in"][0, p : cu[2]] = (later["tgt_in"][0, p : cu[2]] + 5) % (VOCAB - 4) + 4
        out = model(**model_inputs(later))[0]
        torch.testing.assert_close(out[:p], ref[:p], atol=0, rtol=0)  # segment 0 and segment 1's prefix
        torch.testing.assert_close(out[cu[2] :], ref[cu[2] :], atol=0, rtol=0)  # segment 2 and the tail
        assert (out[p] - ref[p]).abs().max() > 1e-3  # position p reads its own input token

        other = dict(batch, src=batch["src"].clone())  # segment 1's source changed
        s = batch["cu_seqlens_src"].tolist()
        other["src"][0, s[1] : s[2] - 1] = (other["src"][0, s[1] : s[2] - 1] + 7) % (VOCAB - 4) + 4
        out = model(**model_inputs(other))[0]
        torch.testing.assert_close(out[: cu[1]], ref[: cu[1]], atol=0, rtol=0)
        torch.testing.assert_close(out[cu[2] :], ref[cu[2] :], atol=0, rtol=0)
        assert (out[cu[1]] - ref[cu[1]]).abs().max() > 1e-3  # cross-attention reads its own segment's source


def test_segment_ids_given_by_the_batch_give_the_same_logits_and_grads():
    """A packed batch's precomputed segment ids (the data workers build them) are the model's own: same logits and
    gradients with and without them; a wrong shape or dtype, or segment ids on a padded model, is refused."""
    from kernels.packed_attention import segment_ids

    model = build(layout="packed")
    padded, packed = packed_batch(seed=4)
    segs = {f"{side}_seg": segment_ids(packed[f"cu_seqlens_{side}"], packed[name].shape[1])
            for side, name in (("src", "src"), ("tgt", "tgt_in"))}
    assert_same(logits_and_grads(model, packed), logits_and_grads(model, {**packed, **segs}), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"src's segment ids as an int32 \(32,\) stream, got torch.int64"):
        model(**model_inputs(packed), src_seg=segs["src_seg"].long())
    with pytest.raises(ValueError, match=r"tgt_in's segment ids .* got torch.int32 \(23,\)"):
        model(**model_inputs(packed), tgt_seg=segs["tgt_seg"][1:])
    with pytest.raises(ValueError, match="src_seg/tgt_seg are packed-batch fields but layout='padded'"):
        build()(**model_inputs(padded), src_seg=segs["src_seg"])


def test_compiled_packed_forward_backward_is_one_graph_and_matches_eager():
    """fullgraph=True raises on any graph break (a boolean index, a .item(), a data-dependent shape)."""
    torch._dynamo.reset()
    model = build(layout="packed", enc_layers=1, dec_layers=1)
    _, batch = packed_batch(seed=5)
    eager = logits_and_grads(model, batch)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same(eager, logits_and_grads(model, batch, forward=compiled))
    _, other = packed_batch(seed=6, src_lens=[4, 8, 2, 6], tgt_lens=[9, 3, 3, 5])  # same shapes: no recompile
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert_same(logits_and_grads(model, other), logits_and_grads(model, other, forward=compiled))


@pytest.mark.interpreter
def test_triton_attention_matches_reference_in_packed_layout(poison):
    """Our varlen kernel (interpreter on CPU, outputs poisoned) inside the packed model: tiny streams, 1+1
    layers."""
    model = build(layout="packed", attn_backend="reference", enc_layers=1, dec_layers=1, d_ff=32)
    _, batch = packed_batch(seed=7, src_lens=[5, 3], tgt_lens=[4, 1], capacity=(10, 8), slots=4, max_len=5)
    assert_same(logits_and_grads(model, batch), logits_and_grads(clone_as(model, attn_backend="triton"), batch),
                atol=1e-4, rtol=1e-3)


def test_packed_model_decodes_like_the_padded_one():
    model = build(tie_embeddings=False).eval()
    packed = clone_as(model, layout="packed").eval()
    batch = make_batch([6, 2, 4], [3, 3, 3], VOCAB, seed=8)
    ids = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_extra=4)
    want = greedy_decode(model, batch["src"], batch["src_lengths"], **ids)
    assert greedy_decode(packed, batch["src"], batch["src_lengths"], **ids) == want
    assert beam_search(packed, batch["src"], batch["src_lengths"], beam_size=2, **ids) == \
        beam_search(model, batch["src"], batch["src_lengths"], beam_size=2, **ids)
    assert any(len(h) > 0 for h in want)  # something was generated


def test_packed_inputs_are_validated():
    model = build(layout="packed")
    padded, packed = packed_batch(seed=9)
    missing = {k: v for k, v in model_inputs(packed).items() if k not in ("cu_seqlens_tgt", "tgt_pos")}
    with pytest.raises(ValueError, match=r"layout='packed' needs \['cu_seqlens_tgt', 'tgt_pos'\]"):
        model(**missing)
    with pytest.raises(ValueError, match=r"\(1, C\) streams, got \(3, 9\)"):
        model(**dict(model_inputs(packed), src=padded["src"]))
    with pytest.raises(ValueError, match="max_len bound 40 must be a python int <= max_positions=32"):
        model(**dict(model_inputs(packed), max_src_len=40))
    with pytest.raises(ValueError, match="src_pos/tgt_pos/src_seg/tgt_seg are packed-batch fields but layout='padded'"):
        build()(**model_inputs(padded), src_pos=packed["src_pos"], tgt_pos=packed["tgt_pos"])
    with pytest.raises(ValueError, match="SDPA does not have"):
        small_cfg(layout="packed", attn_backend="sdpa")
