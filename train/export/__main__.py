"""``python -m train.export``: the same as ``fastmt export``."""

import sys

from train.export.cli import main

sys.exit(main())
