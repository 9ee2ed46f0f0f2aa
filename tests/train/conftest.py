"""Fixtures for the train tests: one synthetic corpus and one built DataBundle per session."""

from __future__ import annotations

import pytest

from tests.train.helpers import tiny_config, write_corpus


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="session")
def corpus(workdir):
    return write_corpus(workdir / "corpus.jsonl")


@pytest.fixture(scope="session")
def bundle(corpus, workdir):
    from data import build_data

    return build_data(tiny_config(corpus, workdir).data, log=lambda *a: None)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a 2nd thread, and on shared 2-core machines OpenMP threads
    contending made a 512x32x32 matmul ~25x slower; restore the setting for other packages' tests."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
