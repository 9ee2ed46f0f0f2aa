"""The cases of ``bench.kernels`` (shapes, in priority order) and the inputs each case is timed on:
padded training batches, FlashAttention-2's long grid, one packed corpus batch built as training builds
it, LayerNorm rows. The shapes of each group: bench/README.md."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch
from einops import rearrange

from bench import registry

GROUPS = ("train-ragged", "train-dense", "long", "corpus", "ln")
CORPUS_KINDS = ("enc-self", "dec-self", "cross")
CORPUS_TOKENS = (4096, 16384)  # src + tgt tokens per packed batch (DataConfig.max_tokens)
CORPUS_MAX_LEN = 256  # DataConfig.max_len: longest segment, real or dummy
# The stand-in corpus (en-it train split, joint 8k BPE, incl. EOS/BOS): mean ~16 and p99 ~75 tokens per
# side, log lengths of a pair correlated (the log of tgt/src has a spread of ~0.2)
LENGTH_MEAN, LENGTH_P99, PAIR_SIGMA = 16.5, 75.0, 0.14
GENERATED_PAIRS = 20_000


@dataclass(frozen=True)
class Case:
    bench: str  # "attention" | "layernorm"
    group: str  # one of GROUPS
    providers: tuple[str, ...]
    B: int = 0  # attention: sequences
    H: int = 0  # heads
    T: int = 0  # padded (maximum) length; self-attention, so Tq = Tk = T
    D: int = 0  # head dim
    causal: bool = False
    rows: int = 0  # layernorm: rows (tokens)
    width: int = 0  # layernorm: normalised width
    seed: int = 0
    kind: str = ""  # corpus: one of CORPUS_KINDS
    max_tokens: int = 0  # corpus: src + tgt tokens per packed batch
    max_len: int = 0  # corpus: longest segment
    host_split: bool = False  # time the kernels (CUDA graph) and the eager op separately
    name: str = ""  # the id of an op's own case (registry.Op.cases); "" for the built-in groups

    @property
    def id(self) -> str:
        if self.name:
            return self.name
        if self.bench == "layernorm":
            return f"ln-R{self.rows}-N{self.width}"
        if self.group == "corpus":
            return f"corpus-{self.max_tokens}-{self.kind}"
        return f"{self.group}-T{self.T}-hd{self.D}-{'causal' if self.causal else 'full'}"

    @property
    def ragged(self) -> bool:
        return self.group == "train-ragged"


def build_cases(*, smoke: bool, only: str | None, groups: Sequence[str] | None = None,
                corpus_tokens: Sequence[int] = CORPUS_TOKENS) -> list[Case]:
    """All cases in priority order: the targets first, so a spent budget drops the least useful."""
    registry.load()

    def attn(group, T, D, causal, B, Hh):
        return Case("attention", group, registry.names("attention", group), B=B, H=Hh, T=T, D=D, causal=causal,
                    seed=T * 7 + D + causal)

    def corpus(tokens, kind, Hh, D, max_len):
        return Case("attention", "corpus", registry.names("attention", "corpus"), H=Hh, D=D,
                    causal=kind == "dec-self", kind=kind, max_tokens=tokens, max_len=max_len, seed=tokens,
                    host_split=True)

    def ln(rows, width, split=False):
        return Case("layernorm", "ln", registry.names("layernorm", "ln"), rows=rows, width=width, seed=rows + width,
                    host_split=split)

    if smoke:
        cases = [  # one case per group, every provider: the paths, not the numbers
            ln(64, 32, split=True),
            attn("train-ragged", 16, 16, True, 3, 2),
            attn("train-dense", 16, 16, False, 2, 2),
            attn("long", 32, 64, True, 1, 2),
            *(corpus(256, kind, 2, 16, 32) for kind in CORPUS_KINDS),
        ]
    else:
        train_tokens, train_heads, train_hd = 32768, 8, 64
        train_T = (512, 256, 128, 64, 32)
        long_tokens, long_hidden, long_T = 16384, 2048, (1024, 2048, 4096, 8192)
        cases = [ln(16384, 512, True), ln(8192, 512, True), ln(65536, 512, True)]
        cases += [corpus(t, kind, 8, 64, CORPUS_MAX_LEN) for t in corpus_tokens for kind in CORPUS_KINDS]
        cases += [attn("train-ragged", T, train_hd, c, train_tokens // T, train_heads)
                  for c in (False, True) for T in train_T]
        cases += [attn("long", T, 64, c, long_tokens // T, long_hidden // 64) for c in (False, True) for T in long_T]
        cases += [attn("train-dense", T, train_hd, c, train_tokens // T, train_heads)
                  for c in (False, True) for T in train_T]
        cases += [attn("long", T, 128, c, long_tokens // T, long_hidden // 128) for c in (False, True) for T in long_T]
        cases += [ln(32768, w) for w in (1024, 2048, 4096, 8192)]
    cases += [c for op in registry.ops() if op.cases is not None for c in op.cases(smoke)]  # ops' own cases
    if only:
        cases = [c for c in cases if c.bench == only]
    if groups:
        cases = [c for c in cases if c.group in groups]
    return cases


# -- Random leaves ---------------------------------------------------------------------------------
def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def leaf(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    """Random N(0, scale^2) leaf drawn on ``device`` (never zeros: they hide bugs and time faster)."""
    x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
    return x.mul_(scale).to(dtype).requires_grad_()


# -- Padded attention batches (train-ragged, train-dense, long) ------------------------------------
@dataclass
class AttnInputs:
    q: torch.Tensor  # (B, H, T, D) leaf, requires grad
    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]  # real length of every sequence (all T when dense)
    lengths_t: torch.Tensor | None  # int32 (B,) on the device; None when dense
    sdpa_mask: torch.Tensor | None  # bool, True = attend; None when dense
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (total, H, D) leaves
    cu_seqlens: torch.Tensor | None = None  # int32 (B+1,)
    ref: torch.Tensor | None = None  # fp32 reference output of the checked slice


def ragged_lengths(B: int, T: int, min_fill: float, gen: torch.Generator) -> list[int]:
    """Per-sequence lengths uniform in [ceil(min_fill * T), T], the first one exactly T."""
    low = max(1, math.ceil(min_fill * T))
    lengths = torch.randint(low, T + 1, (B,), generator=gen)
    lengths[0] = T
    return [int(v) for v in lengths]


def make_attention_inputs(case: Case, dtype: torch.dtype, device: torch.device, min_fill: float) -> AttnInputs:
    gen = generator(case.seed, device)
    shape = (case.B, case.H, case.T, case.D)
    q, k, v = (leaf(shape, dtype, device, gen) for _ in range(3))
    if not case.ragged:
        return AttnInputs(q, k, v, [case.T] * case.B, None, None)
    lengths = ragged_lengths(case.B, case.T, min_fill, generator(case.seed))
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    j = torch.arange(case.T, device=device)
    keys = j[None, :] < lengths_t[:, None].long()  # (B, Tk)
    if case.causal:
        mask = keys[:, None, :] & (j[None, :, None] >= j[None, None, :])  # (B, Tq, Tk)
        mask = rearrange(mask, "b i j -> b 1 i j")
    else:
        mask = rearrange(keys, "b j -> b 1 1 j")
    inputs = AttnInputs(q, k, v, lengths, lengths_t, mask)
    if any(p in case.providers for p in ("ours-varlen", "torch-varlen")):
        cu = torch.zeros(case.B + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths_t, 0)
        packed = [rearrange(t.detach(), "b h t d -> b t h d")[keys].contiguous().requires_grad_()
                  for t in (q, k, v)]  # (total, H, D)
        inputs.packed, inputs.cu_seqlens = tuple(packed), cu
    return inputs


# -- Packed corpus batches -------------------------------------------------------------------------
def lognormal_params(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal with this mean and 99th percentile (the narrower of two solutions)."""
    z = NormalDist().inv_cdf(0.99)
    gap = math.log(p99) - math.log(mean)  # = z * sigma - sigma^2 / 2
    if not 0 < gap <= z * z / 2:
        raise ValueError(f"no log-normal has mean {mean} and p99 {p99}: need mean < p99 <= "
                         f"mean * exp({z * z / 2:.2f}); give other --length-mean/--length-p99")
    sigma = z - math.sqrt(z * z - 2 * gap)
    return math.log(mean) - sigma * sigma / 2, sigma


def generated_lengths(n: int = GENERATED_PAIRS, *, mean: float = LENGTH_MEAN, p99: float = LENGTH_P99,
                      max_len: int = CORPUS_MAX_LEN, pair_sigma: float = PAIR_SIGMA,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src, tgt) int32 lengths (tokens incl. EOS/BOS, >= 2) of ``n`` pairs, each side log-normal with
    ``mean`` and ``p99``; a pair shares all but ``pair_sigma`` of its log spread, like real translations.
    Pairs with a side over ``max_len`` are dropped, as the data layer's cleaning does."""
    mu, sigma = lognormal_params(mean, p99)
    if not 0 <= pair_sigma < sigma:
        raise ValueError(f"pair_sigma={pair_sigma} must lie in [0, {sigma:.3f}) (the log-normal's sigma)")
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal(n) * math.sqrt(sigma * sigma - pair_sigma * pair_sigma)
    src, tgt = (np.maximum(2, np.rint(np.exp(mu + shared + pair_sigma * rng.standard_normal(n)))) for _ in range(2))
    keep = (src <= max_len) & (tgt <= max_len)
    return src[keep].astype(np.int32), tgt[keep].astype(np.int32)


@functools.lru_cache(maxsize=4)
def corpus_lengths(data_files: tuple[str, ...], max_len: int = CORPUS_MAX_LEN) -> tuple[np.ndarray, np.ndarray, str]:
    """Train-split (src, tgt) lengths of a corpus as the data layer tokenizes it (DataConfig defaults, the
    `fast` preset's vocabulary), and a label for the rows."""
    from data import DataConfig

    cfg = DataConfig(data_files=data_files, max_len=max_len, batching="packed", num_workers=0)
    return corpus_lengths_from(cfg) + (f"corpus {', '.join(data_files)} (train split)",)


def corpus_lengths_from(cfg) -> tuple[np.ndarray, np.ndarray]:
    """Train-split (src, tgt) lengths of the `DataBundle` that ``cfg`` (a DataConfig) builds."""
    from data import build_data

    train = build_data(cfg, log=lambda *a: None).splits["train"]
    return np.asarray(train.src_lengths, dtype=np.int32), np.asarray(train.tgt_lengths, dtype=np.int32)


def length_source(opts, max_len: int) -> tuple[np.ndarray, np.ndarray, str]:
    """The run's segment lengths: the corpus of ``--data-files``, else the generated log-normal."""
    files = tuple(getattr(opts, "data_files", None) or ())
    if files:
        return corpus_lengths(files, max_len)
    mean = getattr(opts, "length_mean", LENGTH_MEAN)
    p99 = getattr(opts, "length_p99", LENGTH_P99)
    src, tgt = generated_lengths(mean=mean, p99=p99, max_len=max_len)
    return src, tgt, f"log-normal per side, mean {mean:g}, p99 {p99:g} (generated, seed 0)"


def packed_batch(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, max_len: int, seed: int = 0):
    """One packed `data.Batch` built exactly as training builds them (`pack_layout`, the packed plan,
    `PackedCollator`; token ids are zeros): the plan's batch with the median real-token count."""
    from data.batching import BatchSpec, pack_layout, plan_batches
    from data.collate import PackedCollator

    src_len, tgt_len = np.asarray(src_len, dtype=np.int64), np.asarray(tgt_len, dtype=np.int64)
    layout = pack_layout(src_len, tgt_len, max_tokens, max_len)
    plan = plan_batches(src_len, tgt_len, BatchSpec("packed", max_tokens=max_tokens, pack=layout), seed=seed)
    real = [int(src_len[b].sum() + tgt_len[b].sum()) for b in plan]
    pick = plan[int(np.argsort(real, kind="stable")[len(real) // 2])]

    def stream(lengths):  # zeros of the subword counts (lengths minus EOS/BOS) and their offsets
        off = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths - 1, out=off[1:])
        return np.zeros(int(off[-1]), dtype=np.int32), off

    return PackedCollator(*stream(src_len), *stream(tgt_len), layout=layout)(pick), layout


@dataclass
class CorpusInputs:
    """One attention call of a packed batch: streams as the model holds them, (C, H, D) per side."""

    q: torch.Tensor  # (C_q, H, D) leaf
    k: torch.Tensor  # (C_k, H, D) leaf
    v: torch.Tensor
    cu_q: torch.Tensor  # int32 (N+1,) on the device: real segments, empty slots, dummy tail
    cu_k: torch.Tensor
    lengths_q: list[int]  # (N,) segment lengths, the first `real` are the pairs
    lengths_k: list[int]
    real: int  # real pairs
    max_len: int  # the layout's static bound on a segment (max_seqlen)
    causal: bool
    source: str  # where the segment lengths came from
    checked: tuple[int, ...] = ()  # segments compared with the fp32 reference
    ref: torch.Tensor | None = None  # their reference output, (tokens, h, D)

    offsets_q = property(lambda self: [0, *np.cumsum(self.lengths_q).tolist()])  # segment starts
    offsets_k = property(lambda self: [0, *np.cumsum(self.lengths_k).tolist()])


def make_corpus_inputs(case: Case, dtype: torch.dtype, device: torch.device, opts) -> CorpusInputs:
    src_len, tgt_len, source = length_source(opts, case.max_len)
    batch, _ = packed_batch(src_len, tgt_len, case.max_tokens, case.max_len, seed=case.seed)
    src = (batch.cu_seqlens_src, batch.src_lengths)
    tgt = (batch.cu_seqlens_tgt, batch.tgt_lengths)
    (cu_q, len_q), (cu_k, len_k) = {"enc-self": (src, src), "dec-self": (tgt, tgt), "cross": (tgt, src)}[case.kind]
    gen = generator(case.seed + len(case.kind), device)
    q = leaf((int(cu_q[-1]), case.H, case.D), dtype, device, gen)
    k, v = (leaf((int(cu_k[-1]), case.H, case.D), dtype, device, gen) for _ in range(2))
    real = len(batch)
    return CorpusInputs(q, k, v, cu_q.to(device), cu_k.to(device), len_q.tolist(), len_k.tolist(), real,
                        batch.max_src_len, case.causal, source, checked=tuple(dict.fromkeys((0, real - 1))))


# -- LayerNorm rows --------------------------------------------------------------------------------
@dataclass
class LNInputs:
    x: torch.Tensor  # (rows, width) leaves, requires grad
    r: torch.Tensor
    w: torch.Tensor  # (width,)
    b: torch.Tensor
    ref: torch.Tensor | None = None  # fp32 reference y


def make_ln_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> LNInputs:
    gen = generator(case.seed, device)
    x = leaf((case.rows, case.width), dtype, device, gen)
    r = leaf((case.rows, case.width), dtype, device, gen)
    w = leaf((case.width,), dtype, device, gen, scale=0.1).detach().add_(1).requires_grad_()
    b = leaf((case.width,), dtype, device, gen, scale=0.1)
    return LNInputs(x, r, w, b)
