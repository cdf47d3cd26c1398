"""warpforge.kernels.memory: copy, fill and sum against their references on odd sizes.

CPU runs go through the Triton interpreter (the triton_on_cpu fixture) with small blocks, so these
sizes cover one partial block, many full blocks plus a ragged tail, and sum's persistent loop.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import memory
from warpforge.kernels.reference import copy_ref, fill_ref, sum_ref
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL

SIZES = [1, 7, 129, 4095]
CPU_DTYPES = [torch.float32, torch.float16]  # the interpreter gives garbage for bf16


def _rand(n, dtype, device, seed=0, shape=None):
    g = torch.Generator(device=device).manual_seed(seed + n)
    return torch.randn(shape or (n,), generator=g, device=device).to(dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_copy_into_poisoned_out(triton_on_cpu, device, n, dtype):
    src = _rand(n, dtype, device)
    out = torch.full_like(src, float("nan"))
    got = memory.copy(src, out)
    assert got is out
    assert torch.equal(out, copy_ref(src))  # bit-exact, and every element written


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_copy_allocates_and_keeps_shape(triton_on_cpu, device, dtype):
    src = _rand(0, dtype, device, shape=(3, 5, 67))
    got = memory.copy(src)
    assert got.shape == src.shape and got.data_ptr() != src.data_ptr() and torch.equal(got, src)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("value", [0.1, -3.75, 1 / 3, float("inf")])
def test_fill_poisoned_out(triton_on_cpu, device, n, dtype, value):
    out = torch.full((n,), float("nan"), dtype=dtype, device=device)
    memory.fill(out, value)
    assert torch.equal(out, fill_ref(torch.empty_like(out), value))  # rounded exactly as torch rounds


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", SIZES + [64 * 7 + 3])
def test_sum_matches_float64(triton_on_cpu, device, n, dtype):
    x = _rand(n, dtype, device, seed=1)
    got = memory.sum(x)
    assert got.dtype == torch.float32 and got.shape == () and got.device == x.device
    ref = x.to(torch.float64).sum()
    # fp32 accumulation: error relative to sum |x| (a signed sum can cancel to near zero)
    scale = x.to(torch.float64).abs().sum().item()
    assert abs(got.item() - ref.item()) <= FP32_ELEMENTWISE_TOL[0] * scale
    assert got.item() == pytest.approx(sum_ref(x).item(), abs=FP32_ELEMENTWISE_TOL[0] * scale)


def test_empty_tensors(triton_on_cpu, device):
    e = torch.empty(0, device=device)
    assert memory.copy(e).numel() == 0
    assert memory.fill(e, 1.0).numel() == 0
    assert memory.sum(e).item() == 0.0


def test_cpu_tensors_without_forcing_use_the_reference():
    x = torch.randn(33)
    assert torch.equal(memory.copy(x), x)
    assert memory.sum(x).item() == pytest.approx(x.double().sum().item(), abs=1e-5)
    assert torch.equal(memory.fill(torch.empty(5), 2.5), torch.full((5,), 2.5))


def test_validation():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="src.*contiguous"):
        memory.copy(x.t())
    with pytest.raises(ValueError, match="x: expected dtype"):
        memory.sum(torch.arange(5))
    with pytest.raises(ValueError, match="out: expected shape"):
        memory.copy(x, torch.empty(24))
    with pytest.raises(ValueError, match="out: expected shape"):
        memory.copy(x, torch.empty(4, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="value"):
        memory.fill(torch.empty(3), "1.0")
    with pytest.raises(ValueError, match="src: expected a torch.Tensor"):
        memory.copy([1.0, 2.0])
    with pytest.raises(ValueError, match="num_warps"):
        memory.MemoryConfig(block_bytes=256, num_warps=3, programs_per_sm=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4095, 10_000_019])
def test_memory_kernels_on_gpu(n, dtype):
    dev = torch.device("cuda")
    src = _rand(n, dtype, dev, seed=7)
    out = torch.full_like(src, float("nan"))
    assert torch.equal(memory.copy(src, out), src)
    memory.fill(out, 1 / 3)
    assert torch.equal(out, torch.full_like(src, 1 / 3))
    got = memory.sum(src)
    scale = src.to(torch.float64).abs().sum().item()
    assert abs(got.item() - src.to(torch.float64).sum().item()) <= 1e-5 * scale
