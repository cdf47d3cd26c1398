"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import zlib

import pytest
import torch


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh inputs per test, reproducible per test name."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))
