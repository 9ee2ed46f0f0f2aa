"""``python -m train.export``: the same as ``fastmt export`` (the command lives in train/cli/export.py)."""

import sys

from train.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
