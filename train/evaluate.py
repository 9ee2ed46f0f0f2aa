"""``python -m train.evaluate --ckpt C --src FILE [--ref FILE ...]``: the ``fastmt evaluate`` command at its documented
``python -m`` path; the command lives in train/cli/evaluate.py (this entry imports nothing else)."""

import sys

from train.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
