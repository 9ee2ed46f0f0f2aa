"""fastmt training: configs and presets, the compiled training loop, evaluation, checkpoints, translation.

Entry points: ``python -m train --preset P [--section.field value ...]`` (or ``--auto``),
``python -m train.translate --ckpt C "text"`` and ``python -m train.evaluate --ckpt C --src F --ref R``.
Modules (imported on use; this package imports nothing):

- ``train.config``      ``Config`` (data/model/optim/run sections), presets ``tiny s18 s16 fast baseline``
- ``train.overrides``   typed ``--section.field`` overrides for nested dataclasses
- ``train.loop``        ``Trainer(cfg)``: ``.fit()`` and ``.train_step(batch)`` (used by bench.ladder)
- ``train.optim``       no-decay parameter groups, Lion/AdamW/Adam, OneCycle / inverse-sqrt schedules
- ``train.evaluate``    validation loss, beam-search sacreBLEU/chrF, ``translate``, the scoring protocol
- ``train.checkpoint``  atomic save, keep-last-K + best, RNG state
- ``train.metrics``     provenance, metrics.jsonl + TensorBoard, curves.png
- ``train.distributed`` torchrun/DDP setup (NCCL on CUDA, gloo on CPU)
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
