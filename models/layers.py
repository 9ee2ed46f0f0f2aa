"""The building blocks of the Transformer (`models.transformer`): the batch side's lengths (`Side`), the norms
on the residual stream, the sublayers (self- and cross-attention, the FFN), the encoder and decoder blocks and
the stack that applies a side's unique blocks by its schedule.

The residual stream is a pair ``(h, res)`` whose value is ``h + res``: each sublayer starts with
``x, res = norm(h, residual=res)`` (one fused kernel: the add and the LayerNorm) and ends with
``h = dropout(sublayer(x))``. Each sublayer has three forms: ``forward`` (training and scoring, every layout),
``step`` (one decoding token over a preallocated KV cache, `models.decoding.state`) and ``live_step`` (the
eager decoder's live state: PyTorch's SDPA over one cache that the K beams of a sentence share).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from kernels import attention
from models.components import activation_for, attention_for, norm_class, norm_for
from models.config import ModelConfig
from models.decoding.state import KVCache, LiveState, StepPlan


class Side(NamedTuple):
    """Lengths of one side of the batch, in every layout's terms."""

    lengths: torch.Tensor  # int32 (B,) real tokens per sequence; packed: (N,) segment lengths
    cu_seqlens: torch.Tensor | None  # int32 (B+1,) cumulative lengths (varlen and packed layouts)
    max_len: int | None  # longest sequence (packed: the static bound), python int (varlen and packed)
    index: torch.Tensor | None  # int64 (total,) flat (b*T + t) positions of real tokens (varlen only)
    # int32 (total,) segment of each packed token, computed once per batch and side and reused by every
    # layer's attention (varlen and packed layouts; kernels.packed_attention.segment_ids)
    segment_ids: torch.Tensor | None = None


ALL_QUERIES = Side(None, None, None, None)  # padded layout, every query position real (decoding)


# ----------------------------------------------------------------------------------------------
# Norms: the registry's module (models/components.py) on the residual stream
# ----------------------------------------------------------------------------------------------
class ResidualNorm(nn.Module):
    """``forward(h, res) -> (LN(h + res), h + res)``; ``res=None`` means the stream is ``h``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = norm_for(cfg, cfg.d_model)

    def forward(self, h: torch.Tensor, res: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if res is None:
            return self.ln(h), h
        return self.ln(h, residual=res)  # fused: one kernel computes s = h + res and y = LN(s)

    def plain(self, h: torch.Tensor, res: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` as one PyTorch call (the norm module's ``plain``): what the module computes on fp32 CPU tensors
        when ``plain_norms`` says so, without the kernel dispatch's checks (the live step)."""
        s = h if res is None else h + res
        return self.ln.plain(s), s


def plain_norms(cfg: ModelConfig, x: torch.Tensor) -> bool:
    """Whether every ``ResidualNorm`` of the model computes its ``plain`` form on tensors like ``x``: fp32 on the CPU
    without autocast, with a norm module whose ``plain`` is then exact (``plain_exact``: PyTorch's always, the fused
    module's on its reference, ``FASTMT_NORM_BACKEND`` unset, auto or reference)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return False
    return norm_class(cfg).plain_exact()


class NormAct(nn.Module):
    """``act(LN(x))`` over the FFN's d_ff features: the fused LN+GELU kernel, or the norm then the activation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = norm_for(cfg, cfg.d_ff, activation=cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


# ----------------------------------------------------------------------------------------------
# Sublayers
# ----------------------------------------------------------------------------------------------
def split_heads(x: torch.Tensor, n: int, heads: int) -> tuple[torch.Tensor, ...]:
    """(B, T, n*H*D) -> n x (B, H, T, D), or (total, n*H*D) -> n x (total, H, D)."""
    if x.dim() == 3:
        return tuple(rearrange(x, "b t (n h d) -> n b h t d", n=n, h=heads).unbind(0))
    return tuple(rearrange(x, "t (n h d) -> n t h d", n=n, h=heads).unbind(0))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D), or (total, H, D) -> (total, H*D)."""
    if x.dim() == 4:
        return rearrange(x, "b h t d -> b t (h d)")
    return rearrange(x, "t h d -> t (h d)")


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, causal: bool):
        super().__init__()
        self.heads, self.causal, self.backend = cfg.n_heads, causal, cfg.attn_backend
        self.attend = attention_for(cfg)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, side: Side) -> torch.Tensor:
        q, k, v = split_heads(self.qkv(x), 3, self.heads)  # 3 x (B, H, T, D) or (total, H, D)
        return self.out(merge_heads(self.attend(q, k, v, side, side, self.causal)))

    def step(self, x: torch.Tensor, cache: KVCache, plan: StepPlan) -> torch.Tensor:
        """One decoding step: x (B, 1, d_model) at position ``plan.pos``; writes its K/V to the cache."""
        q, k, v = split_heads(self.qkv(x), 3, self.heads)  # 3 x (B, H, 1, D)
        cache.write(plan.pos, k, v)
        keys, values = cache.read(plan.span, plan.gather)  # 2 x (B, H, span, D)
        # query length 1: every key up to its own position is visible (k_lengths masks a static span)
        o = attention(q, keys, values, k_lengths=plan.k_lengths, backend=self.backend)  # (B, H, 1, D)
        return self.out(merge_heads(o))

    def live_step(self, x: torch.Tensor, groups: list[tuple[tuple[torch.Tensor, torch.Tensor], int, torch.Tensor | None]],
                  sizes: list[int]) -> torch.Tensor:
        """One ``live_step`` of x (n, K, d_model), the sentences of ``groups`` one after the other (``sizes``
        each). A group (its cache, its filled slots u, its mask): the K beams of each of its sentences write their
        K/V into cache slots ``u .. u+K-1`` and attend, as one query block, to the slots the mask ((n_g, 1, K, u+K),
        SDPA's boolean or additive mask: the beam's own ancestors; None: every slot) allows."""
        n, K, _ = x.shape
        qkv = self.qkv(x).view(n, K, 3, self.heads, -1)  # (n, K, 3, H, D)
        outs, start = [], 0
        for ((keys, values), u, mask), size in zip(groups, sizes):  # keys, values: (n_g, H, T*K, D)
            part = qkv if len(sizes) == 1 else qkv[start : start + size]
            q, k, v = part.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (n_g, H, K, D)
            keys[:, :, u : u + K] = k
            values[:, :, u : u + K] = v
            end = u + K
            o = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask)  # (n_g, H, K, D)
            outs.append(o.transpose(1, 2).reshape(size, K, -1))
            start += size
        return self.out(outs[0] if len(outs) == 1 else torch.cat(outs))


class CrossAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.attend = cfg.n_heads, attention_for(cfg)
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, S, d_model) or (total_src, d_model) -> K, V per head."""
        return split_heads(self.kv(memory), 2, self.heads)  # 2 x (B, H, S, D) or (total_src, H, D)

    def forward(self, x, memory, q_side: Side, k_side: Side, kv=None) -> torch.Tensor:
        (q,) = split_heads(self.q(x), 1, self.heads)  # (B, H, T, D) or (total_tgt, H, D)
        k, v = kv if kv is not None else self.memory_kv(memory)
        return self.out(merge_heads(self.attend(q, k, v, q_side, k_side, False)))

    def live_step(self, x: torch.Tensor, groups: list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]],
                  sizes: list[int]) -> torch.Tensor:
        """x (n, K, d_model), the sentences of ``groups`` one after the other (``sizes`` each): the K beams of each
        sentence attend to its encoder K/V (n_g, H, S, D); a group's mask (n_g, 1, 1, S): SDPA's additive mask, -inf
        past the source (None: every position is real)."""
        n, K, _ = x.shape
        q = self.q(x).view(n, K, self.heads, -1)  # (n, K, H, D)
        outs, start = [], 0
        for ((keys, values), mask), size in zip(groups, sizes):
            part = (q if len(sizes) == 1 else q[start : start + size]).transpose(1, 2)  # (n_g, H, K, D)
            o = F.scaled_dot_product_attention(part, keys, values, attn_mask=mask)  # (n_g, H, K, D)
            outs.append(o.transpose(1, 2).reshape(size, K, -1))
            start += size
        return self.out(outs[0] if len(outs) == 1 else torch.cat(outs))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activate = activation_for(cfg)
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.act = NormAct(cfg) if cfg.ffn_norm else None
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)  # (..., d_ff)
        h = self.act(h) if self.act is not None else self.activate(h)
        return self.w2(h)


# ----------------------------------------------------------------------------------------------
# Blocks and stacks
# ----------------------------------------------------------------------------------------------
class EncoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_attn = ResidualNorm(cfg)
        self.attn = SelfAttention(cfg, causal=False)
        self.norm_ffn = ResidualNorm(cfg)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, res, side: Side):
        x, res = self.norm_attn(h, res)
        h = self.drop(self.attn(x, side))
        x, res = self.norm_ffn(h, res)
        h = self.drop(self.ffn(x))
        return h, res


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_self = ResidualNorm(cfg)
        self.self_attn = SelfAttention(cfg, causal=True)
        self.norm_cross = ResidualNorm(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.norm_ffn = ResidualNorm(cfg)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, res, memory, tgt: Side, src: Side):
        x, res = self.norm_self(h, res)
        h = self.drop(self.self_attn(x, tgt))
        x, res = self.norm_cross(h, res)
        h = self.drop(self.cross_attn(x, memory, tgt, src))
        x, res = self.norm_ffn(h, res)
        h = self.drop(self.ffn(x))
        return h, res

    def step(self, h, res, cache: KVCache, cross_kv, src: Side, plan: StepPlan):
        """One decoding step for x (B, 1, d_model) (eval mode: dropout is the identity)."""
        x, res = self.norm_self(h, res)
        h = self.self_attn.step(x, cache, plan)
        x, res = self.norm_cross(h, res)
        h = self.cross_attn(x, None, ALL_QUERIES, src, kv=cross_kv)
        x, res = self.norm_ffn(h, res)
        return self.ffn(x), res

    def live_step(self, h, res, layer: int, block: int, states: list[LiveState], masks: list, sizes: list[int]):
        """One ``live_step`` for h (n, K, d_model), applied layer ``layer`` (this block is unique block ``block``),
        the sentences of ``states`` one after the other (eval mode: dropout is the identity)."""
        norm = ResidualNorm.plain if states[0].plain_norms else ResidualNorm.__call__
        x, res = norm(self.norm_self, h, res)
        h = self.self_attn.live_step(x, [(s.caches[layer], s.slots, m) for s, m in zip(states, masks)], sizes)
        x, res = norm(self.norm_cross, h, res)
        h = self.cross_attn.live_step(x, [(s.cross[block], s.cross_mask) for s in states], sizes)
        x, res = norm(self.norm_ffn, h, res)
        return self.ffn(x), res


class Stack(nn.Module):
    """One side's unique blocks (``block(cfg)`` each), the schedule that applies them, and the final norm."""

    def __init__(self, cfg: ModelConfig, side: str, block: Callable[[ModelConfig], nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList([block(cfg) for _ in range(cfg.unique_blocks(side))])
        self.schedule = cfg.schedule(side)  # unique-block index per applied layer
        self.final_norm = ResidualNorm(cfg)
        self.checkpointing = cfg.checkpointing

    def forward(self, h: torch.Tensor, *args) -> torch.Tensor:
        # a zero first residual (h + 0 is h exactly, in h's dtype): every layer sees a tensor that requires grad
        # like the later ones, so a compiled block type is one graph, not two (res=None and res=tensor; dynamo
        # guards on requires_grad too). The leaf's gradient is dropped with it (issue 43). A whole-model trace has one
        # graph anyway (and refuses a requires_grad_ leaf made inside it).
        res = torch.zeros_like(h)
        if h.requires_grad and not torch.compiler.is_compiling():
            res.requires_grad_()
        for i in self.schedule:
            block = self.blocks[i]
            if self.checkpointing and self.training:
                h, res = checkpoint(block, h, res, *args, use_reentrant=False)
            else:
                h, res = block(h, res, *args)
        y, _ = self.final_norm(h, res)
        return y
