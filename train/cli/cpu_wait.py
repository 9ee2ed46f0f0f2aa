"""How the threads of a CPU run wait for each other: passively (``OMP_WAIT_POLICY=PASSIVE``), issue 45.

PyTorch's CPU kernels run on OpenMP threads. By default an idle OpenMP thread spins (busy-waits) before it sleeps, so
on a machine where another program holds a core, the threads of each parallel region spin through the time slices
of the thread whose core was taken: the tiny preset's run took 4-16x longer beside two ``nice -n 19`` busy loops of
another login session, against 1.0-1.3x with the passive policy, which costs nothing measurable on a machine of its
own (bench/results/cpu-threads.md). OpenMP reads the variable once, when torch loads it, so every fastmt command
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
