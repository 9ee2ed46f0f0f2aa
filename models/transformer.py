"""Pre-LN encoder-decoder Transformer on fastmt's kernels.

Architecture (all switches in ``ModelConfig``):
- One joint vocabulary. Token embeddings are multiplied by sqrt(d_model) and initialised
  N(0, 1/d_model), so the scaled embedding has unit variance and, with ``tie_embeddings``, the output
  projection (the same matrix) gives unit-scale logits. Tied: src embedding = tgt embedding = output
  projection; untied: three matrices. Positions: fixed sinusoids or a learned table per side.
- Pre-LN blocks. The residual stream is carried as a pair ``(h, res)`` whose value is ``h + res``:
  each sublayer starts with ``x, res = norm(h, residual=res)`` (one fused kernel computes the add
  and the LayerNorm and returns the new stream ``res``) and ends with ``h = dropout(sublayer(x))``.
  The first block gets a zero residual (one graph per block type); each stack ends with its own final LayerNorm of ``h + res``.
- Layouts (``cfg.layout``): ``padded`` runs (B, T, D) activations and gives ``kernels.attention`` the
  batch's lengths; ``varlen`` gathers a padded batch's real tokens into (total, D) activations, runs
  attention with cu_seqlens and re-pads only the final decoder states; ``packed`` consumes the
  fixed-shape token streams of ``data.batching="packed"`` (docs/ARCHITECTURE.md "Packed batches"):
  (1, C) -> (C, D) activations, positions gathered from the batch's ``src_pos``/``tgt_pos``,
  attention varlen with the batch's cu_seqlens and the static ``max_len`` bound, logits (1, C, V).
  The packed path has no data-dependent shapes (no boolean indexing, no host syncs), so the whole
  forward compiles to one graph; tail-padding tokens form their own dummy segments and never mix
  with real ones.
- Attention: bias-free fused QKV (self) or Q + fused KV (cross) projections, ``kernels.attention``,
  bias-free output projection. Encoder self, decoder causal self (bottom-right convention), cross
  (q = tgt, k = src; segment k of tgt attends to segment k of src).
- FFN: ``W2 act(LN(W1 x))`` with ``ffn_norm`` (a NormFormer-style mid-FFN LayerNorm, placed before
  the activation so that LN+GELU is one fused kernel), ``W2 act(W1 x)`` without. Bias-free linears
  (the LayerNorms carry the biases). ReLU has no fused form: LN kernel, then ``F.relu``.
- ``norm="torch"`` swaps every kernel LayerNorm for ``nn.LayerNorm`` + explicit adds + F.gelu: the
  same math and the same parameter names (state dicts load across the switch).
- The blocks, sublayers and norms live in `models.layers`; this module holds the model: embeddings, the two
  stacks, the layouts, the output projection and the decoding entry points.
- Components chosen by name (norm, activation, attention backend, positions) come from one registry each through
  ``models.components``' factories (``norm_for``, ``activation_for``, ``attention_for``, ``positions_for``), the
  layouts from ``LAYOUTS`` below; every module takes the ``ModelConfig``. An unknown name fails when the model is
  built, naming the choices.
- Parameter sharing: each stack holds a ModuleList of its unique blocks and applies them following
  ``cfg.schedule(side)``; a shared block is one module object called several times.
- Decoding runs padded batches in every layout (the weights do not depend on it): ``start_decoding``
  (cross-attention K/V per unique decoder block, which is the same for every application of a shared
  block, plus a preallocated self-attention KV cache per applied layer) ->
  ``decode_step`` one token at a time (query length 1, every filled position visible), eagerly over the
  filled prefix or over a fixed span with the position on the device (static shapes, no host sync).
  The eager path of ``models.decoding`` uses ``start_live`` -> ``live_step`` instead: a state holds only the
  sentences still decoding (``LiveState.keep`` drops the finished ones), the K beams of a sentence are one
  query block of length K over one cache that all of them write (position j of beam k in slot ``j*K + k``), so a
  beam's ancestry is an attention mask and no step copies a prefix, the cross K/V are kept once per sentence,
  and attention is PyTorch's SDPA (its fused CPU kernel) with plain views in place of einops. One step can run
  several states (batches at different positions): the row-wise work once for all, attention per state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from kernels.packed_attention import segment_ids
from models.components import pick, positions_for
from models.config import ModelConfig
from models.decoding.state import DecodeState, KVCache, LiveState, StepPlan
from models.layers import DecoderBlock, EncoderBlock, Side, Stack, plain_norms


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------
class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, V = cfg.d_model, cfg.vocab_size
        self.embed_scale = math.sqrt(d)  # token embeddings are multiplied by sqrt(d_model)
        self.src_embed = nn.Embedding(V, d)
        if cfg.tie_embeddings:  # the same module object: one parameter, three uses
            self.tgt_embed = self.src_embed
            self.lm_head = None
        else:
            self.tgt_embed = nn.Embedding(V, d)
            self.lm_head = nn.Linear(d, V, bias=False)
        self.src_pos, self.tgt_pos = positions_for(cfg), positions_for(cfg)  # learned: src_pos.weight, tgt_pos.weight
        self.drop = nn.Dropout(cfg.dropout)
        self._token_indices: dict[tuple[int, torch.device], torch.Tensor] = {}  # packed: arange per stream length
        pick(LAYOUTS, "model.layout", cfg.layout)  # an unknown layout fails here, not at the first batch
        self.encoder = Stack(cfg, "enc", EncoderBlock)
        self.decoder = Stack(cfg, "dec", DecoderBlock)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        d = self.cfg.d_model
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
        for emb in dict.fromkeys((self.src_embed, self.tgt_embed)):  # a set would order them by id per process
            nn.init.normal_(emb.weight, std=d**-0.5)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=d**-0.5)
        self.src_pos.reset_parameters()  # learned: N(0, 0.02^2); sinusoids: fixed
        self.tgt_pos.reset_parameters()

    # -- pieces ---------------------------------------------------------------------------------
    def _side(self, tokens, lengths, cu_seqlens, max_len, seg=None) -> Side:
        """The Side of one side of a batch, in the model's layout (``LAYOUTS``); ``seg``: a packed batch's segment
        ids, as its data workers built them (else computed here)."""
        return LAYOUTS[self.cfg.layout](self, tokens, lengths, cu_seqlens, max_len, seg)

    def _padded_side(self, tokens, lengths, cu_seqlens, max_len, seg=None) -> Side:
        return Side(lengths, None, None, None)

    def _packed_side(self, tokens, lengths, cu_seqlens, max_len, seg=None) -> Side:
        """The batch's segments as they are: no gather, static shapes."""
        total = tokens.numel()
        if seg is None:
            seg = segment_ids(cu_seqlens, total, self._token_index(total, tokens.device))
        return Side(lengths, cu_seqlens, max_len, None, seg)

    def _varlen_side(self, tokens, lengths, cu_seqlens, max_len, seg=None) -> Side:
        """A padded batch's real tokens gathered into one (total,) stream."""
        B, T = tokens.shape
        if cu_seqlens is None:
            cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        valid = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]  # (B, T)
        index = rearrange(valid, "b t -> (b t)").nonzero().squeeze(1)  # (total,) row-major = cu_seqlens order
        return Side(lengths, cu_seqlens, T if max_len is None else max_len, index,
                    segment_ids(cu_seqlens, index.shape[0]))

    def _token_index(self, total: int, device: torch.device) -> torch.Tensor | None:
        """int32 ``arange(total)`` for ``segment_ids``, made once per stream length and device and kept (a
        packed run has one or two lengths); None while torch.compile traces (it makes its own)."""
        if torch.compiler.is_compiling():
            return None
        key = (total, device)
        cached = self._token_indices.get(key)
        if cached is None:
            cached = self._token_indices[key] = torch.arange(total, dtype=torch.int32, device=device)
        return cached

    def _embed(self, tokens, side: Side, table: nn.Embedding, pos_table: nn.Module,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> (B, T, d_model), or (total, d_model) in the varlen layout; packed:
        tokens and ``positions`` (1, C) -> (C, d_model)."""
        if positions is not None:  # packed: positions inside each segment come with the batch
            tokens = rearrange(tokens, "1 c -> c")  # (C,)
            pos = rearrange(positions, "1 c -> c")  # (C,)
        else:
            T = tokens.shape[1]
            if T > self.cfg.max_positions:
                raise ValueError(f"sequence length {T} > max_positions={self.cfg.max_positions}; raise max_positions")
            pos = torch.arange(T, device=tokens.device).expand_as(tokens)  # (B, T)
            if side.index is not None:
                tokens = rearrange(tokens, "b t -> (b t)")[side.index]  # (total,)
                pos = rearrange(pos, "b t -> (b t)")[side.index]
        x = table(tokens) * self.embed_scale
        x = x + pos_table(pos)
        return self.drop(x)

    def output_weight(self) -> torch.Tensor:
        """(V, d_model) output projection: the shared embedding when tied."""
        return self.src_embed.weight if self.lm_head is None else self.lm_head.weight

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.output_weight())

    def _check_packed_inputs(self, src, tgt_in, cu_seqlens_src, cu_seqlens_tgt, max_src_len, max_tgt_len,
                             src_pos, tgt_pos, src_seg=None, tgt_seg=None) -> None:
        """Static checks of a packed batch (shapes and python ints only: no host sync, no graph break)."""
        given = dict(cu_seqlens_src=cu_seqlens_src, cu_seqlens_tgt=cu_seqlens_tgt, max_src_len=max_src_len,
                     max_tgt_len=max_tgt_len, src_pos=src_pos, tgt_pos=tgt_pos)
        missing = [name for name, v in given.items() if v is None]
        if missing:
            raise ValueError(f"layout='packed' needs {missing} (None given): pass every field of a packed Batch "
                             f"(data batching='packed'), or use layout='padded'/'varlen' for padded batches")
        if cu_seqlens_src.dim() != 1 or cu_seqlens_src.shape != cu_seqlens_tgt.shape:
            raise ValueError(f"layout='packed' needs cu_seqlens_src/cu_seqlens_tgt of one shape (N+1,) "
                             f"(segment k of src pairs with segment k of tgt), got {tuple(cu_seqlens_src.shape)} and "
                             f"{tuple(cu_seqlens_tgt.shape)}")
        for name, tokens, pos, seg, max_len in (("src", src, src_pos, src_seg, max_src_len),
                                                ("tgt_in", tgt_in, tgt_pos, tgt_seg, max_tgt_len)):
            if tokens.dim() != 2 or tokens.shape[0] != 1 or pos.shape != tokens.shape:
                raise ValueError(f"layout='packed' needs {name} and its positions as (1, C) streams, got "
                                 f"{tuple(tokens.shape)} and {tuple(pos.shape)}")
            if seg is not None and (seg.shape != tokens.shape[1:] or seg.dtype != torch.int32):
                raise ValueError(f"layout='packed' needs {name}'s segment ids as an int32 ({tokens.shape[1]},) "
                                 f"stream, got {seg.dtype} {tuple(seg.shape)}")
            if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len > self.cfg.max_positions:
                raise ValueError(f"layout='packed': the {name} max_len bound {max_len!r} must be a python int <= "
                                 f"max_positions={self.cfg.max_positions}")

    def encode(self, src, src_lengths, cu_seqlens_src=None, max_src_len=None,
               src_pos=None, src_seg=None) -> tuple[torch.Tensor, Side]:
        """Encoder states (B, S, d_model) (padded), (total_src, d_model) (varlen) or (C_src, d_model)
        (packed), and the src Side."""
        side = self._side(src, src_lengths, cu_seqlens_src, max_src_len, src_seg)
        return self.encoder(self._embed(src, side, self.src_embed, self.src_pos, src_pos), side), side

    # -- training forward ---------------------------------------------------------------------------
    def forward(self, src, tgt_in, src_lengths, tgt_lengths, cu_seqlens_src=None, cu_seqlens_tgt=None,
                max_src_len=None, max_tgt_len=None, src_pos=None, tgt_pos=None, src_seg=None, tgt_seg=None, *,
                return_hidden: bool = False) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) int token ids; lengths int32 (B,) -> logits (B, T, V).

        Packed layout: src (1, C_src), tgt_in (1, C_tgt) streams; lengths (N,), cu_seqlens (N+1,) int32;
        ``max_*_len`` the static max_len bound; ``src_pos``/``tgt_pos`` (1, C) int32 positions inside
        each segment; ``src_seg``/``tgt_seg`` (C,) int32 the segment of each token, optional (the packed
        collate builds them; computed from cu_seqlens when None) -> logits (1, C_tgt, V).

        Logits at padded target positions (packed: tail padding) are unspecified (the loss ignores
        them). No log_softmax: the cross-entropy applies it. ``return_hidden``: the final decoder states
        (B, T, d_model) (packed (1, C_tgt, d_model)) instead, for a loss that fuses the projection.
        """
        packed = self.cfg.layout == "packed"
        if packed:
            self._check_packed_inputs(src, tgt_in, cu_seqlens_src, cu_seqlens_tgt, max_src_len, max_tgt_len,
                                      src_pos, tgt_pos, src_seg, tgt_seg)
        elif any(v is not None for v in (src_pos, tgt_pos, src_seg, tgt_seg)):
            raise ValueError(f"src_pos/tgt_pos/src_seg/tgt_seg are packed-batch fields but layout="
                             f"{self.cfg.layout!r}; build the model with layout='packed' for data batching='packed'")
        memory, src_side = self.encode(src, src_lengths, cu_seqlens_src, max_src_len, src_pos, src_seg)
        tgt_side = self._side(tgt_in, tgt_lengths, cu_seqlens_tgt, max_tgt_len, tgt_seg)
        h = self.decoder(self._embed(tgt_in, tgt_side, self.tgt_embed, self.tgt_pos, tgt_pos), memory, tgt_side, src_side)
        if packed:
            h = rearrange(h, "c d -> 1 c d")  # (1, C_tgt, d)
        elif tgt_side.index is not None:  # re-pad (total_tgt, d) -> (B, T, d), zeros at padded positions
            B, T = tgt_in.shape
            flat = h.new_zeros(B * T, h.shape[-1]).index_copy(0, tgt_side.index, h)
            h = rearrange(flat, "(b t) d -> b t d", b=B)
        return h if return_hidden else self._project(h)  # (B, T, V); packed (1, C_tgt, V)

    # -- incremental decoding -------------------------------------------------------------------
    def start_decoding(self, src, src_lengths, max_len: int, repeat: int = 1,
                       state: DecodeState | None = None) -> DecodeState:
        """Encode src (B, S) (padded layout) and set up decoding of ``max_len`` decoder input positions
        for B*repeat rows (each source's rows consecutive: beams). The encoder and cross K/V run on the
        B sources once. ``state``: refill that state in place (same shapes) instead of allocating, so
        that its tensors keep their addresses (a captured CUDA graph reads them)."""
        memory = self._decoding_memory(src, src_lengths, max_len)  # (B, S, d)
        cross_kv = [tuple(repeat_rows(x, repeat) for x in blk.cross_attn.memory_kv(memory))
                    for blk in self.decoder.blocks]  # one (K, V) per unique block, (B*repeat, H, S, D) each
        lengths = repeat_rows(src_lengths, repeat)
        if state is not None:
            if state.cross_kv[0][0].shape != cross_kv[0][0].shape or state.max_len != max_len:
                raise ValueError(f"start_decoding(state=...): the state holds cross K/V "
                                 f"{tuple(state.cross_kv[0][0].shape)} and max_len {state.max_len}, this batch "
                                 f"needs {tuple(cross_kv[0][0].shape)} and {max_len}; pass state=None")
            for (k0, v0), (k1, v1) in zip(state.cross_kv, cross_kv):
                k0.copy_(k1)
                v0.copy_(v1)
            state.src.lengths.copy_(lengths)
            state.pos.zero_()
            state.t = 0
            return state
        B, cfg, dev = lengths.shape[0], self.cfg, memory.device
        dtype = self._cache_dtype(memory)
        caches = [KVCache(B, cfg.n_heads, max_len, cfg.head_dim, dtype, dev) for _ in self.decoder.schedule]
        # the state owns its lengths (a later refill writes into them, never into the caller's tensor)
        return DecodeState(caches, cross_kv, Side(lengths.clone(), None, None, None), max_len)

    def _decoding_memory(self, src: torch.Tensor, src_lengths: torch.Tensor, max_len: int) -> torch.Tensor:
        """The encoder states (B, S, d_model) of a padded batch to decode ``max_len`` positions from."""
        if max_len > self.cfg.max_positions:
            raise ValueError(f"max_len={max_len} > max_positions={self.cfg.max_positions}")
        src_side = Side(src_lengths, None, None, None)
        return self.encoder(self._embed(src, src_side, self.src_embed, self.src_pos), src_side)

    def _cache_dtype(self, memory: torch.Tensor) -> torch.dtype:
        """The dtype the decoder's linears produce (autocast's, when it is on), so cache writes need no cast."""
        dev = memory.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else memory.dtype

    def start_live(self, src: torch.Tensor, src_lengths: torch.Tensor, max_len: int, beams: int = 1,
                   host_lengths: list[int] | None = None) -> LiveState:
        """Encode src (B, S) (padded layout) once and set up ``live_step`` decoding of ``max_len`` decoder
        input positions for ``beams`` hypotheses per sentence. ``host_lengths``: ``src_lengths`` as the host
        knows them, if it does (see ``LiveState``)."""
        memory = self._decoding_memory(src, src_lengths, max_len)  # (B, S, d)
        B, S, cfg = src.shape[0], src.shape[1], self.cfg
        cross_kv = [blk.cross_attn.memory_kv(memory) for blk in self.decoder.blocks]  # (B, H, S, D) each, per block
        dtype = self._cache_dtype(memory)
        real = (torch.arange(S, device=src.device) < src_lengths.to(torch.long)[:, None]).view(B, 1, 1, S)
        src_bias = torch.zeros(B, 1, 1, S, dtype=dtype, device=src.device).masked_fill_(~real, -math.inf)
        shape = (B, cfg.n_heads, max_len * beams, cfg.head_dim)
        # unfilled: a step reads only the slots it and the steps before it wrote
        caches = [(torch.empty(shape, dtype=dtype, device=memory.device),
                   torch.empty(shape, dtype=dtype, device=memory.device)) for _ in self.decoder.schedule]
        state = LiveState(caches, cross_kv, src_bias, beams, max_len, host_lengths)
        state.plain_norms = plain_norms(cfg, memory)
        return state

    def live_step(self, tokens: torch.Tensor, states: list[LiveState], masks: list) -> torch.Tensor:
        """tokens (n*K,) -> next-token logits (n*K, V): the sentences of ``states`` one after the other (the K beams
        of each sentence consecutive), each state's at its own position ``t``, advanced. ``masks``: per state,
        (n_g, 1, K, (t+1)*K), boolean or additive, the cache slots each beam may see (its ancestors: see
        ``LiveState``); None: every slot (greedy decoding, K = 1). The row-wise work (norms, projections, FFN)
        runs once for every sentence; attention per state."""
        K = states[0].beams
        n, sizes = tokens.shape[0] // K, [len(s) for s in states]
        for s in states:
            if s.t >= s.max_len:
                raise ValueError(f"live_step: position {s.t} is past the cache (max_len={s.max_len})")
        table = self.tgt_pos.weight
        x = self.tgt_embed(tokens).view(n, K, -1) * self.embed_scale  # (n, K, d)
        if len(states) == 1:
            x = x + table[states[0].t]
        else:  # each state's rows get its position
            x = x + torch.cat([table[s.t].expand(size, 1, -1) for s, size in zip(states, sizes)])
        h, res = x, None
        for layer, i in enumerate(self.decoder.schedule):
            h, res = self.decoder.blocks[i].live_step(h, res, layer, i, states, masks, sizes)
        final = self.decoder.final_norm
        y, _ = final.plain(h, res) if states[0].plain_norms else final(h, res)
        for s in states:
            s.t += 1
            s.slots += K
        return self._project(y).view(n * K, -1)

    def decode_step(self, tokens: torch.Tensor, state: DecodeState, span: int | None = None) -> torch.Tensor:
        """tokens (B,) at position ``state.pos`` -> next-token logits (B, V); advances the position.

        ``span=None`` (eager): the self-attention reads exactly the t+1 filled cache positions (t =
        ``state.t``, a host counter): shapes change every step. ``span=int`` (static): it reads the
        first ``span`` positions and masks those past the position on the device, so the step's shapes
        depend on ``span`` only and it syncs nothing: what torch.compile and CUDA-graph capture need
        (``state.t`` is then not advanced; the caller keeps position < span <= max_len).
        """
        B = tokens.shape[0]
        if span is None:
            span, k_lengths = state.t + 1, None
            if span > state.max_len:
                raise ValueError(f"decode_step: position {state.t} is past the cache (max_len={state.max_len})")
            state.t += 1
        else:
            if not 1 <= span <= state.max_len:
                raise ValueError(f"decode_step: span={span} must lie in [1, max_len={state.max_len}]")
            k_lengths = (state.pos + 1).to(torch.int32).repeat(B)  # (B,)
        gather = None if state.rows is None else KVCache.gather_index(state.rows, self.cfg.n_heads, span)
        plan = StepPlan(state.pos, span, k_lengths, gather)
        x = self.tgt_embed(rearrange(tokens, "b -> b 1")) * self.embed_scale  # (B, 1, d)
        x = x + self.tgt_pos(state.pos)
        h, res = x, None
        for layer, i in enumerate(self.decoder.schedule):
            h, res = self.decoder.blocks[i].step(h, res, state.caches[layer], state.cross_kv[i], state.src, plan)
        y, _ = self.decoder.final_norm(h, res)
        state.pos.add_(1)
        return rearrange(self._project(y), "b 1 v -> b v")


# the layouts (model.layout): how a batch side becomes a Side
LAYOUTS = {"padded": Transformer._padded_side, "varlen": Transformer._varlen_side, "packed": Transformer._packed_side}


def repeat_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Each row of x (B, ...) n times in a row: (B*n, ...)."""
    return x if n == 1 else x.repeat_interleave(n, dim=0)
