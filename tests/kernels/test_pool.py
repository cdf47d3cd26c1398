"""max_pool2d (kernels/pool.py) against torch's max pool: exact for every dtype (a max is a selection), NaNs
propagated, odd sizes; int8 codes pool as the quantized float pool (what the int8 pass relies on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from warpforge.kernels import reference as ref
from warpforge.kernels.pool import max_pool2d

CL = torch.channels_last
CASES = [  # n, c, h, w, kernel, stride, padding
    (2, 64, 11, 9, 3, 2, 1),  # ResNet's stem pool, odd sizes
    (1, 5, 7, 8, 2, 2, 0),  # few channels (masked), even kernel
    (3, 70, 6, 5, 3, 1, 1),  # stride 1, C past one channel block
    (1, 16, 9, 9, (3, 2), (2, 1), (1, 0)),  # asymmetric
]
DTYPES = [torch.int8, torch.float16, torch.float32]


def _x(n, c, h, w, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (n, c, h, w), generator=g, dtype=torch.int8)
    else:
        x = (torch.randn(n, c, h, w, generator=g) * 3).to(dtype)
    return x.to(device).contiguous(memory_format=CL)


def _want(x, k, s, p):
    """torch's pool on the same device, int8 through fp32 (exact for codes)."""
    return F.max_pool2d(x.float() if x.dtype == torch.int8 else x, k, s, p).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_max_pool2d_matches_torch(triton_on_cpu, device, case, dtype):
    n, c, h, w, k, s, p = case
    x = _x(n, c, h, w, dtype, device)
    got = max_pool2d(x, k, s, p)
    assert got.dtype == dtype and got.is_contiguous(memory_format=CL)
    assert torch.equal(got, _want(x, k, s, p))


def test_max_pool2d_nan_and_any_layout(triton_on_cpu, device):
    x = _x(1, 8, 6, 6, torch.float32, device).contiguous()  # NCHW in: read as channels_last
    x[0, 3, 2, 2] = float("nan")
    got, want = max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_max_pool_of_codes_is_the_code_of_the_max(triton_on_cpu, device):
    g = torch.Generator().manual_seed(1)
    y = torch.randn(2, 24, 13, 13, generator=g).relu().to(device).contiguous(memory_format=CL)
    s = torch.tensor([float(y.max()) / 255], device=device)
    for zero in (0, -128):
        q = ref.quantize_int8_reference(y, s, zero).contiguous(memory_format=CL)
        want = ref.quantize_int8_reference(F.max_pool2d(y, 3, 2, 1), s, zero)
        assert torch.equal(max_pool2d(q, 3, 2, 1), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool2d_reference_path(dtype):
    x = _x(2, 64, 11, 9, dtype, "cpu")  # CPU without the interpreter forced: torch
    got = max_pool2d(x, 3, 2, 1)
    assert got.is_contiguous(memory_format=CL) and torch.equal(got, _want(x, 3, 2, 1))


def test_max_pool2d_bad_input(device):
    x = _x(1, 4, 5, 5, torch.int8, device)
    with pytest.raises(ValueError, match="4-D tensor"):
        max_pool2d(x.to(torch.int32), 3)
    with pytest.raises(ValueError, match="4-D tensor"):
        max_pool2d(x[0], 3)
    with pytest.raises(ValueError, match="padding must be at most half"):
        max_pool2d(x, 3, 2, 2)
    with pytest.raises(ValueError, match="too small"):
        max_pool2d(x, 7)
    with pytest.raises(ValueError, match="stride must be"):
        max_pool2d(x, 3, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)
def test_gpu_max_pool2d_resnet_stem(dtype):
    x = _x(32, 64, 112, 112, dtype, "cuda", seed=2)
    got, want = max_pool2d(x, 3, 2, 1), _want(x, 3, 2, 1)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} of {got.numel()} differ, first at {bad[:4].tolist()}"
