"""Batch plans: which examples go together, per epoch and per rank. Pure numpy, no torch.

A plan is a list of int64 index arrays (one per batch). Every mode covers each example exactly once per
epoch; with ``world_size`` > 1 the global plan is split into equal-length, disjoint per-rank lists.
All randomness comes from ``np.random.default_rng([seed, epoch])``, so every rank builds the same plan.

Modes (lengths are per side and include EOS on src / BOS on tgt):
  fixed         ``batch_size`` random sentences, every side padded to ``seq_len`` (the seeds' baseline).
  dynamic       ``batch_size`` random sentences, padded to the batch maximum (rounded to ``pad_multiple``).
  sorted        "uniform length batching": sentences sorted by (src, tgt) length with random ties,
                cut into ``batch_size`` chunks, batch order shuffled every epoch (the seed always put
                the longest chunk last, so its reported last-batch loss was the hardest batch).
  token_bucket  sentences bucketed by padded (src, tgt) length, shuffled within buckets, the buckets
                walked along a Hilbert curve over the (S, T) plane (so consecutive buckets are close in
                both lengths, unlike a src-then-tgt sort) and cut greedily so that
                ``B * (S + T) <= max_tokens`` with S, T the padded lengths; a batch that is already at
                least half full is also closed early when the next sentence would raise its padded
                cost by more than twice that sentence's own tokens. Batch order shuffled.
                Measured on the stand-in corpus: Hilbert order 3.2 % padding vs 3.7 % for a snake
                order at 2048 tokens, and the early close 3.0 % (bench/results/vocab-sweep.md).
  packed        padding-free: pairs laid back to back in one stream per side of FIXED capacity
                (C_src, C_tgt) with at most ``slots`` real pairs, so every batch of the run has the same
                shapes (docs/ARCHITECTURE.md, "Packed batches"). Pairs are taken in a shuffled order and
                packed greedily with a small look-ahead: when the next pair does not fit, the next
                ``PACK_LOOKAHEAD`` pairs are searched for one that does before the batch is closed.
                The layout (`PackLayout`) is derived once from the train split and the config
                (`pack_layout`), so all ranks and epochs agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACK_MULTIPLE = 64  # packed capacities are multiples of this (attention tile / tensor-core friendly)
PACK_SLOT_SLACK = 1.5  # real slots = ceil(slack x the pairs an average-length stream holds)
PACK_LOOKAHEAD = 32  # pairs searched for one that still fits before a packed batch is closed


def round_up(x, m: int):
    return -(-x // m) * m


@dataclass(frozen=True)
class PackLayout:
    """Fixed shapes of every packed batch of a run (see `pack_layout` for how they are chosen)."""

    src_capacity: int  # C_src: tokens in the src stream (1, C_src)
    tgt_capacity: int  # C_tgt: tokens in the tgt_in / tgt_out streams (1, C_tgt)
    slots: int  # N: segments per batch (cu_seqlens has N+1 entries): real pairs + empty + dummy tail
    max_len: int  # longest segment, real or dummy; the static max_seqlen handed to attention

    def __post_init__(self):
        for name in ("src_capacity", "tgt_capacity", "slots", "max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"PackLayout.{name}={v!r} must be a positive int")
        if min(self.src_capacity, self.tgt_capacity) < self.max_len:
            raise ValueError(
                f"PackLayout capacities ({self.src_capacity}, {self.tgt_capacity}) < max_len={self.max_len}: "
                "a maximal pair would not fit; raise max_tokens"
            )
        if self.real_slots < 1:
            raise ValueError(
                f"PackLayout.slots={self.slots} leaves no real slot after {self.dummy_slots} dummy tail slots"
            )

    @property
    def dummy_slots(self) -> int:
        """Slots reserved for the tail padding, cut into segments of <= max_len: enough for an empty stream."""
        return -(-max(self.src_capacity, self.tgt_capacity) // self.max_len)

    @property
    def real_slots(self) -> int:
        """Most real pairs a batch may hold."""
        return self.slots - self.dummy_slots

    def as_dict(self) -> dict:
        return {
            "src_capacity": int(self.src_capacity),
            "tgt_capacity": int(self.tgt_capacity),
            "slots": int(self.slots),
            "real_slots": int(self.real_slots),
            "max_len": int(self.max_len),
        }


def pack_layout(src_len, tgt_len, max_tokens: int, max_len: int, multiple: int = PACK_MULTIPLE) -> PackLayout:
    """The packed layout for a corpus (pass the TRAIN split's lengths; reuse the result for every split).

    Capacity: ``max_tokens`` split between the sides in proportion to the corpus' src / tgt token totals,
    each rounded up to ``multiple`` and at least ``max_len`` (so any admissible pair fits); the total may
    exceed ``max_tokens`` by < 2 x ``multiple`` (more only where the max_len floor applies).
    Slots: real slots = ceil(PACK_SLOT_SLACK x max(C_src / mean src length, C_tgt / mean tgt length)), so a
    batch rarely closes on slots (`plan_stats` counts it), plus ceil(max(C_src, C_tgt) / max_len) slots for
    the dummy tail segments: enough to cut even a completely empty stream into segments of <= max_len.
    """
    src_len = np.asarray(src_len, dtype=np.int64)
    tgt_len = np.asarray(tgt_len, dtype=np.int64)
    if len(src_len) == 0 or src_len.shape != tgt_len.shape:
        raise ValueError(
            f"pack_layout needs equal, non-empty length arrays, got {src_len.shape} and {tgt_len.shape}"
        )
    return pack_layout_from_totals(len(src_len), int(src_len.sum()), int(tgt_len.sum()), max_tokens, max_len,
                                   multiple)


def pack_layout_from_totals(n: int, s_tot: int, t_tot: int, max_tokens: int, max_len: int,
                            multiple: int = PACK_MULTIPLE) -> PackLayout:
    """`pack_layout` from the pair count and the token totals per side (all it reads of the lengths)."""
    if n < 1 or s_tot < n or t_tot < n:
        raise ValueError(f"pack_layout needs n >= 1 pairs of >= 1 token a side, got n={n}, totals {s_tot}, {t_tot}")
    if max_tokens < 2 * max_len:
        raise ValueError(f"max_tokens={max_tokens} < 2 * max_len={max_len}: a maximal pair would not fit")
    floor = int(round_up(max_len, multiple))
    c_src = max(int(round_up(-(-max_tokens * s_tot // (s_tot + t_tot)), multiple)), floor)
    c_tgt = max(int(round_up(-(-max_tokens * t_tot // (s_tot + t_tot)), multiple)), floor)
    # both terms: a stream's expected pair count when filled with average-length pairs
    fill = max(c_src * n / s_tot, c_tgt * n / t_tot)
    real = int(np.ceil(PACK_SLOT_SLACK * fill))
    dummy = -(-max(c_src, c_tgt) // max_len)
    return PackLayout(c_src, c_tgt, real + dummy, max_len)


@dataclass(frozen=True)
class BatchSpec:
    mode: str = "token_bucket"  # one of MODES (the modes PLANNERS has a planner for)
    batch_size: int = 32  # sentences per batch (fixed / dynamic / sorted)
    max_tokens: int = 2048  # padded src+tgt tokens per batch (token_bucket)
    seq_len: int = 256  # padded length of both sides (fixed)
    pad_multiple: int = 1  # padded lengths rounded up to a multiple of this (not fixed)
    pack: PackLayout | None = None  # packed: the run's fixed layout; None = derive from the lengths planned

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"batching mode {self.mode!r}; choose one of {MODES}")
        if self.pack is not None and not isinstance(self.pack, PackLayout):
            raise TypeError(f"BatchSpec.pack must be a PackLayout or None, got {type(self.pack).__name__}")
        for name in ("batch_size", "max_tokens", "seq_len", "pad_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")

    def padded(self, lengths: np.ndarray) -> np.ndarray:
        """Padded length of a batch side from the lengths of its members (a scalar)."""
        if self.mode == "fixed":
            return self.seq_len
        if self.mode == "packed":
            raise ValueError("packed batches have no per-batch padded length; use spec.pack capacities")
        return int(round_up(int(lengths.max()), self.pad_multiple))


def plan_batches(
    src_len: np.ndarray,
    tgt_len: np.ndarray,
    spec: BatchSpec,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> list[np.ndarray]:
    """This rank's batches for this epoch, as arrays of example indices."""
    src_len = np.asarray(src_len, dtype=np.int64)
    tgt_len = np.asarray(tgt_len, dtype=np.int64)
    if src_len.shape != tgt_len.shape or src_len.ndim != 1:
        raise ValueError(
            f"src_len {src_len.shape} and tgt_len {tgt_len.shape} must be equal-length 1-D arrays"
        )
    if not (
        isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size
    ):
        raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need ints with 0 <= rank < world_size")
    n = len(src_len)
    if n and (src_len.min() < 1 or tgt_len.min() < 1):
        raise ValueError("lengths must be >= 1 (they include EOS / BOS)")
    if n and world_size > n:
        raise ValueError(f"world_size={world_size} > {n} examples: some rank would get no batch")
    planner = PLANNERS.get(spec.mode)
    if planner is None:  # a BatchSpec checks its mode: this is one built around that check
        raise ValueError(f"batching mode {spec.mode!r} has no planner; choose one of {MODES}")
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    batches = planner(src_len, tgt_len, spec, rng)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    batches = _divisible(batches, world_size)
    return batches[rank::world_size]


def _chunks(order: np.ndarray, size: int) -> list[np.ndarray]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def _random_chunks(src_len, tgt_len, spec: BatchSpec, rng) -> list[np.ndarray]:
    """fixed, dynamic: ``batch_size`` sentences in a random order (in order without ``rng``)."""
    n = len(src_len)
    return _chunks(rng.permutation(n) if rng is not None else np.arange(n), spec.batch_size)


def _sorted_chunks(src_len, tgt_len, spec: BatchSpec, rng) -> list[np.ndarray]:
    """sorted: by (src, tgt) length with random ties, cut into ``batch_size`` chunks."""
    n = len(src_len)
    perm = rng.permutation(n) if rng is not None else np.arange(n)
    order = perm[np.lexsort((tgt_len[perm], src_len[perm]))]  # stable: ties keep the random order
    return _chunks(order, spec.batch_size)


def _packed(src_len, tgt_len, spec: BatchSpec, rng) -> list[np.ndarray]:
    if spec.pack is None:
        raise ValueError(
            "batching mode 'packed' needs BatchSpec.pack = pack_layout(train src/tgt lengths, max_tokens, "
            "max_len), derived once per run (DataBundle.spec does this)"
        )
    return _pack(src_len, tgt_len, spec.pack, rng)


def _token_buckets(src_len, tgt_len, spec: BatchSpec, rng) -> list[np.ndarray]:
    m, budget = spec.pad_multiple, spec.max_tokens
    s_pad, t_pad = round_up(src_len, m), round_up(tgt_len, m)
    if len(s_pad) and int((s_pad + t_pad).max()) > budget:
        worst = int((s_pad + t_pad).max())
        raise ValueError(
            f"a pair needs {worst} padded tokens > max_tokens={budget}; raise max_tokens or filter with max_len"
        )
    n = len(src_len)
    if n == 0:
        return []
    perm = rng.permutation(n) if rng is not None else np.arange(n)
    h = hilbert_index(s_pad // m, t_pad // m)
    hp = h[perm].astype(np.uint16) if int(h.max()) < 1 << 16 else h[perm]  # 16-bit keys: numpy's radix sort
    order = perm[np.argsort(hp, kind="stable")]  # buckets in curve order, shuffled within each

    # The greedy cut, walked per run of equal padded (S, T) instead of per pair: within a run that does not
    # raise the batch maxima both close conditions grow monotonically with the batch size, so the next
    # cut is computed, not searched (the same cuts as the per-pair loop; O(runs + batches) python steps).
    s_o, t_o = s_pad[order], t_pad[order]
    edges = np.flatnonzero((np.diff(s_o) != 0) | (np.diff(t_o) != 0)) + 1
    cuts, start, max_s, max_t = [], 0, 0, 0
    for a, e in zip([0, *edges.tolist()], [*edges.tolist(), n]):
        s, t = int(s_o[a]), int(t_o[a])
        ns, nt, b = max(max_s, s), max(max_t, t), a - start  # the run's first pair, as the per-pair loop
        over = (b + 1) * (ns + nt) > budget
        jump = 2 * b * (max_s + max_t) >= budget and (b + 1) * (ns + nt) - b * (max_s + max_t) > 2 * (s + t)
        if over or jump:
            cuts.append(a)
            start, ns, nt = a, s, t
        max_s, max_t = ns, nt
        pos = a + 1
        while pos < e:  # the rest of the run: equal pairs that do not raise the maxima
            w = max_s + max_t
            close = budget // w  # over: (b + 1) * w > budget
            if w > 2 * (s + t):  # jump: 2 * b * w >= budget
                close = min(close, -(-budget // (2 * w)))
            j = max(start + close, pos)
            if j >= e:
                break
            cuts.append(j)
            start, max_s, max_t, pos = j, s, t, j + 1
    return [order[x:y] for x, y in zip([0, *cuts], [*cuts, n]) if y > x]


def _pack(src_len, tgt_len, layout: PackLayout, rng, lookahead: int = PACK_LOOKAHEAD) -> list[np.ndarray]:
    """Greedy fill in (shuffled) order; when the head pair does not fit, the first of the next ``lookahead``
    pending pairs that does fit goes in instead; the batch closes when none fits or the slots are full.
    A skipped pair stays at the head of the queue, so it opens the next batch (delayed by one batch at most)."""
    cs, ct, cap = layout.src_capacity, layout.tgt_capacity, layout.real_slots
    lim_s, lim_t = min(cs, layout.max_len), min(ct, layout.max_len)
    if len(src_len) and (int(src_len.max()) > lim_s or int(tgt_len.max()) > lim_t):
        raise ValueError(
            f"a pair has {int(src_len.max())} src / {int(tgt_len.max())} tgt tokens > the packed limit "
            f"({lim_s}, {lim_t}) = min(capacity, max_len); filter with max_len or raise max_tokens"
        )
    n = len(src_len)
    order = (rng.permutation(n) if rng is not None else np.arange(n)).tolist()
    s_l, t_l = src_len.tolist(), tgt_len.tolist()
    batches, cur, used_s, used_t = [], [], 0, 0
    pending, nxt = [], 0  # the look-ahead window: not yet placed, in order
    while pending or nxt < n:
        while len(pending) < lookahead and nxt < n:
            pending.append(order[nxt])
            nxt += 1
        room_s, room_t = cs - used_s, ct - used_t
        if len(cur) >= cap:
            j = None
        elif s_l[pending[0]] <= room_s and t_l[pending[0]] <= room_t:  # the common case: the head fits
            j = 0
        else:
            j = next((j for j, i in enumerate(pending) if s_l[i] <= room_s and t_l[i] <= room_t), None)
        if j is None:  # nothing fits (or the slots are full): close; the head pair fits an empty batch
            batches.append(np.array(cur, dtype=np.int64))
            cur, used_s, used_t = [], 0, 0
            continue
        i = pending.pop(j)
        cur.append(i)
        used_s += s_l[i]
        used_t += t_l[i]
    if cur:
        batches.append(np.array(cur, dtype=np.int64))
    return batches


# batching mode -> (src_len, tgt_len, spec, rng or None) -> the epoch's batches (before the batch order shuffle)
PLANNERS = {"fixed": _random_chunks, "dynamic": _random_chunks, "sorted": _sorted_chunks,
            "token_bucket": _token_buckets, "packed": _packed}
MODES = tuple(PLANNERS)


def hilbert_index(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Position of integer points (x, y) >= 0 along a Hilbert curve covering them (vectorised). Many points in
    a small box (padded lengths: at most 257 x 257 cells) are looked up in the curve computed once per cell."""
    x, y = np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64)
    mx, my = int(x.max(initial=0)), int(y.max(initial=0))
    if x.size > 4 * (mx + 1) * (my + 1):
        gx, gy = np.divmod(np.arange((mx + 1) * (my + 1), dtype=np.int64), my + 1)  # the box holds (mx, my)
        return hilbert_index(gx, gy)[x * (my + 1) + y]
    x, y = x.copy(), y.copy()
    side = 1 << max(1, max(mx, my).bit_length())
    d = np.zeros_like(x)
    s = side >> 1
    while s > 0:
        rx, ry = (x & s) > 0, (y & s) > 0
        d += s * s * ((3 * rx.astype(np.int64)) ^ ry.astype(np.int64))
        flip = ~ry & rx  # rotate the quadrant so the sub-curve is in standard orientation
        x, y = np.where(flip, side - 1 - x, x), np.where(flip, side - 1 - y, y)
        x, y = np.where(~ry, y, x), np.where(~ry, x, y)
        s >>= 1
    return d


def _divisible(batches: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Split the largest batches in two until the count divides by world_size (splits respect budgets)."""
    batches = list(batches)
    while len(batches) % world_size:
        i = max(range(len(batches)), key=lambda k: len(batches[k]))
        b = batches[i]
        if len(b) < 2:
            raise ValueError(
                f"cannot share {len(batches)} single-example batches equally among {world_size} ranks"
            )
        batches[i : i + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return batches


@dataclass
class PlanStats:
    batches: int  # number of batches
    shapes: int  # distinct (B, S, T) padded tensor shapes
    seq_shapes: int  # distinct (S, T) padded length pairs
    real_tokens: int  # src + tgt tokens incl. EOS / BOS
    computed_tokens: int  # sum of B * (S + T)
    max_batch_tokens: int  # largest B * (S + T)
    full_slots: int = 0  # packed: batches that closed because every real slot was taken

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0


def plan_stats(
    batches: list[np.ndarray], src_len: np.ndarray, tgt_len: np.ndarray, spec: BatchSpec
) -> PlanStats:
    """Padding and shape statistics of a plan (fixed mode: lengths clipped at seq_len, as truncated;
    packed: every batch computes C_src + C_tgt positions, one shape)."""
    if spec.mode == "packed":
        if spec.pack is None:
            raise ValueError("plan_stats for 'packed' needs spec.pack (the layout the plan was built with)")
        cap = spec.pack.src_capacity + spec.pack.tgt_capacity
        real = sum(int(src_len[b].sum() + tgt_len[b].sum()) for b in batches)
        full = sum(len(b) == spec.pack.real_slots for b in batches)
        n = len(batches)
        return PlanStats(n, min(n, 1), min(n, 1), real, n * cap, cap if n else 0, full)
    shapes, seq_shapes, real, computed, worst = set(), set(), 0, 0, 0
    for b in batches:
        s, t = src_len[b], tgt_len[b]
        S, T = spec.padded(s), spec.padded(t)
        if spec.mode == "fixed":
            s, t = np.minimum(s, S), np.minimum(t, T)
        shapes.add((len(b), S, T))
        seq_shapes.add((S, T))
        real += int(s.sum() + t.sum())
        cost = len(b) * (S + T)
        computed += cost
        worst = max(worst, cost)
    return PlanStats(len(batches), len(shapes), len(seq_shapes), real, computed, worst)
