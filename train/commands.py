"""``python -m train.commands COMMAND ...``: the ``fastmt COMMAND`` command at its documented ``python -m`` path, and
the console script's target (pyproject.toml: ``fastmt = "train.commands:main"``); the dispatch lives in
train/cli/commands.py (this entry imports nothing else)."""

import sys

from train.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
