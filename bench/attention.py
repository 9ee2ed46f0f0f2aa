"""Attention providers of ``bench.kernels``: our Triton kernel against what PyTorch offers, on padded
batches and on packed corpus streams (called as the model calls it). FLOPs count real positions only;
corpus cases also get a memory floor (``floor_bytes``). Each provider: bench/README.md."""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from bench import harness as H
from bench.cases import AttnInputs, Case, CorpusInputs, make_attention_inputs, make_corpus_inputs
from bench.registry import Op, Prepared, Unsupported, compiled, register, register_op

CHECK_HEADS = 2  # heads compared against the fp32 reference
TILING_ENV = "FASTMT_ATTN_TILING"
RAGGED, DENSE, LONG, CORPUS = "train-ragged", "train-dense", "long", "corpus"


# -- The op: inputs, reference, counting, columns --------------------------------------------------
def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, opts) -> AttnInputs | CorpusInputs:
    if case.group == CORPUS:
        return make_corpus_inputs(case, dtype, device, opts)
    return make_attention_inputs(case, dtype, device, opts.min_fill)


def _segment(t: torch.Tensor, start: int, length: int, h: int) -> torch.Tensor:
    return rearrange(t.detach()[start : start + length, :h].float(), "t h d -> 1 h t d")


def reference(case: Case, d: AttnInputs | CorpusInputs) -> torch.Tensor:
    """fp32 output of the checked slice: padded, the first sequence's first CHECK_HEADS heads
    (1, h, L0, D); corpus, the checked segments' tokens (tokens, h, D)."""
    from kernels import attention_reference

    h = min(CHECK_HEADS, case.H)
    with torch.no_grad():
        if isinstance(d, CorpusInputs):
            oq, ok = d.offsets_q, d.offsets_k
            outs = [attention_reference(_segment(d.q, oq[i], d.lengths_q[i], h), _segment(d.k, ok[i], d.lengths_k[i], h),
                                        _segment(d.v, ok[i], d.lengths_k[i], h), causal=d.causal, upcast=True)
                    for i in d.checked]
            return torch.cat([rearrange(o, "1 h t d -> t h d") for o in outs])
        L0 = d.lengths[0]
        q, k, v = (t.detach()[:1, :h, :L0].float() for t in (d.q, d.k, d.v))
        return attention_reference(q, k, v, causal=case.causal, upcast=True)


def floor_bytes(q_tokens: int, k_tokens: int, heads: int, head_dim: int, elem_bytes: int, mode: str) -> int:
    """Fewest bytes attention must move: fwd reads q, k, v and writes o; bwd (and fwd+bwd, whose
    forward output is what the backward reads) reads q, k, v, o, dO and writes dQ, dK, dV."""
    if mode not in H.MODES:
        raise ValueError(f"mode={mode!r} is not one of {H.MODES}")
    return (2 if mode == "fwd" else 4) * (q_tokens + k_tokens) * heads * head_dim * elem_bytes


def work(case: Case, mode: str, d, dtype: torch.dtype) -> dict[str, float]:
    if isinstance(d, CorpusInputs):
        lq, lk = d.lengths_q[: d.real], d.lengths_k[: d.real]
        elem = torch.empty((), dtype=dtype).element_size()
        return {"flops": H.attention_flops(lq, lk, case.H, case.D, causal=case.causal, mode=mode),
                "floor_bytes": floor_bytes(sum(lq), sum(lk), case.H, case.D, elem, mode)}
    lengths = d.lengths if d is not None else [case.T] * case.B
    return {"flops": H.attention_flops(lengths, lengths, case.H, case.D, causal=case.causal, mode=mode)}


def columns(case: Case, d) -> dict[str, Any]:
    cols: dict[str, Any] = {"B": case.B, "H": case.H, "Tq": case.T, "Tk": case.T, "D": case.D, "causal": case.causal,
                            "masked": case.ragged or case.group == CORPUS}
    if case.group == CORPUS:
        cols.update(kind=case.kind, max_tokens=case.max_tokens, max_len=case.max_len)
        if isinstance(d, CorpusInputs):
            lq = d.lengths_q[: d.real]
            cols.update(B=len(d.lengths_q), Tq=sum(d.lengths_q), Tk=sum(d.lengths_k), tokens=sum(lq),
                        fill=sum(lq) / sum(d.lengths_q), segments=d.real, mean_len=sum(lq) / d.real,
                        max_seg=max(lq), lengths=d.source)
        return cols
    if isinstance(d, AttnInputs):
        real = sum(L * L for L in d.lengths)
        cols.update(fill=real / (case.B * case.T * case.T), tokens=sum(d.lengths))
    return cols


register_op(Op("attention", make_inputs, reference, work, columns))


# -- Output slices compared with the reference -----------------------------------------------------
def _padded_check(case: Case, d: AttnInputs):
    L0, h = d.lengths[0], min(CHECK_HEADS, case.H)
    return lambda out: out[:1, :h, :L0]


def _packed_check(case: Case, d: AttnInputs):
    L0, h = d.lengths[0], min(CHECK_HEADS, case.H)
    return lambda out: rearrange(out[:L0, :h], "t h d -> 1 h t d")


def _stream_check(case: Case, d: CorpusInputs):
    """(C_q, H, D) output -> the checked segments' tokens, (tokens, h, D)."""
    off, h = d.offsets_q, min(CHECK_HEADS, case.H)
    return lambda out: torch.cat([out[off[i] : off[i] + d.lengths_q[i], :h] for i in d.checked])


# -- Padded groups ---------------------------------------------------------------------------------
def _lengths_kw(d: AttnInputs) -> dict[str, Any]:
    return {"q_lengths": d.lengths_t, "k_lengths": d.lengths_t} if d.lengths_t is not None else {}


@register("attention", "ours", groups=(RAGGED, DENSE, LONG), triton=True)
def ours(case: Case, d: AttnInputs, opts) -> Prepared:
    import kernels

    kw, qkv = _lengths_kw(d), (d.q, d.k, d.v)
    return Prepared(lambda: kernels.attention(*qkv, causal=case.causal, backend="triton", **kw), qkv,
                    _padded_check(case, d))


@register("attention", "ours-varlen", groups=(RAGGED,), triton=True)
def ours_varlen(case: Case, d: AttnInputs, opts) -> Prepared:
    import kernels

    qp, kp, vp = d.packed
    T = max(d.lengths)
    kw = {"cu_seqlens_q": d.cu_seqlens, "cu_seqlens_k": d.cu_seqlens, "max_seqlen_q": T, "max_seqlen_k": T}
    return Prepared(lambda: kernels.attention(qp, kp, vp, causal=case.causal, backend="triton", **kw), d.packed,
                    _packed_check(case, d))


def _varlen_attn(causal: bool, device: torch.device):
    """torch's varlen_attn and its causal keyword (is_causal in 2.10, window_size later)."""
    if device.type != "cuda":
        raise Unsupported("varlen_attn runs FlashAttention-2's CUDA kernels: needs a CUDA device")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise Unsupported(f"torch.nn.attention.varlen is not in torch {torch.__version__}") from e
    params = inspect.signature(varlen_attn).parameters
    if not causal:
        return varlen_attn, {}
    if "is_causal" in params:
        return varlen_attn, {"is_causal": True}
    if "window_size" in params:
        return varlen_attn, {"window_size": (-1, 0)}
    raise Unsupported("varlen_attn takes neither is_causal nor window_size")


@register("attention", "torch-varlen", groups=(RAGGED,))
def torch_varlen(case: Case, d: AttnInputs, opts) -> Prepared:
    varlen_attn, kw = _varlen_attn(case.causal, d.q.device)
    qp, kp, vp = d.packed
    T = max(d.lengths)
    return Prepared(lambda: varlen_attn(qp, kp, vp, d.cu_seqlens, d.cu_seqlens, T, T, **kw), d.packed,
                    _packed_check(case, d))


SDPA_BACKENDS = {"sdpa": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                 "sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-math": "MATH"}  # provider -> the SDPBackend it forces


def _sdpa(name: str):
    def prepare(case: Case, d: AttnInputs, opts) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qkv, mask = (d.q, d.k, d.v), d.sdpa_mask
        is_causal = case.causal and mask is None
        backends = [getattr(SDPBackend, SDPA_BACKENDS[name])] if SDPA_BACKENDS[name] else None

        def sdpa():
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                return F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=is_causal)

        extra = {"sdpa_backend": H.sdpa_choice(*qkv, mask, is_causal)} if name == "sdpa" else {}
        note = "" if mask is None else f"bool mask {tuple(mask.shape)}"
        return Prepared(sdpa, qkv, _padded_check(case, d), note=note, extra=extra)

    return prepare


for _name, _groups in (("sdpa", (RAGGED, DENSE)), ("sdpa-flash", (RAGGED, DENSE, LONG)),
                       ("sdpa-efficient", (RAGGED, DENSE, LONG)), ("sdpa-cudnn", (RAGGED, DENSE, LONG)),
                       ("sdpa-math", (RAGGED,))):
    register("attention", _name, groups=_groups)(_sdpa(_name))


def _reference(compile_it: bool):
    def prepare(case: Case, d: AttnInputs, opts) -> Prepared:
        from kernels import attention_reference

        fn, note = attention_reference, "upcast=False"
        if compile_it:
            fn = compiled("attention_reference", attention_reference, opts.compile_backend, None)
            note += f", torch.compile(backend={opts.compile_backend}, dynamic=None)"
        kw, qkv = _lengths_kw(d), (d.q, d.k, d.v)
        return Prepared(lambda: fn(*qkv, causal=case.causal, upcast=False, **kw), qkv, _padded_check(case, d),
                        note=note)

    return prepare


register("attention", "reference", groups=(RAGGED,))(_reference(False))
register("attention", "reference-compile", groups=(RAGGED,))(_reference(True))


# -- Packed corpus group ---------------------------------------------------------------------------
def _ours_tiled(tiling: str):
    def prepare(case: Case, d: CorpusInputs, opts) -> Prepared:
        import kernels

        kw = {"cu_seqlens_q": d.cu_q, "cu_seqlens_k": d.cu_k, "max_seqlen_q": d.max_len, "max_seqlen_k": d.max_len}

        def fn():
            try:
                return kernels.attention(d.q, d.k, d.v, causal=d.causal, backend="triton", **kw)
            except ValueError as e:  # a build that rejects the switch's value
                if "tiling" in str(e).lower():
                    raise Unsupported(f"{TILING_ENV}={tiling} rejected: {e}") from e
                raise

        return Prepared(fn, (d.q, d.k, d.v), _stream_check(case, d), note=f"{TILING_ENV}={tiling}",
                        extra={"tiling": tiling})

    return prepare


for _tiling in ("sequence", "stream"):
    register("attention", f"ours-{_tiling}", groups=(CORPUS,), triton=True, env={TILING_ENV: _tiling})(
        _ours_tiled(_tiling))


@register("attention", "torch-varlen", groups=(CORPUS,))
def torch_varlen_corpus(case: Case, d: CorpusInputs, opts) -> Prepared:
    varlen_attn, kw = _varlen_attn(d.causal, d.q.device)
    m = d.max_len
    return Prepared(lambda: varlen_attn(d.q, d.k, d.v, d.cu_q, d.cu_k, m, m, **kw), (d.q, d.k, d.v),
                    _stream_check(case, d))


def segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int32 index of the segment each stream position belongs to (empty segments own none)."""
    lengths = (cu[1:] - cu[:-1]).long()
    ids = torch.arange(len(lengths), device=cu.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def document_mask_mod(doc_q: torch.Tensor, doc_k: torch.Tensor, causal: bool):
    """Flex mask_mod: a query sees the keys of its own segment (and, causal, none after it: within one
    stream a segment's positions are consecutive, so q_idx >= kv_idx is causal inside the segment)."""
    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return mask_mod


@register("attention", "flex", groups=(CORPUS,))
def flex(case: Case, d: CorpusInputs, opts) -> Prepared:
    device = d.q.device
    if device.type != "cuda":
        raise Unsupported("FlexAttention has no backward on CPU (torch raises NotImplementedError): needs CUDA")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cq, ck = d.q.shape[0], d.k.shape[0]
    mask_mod = document_mask_mod(segment_ids(d.cu_q, cq), segment_ids(d.cu_k, ck), d.causal)
    H.synchronize(device)
    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, cq, ck, device=device)
    H.synchronize(device)
    setup_ms = (time.perf_counter() - t0) * 1e3
    fx = compiled("flex_attention", flex_attention, opts.compile_backend, False)

    def fn():
        q, k, v = (rearrange(t, "t h d -> 1 h t d") for t in (d.q, d.k, d.v))
        return rearrange(fx(q, k, v, block_mask=block_mask), "1 h t d -> t h d")

    return Prepared(fn, (d.q, d.k, d.v), _stream_check(case, d), setup_ms=setup_ms,
                    note=f"document mask, block mask {block_mask.BLOCK_SIZE} built once per batch "
                         f"(setup_ms), torch.compile(backend={opts.compile_backend})")


def _pad_segments(x: torch.Tensor, offsets: list[int], lengths: list[int], T: int) -> torch.Tensor:
    """(C, H, D) stream -> (n, H, T, D) new leaf holding the n given segments, zero padded."""
    start = torch.tensor(offsets[: len(lengths)], device=x.device)[:, None]
    j = torch.arange(T, device=x.device)[None, :]
    valid = j < torch.tensor(lengths, device=x.device)[:, None]
    rows = x.detach()[(start + j).clamp(max=x.shape[0] - 1)] * rearrange(valid, "n t -> n t 1 1").to(x.dtype)
    return rearrange(rows, "n t h d -> n h t d").contiguous().requires_grad_()


@register("attention", "sdpa-padded", groups=(CORPUS,))
def sdpa_padded(case: Case, d: CorpusInputs, opts) -> Prepared:
    device = d.q.device
    lq, lk = d.lengths_q[: d.real], d.lengths_k[: d.real]
    Tq, Tk = max(lq), max(lk)
    H.synchronize(device)
    t0 = time.perf_counter()
    q = _pad_segments(d.q, d.offsets_q, lq, Tq)
    k, v = (_pad_segments(t, d.offsets_k, lk, Tk) for t in (d.k, d.v))
    keys = torch.arange(Tk, device=device)[None, :] < torch.tensor(lk, device=device)[:, None]  # (n, Tk)
    if d.causal:
        i = torch.arange(Tq, device=device)
        mask = rearrange(keys[:, None, :] & (i[:, None] >= i[None, :])[None], "n i j -> n 1 i j")
    else:
        mask = rearrange(keys, "n j -> n 1 1 j")
    H.synchronize(device)
    setup_ms = (time.perf_counter() - t0) * 1e3
    backend = H.sdpa_choice(q, k, v, mask, False)
    h = min(CHECK_HEADS, case.H)

    def check(out):  # padded row i is segment i: the real pairs come first in the stream
        return torch.cat([rearrange(out[i, :h, : lq[i]], "h t d -> t h d") for i in d.checked])

    return Prepared(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), check,
                    note=f"padded ({d.real}, H, {Tq}, D), bool mask {tuple(mask.shape)}, backend {backend}",
                    setup_ms=setup_ms, extra={"sdpa_backend": backend})
