"""fastmt data pipeline: files / HF datasets -> cleaning -> leakage-free split -> SentencePiece -> memory-mapped
cache entry (built once, in parallel, streaming) -> batches.

Public: `DataConfig`, `build_data(cfg, log=print, tokenizer=None) -> DataBundle`, `Batch`. Importing this package is light
(stdlib only); torch, numpy-heavy code, datasets and sentencepiece load on first use.
"""

from .config import DataConfig

__all__ = [
    "DataConfig",
    "build_data",
    "Batch",
    "DataBundle",
    "EncodedSplit",
    "BatchSpec",
    "PackLayout",
    "plan_batches",
]

_LAZY = {
    "build_data": "pipeline",
    "DataBundle": "pipeline",
    "EncodedSplit": "pipeline",
    "Batch": "collate",
    "BatchSpec": "batching",
    "PackLayout": "batching",
    "plan_batches": "batching",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
