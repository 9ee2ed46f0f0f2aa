"""``python -m train --preset P [--section.field value ...]``: the ``fastmt train`` command at its documented
``python -m`` path; the command lives in train/cli/train.py (this entry imports nothing else)."""

import sys

from train.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
