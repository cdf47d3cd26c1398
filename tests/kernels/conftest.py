"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh inputs per test, reproducible per test name."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="session")
def sm90_cache(tmp_path_factory):
    """One TRITON_CACHE_DIR for a session's offline sm_90 compile tests (sm90_shards.run_sharded): a kernel that
    two of them compile alike (a GEMV config several M classes share, the norm fusion's default configs) is
    compiled once."""
    return tmp_path_factory.mktemp("triton-sm90")
