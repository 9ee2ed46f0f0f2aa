"""One intra-op thread for the model tests: on the shared 2-core CI/dev machines torch's default
(2 threads) made these tiny-shape steps ~8x slower under load (thread spin-waits, measured)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
