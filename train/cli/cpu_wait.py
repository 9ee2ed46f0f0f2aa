"""How the threads of a CPU run wait for each other: passively (``OMP_WAIT_POLICY=PASSIVE``), issue 45.

PyTorch's CPU kernels run on OpenMP threads. By default an idle OpenMP thread spins (busy-waits) before it sleeps, so
on a machine where another program holds a core, the threads of each parallel region spin through the time slices
of the thread whose core was taken. Measured on a shared 2-core machine (bench/results/cpu-threads.md): beside two
``nice -n 19`` busy loops of another session one epoch of the tiny preset trained in 10.8-16.0 s spinning against
2.2-3.7 s passive; with no loop (load 1.5-2.5 from others) 1.1-1.3 s spinning (2 of 3 repeats; 6.0 s the third) against 1.7-1.8 s passive:
passive costs something on a machine of its own, spinning costs several times more on a shared one.
OpenMP reads the variable once, when torch loads it, so every fastmt command
sets it before anything imports torch: `wait_passively` is called by each entry (``fastmt``, ``python -m train``,
``train.translate``, ``train.evaluate``, ``train.stats``); the data build's workers and other children inherit it.
A value the user set (``OMP_WAIT_POLICY=ACTIVE``) is kept. Imports nothing (certainly not torch).
"""

from __future__ import annotations

import os
import sys

POLICY = "PASSIVE"
in_force: str | None = None  # the OMP_WAIT_POLICY torch's OpenMP runtime started with, when this process set it up


def wait_passively() -> str | None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process and its children, unless the user set a value, before torch
    is imported; returns the policy torch will run with (``None``: torch was imported already, unknown)."""
    global in_force
    if "torch" in sys.modules:  # too late for this process: its OpenMP runtime read the environment already
        return in_force
    in_force = os.environ.setdefault("OMP_WAIT_POLICY", POLICY).upper()
    return in_force
