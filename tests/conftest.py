"""Test-wide setup and the fixtures shared across test packages (helpers: tests/utils.py).

Without CUDA, Triton kernels run through the interpreter: TRITON_INTERPRET must be set before any
``@triton.jit`` function is created, i.e. here, before tests import ``kernels``.
"""

import os

import torch

from train import flush_denormals

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
flush_denormals()  # denormals made eager CPU steps ~3x slower (shared/ENV.md)

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not ``"gpu" in item.keywords``: keywords also hold folder names (a checkout in ~/gpu)
        if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def poison(monkeypatch):
    """``FASTMT_POISON=1``: kernel outputs start as NaN (integer outputs as -1), so an element that no
    program writes fails the comparison."""
    monkeypatch.setenv("FASTMT_POISON", "1")


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test. Tiny shapes gain nothing from a 2nd thread, and on the shared
    2-core machines OpenMP threads contending made them many times slower; float sums that are compared
    exactly (resumed runs, other processes) also depend on the split. The tests/train and tests/models
    packages use it for every test (their conftest.py)."""
    from tests.utils import torch_threads  # tests/utils imports train and data: not for every package

    with torch_threads(1):
        yield


@pytest.fixture
def cuda_like_kernels(monkeypatch):
    """The attention wrapper checks index values of CPU tensors only (on CUDA that would sync): make a
    CPU run take the CUDA decision, so that what a host-sync count sees is what a GPU run would do."""
    monkeypatch.setattr("kernels.flash_attention._inspectable", lambda t: False)


@pytest.fixture(scope="session")
def toy_bundle(tmp_path_factory):
    """The DataBundle of the product's toy data setting (``data.config.toy``), built once per session;
    its cache (the generated corpus, tokenizer, arrays) lies in ``toy_bundle.cfg.cache_dir``."""
    from data import build_data
    from tests.utils import quiet, toy_data

    return build_data(toy_data(tmp_path_factory.mktemp("toy")), log=quiet)
