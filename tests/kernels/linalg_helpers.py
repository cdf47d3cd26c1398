"""Shared by the matmul, GEMV and quantized-linear tests: random inputs and the dtype-keyed check (the `gen`
fixture is in conftest.py)."""

from __future__ import annotations

import torch

from warpforge.kernels.tolerance import rel_err, tolerance


def _randn(shape, dtype, gen, device="cpu", scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _check(out, ref, dtype):
    e = rel_err(out, ref)
    assert e <= tolerance(dtype), f"rel_err {e:.3e} > {tolerance(dtype):.1e}"
