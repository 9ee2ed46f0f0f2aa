"""Stop requests: SIGINT (Ctrl-C), SIGTERM (``timeout``, SLURM, Kubernetes, ``docker stop``) and SIGUSR1
(SLURM's advance warning before a pre-emption or the time limit, ``#SBATCH --signal=B:USR1@120``).

While training (``stop_on_signals``), the first SIGINT, SIGTERM or SIGUSR1 only asks the loop to stop at the next
step boundary, where it writes a checkpoint; the command then exits ``EXIT_INTERRUPTED`` (75). A second
Ctrl-C aborts at once (``KeyboardInterrupt``). Before training starts (``interrupt_setup``) there is
nothing to save: either signal raises ``SetupInterrupted`` at once, and the half-made run is undone.
DataLoader workers ignore all three (data/workers.py), so a signal sent to the whole process group
reaches the training process alone in effect. Handlers can only be installed in the main thread:
elsewhere both context managers do nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_trainings = 0  # how many stop_on_signals blocks this process has entered (training loops started)


class SetupInterrupted(Exception):
    """A stop signal arrived before the first training step (nothing to save)."""

    def __init__(self, signame: str):
        super().__init__(f"{signame} before training started: nothing was trained, nothing to save")
        self.signame = signame


def _installable() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handlers(handler: Callable[[int, Any], Any]):
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[str], Any]):
    """While active, the first Ctrl-C (SIGINT), SIGTERM or SIGUSR1 calls ``request_stop(name)`` instead of killing the
    run, so the loop can stop at a step boundary with a checkpoint; a second Ctrl-C interrupts at once.
    The previous handlers are restored on exit."""
    if not _installable():
        yield
        return

    def handler(signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        request_stop(signal.Signals(signum).name)

    global _trainings
    _trainings += 1
    with _handlers(handler):
        yield


@contextlib.contextmanager
def interrupt_setup():
    """While active, SIGINT, SIGTERM or SIGUSR1 raises ``SetupInterrupted`` until training starts (building data and
    the model: nothing to save yet); inside training ``stop_on_signals`` decides; once training has ended
    (stopped or finished, its checkpoint written), further signals are ignored so that the command ends
    with its own exit code. The previous handlers are restored on exit."""
    if not _installable():
        yield
        return
    started = _trainings

    def handler(signum, frame):
        if _trainings == started:
            raise SetupInterrupted(signal.Signals(signum).name)

    with _handlers(handler):
        yield

