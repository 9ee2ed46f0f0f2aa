"""Cached decoding: step logits equal the full forward, greedy/beam correctness, a copy task learned;
the device-side search returns what the previous host-side implementation (kept below as the oracle)
returned, syncs the host once per ``check_every`` steps, and runs a step at static shapes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from models import Transformer
from models import layers as layers_module
from models.decoding import (
    Batch,
    Decoder,
    DecodeStats,
    beam_search,
    common,
    device,
    greedy_decode,
    host,
    length_limits,
    rule,
    state,
    static,
)
from tests.models.oracle import oracle_beam_search, oracle_greedy_decode
from tests.utils import (
    BOS,
    EOS,
    PAD,
    SyncCounter,
    assert_same_hypotheses,
    build_eos,
    decoding_model,
    make_batch,
    model_inputs,
    sequence_logprobs,
    small_cfg,
)

IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


@pytest.mark.parametrize("span", [None, 7], ids=["exact", "static7"])
@pytest.mark.parametrize("kw", [
    pytest.param({}, id="none"),
    pytest.param(dict(sharing="cycle_rev", dec_layers=4, dec_unique=2, enc_unique=1, positions="learned",
                      attn_backend="sdpa", norm="torch"), id="cycle_rev-learned-sdpa-torchnorm"),
])
def test_decode_steps_match_full_forward(kw, span):
    """Eager steps (the filled prefix) and static steps (a fixed span of a longer cache, masked on the
    device) both give the full forward's logits."""
    model = decoding_model(**kw)
    batch = make_batch([6, 2, 4], [5, 5, 5], 40, seed=1)  # ragged sources, full-length targets
    full = model(**model_inputs(batch))  # (B, T, V)
    state = model.start_decoding(batch["src"], batch["src_lengths"], max_len=5 if span is None else 9)
    with torch.no_grad():
        steps = torch.stack([model.decode_step(batch["tgt_in"][:, t].long(), state, span) for t in range(5)], 1)
    torch.testing.assert_close(steps, full.detach(), atol=1e-5, rtol=1e-4)
    assert int(state.pos) == 5


def test_greedy_equals_argmax_of_uncached_reforward():
    model = decoding_model()
    batch = make_batch([7, 3, 5, 1], [2, 2, 2, 2], 40, seed=2)
    ratio, extra = 1.0, 2
    out = greedy_decode(model, batch["src"], batch["src_lengths"], max_len_ratio=ratio, max_len_extra=extra, **IDS)
    assert len(out) == 4
    for b, toks in enumerate(out):
        limit = int(batch["src_lengths"][b]) * ratio + extra
        assert len(toks) <= limit and EOS not in toks and BOS not in toks
        seq = toks + ([EOS] if len(toks) < limit else [])  # stopped early only by EOS
        tgt_in = torch.tensor([[BOS] + seq[:-1]], dtype=torch.int32)
        with torch.no_grad():
            logits = model(batch["src"][b : b + 1], tgt_in, batch["src_lengths"][b : b + 1],
                           torch.tensor([len(seq)], dtype=torch.int32))
        logits[..., [PAD, BOS]] = -math.inf
        assert logits[0].argmax(-1).tolist() == seq


def test_beam_size_one_equals_greedy():
    model = decoding_model(seed=3)
    batch = make_batch([7, 3, 5, 1, 6], [2] * 5, 40, seed=3)
    args = (model, batch["src"], batch["src_lengths"])
    assert beam_search(*args, beam_size=1, **IDS) == greedy_decode(*args, **IDS)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_wide_beam_is_exact_search(length_penalty):
    """A beam wider than the hypothesis space finds the best-scoring sequence of an exhaustive search."""
    V, limit = 7, 3  # 4 specials + 3 words; at most 3 generated tokens
    model = decoding_model(vocab=V, seed=4)
    batch = make_batch([4], [2], V, seed=4)
    src, src_len = batch["src"], batch["src_lengths"]
    best = beam_search(model, src, src_len, beam_size=200, length_penalty=length_penalty, max_len_ratio=0.0,
                       max_len_extra=limit, **IDS)[0]
    # every sequence: some words (UNK is one; PAD and BOS are never generated) then EOS, or `limit` words
    words = [t for t in range(V) if t not in (EOS, PAD, BOS)]
    seqs = [list(p) + [EOS] for n in range(limit) for p in itertools.product(words, repeat=n)]
    seqs += [list(p) for p in itertools.product(words, repeat=limit)]
    lp = sequence_logprobs(model, src, src_len, seqs, forbidden=[PAD, BOS])
    scores = torch.tensor([lp[i] / ((5 + len(s)) / 6) ** length_penalty for i, s in enumerate(seqs)])
    i = int(scores.argmax())
    target = seqs[i][:-1] if seqs[i][-1] == EOS else seqs[i]
    if best != target:  # allow only a numerical tie
        j = next(k for k, s in enumerate(seqs) if (s[:-1] if s[-1] == EOS else s) == best and len(s) >= len(best))
        assert math.isclose(scores[j], scores[i], abs_tol=1e-5), (best, target)


def test_tiny_model_learns_to_copy():
    """A tiny model overfits a synthetic copy task; greedy and beam search then reproduce the sources."""
    torch.manual_seed(0)
    V, n = 12, 32
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(3, 8, (n,), generator=g).tolist()  # tokens + EOS
    batch = make_batch(lens, lens, V, seed=5)
    src = batch["src"]
    words = [src[i, : lens[i] - 1].tolist() for i in range(n)]
    tgt_in, tgt_out = torch.zeros_like(src), torch.zeros_like(src)
    for i, w in enumerate(words):  # target = source
        tgt_in[i, : lens[i]] = torch.tensor([BOS] + w)
        tgt_out[i, : lens[i]] = torch.tensor(w + [EOS])
    batch.update(tgt_in=tgt_in, tgt_out=tgt_out)
    model = Transformer(small_cfg(vocab_size=V, d_ff=64, enc_layers=1, dec_layers=1, max_positions=16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(600):
        logits = model(**model_inputs(batch))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten().long(), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.002:
            break
    assert loss.item() < 0.005
    args = (model, src, batch["src_lengths"])
    assert greedy_decode(*args, **IDS) == words
    assert beam_search(*args, beam_size=3, **IDS) == words
    assert model.training  # decoding restored the mode


# ----------------------------------------------------------------------------------------------
# The device-side search against the previous host-side implementation
# ----------------------------------------------------------------------------------------------
SRC_LENS = [9, 1, 5, 3, 7, 2, 12]  # ragged


@pytest.mark.parametrize("vocab,gain,beam,lp,ratio,extra,spans,check_every", [
    pytest.param(12, 1.0, 4, 0.6, 1.5, 10, "exact", 4, id="V12-K4-lp0.6"),
    pytest.param(7, 1.0, 2, 1.5, 0.5, 2, "full", 1, id="V7-K2-lp1.5-short-full"),
    pytest.param(40, 3.0, 4, 0.6, 1.5, 10, "pow2", 3, id="V40-eos3-K4-pow2"),
    pytest.param(40, 2.0, 7, 0.0, 0.5, 2, "exact", 100, id="V40-eos2-K7-lp0-short"),
    pytest.param(40, 2.0, 3, 1.0, 1.0, 3, "full", 2, id="V40-eos2-K3-lp1-full"),
    pytest.param(40, 1.0, 1, 0.6, 1.5, 10, "exact", 5, id="V40-K1"),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_beam_search_matches_previous_implementation(vocab, gain, beam, lp, ratio, extra, spans, check_every,
                                                     seed):
    model = build_eos(vocab, seed, gain)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), vocab, seed=seed)
    args = (model, batch["src"], batch["src_lengths"])
    kw = dict(beam_size=beam, length_penalty=lp, max_len_ratio=ratio, max_len_extra=extra, **IDS)
    want = oracle_beam_search(*args, **kw)
    got = beam_search(*args, spans=spans, check_every=check_every, **kw)
    limits = length_limits(model, batch["src_lengths"], ratio, extra).tolist()
    assert_same_hypotheses(model, batch, got, want, limits, lp)
    if spans == "exact":  # the CPU default is the host search: the device one on the eager path too
        device = beam_search(*args, spans=spans, check_every=check_every, host_search=False, **kw)
        assert_same_hypotheses(model, batch, device, want, limits, lp)


def test_comparison_covers_eos_and_limit_endings():
    """A case above ends sentences both ways, by EOS at several lengths (what the comparison claims to test)."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    out = beam_search(model, batch["src"], batch["src_lengths"], beam_size=4, length_penalty=0.6, **IDS)
    limits = length_limits(model, batch["src_lengths"], 1.5, 10).tolist()
    by_eos = {len(h) for h, n in zip(out, limits) if len(h) < n}
    assert len(by_eos) >= 2 and any(len(h) == n for h, n in zip(out, limits)), (out, limits)


@pytest.mark.parametrize("spans", ["exact", "full"])
@pytest.mark.parametrize("ratio,extra", [(1.5, 10), (0.5, 2)])
def test_greedy_matches_previous_implementation(spans, ratio, extra):
    for seed in (0, 1):
        model = build_eos(40, seed, 2.0)
        batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=seed)
        args = (model, batch["src"], batch["src_lengths"])
        kw = dict(max_len_ratio=ratio, max_len_extra=extra, **IDS)
        assert greedy_decode(*args, spans=spans, **kw) == oracle_greedy_decode(*args, **kw)


@pytest.mark.parametrize("beam", [None, 3], ids=["greedy", "beam3"])
def test_padding_rows_and_reuse_across_batches(beam):
    """One Decoder, two batches of one shape: inactive (padding) rows decode to [] and change nothing
    for the others, and the second batch's answers are those of a fresh decoder (buffers refilled)."""
    model = build_eos(40, 2, 3.0)
    dec = Decoder(model, beam_size=beam, spans="pow2", **IDS)
    first = make_batch([5, 8, 2, 6], [2] * 4, 40, seed=3)
    second = make_batch([7, 3, 1, 8], [2] * 4, 40, seed=4)
    active = torch.tensor([True, False, True, True])
    stats = DecodeStats()
    first_lengths = first["src_lengths"].clone()
    a = dec(first["src"], first["src_lengths"], stats=stats)
    b = dec(second["src"], second["src_lengths"], active=active, stats=stats)
    assert len(dec._runs) == 1 and stats.batches == 2
    assert torch.equal(first["src_lengths"], first_lengths)  # the state refilled its own buffers
    fresh = Decoder(model, beam_size=beam, **IDS)
    assert a == fresh(first["src"], first["src_lengths"])
    keep = [0, 2, 3]
    want = fresh(second["src"][keep], second["src_lengths"][keep])
    assert b[1] == [] and [b[i] for i in keep] == want


# ----------------------------------------------------------------------------------------------
# The eager ("exact") path: finished sentences leave, beams share a cache, SDPA, no einops
# ----------------------------------------------------------------------------------------------
def _record_live_steps(monkeypatch):
    """Every live step's (rows, the cache tensors' addresses) and every einops call made inside one."""
    import einops

    from models import transformer as T

    steps, einops_calls, inside = [], [], [False]
    original = T.Transformer.live_step

    def live_step(self, tokens, states, masks):
        steps.append((tokens.shape[0], tuple(t.data_ptr() for s in states for pair in s.caches for t in pair),
                      tuple(s.t for s in states)))
        inside[0] = True
        try:
            return original(self, tokens, states, masks)
        finally:
            inside[0] = False

    for name in ("rearrange", "repeat", "einsum", "reduce"):
        fn = getattr(einops, name)

        def spy(*a, _fn=fn, _name=name, **k):
            if inside[0]:
                einops_calls.append(_name)
            return _fn(*a, **k)

        for module in (einops, T, common, device, host, rule, state, static):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(T.Transformer, "live_step", live_step)
    return steps, einops_calls


@pytest.mark.parametrize("beam", [None, 4], ids=["greedy", "beam4"])
def test_finished_sentences_leave_and_beams_share_a_cache(monkeypatch, beam):
    """Rows shrink as sentences finish (the landed tree kept every row to the last step); between two departures
    every step writes into the same cache tensors (reordering beams copies no prefix); no einops call in a step; the
    answers are the oracle's."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    steps, einops_calls = _record_live_steps(monkeypatch)
    kw = dict(max_len_ratio=1.5, max_len_extra=10, **IDS)
    args = (model, batch["src"], batch["src_lengths"])
    if beam is None:
        got, want = greedy_decode(*args, **kw), oracle_greedy_decode(*args, **kw)
    else:
        got = beam_search(*args, beam_size=beam, **kw)
        want = oracle_beam_search(*args, beam_size=beam, **kw)
    limits = length_limits(model, batch["src_lengths"], 1.5, 10).tolist()
    assert_same_hypotheses(model, batch, got, want, limits, 0.6)
    rows = [r for r, _, _ in steps]
    K = beam or 1
    assert rows[0] == K * len(SRC_LENS) and rows[-1] < rows[0] and rows == sorted(rows, reverse=True), rows
    for (r0, caches0, _), (r1, caches1, _) in zip(steps, steps[1:]):
        assert r0 != r1 or caches0 == caches1  # same rows: the same cache tensors, written in place
    assert einops_calls == []


@pytest.mark.parametrize("host_search", [None, False], ids=["host", "device"])
@pytest.mark.parametrize("beam,check_every", [(None, 1), (3, 1), (3, 3)], ids=["greedy", "beam3", "beam3-check3"])
def test_next_batch_starts_beside_the_last_sentences(monkeypatch, beam, check_every, host_search):
    """decode_batches ("exact"): once at most a quarter of a batch is left, the next batch starts beside it (two
    groups in one step, each at its own position); every answer is the one its batch gets alone (the oracle's),
    inactive rows decode to []."""
    model = build_eos(40, 3, 3.0)
    lens = [[9, 12, 5, 3, 7, 2, 12, 11], [7, 2, 6, 4, 9, 1, 5, 3], [11, 4, 8, 1, 6, 3, 2, 10]]
    batches = [make_batch(x, [2] * len(x), 40, seed=10 + i) for i, x in enumerate(lens)]
    active = torch.tensor([True, True, False, True, True, True, True, True])
    steps, _ = _record_live_steps(monkeypatch)
    dec = Decoder(model, beam_size=beam, check_every=check_every, host_search=host_search, **IDS)
    stats = DecodeStats()
    got = dec.decode_batches([Batch(b["src"], b["src_lengths"], active if i == 2 else None, x)
                              for i, (b, x) in enumerate(zip(batches, lens))], stats=stats)
    K = beam or 1
    assert stats.batches == 3 and max(r for r, _, _ in steps) <= (8 + 8 // 4) * K
    assert any(len(positions) > 1 for _, _, positions in steps)  # two batches in one step
    kw = dict(max_len_ratio=1.5, max_len_extra=10, **IDS)
    for i, (b, answers) in enumerate(zip(batches, got)):
        args = (model, b["src"], b["src_lengths"])
        want = oracle_greedy_decode(*args, **kw) if beam is None else oracle_beam_search(*args, beam_size=beam, **kw)
        if i == 2:
            assert answers[2] == []
            want[2] = []
        limits = length_limits(model, b["src_lengths"], 1.5, 10).tolist()
        assert_same_hypotheses(model, b, answers, want, limits, 0.6)


def test_live_step_attends_with_sdpa_and_skips_the_source_mask_it_does_not_need(monkeypatch):
    """The CPU step's attention is PyTorch's SDPA; with the lengths known on the host, a batch whose sources have
    one length gets no cross-attention mask, and the answers are those without the hint."""
    import torch.nn.functional as F

    calls = []
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        if attn_mask is None or attn_mask.shape[2] == 1:  # a cross-attention call (beam search masks its self one)
            calls.append(attn_mask is None)
        return original(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(layers_module.F, "scaled_dot_product_attention", sdpa)
    model = build_eos(40, 1, 3.0)
    for lens, masked in (([6, 6, 6], False), ([6, 3, 5], True)):
        batch = make_batch(lens, [2] * 3, 40, seed=4)
        dec = Decoder(model, beam_size=3, **IDS)
        calls.clear()
        hinted = dec(batch["src"], batch["src_lengths"], host_lengths=lens)
        assert calls and (calls[0] is not masked) and (masked or all(calls)), (lens, calls)
        calls.clear()
        assert hinted == dec(batch["src"], batch["src_lengths"]), lens
        assert calls and not any(calls)  # without the hint every cross-attention call is masked
    with pytest.raises(ValueError, match="host_lengths"):
        Decoder(model, beam_size=3, **IDS)(batch["src"], batch["src_lengths"], host_lengths=[1, 2])


# ----------------------------------------------------------------------------------------------
# Host syncs and static shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beam", [None, 4], ids=["greedy", "beam4"])
@pytest.mark.parametrize("spans", ["exact", "full"])
def test_host_syncs_once_per_check(cuda_like_kernels, beam, spans):
    """Host reads per batch (every Tensor method that hands a value to the host; on CUDA: a sync): one per
    ``check_every`` steps plus one for the answers, whatever the batch size; the previous implementation
    read the host at every step (and per finished hypothesis)."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch([9, 12, 5, 3, 7, 2, 12, 11], [2] * 8, 40, seed=5)
    args = (model, batch["src"], batch["src_lengths"])
    kw = dict(max_len_ratio=1.5, max_len_extra=10, **IDS)
    check_every, stats = 4, DecodeStats()
    kw["host_search"] = False  # the tensor search, as on CUDA (a CPU call defaults to the host search)
    with SyncCounter(aten=False) as counter:
        if beam is None:
            greedy_decode(*args, check_every=check_every, spans=spans, stats=stats, **kw)
        else:
            beam_search(*args, beam_size=beam, check_every=check_every, spans=spans, stats=stats, **kw)
    del kw["host_search"]
    assert stats.steps >= 8
    assert counter.host_reads() == stats.host_syncs <= stats.steps // check_every + 1, (counter.events, stats)
    with SyncCounter(aten=False) as oracle:
        if beam is None:
            oracle_greedy_decode(*args, **kw)
        else:
            oracle_beam_search(*args, beam_size=beam, **kw)
    assert oracle.host_reads() >= stats.steps  # the contrast: at least one read per step


@pytest.mark.parametrize("spans,max_shapes", [("full", 1), ("pow2", 2)])
def test_static_spans_give_few_step_shapes(monkeypatch, spans, max_shapes):
    """A static step's self-attention reads a span that changes only at span boundaries (here T=23:
    "full" 23, "pow2" 16 then 23); the position is on the device (no host counter advances)."""
    shapes = set()
    original = layers_module.attention

    def recording(q, k, v, **kw):
        shapes.add((tuple(q.shape), tuple(k.shape), kw.get("k_lengths") is not None))
        return original(q, k, v, **kw)

    monkeypatch.setattr(layers_module, "attention", recording)
    model = build_eos(40, 0, 1.0)
    batch = make_batch([9, 4, 5], [2] * 3, 40, seed=6)
    dec = Decoder(model, beam_size=2, spans=spans, check_every=1000, **IDS)
    stats = DecodeStats()
    dec(batch["src"], batch["src_lengths"], stats=stats)
    self_attn = {s for s in shapes if s[1][2] != batch["src"].shape[1]}  # not the cross-attention
    assert stats.steps == 23 and len(self_attn) == max_shapes, sorted(self_attn)
    assert all(with_lengths for _, _, with_lengths in self_attn)  # masked on the device
    (run,) = dec._runs.values()
    assert run.state.t == 0 and int(run.state.pos) == 23


@pytest.mark.parametrize("beam", [pytest.param(None, marks=pytest.mark.slow, id="greedy"), pytest.param(3, id="beam3")])
def test_static_step_traces_as_one_graph(monkeypatch, beam):
    """torch.compile(fullgraph=True) of the whole static step (decode + bookkeeping) succeeds: no host
    sync, no data-dependent shape or branch (what CUDA-graph capture needs), and no recompilation
    across steps; the answers equal the eager ones."""
    import torch._dynamo

    from models.decoding.static import BeamRun, GreedyRun

    model = decoding_model(vocab=40, seed=7, max_positions=64, norm="torch", attn_backend="reference", enc_layers=1,
                  dec_layers=1)
    batch = make_batch([9, 1, 5], [2] * 3, 40, seed=7)
    run_cls = GreedyRun if beam is None else BeamRun
    want = Decoder(model, beam_size=beam, spans="full", **IDS)(batch["src"], batch["src_lengths"])
    torch._dynamo.reset()
    monkeypatch.setattr(run_cls, "step", torch.compile(run_cls.step, fullgraph=True, backend="eager"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = Decoder(model, beam_size=beam, spans="full", **IDS)(batch["src"], batch["src_lengths"])
    torch._dynamo.reset()
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("beam", [None, 4], ids=["greedy", "beam4"])
def test_cuda_graph_decoding_equals_eager(beam):
    """Graph-replayed steps give the eager answers, in bf16 autocast, across two calls (graphs reused)."""
    model = build_eos(40, 0, 3.0, d_model=64, n_heads=2).cuda()
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    src, lens = batch["src"].cuda(), batch["src_lengths"].cuda()
    eager = Decoder(model, beam_size=beam, spans="pow2", **IDS)
    graphed = Decoder(model, beam_size=beam, cuda_graph=True, **IDS)
    stats = DecodeStats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = eager(src, lens)
        assert graphed(src, lens, stats=stats) == want
        captured = stats.graphs
        assert graphed(src, lens, stats=stats) == want
    assert captured >= 1 and stats.graphs == captured and graphed.cuda_graph


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: capture records which steps a graph would hold
    (running none of them, as a real capture runs no kernel); replay runs them."""

    recording: FakeGraph | None = None
    fail_next = 0  # captures that raise (a first capture in a process can fail on a lazy init)
    # a DataLoader pin-memory thread allocating pinned memory during every capture: in the default "global"
    # capture mode CUDA refuses that call and invalidates the capture; "thread_local" confines the check
    # to the capturing thread
    other_thread_allocates = False
    modes: list[str] = []  # capture_error_mode of every capture

    def __init__(self):
        self.steps: list = []
        self.replays = 0

    def replay(self):
        self.replays += 1
        for run, span in self.steps:
            REAL_STEP[type(run)](run, span)


REAL_STEP: dict = {}


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """torch.cuda's stream and graph API replaced by CPU stand-ins (see FakeGraph)."""
    import contextlib

    from models.decoding import decoder, static

    class Stream:
        def __init__(self, *_device):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        FakeGraph.modes.append(capture_error_mode)
        if FakeGraph.fail_next:
            FakeGraph.fail_next -= 1
            raise RuntimeError("operation not permitted when stream is capturing")
        if FakeGraph.other_thread_allocates and capture_error_mode == "global":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (cudaHostAlloc "
                               "from another thread during a global-mode capture)")
        FakeGraph.recording = g
        try:
            yield
        finally:
            FakeGraph.recording = None

    def recording_step(run, span):
        if FakeGraph.recording is not None:
            FakeGraph.recording.steps.append((run, span))
        else:
            REAL_STEP[type(run)](run, span)

    for cls in (static.GreedyRun, static.BeamRun):
        REAL_STEP[cls] = cls.step
        monkeypatch.setattr(cls, "step", recording_step)
    for name, value in dict(Stream=Stream, stream=lambda s: contextlib.nullcontext(), current_stream=Stream,
                            CUDAGraph=FakeGraph, graph=graph, graph_pool_handle=object).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(static, "no_autocast_cache", contextlib.nullcontext)
    monkeypatch.setattr(decoder, "make_step_graphs", static.CudaStepGraphs)  # the CUDA one on CPU tensors
    FakeGraph.fail_next, FakeGraph.other_thread_allocates, FakeGraph.modes = 0, False, []
    yield FakeGraph


@pytest.mark.parametrize("beam", [None, 3], ids=["greedy", "beam3"])
def test_graph_driver_warms_captures_and_replays(fake_cuda_graphs, beam):
    """The CUDA-graph driver, on CPU stand-ins: per span one eager warm-up step, then one capture,
    then replays; no step lost or doubled (answers equal eager decoding), graphs reused by the next
    call, dropped when a parameter moves; a capture that fails twice falls back to eager decoding."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    args = (batch["src"], batch["src_lengths"])
    want = Decoder(model, beam_size=beam, **IDS)(*args)
    dec = Decoder(model, beam_size=beam, cuda_graph=True, check_every=1000, **IDS)
    stats = DecodeStats()
    assert dec(*args, stats=stats) == want
    (run,) = dec._runs.values()
    spans = sorted(run.graphs)
    graphs = [replay.__self__ for replay in run.graphs.values()]  # the FakeGraph behind each replay
    assert run.T == 28 and stats.steps == 28  # longest source 12: 1.5 * 12 + 10 steps, all run
    assert spans == [16, 28] and stats.graphs == 2 and run.warm == set(spans)  # spans 1-16, then 17-28
    assert sum(g.replays for g in graphs) == stats.steps - len(spans)  # all but the warm-ups
    assert all(len(g.steps) == 1 for g in graphs)  # a graph holds one step
    assert dec(*args, stats=stats) == want and stats.graphs == 2  # reused: nothing captured again
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone()  # a parameter moved
    assert dec(*args, stats=stats) == want and stats.graphs == 4 and len(dec._runs) == 1
    fake_cuda_graphs.fail_next = 3  # span 16: fails twice -> eager from then on
    fallback = Decoder(model, beam_size=beam, cuda_graph=True, **IDS)
    with pytest.warns(UserWarning, match="capture failed twice"):
        assert fallback(*args) == want
    assert not fallback.cuda_graph and fake_cuda_graphs.fail_next == 1


@pytest.mark.parametrize("beam", [None, 3], ids=["greedy", "beam3"])
def test_captures_are_thread_local_and_fallbacks_are_recorded(fake_cuda_graphs, beam):
    """With another thread allocating pinned memory during every capture (the DataLoader's pin-memory
    thread, alive during evaluation), captures still succeed: they run in thread-local mode. A decoder
    whose captures fail twice decodes eagerly for good, and says so in every call's stats: the failed
    attempts, one fall-back, and the reason."""
    model = build_eos(40, 0, 3.0)
    batch = make_batch(SRC_LENS, [2] * len(SRC_LENS), 40, seed=0)
    args = (batch["src"], batch["src_lengths"])
    want = Decoder(model, beam_size=beam, **IDS)(*args)
    fake_cuda_graphs.other_thread_allocates = True
    stats = DecodeStats()
    assert Decoder(model, beam_size=beam, cuda_graph=True, **IDS)(*args, stats=stats) == want
    assert (stats.graphs, stats.capture_failures, stats.fallbacks, stats.eager_reason) == (2, 0, 0, None)
    assert fake_cuda_graphs.modes == ["thread_local"] * 2

    fake_cuda_graphs.fail_next = 1  # a first capture that fails once (a lazy initialisation): retried
    stats = DecodeStats()
    assert Decoder(model, beam_size=beam, cuda_graph=True, **IDS)(*args, stats=stats) == want
    assert (stats.graphs, stats.capture_failures, stats.fallbacks) == (2, 1, 0)

    fake_cuda_graphs.fail_next = 2
    dec, first, later = Decoder(model, beam_size=beam, cuda_graph=True, **IDS), DecodeStats(), DecodeStats()
    with pytest.warns(UserWarning, match="capture failed twice"):
        assert dec(*args, stats=first) == want
    assert (first.graphs, first.capture_failures, first.fallbacks) == (0, 2, 1)
    assert "operation not permitted when stream is capturing" in first.eager_reason
    assert dec(*args, stats=later) == want  # eager from now on, no new attempt, the reason kept
    assert (later.graphs, later.capture_failures, later.fallbacks) == (0, 0, 0)
    assert later.eager_reason == first.eager_reason == dec.fallback_reason and not dec.cuda_graph
