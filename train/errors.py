"""The exit codes of every fastmt command, and the base class of the errors a user can fix.

A command ends with one of these codes, so that schedulers and scripts can tell the cases apart:

    0   EXIT_OK           finished: the run reached its end (epochs, max_steps, wall budget, early stop),
                          or the command did what it was asked
    1   EXIT_BUG          an unexpected error: a traceback is printed (a bug in fastmt; please report it)
    2   EXIT_USAGE        a mistake the message explains in one line (bad flag or value, bad input file,
                          a run folder in use or not a run, a full or read-only disk); nothing was changed
    3   EXIT_NONFINITE    training stopped on non-finite values; the message names a finite checkpoint
    75  EXIT_INTERRUPTED  stopped early by a signal (SIGTERM, SIGINT, SIGUSR1: pre-emption) with a checkpoint:
                          resume with ``--resume auto`` (75 is EX_TEMPFAIL: "try again later")
    130 EXIT_ABORTED      a second Ctrl-C (training) or a Ctrl-C (translate, evaluate): stopped at once; what
                          was written before is intact (128 + SIGINT, as shells report it)

``UserError`` (and the other error classes that commands map to ``EXIT_USAGE``) print one line,
``error: <message>``, without a traceback; ``--debug`` or ``FASTMT_DEBUG=1`` shows the traceback too.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_INTERRUPTED = 75
EXIT_ABORTED = 130


class UserError(Exception):
    """A mistake the user can fix; the message says what was wrong (the value, the file/line) and the fix."""

    exit_code = EXIT_USAGE


def debug_enabled() -> bool:
    """``FASTMT_DEBUG=1``: show tracebacks for user errors too."""
    return os.environ.get("FASTMT_DEBUG", "") not in ("", "0", "false", "no")
