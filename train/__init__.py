"""fastmt training: configs and presets, the compiled training loop, evaluation, checkpoints, translation.

Three wings, each file one job and the path telling which (docs/ARCHITECTURE.md):

- the engine, here at the top level: ``config`` (+ ``overrides``, ``fields``: each field's type, choices and help, ``bounds``),
  ``loop`` (``Trainer``), ``step``, ``optim``, ``loss``, ``compile``, ``distributed``, ``epoch_end``, ``objective``,
  ``preflight``, ``errors``, and ``evaluation/`` (the library: decoding, BLEU/chrF scoring, loading a checkpoint);
- ``train.runs``: a run folder from claim to prune (folder, lock, plan, start, resume, checkpoint, metrics, report,
  signals);
- ``train.cli``: every command and flag (``fastmt``, train, translate, evaluate, stats, model, export), on top:
  nothing in the engine or the run wing imports it. ``python -m train``, ``train.translate``, ``train.evaluate``,
  ``train.stats`` and ``train.commands`` are thin entries into it.

This package imports nothing on import.
"""


def flush_denormals() -> None:
    """Flush denormals to zero on CPU: with them, eager CPU steps ran ~3x slower (shared/ENV.md).

    numpy computes its float limits lazily and warns once the CPU flushes denormals, so they are
    computed first. A no-op for CUDA work."""
    import numpy as np
    import torch

    for dtype in (np.float16, np.float32, np.float64):
        np.finfo(dtype)  # cached per dtype
    torch.set_flush_denormal(True)
