"""``python -m train.stats``: the ``fastmt stats`` command at its documented
``python -m`` path; the command lives in train/cli/stats.py (this entry imports nothing else, and sets
the CPU threads' wait policy first: train/cli/cpu_wait.py)."""

import sys

from train.cli.cpu_wait import wait_passively

wait_passively()  # before torch loads OpenMP: train/cli/cpu_wait.py
from train.cli.stats import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
