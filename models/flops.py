"""The one place that counts parameters and FLOPs (for MFU).

``count_params(model)``: ``unique`` = distinct parameter tensors (a tied embedding or a shared block
counted once); ``applied`` = parameters as executed: each shared block counted once per application
in its stack's schedule (the tied embedding still counts once: tying is not an application).

``flops_per_token(cfg, src_len, tgt_len)``: model FLOPs of one training step (forward + backward =
3 x forward) for one sentence pair with ``src_len`` source and ``tgt_len`` target tokens, divided by
``tgt_len``. Counted: every matmul (2 FLOPs per multiply-add) -- projections, FFN, the output
projection over the vocabulary, and attention's QK^T and PV over the *visible* score entries only
(S^2 encoder self, T(T+1)/2 causal decoder self, T*S cross). Not counted: norms, activations,
softmax, embeddings lookups, the loss, and the recomputation of activation checkpointing (MFU
convention: model FLOPs, not hardware FLOPs). Cross-attention K/V are counted once per applied
decoder layer, as the training forward computes them. Use the batch's mean real lengths; the
quadratic terms then slightly under-count a batch with spread lengths.
"""

from __future__ import annotations

from torch import nn

from models.config import ModelConfig


def count_params(model: nn.Module) -> dict[str, int]:
    from models.transformer import Stack

    unique = sum(p.numel() for p in model.parameters())  # .parameters() yields a shared tensor once
    applied = unique
    for stack in (m for m in model.modules() if isinstance(m, Stack)):
        sizes = [sum(p.numel() for p in block.parameters()) for block in stack.blocks]
        applied += sum(sizes[i] for i in stack.schedule) - sum(sizes)
    return {"unique": unique, "applied": applied}


def forward_flops(cfg: ModelConfig, src_len: float, tgt_len: float) -> dict[str, float]:
    """Forward matmul FLOPs for one sentence pair, by part (see the module docstring)."""
    d, f, V, S, T = cfg.d_model, cfg.d_ff, cfg.vocab_size, float(src_len), float(tgt_len)
    ffn = 2 * 2 * d * f  # W1 and W2, per token
    enc_layer = S * (2 * 4 * d * d + ffn) + 2 * 2 * S * S * d  # QKV + out proj, FFN; QK^T + PV
    dec_layer = (
        T * (2 * 4 * d * d + 2 * 2 * d * d + ffn)  # self QKV + out, cross Q + out, FFN
        + S * 2 * 2 * d * d  # cross K/V of the encoder output
        + 2 * 2 * d * T * (T + 1) / 2  # causal self-attention, visible entries
        + 2 * 2 * d * T * S  # cross-attention
    )
    return {
        "encoder": cfg.enc_layers * enc_layer,
        "decoder": cfg.dec_layers * dec_layer,
        "output": 2 * T * d * V,
    }


def flops_per_token(cfg: ModelConfig, src_len: float, tgt_len: float) -> float:
    """Training (fwd + bwd) model FLOPs per real target token; MFU = this * tokens/s / peak FLOP/s."""
    if src_len <= 0 or tgt_len <= 0:
        raise ValueError(f"flops_per_token: src_len={src_len} and tgt_len={tgt_len} must be > 0")
    return 3.0 * sum(forward_flops(cfg, src_len, tgt_len).values()) / float(tgt_len)
