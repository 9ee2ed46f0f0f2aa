"""A test-only attention provider that kills its worker process, to exercise bench.runner's isolation.

Loaded with ``python -m bench.kernels --provider-module tests.bench.fault_provider --isolate process``.
Outside a worker (``FASTMT_BENCH_WORKER`` unset) it refuses instead, so it can never end a test session.
"""

import os

from bench.registry import Unsupported, register
from bench.runner import WORKER_ENV


@register("attention", "fault", groups=("train-ragged", "train-dense", "long"))
def fault(case, inputs, opts):
    if os.environ.get(WORKER_ENV) != "1":
        raise Unsupported("the fault provider only runs in an isolated worker (--isolate process)")
    os._exit(7)  # an abrupt exit, as a kernel that loses the CUDA context would cause


@register("attention", "hang", groups=("train-ragged", "train-dense", "long"))
def hang(case, inputs, opts):
    """Starts a child (as compile workers are) and never returns: the worker must be killed with its group."""
    if os.environ.get(WORKER_ENV) != "1":
        raise Unsupported("the hang provider only runs in an isolated worker (--isolate process)")
    import subprocess
    import time

    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["FASTMT_TEST_HANG_PID"], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
