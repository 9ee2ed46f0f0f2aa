"""Model configuration: one dataclass, its validation, the layer-sharing schedules and the presets.

Presets are plain functions of the vocabulary size (the tokenizer decides it):
``tiny`` (CPU tests and smoke runs), ``s18`` (the S18 seed's 6+6 x 512 x 2048 shape) and ``s16``
(the S16 seed's 3+3 unique blocks applied as 6+6 in ``cycle_rev`` order, d_ff 128).
``get_preset(name, vocab_size=..., **overrides)`` builds one and overrides existing fields only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from data.declare import (
    ARCH,
    DERIVED,
    MAX_FF,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    MAX_WIDTH,
    SAFE,
    Bounds,
    declare,
    refused,
)
from kernels import ATTN_BACKENDS, ATTN_HEAD_DIMS  # what kernels.attention accepts (kernels/__init__.py)

Sharing = Literal["none", "all", "cycle", "cycle_rev"]
Positions = Literal["sinusoidal", "learned"]
Activation = Literal["relu", "gelu", "gelu_tanh"]
Norm = Literal["fused", "torch"]
NormKind = Literal["layernorm", "rmsnorm"]
Layout = Literal["padded", "varlen", "packed"]
AttnBackend = Literal[ATTN_BACKENDS]
SHARING, POSITIONS, ACTIVATIONS = get_args(Sharing), get_args(Positions), get_args(Activation)
NORMS, LAYOUTS = get_args(Norm), get_args(Layout)
TRITON_HEAD_DIMS = ATTN_HEAD_DIMS  # what the Triton attention kernels support
DEFAULT_VOCAB = 8000  # the data package's joint SentencePiece default


def layer_schedule(sharing: str, layers: int, unique: int) -> list[int]:
    """Which unique block runs at each applied layer.

    none: [0, 1, ..., L-1]; all: [0, 0, ...]; cycle (u=3, L=6): [0, 1, 2, 0, 1, 2];
    cycle_rev (u=3, L=6): [0, 1, 2, 2, 1, 0] (the pattern 0..u-1, u-1..0 repeated, cut at L).
    """
    if sharing == "none":
        return list(range(layers))
    if sharing == "all":
        return [0] * layers
    if sharing == "cycle":
        return [i % unique for i in range(layers)]
    if sharing == "cycle_rev":
        period = list(range(unique)) + list(reversed(range(unique)))
        return [period[i % (2 * unique)] for i in range(layers)]
    raise ValueError(f"sharing={sharing!r} is not one of {SHARING}")


@dataclass
class ModelConfig:
    # joint source/target vocabulary, incl. pad/unk/bos/eos: a run takes its tokenizer's (set data.vocab_size)
    vocab_size: int = declare(resume=DERIVED, bounds=Bounds(1, MAX_VOCAB))
    pad_id: int = declare(0, DERIVED, Bounds(0, MAX_VOCAB))  # padding token id: a run takes its tokenizer's (0)
    # residual stream width (shared by encoder and decoder: cross-attention needs it)
    d_model: int = declare(512, ARCH, Bounds(1, MAX_WIDTH))
    n_heads: int = declare(8, ARCH, Bounds(1, 1024))  # attention heads per layer; head dim = d_model // n_heads
    d_ff: int = declare(2048, ARCH, Bounds(1, MAX_FF))  # FFN hidden width
    enc_layers: int = declare(6, ARCH, Bounds(1, MAX_LAYERS))  # encoder layers applied
    dec_layers: int = declare(6, ARCH, Bounds(1, MAX_LAYERS))  # decoder layers applied
    # unique encoder blocks; None = what `sharing` implies (none: enc_layers, all: 1)
    enc_unique: int | None = declare(None, ARCH, Bounds(1, MAX_LAYERS))
    # unique decoder blocks; None = what `sharing` implies (none: dec_layers, all: 1)
    dec_unique: int | None = declare(None, ARCH, Bounds(1, MAX_LAYERS))
    # "none" | "all" (one block repeated) | "cycle" (ABCABC) | "cycle_rev" (ABCCBA)
    sharing: Sharing = declare("none", ARCH)
    # embedding + residual-branch dropout (no attention-probability dropout)
    dropout: float = declare(0.1, SAFE, Bounds(0, 1, hi_open=True))
    positions: Positions = declare("sinusoidal", ARCH)  # "sinusoidal" (fixed) | "learned" (one table per side)
    # longest sequence (tokens incl. BOS/EOS) either side accepts
    max_positions: int = declare(512, ARCH, Bounds(1, MAX_POSITIONS))
    # one matrix for src embedding, tgt embedding and output projection
    tie_embeddings: bool = declare(True, ARCH)
    activation: Activation = declare("gelu", ARCH)  # FFN activation: "relu" | "gelu" (erf) | "gelu_tanh"
    # mid-FFN LayerNorm: W2 act(LN(W1 x)), LN+GELU one fused kernel; off by default: CTranslate2 has no slot for it
    # and it bought no measurable quality (README, Export); a run trained with it keeps it when continued
    ffn_norm: bool = declare(False, ARCH, was=True)
    # kernels.attention backend: "auto" | "triton" | "sdpa" | "reference"
    attn_backend: AttnBackend = declare("auto", SAFE)
    # "fused": kernels.LayerNorm(+residual)(+GELU); "torch": nn.LayerNorm + adds
    norm: Norm = declare("fused", SAFE)
    # "layernorm" | "rmsnorm" (eps 1e-5, no bias; neither export target represents it); each kind runs on the
    # model.norm backends models/components.py NORMS registers for it
    norm_kind: NormKind = declare("layernorm", ARCH, since=4)
    # "padded": (B, T, D) with lengths; "varlen": padded batches run as (total, D) with cu_seqlens;
    # "packed": data.batching="packed" streams, (1, C) -> (C, D) with cu_seqlens and positions from the batch
    layout: Layout = declare("padded", refused("it pairs with data.batching, the plan the checkpoint's position "
                                               "indexes: change both in a new run (--init-from)"))
    checkpointing: bool = declare(False, SAFE)  # activation checkpointing per applied block while training

    def __post_init__(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "enc_layers", "dec_layers", "max_positions"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                 f"{name}={v!r} must be a positive int")
        need(isinstance(self.pad_id, int) and 0 <= self.pad_id < self.vocab_size,
             f"pad_id={self.pad_id!r} must be an id in [0, vocab_size={self.vocab_size})")
        for name, allowed in (("sharing", SHARING), ("positions", POSITIONS), ("activation", ACTIVATIONS),
                              ("attn_backend", ATTN_BACKENDS), ("norm", NORMS), ("layout", LAYOUTS)):
            v = getattr(self, name)
            need(v in allowed, f"{name}={v!r} is not one of {allowed}")
        need(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
             f"dropout={self.dropout!r} must be in [0, 1)")
        # kind -> the backends (model.norm) that compute it; imported here: importing a config starts no torch
        from models.components import NORMS as NORM_BACKENDS

        backends = NORM_BACKENDS.get(self.norm_kind, {"torch": None})
        need(self.norm in backends, f"norm_kind={self.norm_kind!r} runs on norm={' or '.join(map(repr, backends))} only "
                                    f"(models/components.py NORMS): pass --model.norm {next(iter(backends))}")
        need(self.d_model % self.n_heads == 0,
             f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; pick n_heads dividing d_model")
        need(not (self.layout == "packed" and self.attn_backend == "sdpa"),
             "layout='packed' needs varlen attention, which SDPA does not have (kernels.attention would pad "
             "every segment to max_len); use attn_backend='auto' (our kernel on CUDA), 'triton' or 'reference'")
        if self.attn_backend == "triton":
            need(self.head_dim in TRITON_HEAD_DIMS,
                 f"head dim d_model/n_heads={self.head_dim} is not one of {TRITON_HEAD_DIMS} supported by "
                 f"attn_backend='triton'; change n_heads or use attn_backend='sdpa'")
        for side in ("enc", "dec"):
            layers, unique = getattr(self, f"{side}_layers"), getattr(self, f"{side}_unique")
            if unique is None:
                need(self.sharing in ("none", "all"),
                     f"sharing={self.sharing!r} needs {side}_unique (unique blocks, 1..{side}_layers={layers})")
                continue
            need(isinstance(unique, int) and not isinstance(unique, bool) and unique > 0,
                 f"{side}_unique={unique!r} must be a positive int or None")
            if self.sharing == "none":
                need(unique == layers, f"sharing='none' needs {side}_unique == {side}_layers={layers}, got "
                                       f"{unique}; set {side}_unique=None or choose a sharing scheme")
            elif self.sharing == "all":
                need(unique == 1, f"sharing='all' needs {side}_unique == 1, got {unique}")
            else:
                need(unique <= layers, f"{side}_unique={unique} > {side}_layers={layers}: every unique block "
                                       f"must be applied at least once")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def unique_blocks(self, side: str) -> int:
        """Resolved number of unique blocks for side "enc" or "dec"."""
        layers, unique = getattr(self, f"{side}_layers"), getattr(self, f"{side}_unique")
        if unique is not None:
            return unique
        return 1 if self.sharing == "all" else layers

    def schedule(self, side: str) -> list[int]:
        """Unique-block index applied at each layer of side "enc" or "dec"."""
        return layer_schedule(self.sharing, getattr(self, f"{side}_layers"), self.unique_blocks(side))


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------
def tiny(vocab_size: int = DEFAULT_VOCAB) -> ModelConfig:
    """2+2 layers, d_model 64, 4 heads of 16, d_ff 128: CPU tests and smoke runs."""
    return ModelConfig(vocab_size=vocab_size, d_model=64, n_heads=4, d_ff=128, enc_layers=2, dec_layers=2,
                       dropout=0.1, max_positions=256)


def s18(vocab_size: int = DEFAULT_VOCAB) -> ModelConfig:
    """The S18 seed's shape: 6+6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1, no sharing."""
    return ModelConfig(vocab_size=vocab_size, d_model=512, n_heads=8, d_ff=2048, enc_layers=6, dec_layers=6,
                       dropout=0.1)


def s16(vocab_size: int = DEFAULT_VOCAB) -> ModelConfig:
    """The S16 seed's shape: 3+3 unique blocks applied 6+6 as ABCCBA, d_model 512, 8 heads, d_ff 128."""
    return ModelConfig(vocab_size=vocab_size, d_model=512, n_heads=8, d_ff=128, enc_layers=6, dec_layers=6,
                       enc_unique=3, dec_unique=3, sharing="cycle_rev", dropout=0.1)


PRESETS = {"tiny": tiny, "s18": s18, "s16": s16}


def get_preset(name: str, vocab_size: int = DEFAULT_VOCAB, **overrides) -> ModelConfig:
    """Preset ``name`` with ``overrides`` applied to existing fields (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name](vocab_size)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(fields)}")
    return dataclasses.replace(cfg, **overrides)
