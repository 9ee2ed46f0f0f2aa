"""fastmt training: configs and presets, the compiled training loop, evaluation, checkpoints, translation.

Entry points: ``python -m train --preset P [--section.field value ...]`` (or ``--auto``) and
``python -m train.translate --ckpt C "text"``. Modules (imported on use; this package imports nothing):

- ``train.config``      ``Config`` (data/model/optim/run sections), presets ``tiny s18 s16 fast baseline``
- ``train.overrides``   typed ``--section.field`` overrides for nested dataclasses
- ``train.loop``        ``Trainer(cfg)``: ``.fit()`` and ``.train_step(batch)`` (used by bench.ladder)
- ``train.optim``       no-decay parameter groups, Lion/AdamW/Adam, OneCycle / inverse-sqrt schedules
- ``train.evaluate``    validation loss, beam-search sacreBLEU/chrF, ``translate``
- ``train.checkpoint``  atomic save, keep-last-K + best, RNG state
- ``train.metrics``     provenance, metrics.jsonl + TensorBoard, curves.png
- ``train.distributed`` torchrun/DDP setup (NCCL on CUDA, gloo on CPU)
"""
