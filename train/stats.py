"""``python -m train.stats``: the ``fastmt stats`` command at its documented
``python -m`` path; the command lives in train/cli/stats.py (this entry imports nothing else)."""

import sys

from train.cli.stats import main

if __name__ == "__main__":
    sys.exit(main())
