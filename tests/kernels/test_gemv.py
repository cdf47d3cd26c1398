"""gemv / linear (dense weights) against the float64 reference.

CPU: the Triton interpreter with fp32/fp16 at small odd sizes, both the CUDA-core (block_m < 16)
and tensor-core paths, split-K, strided x, padded weight rows. GPU: bf16 at decode sizes.
"""

from __future__ import annotations


import pytest
import torch

from warpforge.kernels import reference
from warpforge.kernels.gemv import GEMV_MAX_M, LINEAR_CONFIGS, LinearConfig, gemv, linear

from .linalg_helpers import _check, _randn





# ---- CPU (interpreter) ------------------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 3, 7, 16, 33])
@pytest.mark.parametrize("N,K", [(29, 45), (40, 64)])
def test_gemv_default_config(triton_on_cpu, device, gen, M, N, K):
    x, w = _randn((M, K), torch.float16, gen, device), _randn((N, K), torch.float16, gen, device, scale=0.2)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=device)
    gemv(x, w, out=out)
    _check(out, reference.linear_ref(x, w, acc_dtype=torch.float64), torch.float16)


@pytest.mark.parametrize("config", [
    LinearConfig(1, 16, 16, 1, 4, 1), LinearConfig(2, 8, 32, 3, 4, 2), LinearConfig(4, 16, 64, 2, 4, 1),
    LinearConfig(16, 16, 16, 1, 4, 1), LinearConfig(16, 32, 32, 4, 4, 2), LinearConfig(32, 16, 64, 2, 4, 1),
], ids=str)
@pytest.mark.parametrize("K", [64, 95])  # 64: every block_k divides K (unmasked loop); 95: ragged tail
def test_gemv_configs(triton_on_cpu, device, gen, config, K):
    M, N = 5, 37
    x, w = _randn((M, K), torch.float32, gen, device), _randn((N, K), torch.float32, gen, device, scale=0.2)
    bias = _randn((N,), torch.float32, gen, device)
    out = torch.full((M, N), float("nan"), dtype=torch.float32, device=device)
    gemv(x, w, bias, activation="silu", out=out, config=config)
    _check(out, reference.linear_ref(x, w, bias, "silu", acc_dtype=torch.float64), torch.float32)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_linear_epilogue(triton_on_cpu, device, gen, activation):
    x, w = _randn((3, 50), torch.float16, gen, device), _randn((24, 50), torch.float16, gen, device, scale=0.2)
    bias = _randn((24,), torch.float16, gen, device)
    y = linear(x, w, bias, activation=activation)
    _check(y, reference.linear_ref(x, w, bias, activation, acc_dtype=torch.float64), torch.float16)


def test_gemv_strided_x_and_padded_weight_rows(triton_on_cpu, device, gen):
    M, N, K = 4, 21, 40
    x = _randn((K, 2 * M), torch.float32, gen, device)[:, ::2].t()  # [M, K], strides (2, 2M)
    w = _randn((N, K + 9), torch.float32, gen, device, scale=0.2)[:, 3:K + 3]  # unit stride, rows K + 9 apart
    _check(gemv(x, w), reference.linear_ref(x, w, acc_dtype=torch.float64), torch.float32)


def test_linear_batched_input_and_matmul_path(triton_on_cpu, device, gen):
    w, bias = _randn((19, 33), torch.float16, gen, device, scale=0.2), _randn((19,), torch.float16, gen, device)
    x = _randn((2, 3, 33), torch.float16, gen, device)  # M = 6: streaming kernel
    y = linear(x, w, bias, activation="gelu")
    assert y.shape == (2, 3, 19)
    _check(y, reference.linear_ref(x, w, bias, "gelu", acc_dtype=torch.float64), torch.float16)
    xl = _randn((GEMV_MAX_M + 7, 33), torch.float16, gen, device)  # M > 64: the matmul path with w.T
    out = torch.full((GEMV_MAX_M + 7, 19), float("nan"), dtype=torch.float16, device=device)
    assert linear(xl, w, bias, out=out) is out
    _check(out, reference.linear_ref(xl, w, bias, acc_dtype=torch.float64), torch.float16)
    out3 = torch.full((2, 3, 19), float("nan"), dtype=torch.float16, device=device)
    linear(x, w, bias, activation="gelu", out=out3)
    _check(out3, reference.linear_ref(x, w, bias, "gelu", acc_dtype=torch.float64), torch.float16)


def test_linear_cpu_tensors_use_reference(gen):
    x, w = _randn((2, 8), torch.float32, gen), _randn((5, 8), torch.float32, gen)
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))


def test_linear_configs_table():
    for bm, cfgs in LINEAR_CONFIGS.items():
        plain = [c for c in cfgs if not c.words]  # word configs serve int8/int4 at M=1 only
        assert 4 <= len(plain) <= 8 and len(cfgs) - len(plain) <= 4, f"class {bm}: keep tuning short"
        assert plain[0].block_m == bm or bm > 64, f"class {bm}: the default must be the class's own block_m"


@pytest.mark.parametrize("x_bytes", [2, 4])
@pytest.mark.parametrize("bm", [c for c in LINEAR_CONFIGS if c <= GEMV_MAX_M])
def test_gated_configs_fit_shared_memory(bm, x_bytes):
    """A gated input stages three x tiles per step: the H200 refused 4 x 80 KB (fp32 x, block_m 32, the class's
    default). Every M class that serves the gated fusion keeps at least one config that fits."""
    from warpforge.kernels.gemv import _fits

    assert not _fits(LinearConfig(32, 64, 128, 1, 4, 4), None, gate=1, x_bytes=4)
    assert _fits(LinearConfig(32, 64, 128, 1, 4, 4), None, gate=0, x_bytes=4)  # ungated: unchanged
    assert any(_fits(c, None, gate=1, x_bytes=x_bytes) for c in LINEAR_CONFIGS[bm])


@pytest.mark.parametrize("call,match", [
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(8, 4).t()), "^weight: expected unit stride along K"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16)), "^weight: expected dtype float32"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 7)), r"^weight: expected shape \(N, 8\)"),
    (lambda: gemv(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(4, 8)), "^x: expected dtype"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(3)), r"^bias: expected shape \(4,\)"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 8), activation="elu"), "^activation: expected one of"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(2, 5)), r"^out: expected shape \(2, 4\)"),
    (lambda: gemv(torch.zeros(2, 8), torch.zeros(4, 8), config=(1, 16, 64)), "^config: expected a LinearConfig"),
    (lambda: linear(torch.zeros(2, 9), torch.zeros(4, 8)), "^x: expected last dimension 8"),
    (lambda: linear(torch.tensor(1.0), torch.zeros(4, 8)), "^x: expected at least 1 dimension"),
    (lambda: linear(torch.zeros(2, 8), torch.zeros(4, 8, device="meta")), "^weight: expected a tensor on cpu"),
    (lambda: linear(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(4, 2).t()), "^out: expected a contiguous"),
    (lambda: linear(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(2, 5)), r"^out: expected shape \(2, 4\)"),
    (lambda: LinearConfig(3, 16, 64), "block_m must be a power of two"),
    (lambda: LinearConfig(16, 8, 64), "block_n must be >= 16 on the tensor-core path"),
])
def test_gemv_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 5, 16, 33, 64])
@pytest.mark.parametrize("N,K", [(14336, 4096), (4096, 14336), (4097, 4095)])
def test_gemv_bf16_gpu(gen, M, N, K):
    x, w = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((N, K), torch.bfloat16, gen, "cuda", 0.02)
    bias = _randn((N,), torch.bfloat16, gen, "cuda")
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv(x, w, bias, activation="silu", out=out)
    _check(out, reference.linear_ref(x, w, bias, "silu", acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for cfgs in LINEAR_CONFIGS.values() for c in cfgs if c.block_m <= 64
                                    and not c.words], ids=str)  # word configs: int8/int4 only (test_quant_linear)
def test_gemv_every_candidate_gpu(gen, config):
    """Each decode candidate must be right on its own: autotuning must never pick a wrong fast one."""
    M = max(1, config.block_m - 1) if config.block_m > 1 else 1
    N, K = 4100, 4095
    x, w = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((N, K), torch.bfloat16, gen, "cuda", 0.02)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv(x, w, out=out, config=config)
    _check(out, reference.linear_ref(x, w, acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
def test_linear_large_m_uses_matmul_gpu(gen):
    x, w = _randn((4, 300, 4096), torch.bfloat16, gen, "cuda"), _randn((1024, 4096), torch.bfloat16, gen, "cuda", 0.02)
    bias = _randn((1024,), torch.bfloat16, gen, "cuda")
    _check(linear(x, w, bias, activation="gelu_tanh"),
           reference.linear_ref(x, w, bias, "gelu_tanh", acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("m, n, k, split, bm", [(1, 37, 300, 1, 1), (3, 64, 129, 1, 4), (1, 50, 512, 4, 1),
                                                (7, 19, 96, 2, 8), (5, 33, 160, 1, 16)])  # bm 16: tensor cores
def test_gated_input_fuses_the_gated_activation_into_the_loads(act, m, n, k, split, bm):
    """linear(x [M, 2K], w [N, K], gated_input=act) == linear(act(x[:, :K]) * x[:, K:] in x's dtype, w)."""
    from warpforge.kernels import force_triton
    from warpforge.kernels.activation import gelu_and_mul, silu_and_mul
    from warpforge.kernels.gemv import LinearConfig, linear

    g = torch.Generator().manual_seed(m * 100 + k)
    x = torch.randn(m, 2 * k, generator=g).half()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    b = torch.randn(n, generator=g).half()
    cfg = LinearConfig(bm, 16, 64, split_k=split)
    assert cfg.use_dot == (bm >= 16)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    with force_triton():
        linear(x, w, bias=b, out=out, config=cfg, gated_input=act)
        h = silu_and_mul(x) if act == "silu" else gelu_and_mul(x, approximate="tanh" if act == "gelu_tanh" else "none")
        want = linear(h, w, bias=b, config=cfg)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same roundings in the same order
    # and against float64: the gated input rounded to fp16, then the product
    href = h.double()
    torch.testing.assert_close(out.double(), href @ w.double().T + b.double(), rtol=2e-2, atol=2e-2)


def test_gated_input_falls_back_outside_the_gemv_and_rejects_bad_input():
    from warpforge.kernels.gemv import linear
    from warpforge.kernels.quant_linear import quantize_weight

    x = torch.randn(70, 2 * 32)  # M > GEMV_MAX_M: silu_and_mul, then the GEMM path (CPU: references)
    w = torch.randn(16, 32)
    want = torch.nn.functional.silu(x[:, :32]) * x[:, 32:] @ w.T
    torch.testing.assert_close(linear(x, w, gated_input="silu"), want, rtol=1e-4, atol=1e-4)
    qw = quantize_weight(w, "int8")  # quantized weights: unfused too
    assert linear(x[:2], qw, gated_input="silu").shape == (2, 16)
    with pytest.raises(ValueError, match="gated_input"):
        linear(x, w, gated_input="relu")
    with pytest.raises(ValueError, match="even last dimension"):
        linear(torch.randn(2, 63), w, gated_input="silu")
    with pytest.raises(ValueError, match="gate | up"):
        linear(torch.randn(2, 2 * 31), w, gated_input="silu")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gated_input_on_the_gpu_in_bf16_equals_the_unfused_pair(m):
    """bf16 on the H200 (the interpreter mishandles bf16): tuned configs, the LLM MLP's down-projection shape."""
    from warpforge.kernels.activation import silu_and_mul
    from warpforge.kernels.gemv import linear

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2 * 5632, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2048, 5632, device="cuda", generator=g) / 75).to(torch.bfloat16)
    fused = linear(x, w, gated_input="silu")
    unfused = linear(silu_and_mul(x), w)
    # the same config is tuned for each bucket separately, so allow bf16 rounding of a different K split
    want = (silu_and_mul(x).double() @ w.double().T)
    for y in (fused, unfused):
        torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
