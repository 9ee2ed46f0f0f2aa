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
