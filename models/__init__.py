"""fastmt's encoder-decoder Transformer: config and presets, the model, counting, decoding.

Public API (imported lazily: ``import models`` loads neither torch nor the kernels):

- ``ModelConfig``, presets ``tiny``/``s18``/``s16``, ``get_preset(name, vocab_size=..., **overrides)``
- ``Transformer(cfg)``: ``model(src, tgt_in, src_lengths, tgt_lengths, ...) -> logits (B, T, V)``;
  ``layout="packed"`` takes data's packed streams (+ cu_seqlens, ``src_pos``/``tgt_pos``) -> (1, C_tgt, V)
- ``count_params(model)``, ``flops_per_token(cfg, src_len, tgt_len)``
- ``models.decoding.greedy_decode`` / ``models.decoding.beam_search``

``fastmt model PRESET [--vocab N] [--json]`` (train/cli/model.py) prints a preset's parameter and FLOP counts.
"""

from importlib import import_module

_EXPORTS = {
    "ModelConfig": "models.config",
    "get_preset": "models.config",
    "tiny": "models.config",
    "s18": "models.config",
    "s16": "models.config",
    "PRESETS": "models.config",
    "Transformer": "models.transformer",
    "count_params": "models.flops",
    "flops_per_token": "models.flops",
    "greedy_decode": "models.decoding",
    "beam_search": "models.decoding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
