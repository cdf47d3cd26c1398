"""max_pool2d_int8 against torch's max pool of the same codes (exact), and its commuting with quantization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from warpforge.kernels import reference as ref
from warpforge.kernels.pool import max_pool2d_int8

CL = torch.channels_last
CASES = [  # n, c, h, w, kernel, stride, padding
    (2, 64, 11, 9, 3, 2, 1),  # ResNet's stem pool, odd sizes
    (1, 5, 7, 8, 2, 2, 0),  # few channels (masked), even kernel
    (3, 70, 6, 5, 3, 1, 1),  # stride 1, C past one channel block
    (1, 16, 9, 9, (3, 2), (2, 1), (1, 0)),  # asymmetric
]


def _x(n, c, h, w, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (n, c, h, w), generator=g, dtype=torch.int8).to(device).contiguous(memory_format=CL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_max_pool2d_int8_matches_torch(triton_on_cpu, device, case):
    n, c, h, w, k, s, p = case
    x = _x(n, c, h, w, device)
    got = max_pool2d_int8(x, k, s, p)
    want = F.max_pool2d(x.cpu().float(), k, s, p).to(torch.int8)
    assert got.dtype == torch.int8 and got.is_contiguous(memory_format=CL)
    assert torch.equal(got.cpu(), want)


def test_max_pool_of_codes_is_the_code_of_the_max(triton_on_cpu, device):
    """What the int8 pass relies on: pool(quantize(y)) == quantize(pool(y)) for both zero points."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(2, 24, 13, 13, generator=g).relu().to(device).contiguous(memory_format=CL)
    s = torch.tensor([float(y.max()) / 255], device=device)
    for zero in (0, -128):
        q = ref.quantize_int8_reference(y, s, zero).contiguous(memory_format=CL)
        want = ref.quantize_int8_reference(F.max_pool2d(y, 3, 2, 1), s, zero)
        assert torch.equal(max_pool2d_int8(q, 3, 2, 1).cpu(), want.cpu())


def test_max_pool2d_int8_reference_path():
    x = _x(2, 64, 11, 9, "cpu")  # CPU without the interpreter forced: torch through fp32
    got = max_pool2d_int8(x, 3, 2, 1)
    assert got.is_contiguous(memory_format=CL)
    assert torch.equal(got, F.max_pool2d(x.float(), 3, 2, 1).to(torch.int8))


def test_max_pool2d_int8_bad_input(device):
    x = _x(1, 4, 5, 5, device)
    with pytest.raises(ValueError, match="4-D int8"):
        max_pool2d_int8(x.float(), 3)
    with pytest.raises(ValueError, match="padding must be at most half"):
        max_pool2d_int8(x, 3, 2, 2)
    with pytest.raises(ValueError, match="too small"):
        max_pool2d_int8(x, 7)
    with pytest.raises(ValueError, match="stride must be"):
        max_pool2d_int8(x, 3, 0)


@pytest.mark.gpu
def test_gpu_max_pool2d_int8_resnet_stem():
    x = _x(32, 64, 112, 112, "cuda", seed=2)
    assert torch.equal(max_pool2d_int8(x, 3, 2, 1).cpu(), F.max_pool2d(x.cpu().float(), 3, 2, 1).to(torch.int8))
