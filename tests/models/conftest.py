"""Every model test runs with one torch thread (tests/conftest.py ``one_torch_thread``): under load,
torch's default of 2 threads made these tiny-shape steps ~8x slower on the shared 2-core machines."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield
