"""Every train test runs with one torch thread (tests/conftest.py ``one_torch_thread``)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield
