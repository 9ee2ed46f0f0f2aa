"""DataLoader worker setup: a requested stop never kills the workers.

``timeout``, SLURM, Kubernetes and ``docker stop`` send SIGTERM to the whole process group, and Ctrl-C
sends SIGINT to the whole foreground group (SLURM's ``--signal=B:USR1@T`` warning, SIGUSR1, too): the
DataLoader's worker processes get the signal too. Left
at its default a signal kills a worker, and the training process then fails with "DataLoader worker
... is killed by signal" instead of stopping at a step boundary with a checkpoint. Workers ignore these
signals; the training process decides when to stop, and its workers end with it (the DataLoader shuts
them down, and each worker also exits by itself once its parent is gone).
"""

from __future__ import annotations

import signal


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of every DataLoader: SIGINT, SIGTERM and SIGUSR1 are ignored in the worker process."""
    del worker_id  # the same for every worker
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
