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
import traceback

from train.cli.flags import resolve_config
from train.errors import (
    EXIT_ABORTED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UserError,
    debug_enabled,
)


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit code (train/errors.py): 0 finished, 2 a user error (one line), 3 stopped on
    non-finite values, 75 stopped by a signal with a checkpoint (resume with ``--resume auto``), 130 a
    second Ctrl-C (aborted at once; the newest checkpoint is intact), 1 a bug (traceback)."""
    from train.cli import cpu_wait

    cpu_wait.choose(training=True)  # before torch is imported (OpenMP reads it once): train/cli/cpu_wait.py
    try:
        cfg, args = resolve_config(argv)
    except SystemExit as e:  # a flag or setting mistake (one line already printed), or --help: its exit code
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    if args.print_config:
        print(json.dumps(cfg.record(), indent=2, default=str))
        return EXIT_OK
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

    from train import flush_denormals

    flush_denormals()
    from data.clean import DataInputError
    from data.sources import HubUnavailableError
    from train.distributed import cleanup
    from train.epoch_end import NonFiniteLossError
    from train.loop import Trainer
    from train.runs.plan import RunFinishedError
    from train.runs.report import summary_lines
    from train.runs.signals import SetupInterrupted, interrupt_setup

    debug = bool(getattr(args, "debug", False)) or debug_enabled()
    # a signal before training: nothing to save, the half-made run is undone; during training it stops at a
    # step boundary with a checkpoint; after training, it is ignored: the command ends as the run did
    with interrupt_setup():
        try:
            trainer = Trainer(cfg, resume=args.resume, init_from=getattr(args, "init_from", None))
            with trainer:  # also a stop between the setup and fit() releases (or removes) the run folder
                summary = trainer.fit()
        except RunFinishedError as e:  # not a mistake: the run is done
            print(str(e))
            return EXIT_OK
        except SetupInterrupted as e:
            print(f"interrupted: {e}; run the same command again to start", file=sys.stderr)
            return EXIT_INTERRUPTED
        except KeyboardInterrupt:  # the second Ctrl-C: abort at once
            if debug:
                traceback.print_exc()
            print("aborted by a second Ctrl-C: the checkpoints written so far are intact; continue with --resume auto",
                  file=sys.stderr)
            return EXIT_ABORTED
        # stopped on non-finite values (3), or a mistake the message explains (2): a bad setting or file, a busy
        # or foreign run folder, a full or read-only disk; each class carries its exit code
        except (NonFiniteLossError, UserError, DataInputError, HubUnavailableError) as e:
            if debug:
                traceback.print_exc()
            print(f"error: {' '.join(str(e).split()) if not isinstance(e, DataInputError) else e}", file=sys.stderr)
            return getattr(e, "exit_code", EXIT_USAGE)
        finally:
            cleanup()
        if trainer.is_main:
            print("\n" + "\n".join(summary_lines(summary)), flush=True)
        return EXIT_INTERRUPTED if summary["stop_reason"] == "interrupted" else EXIT_OK

if __name__ == "__main__":
    sys.exit(main())
