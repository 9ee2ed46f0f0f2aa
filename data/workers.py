"""Worker processes (the DataLoader's and the cold build's): a requested stop never kills the workers.

``timeout``, SLURM, Kubernetes and ``docker stop`` send SIGTERM to the whole process group, and Ctrl-C
sends SIGINT to the whole foreground group (SLURM's ``--signal=B:USR1@T`` warning, SIGUSR1, too): the
DataLoader's worker processes get the signal too. Left
at its default a signal kills a worker, and the training process then fails with "DataLoader worker
... is killed by signal" instead of stopping at a step boundary with a checkpoint. Workers ignore these
signals; the training process decides when to stop, and its workers end with it (the DataLoader shuts
them down, and each worker also exits by itself once its parent is gone). The cold build's workers
(`BuildRunner`, `data.build`) are set up the same way.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal

from . import cache as C


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of every DataLoader: SIGINT, SIGTERM and SIGUSR1 are ignored in the worker process."""
    del worker_id  # the same for every worker
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def build_worker_init(parent: int) -> None:
    """A build worker: leaves Ctrl-C, SIGTERM and SIGUSR1 to the main process (which stops the build as it stops a
    run; no worker tracebacks, no worker killed mid-task by a signal to the whole group),
    dies with it (Linux: parent-death signal; a worker forked from a parent killed by -9 would otherwise
    live on), and drops its copies of the parent's lock fds."""
    ignore_stop_signals(0)
    C.forget_locks()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


START_METHOD = "fork"  # of the build workers ("spawn" works too: a Hub dataset is loaded again in each worker)


class BuildRunner:
    """Runs a task over jobs, results in input order: in this process (one worker or one job) or in forked
    workers. `imap` yields each result as its turn comes, so nothing waits for a whole pass in memory."""

    def __init__(self, workers: int):
        self.workers, self.pool = workers, None

    def imap(self, fn, jobs: list):
        if self.workers <= 1 or len(jobs) <= 1:
            yield from map(fn, jobs)
            return
        if self.pool is None:
            method = START_METHOD if START_METHOD in multiprocessing.get_all_start_methods() else None
            ctx = multiprocessing.get_context(method)
            self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=build_worker_init,
                                               initargs=(os.getpid(),))
        try:
            yield from self.pool.map(fn, jobs)
        except cf.process.BrokenProcessPool:
            raise RuntimeError("a data build worker process died (killed by a signal or out of memory); "
                               "run again: the build restarts from the beginning") from None

    def map(self, fn, jobs: list) -> list:
        return list(self.imap(fn, jobs))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
