"""A pytest plugin of the GPU runbook's test steps (``-p bench.pytest_stop``): a test step ends with its
summary and its JUnit file, whatever stops it.

``--stop-after-s S``: no test starts once S seconds have passed since the session started; the rest of
the selection is reported as not run (pytest's "Interrupted" line) and the session ends normally. SIGTERM
(``timeout`` at the step's limit) stops the session as Ctrl-C does: pytest reports what ran, writes the
JUnit file, and exits 2. Without this a TERM killed pytest with neither (bench/gpu_run.sh's steps).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

_DEADLINE: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--stop-after-s", type=float, default=None, metavar="S",
                     help="start no test after S seconds of the session (bench/pytest_stop.py)")


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum} (the runbook step's time limit)")


def pytest_configure(config):
    seconds = config.getoption("--stop-after-s")
    if seconds is not None:
        _DEADLINE["at"], _DEADLINE["seconds"] = time.monotonic() + seconds, seconds
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is not None and "at" in _DEADLINE and time.monotonic() > _DEADLINE["at"]:
        item.session.shouldstop = (f"--stop-after-s {_DEADLINE['seconds']:g} reached: "
                                   f"the tests after {item.nodeid} did not run")
