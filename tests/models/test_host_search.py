"""The CPU's host-side beam search (``Decoder(host_search=...)``, the default for CPU tensors): the same rule as the
device one step for step, the same answers end to end (and the oracle's), the slots compaction and the row moves it
relies on exact, and a CPU call that runs none of the device rule's tensor work."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.decoding import Batch, Decoder, DecodeStats, device, host, static
from models.decoding.rule import Sentence, beam_update, chain_tokens, host_beam_step, length_limits
from models.decoding.state import LiveState
from tests.models.oracle import oracle_beam_search, oracle_greedy_decode
from tests.utils import BOS, EOS, PAD, assert_same_hypotheses, build_eos, make_batch

IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


@pytest.mark.parametrize("V,K,lp,eos_bias", [(9, 4, 0.6, 1.5), (5, 3, 1.0, 2.5), (2, 2, 0.0, 0.0), (1, 3, 0.6, 0.0),
                                             (40, 5, 0.6, 0.5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_rule_equals_the_device_rule_step_by_step(V, K, lp, eos_bias, seed):
    """Random log-probs (EOS often near the top, ties from rounding to a coarse grid, sentences done from the start,
    limits reached): every step the host rule keeps the same live scores, parents, tokens and histories, finishes the
    same hypotheses with the same scores and lengths, and says done for the same sentences as ``beam_update``."""
    g = torch.Generator().manual_seed(seed)
    B, T, eos = 6, 12, 0
    limits = torch.randint(2, T + 1, (B,), generator=g)
    done = torch.zeros(B, dtype=torch.bool)
    done[0] = True  # a padding row
    alive = torch.full((B, K), -math.inf)
    alive[:, 0] = 0.0
    hist = torch.full((B, K, T), PAD, dtype=torch.long)
    fin_score = torch.full((B, K), -math.inf, dtype=torch.float64)
    fin_tok, fin_len = torch.full((B, K, T), PAD, dtype=torch.long), torch.zeros(B, K, dtype=torch.long)
    penalty = [((5.0 + n) / 6.0) ** lp for n in range(T + 1)]
    sents = [Sentence((0, b), int(limits[b]), bool(done[b]), K) for b in range(B)]
    rank = torch.arange(2 * K)
    for t in range(T):
        logits = torch.randn(B * K, V, generator=g) * 2
        logits[:, eos] += eos_bias
        logp = torch.log_softmax((logits * 4).round() / 4, -1)  # a coarse grid: equal candidates happen
        length = torch.tensor([t + 1])
        s = beam_update(logp, alive, hist, fin_score, fin_tok, fin_len, done, limits, length,
                         torch.tensor([penalty[t + 1]], dtype=torch.float64), rank, eos)
        cand = logp.view(B, K, V).add(torch.tensor([x.alive for x in sents]).unsqueeze(2))
        top_score, top_idx = cand.view(B, K * V).topk(min(2 * K, K * V), dim=-1)
        parents = [host_beam_step(x, sc, ix, V, K, eos, t + 1, penalty[t + 1])
                   for x, sc, ix in zip(sents, top_score.tolist(), top_idx.tolist())]
        assert parents == s.parent.tolist(), t
        assert [x.alive for x in sents] == s.alive.tolist(), t
        assert [[h[0] for h in x.hist] for x in sents] == s.tok.tolist(), t
        assert [[chain_tokens(h) for h in x.hist] for x in sents] == s.hist[:, :, : t + 1].tolist(), t
        for b, x in enumerate(sents):
            n = len(x.fin)
            assert [f[0] for f in x.fin] == s.fin_score[b, :n].tolist() and not torch.isfinite(s.fin_score[b, n:]).any()
            for k, (_, chain) in enumerate(x.fin):
                assert chain_tokens(chain) == s.fin_tok[b, k, : s.fin_len[b, k]].tolist(), (t, b, k)
        assert [x.done for x in sents] == done.tolist(), t
        alive, hist, fin_score, fin_tok, fin_len = s.alive, s.hist, s.fin_score, s.fin_tok, s.fin_len


SRC_LENS = [9, 1, 5, 3, 7, 2, 12]


@pytest.mark.parametrize("beam,lp,ratio,extra", [(4, 0.6, 1.5, 10), (3, 1.0, 1.0, 3), (7, 0.0, 0.5, 2), (None, 0.6, 1.5, 10)],
                         ids=["K4", "K3-lp1", "K7-short", "greedy"])
@pytest.mark.parametrize("seed", [0, 1])
def test_host_and_device_searches_give_the_same_answers(beam, lp, ratio, extra, seed):
    """End to end on the eager path: the host search (with its slots compaction every step) answers as the device
    search on the CPU and as the oracle; the default for CPU tensors is the host search."""
    model = build_eos(40, seed, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=seed)
    args = (batch["src"], batch["src_lengths"])
    kw = dict(beam_size=beam, length_penalty=lp, max_len_ratio=ratio, max_len_extra=extra, **IDS)
    host = Decoder(model, host_search=True, **kw)(*args)
    device = Decoder(model, host_search=False, **kw)(*args)
    default = Decoder(model, **kw)(*args)
    okw = dict(max_len_ratio=ratio, max_len_extra=extra, **IDS)
    want = (oracle_greedy_decode(model, *args, **okw) if beam is None else
            oracle_beam_search(model, *args, beam_size=beam, length_penalty=lp, **okw))
    limits = length_limits(model, batch["src_lengths"], ratio, extra).tolist()
    assert default == host
    assert_same_hypotheses(model, batch, host, device, limits, lp)
    assert_same_hypotheses(model, batch, host, want, limits, lp)


def test_cpu_default_runs_no_device_rule(monkeypatch):
    """A CPU call's search is the host rule: the device rule (tens of small tensor operations a step) never runs,
    and no step reads a device value for an "all done?" check (it has none to make)."""
    def refuse(*a, **k):
        raise AssertionError("the device rule ran on the CPU path")

    for driver in (device, static):  # the tensor rule, wherever a driver calls it
        monkeypatch.setattr(driver, "beam_update", refuse)
        monkeypatch.setattr(driver, "greedy_update", refuse)
    model = build_eos(40, 0, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    for beam in (None, 4):
        stats = DecodeStats()
        out = Decoder(model, beam_size=beam, **IDS)(batch["src"], batch["src_lengths"], stats=stats)
        assert len(out) == len(SRC_LENS) and stats.steps > 0 and stats.host_syncs == 0


def test_host_search_needs_the_eager_path():
    model = build_eos(40, 0, 3.0)
    with pytest.raises(ValueError, match="host_search=True"):
        Decoder(model, spans="pow2", host_search=True, **IDS)


def test_compaction_drops_dead_slots_and_keeps_the_answers(monkeypatch):
    """Compacting every step: the caches hold far fewer slots than K per position (most slots stop being attended to
    as beams share their prefix), and the answers are those of a search that never compacts."""
    model = build_eos(40, 1, 1.0)
    batch = make_batch([12, 11, 12, 10], [2] * 4, 40, seed=3)
    kw = dict(beam_size=4, max_len_ratio=2.0, max_len_extra=10, **IDS)
    seen = []
    original = host.HostStream.compact

    def compact(self, state, mask):
        before = state.slots
        original(self, state, mask)
        seen.append((state.t, before, state.slots))

    monkeypatch.setattr(host.HostStream, "COMPACT_EVERY", 10**9)
    never = Decoder(model, **kw)(batch["src"], batch["src_lengths"])
    monkeypatch.setattr(host.HostStream, "COMPACT_EVERY", 1)
    monkeypatch.setattr(host.HostStream, "compact", compact)
    always = Decoder(model, **kw)(batch["src"], batch["src_lengths"])
    limits = length_limits(model, batch["src_lengths"], 2.0, 10).tolist()
    assert_same_hypotheses(model, batch, always, never, limits, 0.6)
    assert any(after < before for _, before, after in seen)
    # a compaction that runs (it skips when it would keep 3/4) leaves well under K slots per position
    assert all(after <= 2 * t for t, before, after in seen if after < before), seen
    assert max(after for _, _, after in seen) < max(t for t, _, _ in seen) * 4 // 2, seen


def test_live_state_compact_and_keep_move_exactly_what_they_say():
    """``compact(order)``: each sentence's listed slots become its first slots (attention over them, masked alike,
    gives the same output); ``keep(rows)`` with rows in any order copies old row ``rows[i]`` to row i."""
    g = torch.Generator().manual_seed(0)
    n, H, W, D, K = 3, 2, 12, 4, 2
    caches = [(torch.randn(n, H, W, D, generator=g), torch.randn(n, H, W, D, generator=g))]
    cross = [(torch.randn(n, H, 5, D, generator=g), torch.randn(n, H, 5, D, generator=g))]
    state = LiveState(caches, cross, torch.zeros(n, 1, 1, 5), beams=K, max_len=W // K)
    state.t, state.slots = 4, 8
    mask = torch.full((n, 1, K, 8), -math.inf)
    live = [[0, 3, 5], [1, 2, 6], [2, 4, 7]]
    for i, slots in enumerate(live):
        mask[i, :, :, slots] = 0.0
    q = torch.randn(n, H, K, D, generator=g)
    k, v = caches[0]
    want = F.scaled_dot_product_attention(q, k[:, :, :8], v[:, :, :8], attn_mask=mask)
    order = torch.tensor(live)
    state.compact(order)
    assert state.slots == 3
    got = F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], attn_mask=mask.gather(3, order.view(n, 1, 1, 3)
                                                                                           .expand(n, 1, K, 3)))
    torch.testing.assert_close(got, want)
    before = [b.clone() for b in state._buffers]
    state.keep([2, 1])  # row 0 <- row 2, row 1 stays
    assert len(state) == 2
    for b, old in zip(state._buffers[:2], before[:2]):
        assert torch.equal(b[0, :, :3], old[2, :, :3]) and torch.equal(b[1, :, :3], old[1, :, :3])
    for b, old in zip(state._buffers[2:], before[2:]):
        assert torch.equal(b[0], old[2]) and torch.equal(b[1], old[1])


@pytest.mark.parametrize("kw", [dict(beam_size=4), dict(beam_size=None), dict(beam_size=4, spans="pow2"),
                                dict(beam_size=4, host_search=False)], ids=["host", "greedy", "pow2", "device"])
def test_a_batch_of_no_sentence_answers_nothing(kw):
    """An empty batch (alone, or between others) decodes to no answer on every path (it crashed every path before)."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch([9, 1, 5], [2] * 3, 40, seed=0)
    dec = Decoder(model, **kw, **IDS)
    src, lengths = batch["src"], batch["src_lengths"]
    assert dec(src[:0], lengths[:0]) == []
    empty, full = Batch(src[:0], lengths[:0]), Batch(src, lengths)
    assert dec.decode_batches([empty, full, empty]) == [[], dec(src, lengths), []]
