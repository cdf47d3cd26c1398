"""rms_norm / layer_norm (residual, weight offset, fp8 output) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import reference as ref
from warpforge.kernels.activation import RowConfig
from warpforge.kernels.norm import MAX_WIDTH, layer_norm, rms_norm
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err, tolerance

pytestmark = pytest.mark.usefixtures("triton_on_cpu")
F64 = torch.float64
FP8 = torch.float8_e4m3fn


def tol(dtype: torch.dtype) -> float:
    # fp32 reductions do no tf32 matrix math: rounding-level bound; others from the table.
    return FP32_ELEMENTWISE_TOL[0] if dtype == torch.float32 else tolerance(dtype)


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _inputs(rows, n, dtype, device):
    x = torch.randn(rows, n, device=device, dtype=dtype) * 2 + 0.5  # nonzero mean: exercises the LN centering
    w = torch.randn(n, device=device)
    b = torch.randn(n, device=device)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 8), (7, 100), (129, 33), (3, 4095)])
def test_rms_norm(device, dtype, rows, n):
    x, w, _ = _inputs(rows, n, dtype, device)
    out = _nan((rows, n), dtype, device)
    assert rms_norm(x, w, 1e-5, out=out) is out
    assert rel_err(out, ref.rms_norm_reference(x, w, 1e-5, compute_dtype=F64)) <= tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 8), (7, 100), (129, 33), (3, 4095)])
def test_layer_norm(device, dtype, rows, n):
    x, w, b = _inputs(rows, n, dtype, device)
    out = _nan((rows, n), dtype, device)
    layer_norm(x, w, b, out=out)
    assert rel_err(out, ref.layer_norm_reference(x, w, b, compute_dtype=F64)) <= tol(dtype)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_residual(device, kind, dtype):
    rows, n = 7, 129
    x, w, b = _inputs(rows, n, dtype, device)
    r = torch.randn(rows, n, device=device, dtype=dtype)
    out, res_out = _nan((rows, n), dtype, device), _nan((rows, n), dtype, device)
    if kind == "rms":
        got = rms_norm(x, w, residual=r, out=out, residual_out=res_out)
        want_y, _ = ref.rms_norm_reference(x, w, residual=r, compute_dtype=F64)
    else:
        got = layer_norm(x, w, b, residual=r, out=out, residual_out=res_out)
        want_y, _ = ref.layer_norm_reference(x, w, b, residual=r, compute_dtype=F64)
    assert got[0] is out and got[1] is res_out
    # The new residual is the sum rounded once to the input dtype, exactly.
    assert torch.equal(res_out, (x.to(F64) + r.to(F64)).to(dtype))
    assert rel_err(out, want_y) <= tol(dtype)


def test_residual_in_place_and_out_aliasing_x(device):
    x, w, _ = _inputs(5, 64, torch.float32, device)
    r = torch.randn(5, 64, device=device)
    want_y, want_s = ref.rms_norm_reference(x, w, residual=r, compute_dtype=F64)
    out, new_r = rms_norm(x, w, residual=r, out=x, residual_out=r)  # vLLM-style fully in place
    assert out is x and new_r is r
    assert rel_err(r, want_s) <= tol(torch.float32)
    assert rel_err(x, want_y) <= tol(torch.float32)


def test_options_weight_offset_no_weight_out_dtype_leading_dims(device):
    x = torch.randn(2, 3, 50, device=device, dtype=torch.float16)
    w = torch.randn(50, device=device, dtype=torch.float16) * 0.1
    got = rms_norm(x, w, weight_offset=1.0)  # Gemma: (1 + w)
    assert got.shape == x.shape and got.dtype == torch.float16
    assert rel_err(got, ref.rms_norm_reference(x, w, weight_offset=1.0, compute_dtype=F64)) <= tol(torch.float16)
    got32 = layer_norm(x, None, None, out_dtype=torch.float32)
    assert got32.dtype == torch.float32
    # fp32 output of fp16 input: only the fp32 math rounds.
    assert rel_err(got32, ref.layer_norm_reference(x, None, None, compute_dtype=F64)) <= 1e-5
    lw = layer_norm(x, w, None, weight_offset=0.5)
    assert rel_err(lw, ref.layer_norm_reference(x, w, None, weight_offset=0.5, compute_dtype=F64)) <= tol(torch.float16)


def test_multi_row_config_and_row_strided_input(device):
    base = torch.randn(9, 40, device=device)
    x = base[:, :33]  # rows strided by 40
    w = torch.randn(33, device=device)
    got = rms_norm(x, w, config=RowConfig(block_m=4, block_n=64, num_warps=2))
    assert rel_err(got, ref.rms_norm_reference(x, w, compute_dtype=F64)) <= tol(torch.float32)


def _fp8_case(kind, device, static):
    x, w, b = _inputs(7, 100, torch.float32, device)
    x[3] *= 1e-3  # a row with a very different range gets its own scale
    r = torch.randn(7, 100, device=device)
    s = torch.tensor([0.01], device=device) if static else None  # small: clips the largest values
    if kind == "rms":
        got = rms_norm(x, w, residual=r, quant_fp8=True, fp8_scale=s)
        y, _ = ref.rms_norm_reference(x, w, residual=r, compute_dtype=F64)
    else:
        got = layer_norm(x, w, b, residual=r, quant_fp8=True, fp8_scale=s)
        y, _ = ref.layer_norm_reference(x, w, b, residual=r, compute_dtype=F64)
    q, scale, new_r = got
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32
    assert rel_err(new_r, x.to(F64) + r.to(F64)) <= tol(torch.float32)
    if static:
        assert scale is s
    else:
        assert scale.shape == (7, 1)
        assert rel_err(scale, y.abs().amax(-1, keepdim=True) / ref.FP8_E4M3_MAX) <= 1e-6
    return q, scale, y


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_scales(device, kind, static):
    # The interpreter's fp32->e4m3 cast truncates (and mishandles mantissa carries), unlike the GPU's
    # round-to-nearest-even, so on CPU only the kernel's scale logic is checked; the values are
    # checked by test_gpu_fp8_values.
    _fp8_case(kind, device, static)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_fp8_values(kind, static):
    q, scale, y = _fp8_case(kind, "cuda", static)
    want = (y / scale.double()).clamp(-448, 448) * scale.double()  # static scale clips
    assert q.float().abs().max() <= ref.FP8_E4M3_MAX
    assert rel_err(q.double() * scale.double(), want) <= tolerance(FP8)


def test_empty_rows(device):
    x = torch.randn(0, 16, device=device)
    out, new_r = rms_norm(x, torch.randn(16, device=device), residual=torch.randn(0, 16, device=device))
    assert out.shape == (0, 16) and new_r.shape == (0, 16)


def test_validation(device):
    x, w, b = _inputs(4, 16, torch.float16, device)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.randn(15, device=device))
    with pytest.raises(ValueError, match="bias must be on|bias must have"):
        layer_norm(x, w, torch.randn(3, device=device))
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, w, residual=torch.randn(4, 16, device=device))  # fp32 residual for fp16 x
    with pytest.raises(ValueError, match="residual_out is only"):
        rms_norm(x, w, residual_out=x)
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="last dim"):
        rms_norm(torch.randn(16, 4, device=device).t(), w)
    with pytest.raises(ValueError, match="at most"):
        rms_norm(torch.empty(1, MAX_WIDTH + 1, device=device), None)
    with pytest.raises(ValueError, match="fp8_scale is only"):
        rms_norm(x, w, fp8_scale=torch.ones(1, device=device))
    with pytest.raises(ValueError, match="fp8_scale must be"):
        rms_norm(x, w, quant_fp8=True, fp8_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="out_dtype"):
        rms_norm(x, w, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="out must have dtype"):
        rms_norm(x, w, out=torch.empty(4, 16, device=device))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="block_n"):
        rms_norm(x, w, config=RowConfig(1, 8, 1))
    with pytest.raises(ValueError, match="softmax-only"):
        rms_norm(x, w, config=RowConfig(1, 16, 1, programs_per_sm=2))


def test_cpu_dispatch_without_force_keeps_conventions():
    from warpforge.kernels import _dispatch

    prev, _dispatch._forced = _dispatch._forced, False
    try:
        x, w, _ = _inputs(3, 40, torch.float16, "cpu")
        r = torch.randn(3, 40, dtype=torch.float16)
        out, new_r = rms_norm(x, w, residual=r)
        assert torch.equal(new_r, (x.to(F64) + r.to(F64)).to(torch.float16))
        assert rel_err(out, ref.rms_norm_reference(x, w, residual=r, compute_dtype=F64)[0]) <= tol(torch.float16)
        q, scale = layer_norm(x, w, None, quant_fp8=True)
        assert q.dtype == FP8 and scale.shape == (3, 1)
    finally:
        _dispatch._forced = prev


# ---- GPU: bf16, fp8 and the benchmark size ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 5120, 8192 + 7])
def test_gpu_rms_norm_residual_bf16(n):
    rows = 16384 if n == 4096 else 257
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out, new_r = rms_norm(x, w, residual=r, out=_nan((rows, n), torch.bfloat16, "cuda"),
                          residual_out=_nan((rows, n), torch.bfloat16, "cuda"))
    s = x.float() + r.float()
    assert torch.equal(new_r, s.to(torch.bfloat16))
    assert rel_err(out, ref.rms_norm_reference(new_r, w, compute_dtype=F64)) <= tol(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_layer_norm_bf16_narrow_rows():
    x = torch.randn(4099, 128, device="cuda", dtype=torch.bfloat16)  # q/k-norm-like rows: many per program
    w, b = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    out = layer_norm(x, w, b, out=_nan((4099, 128), torch.bfloat16, "cuda"))
    assert rel_err(out, ref.layer_norm_reference(x, w, b, compute_dtype=F64)) <= tol(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_matches_torch_quantization():
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    q, scale = rms_norm(x, w, quant_fp8=True)
    y = ref.rms_norm_reference(x, w, compute_dtype=torch.float32)
    rq, rs = ref.quant_fp8_rows_reference(y)
    assert rel_err(scale, rs) <= 1e-5
    assert rel_err(q.float() * scale, y) <= tolerance(FP8)
    # Round-to-nearest like torch's cast: all but a sliver (fp32 math-order ties) agree exactly.
    assert (q.float() == rq.float()).float().mean() > 0.999
