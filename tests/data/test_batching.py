"""Batch plans: exact-once coverage, budgets, sharding, determinism, padding and shape bounds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.batching import (
    MODES,
    PACK_MULTIPLE,
    BatchSpec,
    PackLayout,
    hilbert_index,
    pack_layout,
    plan_batches,
    plan_stats,
    round_up,
)


def skewed_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sentence-like lengths: log-normal (median ~12 subwords, long tail to 200), tgt ~ src x N(1.1, 0.15)."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(12), 0.7, n)), 1, 199).astype(np.int64) + 1
    tgt = np.clip(np.round((src - 1) * rng.normal(1.1, 0.15, n)), 1, 199).astype(np.int64) + 1
    return src, tgt


def spec_for(mode: str, src, tgt, max_len: int = 256, **kw) -> BatchSpec:
    """A BatchSpec; for packed, with the layout derived from these lengths (as DataBundle.spec does)."""
    pack = pack_layout(src, tgt, kw.get("max_tokens", 2048), max_len) if mode == "packed" else None
    return BatchSpec(mode, pack=pack, **kw)


lengths = st.integers(1, 60)
pairs = st.lists(st.tuples(lengths, lengths), min_size=1, max_size=300)


@settings(max_examples=40, deadline=None)
@given(
    pairs=pairs,
    mode=st.sampled_from(MODES),
    world=st.integers(1, 4),
    epoch=st.integers(0, 3),
    pad_multiple=st.sampled_from([1, 8]),
    shuffle=st.booleans(),
)
def test_every_example_exactly_once_across_ranks(pairs, mode, world, epoch, pad_multiple, shuffle):
    src, tgt = (np.array(x) for x in zip(*pairs))
    if world > len(src):
        world = len(src)
    spec = spec_for(mode, src, tgt, 64, batch_size=7, max_tokens=256, seq_len=64, pad_multiple=pad_multiple)
    per_rank = [
        plan_batches(src, tgt, spec, seed=3, epoch=epoch, shuffle=shuffle, rank=r, world_size=world)
        for r in range(world)
    ]
    assert len({len(p) for p in per_rank}) == 1, "equal batch counts per rank"
    seen = np.concatenate([b for p in per_rank for b in p])
    np.testing.assert_array_equal(np.sort(seen), np.arange(len(src)))  # disjoint and complete
    for p in per_rank:
        for b in p:
            assert len(b) >= 1
            if mode == "token_bucket":
                cost = len(b) * (round_up(src[b].max(), pad_multiple) + round_up(tgt[b].max(), pad_multiple))
                assert cost <= spec.max_tokens
            elif mode == "packed":
                assert src[b].sum() <= spec.pack.src_capacity and tgt[b].sum() <= spec.pack.tgt_capacity
                assert len(b) <= spec.pack.real_slots
            else:
                assert len(b) <= spec.batch_size


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_per_epoch_and_reshuffled_next_epoch(mode):
    src, tgt = skewed_lengths(3000)
    spec = spec_for(mode, src, tgt, batch_size=32, max_tokens=2048, seq_len=256)
    a = plan_batches(src, tgt, spec, seed=1, epoch=0)
    b = plan_batches(src, tgt, spec, seed=1, epoch=0)
    c = plan_batches(src, tgt, spec, seed=1, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    # batch composition changes too (not only the order of the same batches)
    assert {tuple(sorted(x.tolist())) for x in a} != {tuple(sorted(x.tolist())) for x in c}


def test_sorted_mode_does_not_always_end_on_the_longest_batch():
    """The seed's uniform-length sampler put the longest chunk last every epoch (SEEDS.md)."""
    src, tgt = skewed_lengths(2000)
    spec = BatchSpec("sorted", batch_size=32)
    last = [plan_batches(src, tgt, spec, seed=0, epoch=e)[-1] for e in range(6)]
    longest = max(range(len(src)), key=lambda i: src[i])
    assert sum(longest in b for b in last) <= 1
    sizes = {int(src[b].max()) for b in last}
    assert len(sizes) > 1


def test_token_bucket_padding_under_3_percent_on_skewed_lengths():
    src, tgt = skewed_lengths(20000, seed=5)
    out = {}
    for mode in MODES:
        spec = spec_for(mode, src, tgt, batch_size=32, max_tokens=2048, seq_len=256)
        out[mode] = plan_stats(plan_batches(src, tgt, spec, seed=0, epoch=0), src, tgt, spec)
    tb = out["token_bucket"]
    assert tb.padding_fraction <= 0.03, {m: round(s.padding_fraction, 4) for m, s in out.items()}
    assert (
        tb.padding_fraction
        < out["sorted"].padding_fraction
        < out["dynamic"].padding_fraction
        < out["fixed"].padding_fraction
    )
    assert tb.max_batch_tokens <= 2048
    assert tb.real_tokens == out["packed"].real_tokens == int(src.sum() + tgt.sum())  # nothing lost
    assert out["packed"].padding_fraction < tb.padding_fraction and out["packed"].shapes == 1


@pytest.mark.parametrize("budget", [4096, 16384])
def test_packed_padding_under_3_percent_with_one_shape(budget):
    src, tgt = skewed_lengths(40000, seed=5)
    spec = spec_for("packed", src, tgt, max_tokens=budget)
    plan = plan_batches(src, tgt, spec, seed=0, epoch=0)
    stats = plan_stats(plan, src, tgt, spec)
    tb_spec = BatchSpec("token_bucket", max_tokens=budget)
    tb = plan_stats(plan_batches(src, tgt, tb_spec, seed=0, epoch=0), src, tgt, tb_spec)
    assert stats.padding_fraction <= 0.03, stats
    assert stats.padding_fraction < tb.padding_fraction  # and one shape instead of tb.shapes
    assert stats.shapes == stats.seq_shapes == 1 and tb.shapes > 10
    cap = spec.pack.src_capacity + spec.pack.tgt_capacity
    assert stats.computed_tokens == len(plan) * cap and stats.real_tokens == int(src.sum() + tgt.sum())
    assert stats.full_slots == 0  # the slot rule leaves room: batches close on capacity


def test_packed_lookahead_fills_tails():
    """The look-ahead is kept because it measurably cuts padding (greedy alone: lookahead=1)."""
    from data.batching import _pack

    src, tgt = skewed_lengths(20000, seed=5)
    layout = pack_layout(src, tgt, 2048, 256)
    pad = {}
    for w in (1, 32):
        plan = _pack(src, tgt, layout, np.random.default_rng([0, 0]), lookahead=w)
        pad[w] = plan_stats(plan, src, tgt, BatchSpec("packed", pack=layout)).padding_fraction
    assert pad[32] < pad[1] - 0.005, pad


def test_pack_layout_rule():
    src, tgt = skewed_lengths(5000, seed=1)
    share = src.sum() / (src.sum() + tgt.sum())
    for budget in (2048, 4096, 16384):
        L = pack_layout(src, tgt, budget, 256)
        assert L.src_capacity % PACK_MULTIPLE == 0 and L.tgt_capacity % PACK_MULTIPLE == 0
        assert 0 <= L.src_capacity - budget * share < PACK_MULTIPLE
        assert 0 <= L.tgt_capacity - budget * (1 - share) < PACK_MULTIPLE
        assert L.dummy_slots == -(-max(L.src_capacity, L.tgt_capacity) // 256)
        assert L.real_slots >= L.tgt_capacity / tgt.mean()  # room for more than an average fill
        assert pack_layout(src, tgt, budget, 256) == L  # a pure function of corpus + config
    # the max_len floor: any admissible pair fits, even when the proportional share would not hold it
    L = pack_layout(np.full(10, 2), np.full(10, 30), 512, 256)
    assert (L.src_capacity, L.tgt_capacity) == (256, 512)  # src share 32 -> floored at max_len


def test_packed_closes_on_slots_when_pairs_are_tiny():
    src = np.ones(1000, dtype=np.int64)
    tgt = np.ones(1000, dtype=np.int64)
    layout = PackLayout(src_capacity=256, tgt_capacity=256, slots=20, max_len=64)  # 16 real slots
    spec = BatchSpec("packed", pack=layout)
    plan = plan_batches(src, tgt, spec, seed=0, epoch=0)
    assert sorted(map(len, plan)) == [1000 % 16] + [16] * (1000 // 16)  # batch order is shuffled
    assert plan_stats(plan, src, tgt, spec).full_slots == len(plan) - 1


@pytest.mark.parametrize("pad_multiple", [8, 16])
def test_distinct_shapes_bounded_by_pad_multiple(pad_multiple):
    src, tgt = skewed_lengths(20000, seed=2)
    spec = BatchSpec("token_bucket", max_tokens=4096, pad_multiple=pad_multiple)
    plan = plan_batches(src, tgt, spec, seed=0, epoch=0)
    stats = plan_stats(plan, src, tgt, spec)
    per_side = round_up(200, pad_multiple) // pad_multiple
    assert stats.seq_shapes <= per_side**2
    padded = {(spec.padded(src[b]), spec.padded(tgt[b])) for b in plan}
    assert all(S % pad_multiple == 0 and T % pad_multiple == 0 for S, T in padded)
    exact = plan_stats(
        plan_batches(src, tgt, BatchSpec("token_bucket", max_tokens=4096), seed=0, epoch=0),
        src,
        tgt,
        BatchSpec("token_bucket", max_tokens=4096),
    )
    assert stats.seq_shapes < exact.seq_shapes / 2  # rounding is what keeps recompiles down


def test_bad_arguments_raise_clear_errors():
    src, tgt = skewed_lengths(10)
    with pytest.raises(ValueError, match="batching mode"):
        BatchSpec("bucket")
    with pytest.raises(ValueError, match="max_tokens"):
        plan_batches(np.array([300]), np.array([300]), BatchSpec("token_bucket", max_tokens=512))
    with pytest.raises(ValueError, match="rank"):
        plan_batches(src, tgt, BatchSpec(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        plan_batches(src, tgt, BatchSpec(), world_size=11)
    with pytest.raises(ValueError, match="pack_layout"):
        plan_batches(src, tgt, BatchSpec("packed"))
    layout = pack_layout(src, tgt, 512, 64)
    with pytest.raises(ValueError, match="max_len"):
        plan_batches(np.array([65]), np.array([3]), BatchSpec("packed", pack=layout))
    with pytest.raises(ValueError, match="max_tokens=100"):
        pack_layout(src, tgt, 100, 64)
    with pytest.raises(ValueError, match="max_len=64"):
        PackLayout(src_capacity=32, tgt_capacity=128, slots=10, max_len=64)
    with pytest.raises(ValueError, match="no real slot"):
        PackLayout(src_capacity=128, tgt_capacity=128, slots=2, max_len=64)


def test_hilbert_index_is_a_unit_step_walk():
    xs, ys = np.meshgrid(np.arange(16), np.arange(16))
    d = hilbert_index(xs.ravel(), ys.ravel())
    np.testing.assert_array_equal(np.sort(d), np.arange(256))
    o = np.argsort(d)
    steps = np.abs(np.diff(xs.ravel()[o])) + np.abs(np.diff(ys.ravel()[o]))
    assert steps.max() == 1


def test_hilbert_index_of_many_points_in_a_small_box_is_the_per_point_curve():
    """The looked-up path (many points, few cells: padded lengths) gives each point the index the direct
    computation gives it alone, for boxes that are not square and not a power of two."""
    rng = np.random.default_rng(1)
    for mx, my in ((0, 0), (5, 37), (40, 3), (63, 64), (256, 256)):
        x = rng.integers(0, mx + 1, 4 * (mx + 1) * (my + 1) + 50)
        y = rng.integers(0, my + 1, len(x))
        x[0], y[0] = mx, my  # the box's far corner: the direct path sizes the curve from it
        fast = hilbert_index(x, y)
        sample = rng.choice(len(x), 200)
        direct = [int(hilbert_index(np.r_[x[i], mx], np.r_[y[i], my])[0]) for i in sample]
        np.testing.assert_array_equal(fast[sample], direct)


def _token_buckets_per_pair(src_len, tgt_len, spec, rng):
    """The greedy token-bucket cut as first written (one python step per pair): the reference."""
    from data.batching import hilbert_index

    m, budget = spec.pad_multiple, spec.max_tokens
    s_pad, t_pad = round_up(src_len, m), round_up(tgt_len, m)
    n = len(src_len)
    perm = rng.permutation(n)
    order = perm[np.argsort(hilbert_index(s_pad // m, t_pad // m)[perm], kind="stable")]
    batches, start, max_s, max_t = [], 0, 0, 0
    s_o, t_o = s_pad[order].tolist(), t_pad[order].tolist()
    for i in range(n):
        ns, nt, b = max(max_s, s_o[i]), max(max_t, t_o[i]), i - start
        over = (b + 1) * (ns + nt) > budget
        jump = 2 * b * (max_s + max_t) >= budget and (b + 1) * (ns + nt) - b * (max_s + max_t) > 2 * (
            s_o[i] + t_o[i])
        if over or jump:
            batches.append(order[start:i])
            start, ns, nt = i, s_o[i], t_o[i]
        max_s, max_t = ns, nt
    if start < n:
        batches.append(order[start:n])
    return batches


@settings(max_examples=150, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=400),
       few=st.booleans(), pad_multiple=st.sampled_from([1, 2, 8]), budget=st.integers(0, 600), seed=st.integers(0, 9))
def test_token_bucket_cuts_per_run_equal_the_per_pair_reference(pairs, few, pad_multiple, budget, seed):
    """The run-at-a-time cut (O(runs + batches) python steps) gives exactly the per-pair loop's batches."""
    from data.batching import _token_buckets

    src, tgt = (np.array(x) for x in zip(*pairs))
    if few:  # long runs of equal shapes: the arithmetic path
        src, tgt = np.minimum(src, 3), np.minimum(tgt, 2)
    spec = BatchSpec("token_bucket", max_tokens=2 * round_up(40, pad_multiple) + budget, pad_multiple=pad_multiple)
    got = _token_buckets(src, tgt, spec, np.random.default_rng(seed))
    want = _token_buckets_per_pair(src, tgt, spec, np.random.default_rng(seed))
    assert [b.tolist() for b in got] == [b.tolist() for b in want]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 99), world=st.integers(1, 3),
       mode=st.sampled_from(["fixed", "dynamic", "sorted", "token_bucket"]))
def test_epoch_free_modes_have_the_same_batch_count_every_epoch(n, seed, world, mode):
    """DataBundle.num_batches plans these modes once for every epoch (the schedule counts all epochs at start,
    which at millions of pairs cost a plan per epoch): the count must not depend on the epoch's shuffle."""
    from data.pipeline import EPOCH_FREE_COUNT

    assert mode in EPOCH_FREE_COUNT
    rng = np.random.default_rng(seed)
    src, tgt = rng.integers(1, 60, n), rng.integers(1, 60, n)
    spec = BatchSpec(mode, 8, 256, 64, 4, None)
    if n < world:
        return
    counts = {len(plan_batches(src, tgt, spec, seed=seed, epoch=e, world_size=world, rank=r))
              for e in range(4) for r in range(world)}
    assert len(counts) == 1
