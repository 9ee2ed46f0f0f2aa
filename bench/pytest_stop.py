"""A pytest plugin of the GPU runbook's test steps (``-p bench.pytest_stop``): a test step ends with its
summary and its JUnit file, whatever stops it, and no finished test's outcome is lost.

``--stop-after-s S``: no test starts after S seconds of the session (the rest is reported as not run); SIGTERM
stops the session as Ctrl-C does (summary, JUnit file, exit 2). ``--outcomes PATH``: one JSON line per decided
test phase, flushed as each test finishes: a hang inside a CUDA call cannot be interrupted by a signal
handler, so the runbook's KILL would otherwise lose every result. ``--first PATTERN`` (repeatable, fnmatch on
node ids): those tests run first, in their collected order.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import threading
import time

import pytest

_DEADLINE: dict[str, float] = {}
_OUTCOMES: dict[str, int] = {}  # "fd": the open outcomes file


def pytest_addoption(parser):
    parser.addoption("--stop-after-s", type=float, default=None, metavar="S",
                     help="start no test after S seconds of the session (bench/pytest_stop.py)")
    parser.addoption("--outcomes", default=None, metavar="PATH",
                     help="append each finished test's outcome to PATH as a JSON line, flushed at once")
    parser.addoption("--first", action="append", default=[], metavar="PATTERN",
                     help="run the tests whose node id matches PATTERN (fnmatch) before the others")


def pytest_collection_modifyitems(session, config, items):
    patterns = config.getoption("--first")
    if patterns:
        first = [it for it in items if any(fnmatch.fnmatchcase(it.nodeid, p) for p in patterns)]
        chosen = {id(it) for it in first}
        items[:] = first + [it for it in items if id(it) not in chosen]


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum} (the runbook step's time limit)")


def pytest_configure(config):
    seconds = config.getoption("--stop-after-s")
    if seconds is not None:
        _DEADLINE["at"], _DEADLINE["seconds"] = time.monotonic() + seconds, seconds
    path = config.getoption("--outcomes")
    if path and not hasattr(config, "workerinput"):
        _OUTCOMES["fd"] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_unconfigure(config):
    fd = _OUTCOMES.pop("fd", None)
    if fd is not None:
        os.close(fd)


def pytest_runtest_logreport(report):
    """The phase that decides the test's outcome: a failed or skipped setup, the call, a failed teardown."""
    fd = _OUTCOMES.get("fd")
    if fd is None:
        return
    if not (report.when == "call" or (report.when == "setup" and not report.passed)
            or (report.when == "teardown" and report.failed)):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    rec = {"nodeid": report.nodeid, "outcome": outcome, "when": report.when, "duration": round(report.duration, 3)}
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # "path:line: message" of the failure
        text = getattr(crash, "message", None) or (str(report.longreprtext).strip().splitlines() or [""])[-1]
        rec["message"] = str(text)[:500]
    os.write(fd, (json.dumps(rec) + "\n").encode())
    os.fsync(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is not None and "at" in _DEADLINE and time.monotonic() > _DEADLINE["at"]:
        item.session.shouldstop = (f"--stop-after-s {_DEADLINE['seconds']:g} reached: "
                                   f"the tests after {item.nodeid} did not run")


def count(path: str) -> dict[str, int]:
    """Outcome counts of an outcomes file (what a KILLed step still shows): {"passed": n, ...}."""
    from data.files import LOG_MAX, read_json_lines

    out: dict[str, int] = {}
    try:
        lines = read_json_lines(path, "test outcomes", limit=LOG_MAX)
    except (OSError, ValueError):  # missing or refused: no finished test to count
        return out
    for _, rec in lines:  # a line torn by a KILL parses as None
        outcome = rec.get("outcome") if isinstance(rec, dict) else None
        if isinstance(outcome, str):
            out[outcome] = out.get(outcome, 0) + 1
    return out


if __name__ == "__main__":  # python3 -m bench.pytest_stop FILE: the counts, one line
    import sys

    c = count(sys.argv[1])
    print(", ".join(f"{v} {k}" for k, v in sorted(c.items())) or "no finished test")
