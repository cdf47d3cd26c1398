"""matmul_int8 / quantize_rows_int8 against the reference (exact int8 product, then the fp32 epilogue).

The int32 accumulation is exact, so the kernel and ``matmul_int8_ref`` (float64 product, converted
to fp32, then the same epilogue in the same order) agree bit for bit without an activation; the
transcendental activations (erf, sigmoid) differ from torch's by a few fp32 ulps. CPU runs force the
Triton interpreter at small odd sizes; large sizes and every candidate are ``gpu`` tests. Outputs
are pre-filled with NaN so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import reference
from warpforge.kernels.matmul import MatmulConfig
from warpforge.kernels.matmul_int8 import INT8_CONFIGS, matmul_int8, quantize_rows_int8

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]
SMALL_TMA = MatmulConfig(32, 32, 32, 2, 4, 1, tma=True)
SMALL_PTR = MatmulConfig(32, 32, 32, 2, 4, 1, tma=False)
# fp32 rounding of the transcendental activations (kernel vs torch); exact otherwise.
ACT_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _int8(shape, gen, device="cpu"):
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)


def _operands(M, N, K, gen, device="cpu"):
    """a [M, K] row-major, b [K, N] column-major (w.t() of a row-major [N, K] weight)."""
    return _int8((M, K), gen, device), _int8((N, K), gen, device).t()


def _scales(M, N, gen, per_row, device="cpu"):
    if per_row:  # per-token activation scales [M, 1], per-channel weight scales [N]
        return ((torch.rand(M, 1, generator=gen) + 0.5) * 1e-2).to(device), \
            ((torch.rand(N, generator=gen) + 0.5) * 1e-2).to(device)
    return torch.tensor(0.013, device=device), torch.tensor([0.007], device=device)


def _assert_matches(out, ref, activation=None):
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    if out.dtype == torch.bfloat16 and out.device.type == "cpu":
        # Triton 3.6's interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even).
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=0)
    elif activation in (None, "relu"):
        assert torch.equal(out, ref), f"max |diff| {(out.float() - ref.float()).abs().max():.3e}"
    else:
        rtol = ACT_RTOL[out.dtype]
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item())


# ---- CPU (interpreter) ------------------------------------------------------------------------
@pytest.mark.parametrize("K", [64, 96, 200])
@pytest.mark.parametrize("N", [40, 72])
@pytest.mark.parametrize("M", [1, 7, 129])
def test_matmul_int8_shapes(triton_on_cpu, device, gen, M, N, K):
    """Default path: the TMA kernel where K % 16 == 0 (16-byte rows of int8), else the pointer kernel."""
    a, b = _operands(M, N, K, gen, device)
    sa, sb = _scales(M, N, gen, per_row=M != 7, device=device)
    out = torch.full((M, N), float("nan"), dtype=torch.float32, device=device)
    matmul_int8(a, b, sa, sb, out_dtype=torch.float32, out=out)
    _assert_matches(out, reference.matmul_int8_ref(a, b, sa, sb, out_dtype=torch.float32))


@pytest.mark.parametrize("config", [SMALL_TMA, SMALL_PTR, MatmulConfig(32, 64, 32, 1, 4, 1, epilogue_subtile=True)],
                         ids=["tma", "ptr", "tma-subtile"])
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-channel"])
def test_matmul_int8_configs(triton_on_cpu, device, gen, config, per_row):
    M, N, K = 37, 72, 96
    a, b = _operands(M, N, K, gen, device)
    sa, sb = _scales(M, N, gen, per_row, device)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=device)
    matmul_int8(a, b, sa, sb, out=out, config=config)
    _assert_matches(out, reference.matmul_int8_ref(a, b, sa, sb, out_dtype=torch.float16))


def test_matmul_int8_exact_accumulation(triton_on_cpu, device):
    """Running sums far past 2^24 (where fp32 no longer holds every integer) and a small exact result:
    K = 2200 products of 127 * +-127 climb to 1100 * 16129 ~ 1.8e7, then come back down to 127."""
    M, N, K = 5, 40, 2200
    a = torch.full((M, K), 127, dtype=torch.int8, device=device)
    w = torch.full((N, K), 127, dtype=torch.int8, device=device)
    w[:, K // 2:] = -127
    w[:, -1] = -126
    one = torch.tensor(1.0, device=device)
    for k in (K, K - 8):  # TMA kernel (K % 16 == 0) and pointer kernel
        aa, ww = a[:, K - k:].contiguous(), w[:, K - k:].contiguous()
        out = matmul_int8(aa, ww.t(), one, one, out_dtype=torch.float32)
        expect = 127.0 * 127 * (k - K // 2) - 127 * 127 * (K // 2 - 1) - 127 * 126
        assert torch.equal(out, torch.full((M, N), expect, device=device)), (k, out[0, 0].item(), expect)


@pytest.mark.parametrize("activation", ACTS)
def test_matmul_int8_epilogue(triton_on_cpu, device, gen, activation):
    M, N, K = 33, 40, 64
    a, b = _operands(M, N, K, gen, device)
    sa, sb = _scales(M, N, gen, per_row=True, device=device)
    bias = torch.randn(N, generator=gen).to(device)
    res = torch.randn(M, N, generator=gen).to(torch.float16).to(device)
    out = matmul_int8(a, b, sa, sb, bias=bias, activation=activation, residual=res, out_dtype=torch.float32)
    _assert_matches(out, reference.matmul_int8_ref(a, b, sa, sb, bias, activation, res, torch.float32), activation)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_matmul_int8_out_dtype_and_strided_out(triton_on_cpu, device, gen, out_dtype):
    M, N, K = 7, 40, 200
    a, b = _operands(M, N, K, gen, device)
    sa, sb = _scales(M, N, gen, per_row=True, device=device)
    bias = torch.randn(N, generator=gen).to(out_dtype).to(device)
    big = torch.full((M, 2 * N), float("nan"), dtype=out_dtype, device=device)
    out = big[:, :N]
    matmul_int8(a, b, sa, sb, bias=bias, activation="relu", out_dtype=out_dtype, out=out)
    assert torch.isnan(big[:, N:]).all(), "wrote outside out"
    _assert_matches(out, reference.matmul_int8_ref(a, b, sa, sb, bias, "relu", None, out_dtype), "relu")


def test_matmul_int8_cpu_reference(gen):
    """Without force_triton, CPU tensors take the reference."""
    a, b = _operands(9, 40, 50, gen)
    sa, sb = _scales(9, 40, gen, per_row=True)
    out = matmul_int8(a, b, sa, sb)
    assert out.dtype == torch.float16
    assert torch.equal(out, reference.matmul_int8_ref(a, b, sa, sb, out_dtype=torch.float16))


def test_matmul_int8_tma_needs_aligned_k(triton_on_cpu, gen):
    a, b = _operands(8, 40, 200, gen)  # 200-byte rows: not 16-byte aligned
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="config: tma=True"):
        matmul_int8(a, b, one, one, config=SMALL_TMA)


def test_matmul_int8_validation():
    a = torch.zeros(8, 32, dtype=torch.int8)
    b = torch.zeros(16, 32, dtype=torch.int8).t()  # [32, 16] column-major
    one = torch.tensor(1.0)
    cases = [
        ("a:", lambda: matmul_int8(a.float(), b, one, one)),
        ("b:", lambda: matmul_int8(a, b.to(torch.uint8), one, one)),
        ("b:", lambda: matmul_int8(a, torch.zeros(24, 16, dtype=torch.int8).t().t(), one, one)),  # K mismatch
        ("a:", lambda: matmul_int8(torch.zeros(32, 8, dtype=torch.int8).t(), b, one, one)),  # column-major a
        ("b:", lambda: matmul_int8(a, torch.zeros(32, 16, dtype=torch.int8), one, one)),  # row-major b
        ("b:", lambda: matmul_int8(a, b.to("meta"), one, one)),  # another device
        ("scale_a:", lambda: matmul_int8(a, b, torch.ones(3), one)),
        ("scale_a:", lambda: matmul_int8(a, b, torch.ones(8, 2)[:, 0], one)),  # per-row, not contiguous
        ("scale_b:", lambda: matmul_int8(a, b, one, torch.ones(16, dtype=torch.float16))),
        ("scale_b:", lambda: matmul_int8(a, b, one, torch.ones(16, 1))),  # [N, 1] is not per-column
        ("bias:", lambda: matmul_int8(a, b, one, one, bias=torch.zeros(15))),
        ("activation:", lambda: matmul_int8(a, b, one, one, activation="tanh")),
        ("out_dtype:", lambda: matmul_int8(a, b, one, one, out_dtype=torch.int32)),
        ("out:", lambda: matmul_int8(a, b, one, one, out=torch.zeros(8, 16, dtype=torch.float32))),
        ("config:", lambda: matmul_int8(a, b, one, one, config="fast")),
    ]
    for prefix, call in cases:
        with pytest.raises(ValueError, match=prefix):
            call()


def test_quantize_rows_int8_static():
    x = torch.tensor([[0.0, 0.05, -0.05, 0.15, 100.0, -100.0]])
    q, s = quantize_rows_int8(x, 0.1)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == ()
    assert q.tolist() == [[0, 0, 0, 2, 127, -127]]  # half to even (0.5 -> 0, 1.5 -> 2); clamped to +-127
    q, _ = quantize_rows_int8(x.half(), torch.tensor([0.1]))
    assert q.tolist() == [[0, 0, 0, 2, 127, -127]]
    for bad in (0.0, -1.0, float("nan"), torch.ones(2)):
        with pytest.raises(ValueError, match="scale:"):
            quantize_rows_int8(x, bad)
    with pytest.raises(ValueError, match="x:"):
        quantize_rows_int8(x.to(torch.int8))


def test_quantize_rows_int8_dynamic(gen):
    x = torch.randn(3, 5, 64, generator=gen)
    x[1, 2] = 0.0  # an all-zero row quantizes to zeros
    q, s = quantize_rows_int8(x)
    assert q.shape == x.shape and s.shape == (3, 5, 1)
    assert (q.abs().amax(-1) == 127)[x.abs().amax(-1) > 0].all()
    assert (q[1, 2] == 0).all()
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-7).all()


# ---- GPU --------------------------------------------------------------------------------------
def _gpu_assert_close(out, ref):
    """GPU epilogues may contract multiply-add into FMA: one fp32 ulp, so up to one ulp of out's dtype."""
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    rtol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=rtol * ref.float().abs().max().item() * 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(4096, 4096, 4096), (1, 4096, 4096), (129, 272, 4096), (100, 48, 4104),
                                   (2048, 1000, 1032)])
@pytest.mark.parametrize("per_row", [False, True])
def test_matmul_int8_gpu(gen, M, N, K, per_row):
    a, b = _operands(M, N, K, gen, "cuda")
    sa, sb = _scales(M, N, gen, per_row, "cuda")
    bias = torch.randn(N, generator=gen).to(torch.float16).cuda()
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    matmul_int8(a, b, sa, sb, bias=bias, activation="relu", out=out)
    _gpu_assert_close(out, reference.matmul_int8_ref(a, b, sa, sb, bias, "relu", None, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("config", INT8_CONFIGS, ids=str)
def test_matmul_int8_every_candidate_gpu(gen, config):
    """Each autotune candidate must be correct on its own (a fast wrong config must never win)."""
    M, N, K = 1000, 1040, 1024
    a, b = _operands(M, N, K, gen, "cuda")
    sa, sb = _scales(M, N, gen, True, "cuda")
    bias = torch.randn(N, generator=gen).cuda()
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    matmul_int8(a, b, sa, sb, bias=bias, activation="gelu", out=out, config=config)
    _gpu_assert_close(out, reference.matmul_int8_ref(a, b, sa, sb, bias, "gelu", None, torch.float16))


@pytest.mark.gpu
def test_matmul_int8_matches_int_mm_gpu(gen):
    """Scale 1 and fp32 out expose the integer result: K=1024 keeps |acc| <= 1024 * 127^2 < 2^24, so
    the fp32 conversion is exact and must equal torch._int_mm bit for bit."""
    M, N, K = 512, 1024, 1024
    a, b = _operands(M, N, K, gen, "cuda")
    one = torch.tensor(1.0, device="cuda")
    ours = matmul_int8(a, b, one, one, out_dtype=torch.float32)
    theirs = torch._int_mm(a, b.contiguous())
    assert torch.equal(ours, theirs.float())
