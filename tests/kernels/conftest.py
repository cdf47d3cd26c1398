"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import os
import zlib

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh inputs per test, reproducible per test name."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="session")
def sm90_cache(tmp_path_factory):
    """One TRITON_CACHE_DIR for a run's offline sm_90 compile tests (sm90_shards.run_sharded): a kernel that
    two of them compile alike (a GEMV config several M classes share, the norm fusion's default configs) is
    compiled once. Under pytest-xdist the workers share it too (the run's temporary root, one level above each
    worker's): test_matmul.py and test_gemv_norm.py often run on different workers, and Triton's file cache
    takes concurrent writers (each entry lands by an atomic rename)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "triton-sm90"
    path.mkdir(exist_ok=True)
    return path
