"""``python -m train --preset P [--section.field value ...]``: train a translator.

Examples:
    python -m train --auto --data-files ../shared/data/opus_mt_testsets/en-it/train.jsonl
    python -m train --preset tiny --optim.lr 1e-3 --run.precision bf16 --epochs 2
    python -m train --preset fast --resume auto
    python -m train --preset s18 --print-config

``--auto``: CUDA -> the ``fast`` preset (the best measured time to BLEU); no CUDA -> ``tiny`` (says why).
Every field of every config section can be set as ``--data.x``, ``--model.x``, ``--optim.x``,
``--run.x`` (``--help-fields`` lists them); unknown names and values of the wrong type are errors.
Under torchrun the same command trains with DDP (only rank 0 logs and saves).
"""

from __future__ import annotations

import json
import os
import sys

from train.cli import resolve_config


def main(argv: list[str] | None = None) -> int:
    cfg, args = resolve_config(argv)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2, default=str))
        return 0
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

    from train import flush_denormals

    flush_denormals()
    from data.clean import DataInputError
    from train.checkpoint import CheckpointReadError, CheckpointWriteError
    from train.distributed import cleanup
    from train.loop import RunFinishedError, Trainer
    from train.rundir import RunLockedError

    try:
        trainer = Trainer(cfg, resume=args.resume)
        summary = trainer.fit()
    except RunFinishedError as e:
        print(str(e))
        return 0
    # bad input, a busy run name, a full or read-only disk: the message says why and what to do
    except (DataInputError, RunLockedError, CheckpointReadError, CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        cleanup()
    if trainer.is_main:
        print("summary: " + json.dumps(summary, default=str))
        print(f"run folder: {trainer.run_dir} (metrics.jsonl, provenance.json, checkpoints/, curves.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
