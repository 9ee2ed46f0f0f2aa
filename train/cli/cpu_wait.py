"""How the threads of a fastmt process wait for each other (OpenMP's wait policy), issue 45.

PyTorch's CPU kernels run on OpenMP threads. By default an idle OpenMP thread spins (busy-waits) before it sleeps:
the fastest on a machine of one's own, and the slowest beside another program, whose core a spinning thread's partner
waits for. Measured on a shared 2-core machine (bench/results/cpu-threads.md): alone the tiny preset's 3 toy epochs
took 8.3-8.5 s spinning against 9.7 s passive (``OMP_WAIT_POLICY=PASSIVE``); beside one busy neighbour of another
login 200-214 s spinning against 10.1 s passive.

So: training (``fastmt train``, ``python -m train``) keeps OpenMP's spinning default and adapts its thread count
while it runs (train/cpu_threads.py: one thread while other programs use the cores, where nothing waits); every other
command (``fastmt`` with another command, ``train.translate``, ``train.evaluate``, ``train.stats``) sets
``OMP_WAIT_POLICY=PASSIVE``. OpenMP reads the variable once, when torch loads it, so each entry calls `choose`
before anything imports torch; children inherit it (a training child of ``fastmt bench`` chooses again: the value
fastmt set is marked in ``FASTMT_OMP_WAIT_POLICY``). A value the user set (``OMP_WAIT_POLICY=ACTIVE``) is kept.
Imports nothing (certainly not torch).
"""

from __future__ import annotations

import os
import sys

POLICY = "PASSIVE"
SPIN = "DEFAULT"  # `in_force` when OMP_WAIT_POLICY is unset: OpenMP's own default (spin a while, then sleep)
MARK = "FASTMT_OMP_WAIT_POLICY"  # set beside OMP_WAIT_POLICY when fastmt, not the user, chose the value
in_force: str | None = None  # the OMP_WAIT_POLICY torch's OpenMP runtime started with, when this process set it up


def choose(training: bool = False) -> str | None:
    """Set this process's OpenMP wait policy before torch is imported: OpenMP's spinning default for a training
    (whose threads adapt, train/cpu_threads.py), ``PASSIVE`` for every other command; a value the user set is kept.
    Returns the policy torch will run with (`SPIN` for OpenMP's default; ``None``: torch was imported already)."""
    global in_force
    if "torch" in sys.modules:  # too late for this process: its OpenMP runtime read the environment already
        return in_force
    env = os.environ
    ours = MARK in env and env.get("OMP_WAIT_POLICY") == env[MARK]  # a fastmt parent chose it, not the user
    if ours or "OMP_WAIT_POLICY" not in env:
        env.pop(MARK, None)
        env.pop("OMP_WAIT_POLICY", None)
        if not training:
            env["OMP_WAIT_POLICY"] = env[MARK] = POLICY
    in_force = env.get("OMP_WAIT_POLICY", "").strip().upper() or SPIN
    return in_force


def wait_passively() -> str | None:
    """`choose` for a command that does not train."""
    return choose(training=False)
