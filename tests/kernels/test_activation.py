"""silu_and_mul / gelu_and_mul / softmax against the float64 reference (interpreter on CPU, Triton on GPU)."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import reference as ref
from warpforge.kernels.activation import RowConfig, gelu_and_mul, silu_and_mul, softmax
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err, tolerance

pytestmark = pytest.mark.usefixtures("triton_on_cpu")


def tol(dtype: torch.dtype) -> float:
    # fp32 elementwise code does no tf32 matrix math: rounding-level bound; others from the table.
    return FP32_ELEMENTWISE_TOL[0] if dtype == torch.float32 else tolerance(dtype)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


GATED = [("silu", {}), ("gelu", {"approximate": "none"}), ("gelu", {"approximate": "tanh"})]


def _gated(kind, x, **kw):
    return silu_and_mul(x, **kw) if kind == "silu" else gelu_and_mul(x, **kw)


def _gated_ref(kind, x, approximate=None):
    if kind == "silu":
        return ref.silu_and_mul_reference(x, compute_dtype=torch.float64)
    return ref.gelu_and_mul_reference(x, approximate, compute_dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,d", [(1, 9), (7, 33), (129, 5), (3, 4095)])
@pytest.mark.parametrize("kind,kw", GATED)
def test_gated_matches_reference(device, dtype, rows, d, kind, kw):
    x = torch.randn(rows, 2 * d, device=device, dtype=dtype) * 3
    out = _poisoned((rows, d), dtype, device)
    got = _gated(kind, x, out=out, **kw)
    assert got is out
    assert rel_err(out, _gated_ref(kind, x, **kw)) <= tol(dtype)


def test_gated_leading_dims_and_row_strided_view(device):
    base = torch.randn(2, 5, 2 * 7 + 3, device=device)
    with pytest.raises(ValueError, match="row-contiguous"):
        silu_and_mul(base[:, :3, :14])  # leading dims that do not flatten to one row stride
    x2 = base.view(10, 17)[:, :14]  # 2-D row-strided view is served as is
    out = silu_and_mul(x2)
    assert out.shape == (10, 7)
    assert rel_err(out, ref.silu_and_mul_reference(x2, torch.float64)) <= tol(torch.float32)
    x3 = torch.randn(2, 3, 4, 10, device=device)
    assert rel_err(gelu_and_mul(x3), ref.gelu_and_mul_reference(x3, "none", torch.float64)) <= tol(torch.float32)


def test_gated_extreme_values(device):
    # silu/gelu tails: exp overflow must give exact limits, not NaN.
    a = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4], device=device)
    x = torch.cat([a, torch.ones_like(a)])[None]
    for kind, kw in GATED:
        out = _gated(kind, x, **kw)
        assert torch.isfinite(out).all()
        assert rel_err(out, _gated_ref(kind, x, **kw)) <= tol(torch.float32)


def test_gated_validation(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="dtype"):
        silu_and_mul(torch.ones(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="last dim"):
        silu_and_mul(torch.randn(8, 4, device=device).t())
    with pytest.raises(ValueError, match="out must have shape"):
        silu_and_mul(x, out=torch.empty(4, 8, device=device))
    with pytest.raises(ValueError, match="out must have dtype"):
        silu_and_mul(x, out=torch.empty(4, 4, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(x, approximate="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 33), (129, 100), (5, 4095)])
def test_softmax_matches_reference(device, dtype, rows, n):
    x = torch.randn(rows, n, device=device, dtype=dtype) * 4
    out = _poisoned((rows, n), dtype, device)
    softmax(x, out=out)
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)


@pytest.mark.parametrize("n,block", [(4095, 1024), (100, 16), (1, 16)])
def test_softmax_looped_matches_reference(device, n, block):
    x = torch.randn(3, n, device=device) * 4
    out = _poisoned((3, n), torch.float32, device)
    softmax(x, out=out, config=RowConfig(block_m=1, block_n=block, num_warps=4, looped=True))
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)


@pytest.mark.parametrize("looped", [False, True])
def test_softmax_stability_and_masking(device, looped):
    # Huge logits (exp would overflow without the max shift) and -inf entries (causal masks).
    x = torch.randn(6, 300, device=device) * 1e4
    x[:, 7::3] = float("-inf")
    x[2, :150] = float("-inf")  # the first chunk of a looped pass sees only -inf
    cfg = RowConfig(1, 64, 4, looped=True) if looped else None
    out = softmax(x, config=cfg)
    assert torch.isfinite(out).all()
    assert (out[:, 7::3] == 0).all()
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)


def test_softmax_leading_dims_and_validation(device):
    x = torch.randn(2, 3, 37, device=device, dtype=torch.float16)
    assert rel_err(softmax(x, dim=2), ref.softmax_reference(x, torch.float64)) <= tol(torch.float16)
    with pytest.raises(ValueError, match="last dim"):
        softmax(x, dim=1)
    with pytest.raises(ValueError, match="block_n"):
        softmax(x, config=RowConfig(1, 16, 4))
    with pytest.raises(ValueError, match="power of two"):
        RowConfig(3, 16, 4)
    with pytest.raises(ValueError, match="dtype"):
        softmax(torch.ones(3, dtype=torch.int64, device=device))


def test_empty_inputs(device):
    assert silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
    assert softmax(torch.randn(3, 0, 5, device=device)).shape == (3, 0, 5)


def test_cpu_dispatch_without_force_runs_reference():
    from warpforge.kernels import _dispatch

    prev, _dispatch._forced = _dispatch._forced, False
    try:
        x = torch.randn(5, 18)
        assert rel_err(silu_and_mul(x), ref.silu_and_mul_reference(x, torch.float64)) <= tol(torch.float32)
        assert rel_err(softmax(x), ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)
    finally:
        _dispatch._forced = prev


# ---- GPU: bf16 and LLM sizes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_llm_shape(dtype):
    x = torch.randn(1000, 2 * 14336, device="cuda", dtype=dtype)
    for kind, kw in GATED:
        out = _gated(kind, x, out=_poisoned((1000, 14336), dtype, "cuda"), **kw)
        assert rel_err(out, _gated_ref(kind, x.float(), **kw)) <= tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(4099, 4096), (129, 32768), (17, 65536 + 123), (3, 4095)])
def test_gpu_softmax_llm_shapes(dtype, rows, n):
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
    out = softmax(x, out=_poisoned((rows, n), dtype, "cuda"))
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)
