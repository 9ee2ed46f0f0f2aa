"""fastmt data pipeline: HF datasets -> cleaning -> seeded split -> SentencePiece -> cached arrays -> batches.

Public: `DataConfig`, `build_data(cfg, log=print) -> DataBundle`, `Batch`. Importing this package is light
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
