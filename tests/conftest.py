"""Test-wide setup. Runs before any kernel module is imported.

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
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
