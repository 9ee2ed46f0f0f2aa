"""``python -m train.translate --ckpt C "text" ...``: the ``fastmt translate`` command at its documented
``python -m`` path; the command lives in train/cli/translate.py (this entry imports nothing else)."""

import sys

from train.cli.translate import main

if __name__ == "__main__":
    sys.exit(main())
