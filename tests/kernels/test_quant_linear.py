"""Weight-only quantization: packing round trips and the fused dequantizing linear.

The fused kernel is checked against dequantize-then-linear (the reference for the kernel's
in-register dequantization); the quantizer is checked against the original weight with an error
bound per scheme. CPU uses the interpreter with fp16/fp32 activations; bf16 at decode sizes is GPU.
"""

from __future__ import annotations


import pytest
import torch

from warpforge.kernels import reference
from warpforge.kernels.gemv import LinearConfig, linear
from warpforge.kernels.quant_linear import SCHEMES, QuantizedWeight, quantize_weight
from warpforge.kernels.tolerance import rel_err

from .linalg_helpers import _check, _randn

# Relative Frobenius error of dequantize(quantize(w)) against w for Gaussian rows, with the reason.
ROUND_TRIP_TOL = {
    "int8": (1.5e-2, "step amax/127 ~ 3.5 sigma/127; uniform rounding noise step/sqrt(12) ~ 0.8% of sigma"),
    "fp8": (4e-2, "e4m3 keeps 3 mantissa bits: relative rounding up to 2^-4, ~2.5% rms"),
    "int4_g32": (0.11, "16 levels over each group's [min, max]: step ~ range/15, noise step/sqrt(12)"),
    "int4_g64": (0.11, "as g32, a wider range per group"),
    "int4_g128": (0.12, "as g32, the widest range per group"),
}





# ---- packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_round_trip_error(gen, scheme, dtype):
    w = _randn((48, 300), dtype, gen, scale=0.05)
    qw = quantize_weight(w, scheme)
    dq = qw.dequantize()
    assert dq.shape == w.shape and dq.dtype == dtype
    bound, why = ROUND_TRIP_TOL[scheme]
    assert rel_err(dq, w) <= bound, why


def test_int4_error_shrinks_with_group(gen):
    w = _randn((64, 512), torch.float32, gen)
    errs = [rel_err(quantize_weight(w, f"int4_g{g}").dequantize(), w) for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_exact_on_grid_values(gen, group):
    """Weights already on a group's 16-level grid come back bit-exact, whatever the group's float minimum
    (here not a multiple of the step, which an integer zero point could not represent)."""
    n, k = 8, 2 * group
    q = torch.randint(0, 16, (n, k), generator=gen).float()
    q[:, ::group] = 0.0  # each group spans the full 0..15 range, so its scale is exactly 2^-4
    q[:, 1::group] = 15.0
    m = torch.randint(-512, 512, (n, k // group), generator=gen).float() * 2.0**-9  # multiples of step / 32
    w = q * 2.0**-4 + m.repeat_interleave(group, dim=1)
    qw = quantize_weight(w, f"int4_g{group}")
    assert torch.equal(qw.dequantize(), w)
    assert torch.equal(qw.mins, m) and torch.equal(qw.scales, torch.full_like(m, 2.0**-4))


def test_int4_layout_and_padding():
    """Even k in the low nibble, odd k in the high one; K padded up to the group."""
    qw = quantize_weight(torch.zeros(3, 45), "int4_g32")
    assert qw.data.shape == (3, 32) and qw.scales.shape == (3, 2) and qw.mins.shape == (3, 2)
    assert qw.k_stored == 64 and qw.dequantize().shape == (3, 45)
    assert torch.equal(qw.dequantize(), torch.zeros(3, 45))  # all-zero groups: no NaN from a zero range
    data = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8).repeat(1, 8)  # k0=1, k1=2, k2=0, k3=15, ...
    hand = QuantizedWeight("int4_g32", data, torch.full((1, 1), 0.5), torch.full((1, 1), -3.0), 32,
                           (1, 32), torch.float32)
    assert hand.dequantize()[0, :4].tolist() == [-2.5, -2.0, -3.0, 4.5]  # q * 0.5 - 3


def _int4_float64(qw: QuantizedWeight) -> torch.Tensor:  # [N, K] float64, decoded independently of reference.py
    n, k = qw.shape
    q = torch.empty((n, qw.k_stored), dtype=torch.float64)
    q[:, 0::2], q[:, 1::2] = (qw.data.cpu() & 0xF).double(), (qw.data.cpu() >> 4).double()
    s = qw.scales.cpu().double().repeat_interleave(qw.group, dim=1)
    m = qw.mins.cpu().double().repeat_interleave(qw.group, dim=1)
    return (q * s + m)[:, :k]


def _special_groups(n: int, k: int, group: int, gen) -> torch.Tensor:
    """[n, k] float32 rows: Gaussian, all positive, all negative, constant (0.37), all zero, a lone outlier."""
    w = torch.randn(n, k, generator=gen) * 0.05
    w[1] = w[1].abs() + 0.2  # a range far from 0 on the positive side
    w[2] = -w[2].abs() - 0.2
    w[3] = 0.37  # every group constant: scale 0, the minimum carries the value
    w[4] = 0.0
    w[5, :group] = 1e-3
    w[5, 3] = 2.0  # one outlier: clipping it would cost more than it saves
    return w


@pytest.mark.parametrize("group", [32, 128])
def test_int4_special_groups(gen, group):
    """Ranges that exclude 0, constant groups (scale 0, exact), a lone outlier: each group's levels stay inside
    its own [min, max], and the search never ends above plain min-max rounding's squared error."""
    n, k = 7, 2 * group + 5  # a padded tail group
    w = _special_groups(n, k, group, gen)
    qw = quantize_weight(w, f"int4_g{group}")
    dq = _int4_float64(qw)
    torch.testing.assert_close(qw.dequantize().double(), dq, rtol=1e-6, atol=1e-7)  # fp32 q * s + m, one rounding
    assert torch.equal(dq[3], torch.full((k,), 0.37, dtype=torch.float32).double())
    assert (qw.scales[3] == 0).all() and (qw.scales[4] == 0).all() and torch.equal(dq[4], torch.zeros(k).double())
    assert (qw.mins[1] > 0).all() and (qw.mins[2] + 15 * qw.scales[2] < 0).all()
    assert abs(dq[5, 3] - 2.0) < 1e-6  # the outlier is kept
    wp = torch.nn.functional.pad(w, (0, qw.k_stored - k)).reshape(n, -1, group)
    valid = torch.nn.functional.pad(torch.ones(k), (0, qw.k_stored - k)).reshape(1, -1, group).bool()
    lo, hi = torch.where(valid, wp, torch.inf).amin(2), torch.where(valid, wp, -torch.inf).amax(2)
    levels_lo, levels_hi = qw.mins.double(), qw.mins.double() + 15 * qw.scales.double()
    slack = 1e-6 * (hi - lo).double() + 1e-7 * lo.abs().double()  # fp32 rounding of the scale and minimum
    assert (levels_lo >= lo.double() - slack).all() and (levels_hi <= hi.double() + slack).all()
    s0 = (hi - lo) / 15  # plain min-max rounding, the search's first candidate
    plain = ((wp - lo[..., None]) / torch.where(s0 > 0, s0, 1)[..., None]).round().clamp(0, 15) * s0[..., None] \
        + lo[..., None]
    d = torch.nn.functional.pad(dq, (0, qw.k_stored - k)).reshape(n, -1, group)
    err = torch.where(valid, d - wp.double(), 0).pow(2).sum(2)
    err_plain = torch.where(valid, plain.double() - wp.double(), 0).pow(2).sum(2)
    assert (err <= err_plain * (1 + 1e-4) + 1e-12).all()  # 1e-4: the search scores in fp32, this in fp64
    assert err.sum() < 0.95 * err_plain.sum()  # the clipped ranges pay on the Gaussian rows


def test_int4_importance_weights_the_range_search(gen):
    """With column importances the search minimises each group's importance-weighted squared error: never above
    that of the unweighted fit (both pick from the same candidate ranges), and lower where a few columns
    dominate. An all-zero importance leaves plain min-max (the first candidate)."""
    n, k, group = 16, 256, 128
    w = torch.randn(n, k, generator=gen)
    imp = torch.rand(k, generator=gen) * 0.01
    imp[::37] = 10.0  # a few columns whose inputs are large
    weighted = lambda qw: ((qw.dequantize() - w).pow(2) * imp).reshape(n, -1, group).sum(2).double()  # noqa: E731
    plain, fit = quantize_weight(w, "int4_g128"), quantize_weight(w, "int4_g128", importance=imp)
    assert (weighted(fit) <= weighted(plain) * (1 + 1e-5)).all()
    assert weighted(fit).sum() < 0.9 * weighted(plain).sum()
    zero = quantize_weight(w, "int4_g128", importance=torch.zeros(k))
    lo = w.reshape(n, -1, group).amin(2)
    assert torch.equal(zero.mins, lo) and torch.allclose(zero.scales, (w.reshape(n, -1, group).amax(2) - lo) / 15)


@pytest.mark.parametrize("call,match", [
    (lambda: quantize_weight(torch.zeros(4, 8), "int8", importance=torch.ones(8)),
     "^importance: only the int4 schemes search a range, got scheme 'int8'"),
    (lambda: quantize_weight(torch.zeros(4, 8), "int4_g32", importance=torch.ones(7)),
     r"^importance: expected shape \(8,\)"),
    (lambda: quantize_weight(torch.zeros(4, 8), "int4_g32", importance=-torch.ones(8)),
     "^importance: expected finite values >= 0"),
])
def test_importance_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("scheme,config,M", [
    ("int4_g32", None, 1), ("int4_g128", None, 1), ("int4_g32", None, 3),  # the interpreter's default configs
    ("int4_g32", LinearConfig(2, 16, 64, 2, 4, 1), 3), ("int4_g64", LinearConfig(16, 16, 128, 1, 4, 1), 3),
    ("int4_g64", LinearConfig(1, 16, 128, 1, 4, 1), 1), ("int4_g32", LinearConfig(1, 16, 64, 2, 4, 1, words=True), 1),
], ids=str)
def test_int4_linear_against_float64_on_odd_sizes(triton_on_cpu, device, gen, scheme, config, M):
    """The kernels (tiles: q * scale + min per element; words: the minimum folded as min * sum(x) per group)
    against a float64 product with the independently decoded weight: N odd, K not a multiple of the group,
    special groups in the rows, the output poisoned with NaN before the call."""
    group = int(scheme.split("_g")[1])
    N, K = 9, 3 * group + 11 if not (config and config.words) else 3 * group + 12  # words: whole int32 words
    w = _special_groups(N, K, group, gen).to(device)
    qw = quantize_weight(w, scheme)
    x, bias = _randn((M, K), torch.float32, gen, device), _randn((N,), torch.float32, gen, device)
    out = torch.full((M, N), float("nan"), device=device)
    linear(x, qw, bias, out=out, config=config)
    ref = x.cpu().double() @ _int4_float64(qw).t() + bias.cpu().double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)


def test_int8_fp8_per_channel_scales(gen):
    w = _randn((4, 64), torch.float32, gen) * torch.tensor([[1e-3], [1.0], [1e3], [0.0]])
    for scheme, qmax in (("int8", 127.0), ("fp8", 448.0)):
        qw = quantize_weight(w, scheme)
        torch.testing.assert_close(qw.scales[:3], w[:3].abs().amax(dim=1) / qmax)
        assert qw.scales[3] == 1.0 and torch.equal(qw.dequantize()[3], torch.zeros(64))
        assert qw.data.float().abs().max() == qmax


def test_nbytes_is_smaller_than_bf16(gen):
    w = _randn((256, 1024), torch.bfloat16, gen)
    dense = w.numel() * 2
    assert quantize_weight(w, "int8").nbytes < 0.51 * dense
    assert quantize_weight(w, "fp8").nbytes < 0.51 * dense
    assert quantize_weight(w, "int4_g128").nbytes < 0.27 * dense


@pytest.mark.parametrize("call,match", [
    (lambda: quantize_weight(torch.zeros(4, 8), "int3"), "^scheme: expected one of"),
    (lambda: quantize_weight(torch.zeros(2, 4, 8), "int8"), "^w: expected a 2-D"),
    (lambda: quantize_weight(torch.zeros(4, 8, dtype=torch.int32), "int8"), "^w: expected dtype"),
    (lambda: quantize_weight(torch.full((4, 8), float("nan")), "int8"), "^w: contains NaN"),
    (lambda: quantize_weight(torch.zeros(0, 8), "int8"), "^w: expected a non-empty"),
    (lambda: QuantizedWeight("int8", torch.zeros(4, 8), torch.ones(4), None, None, (4, 8), torch.float16),
     "^data: expected dtype int8"),
    (lambda: QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(3), None, None, (4, 8),
                             torch.float16), r"^scales: expected shape \(4,\)"),
    (lambda: QuantizedWeight("int4_g64", torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 1), None, 64, (4, 8),
                             torch.float16), r"^data: expected shape \(4, 32\)"),
    (lambda: QuantizedWeight("int4_g64", torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), None, 32, (4, 8),
                             torch.float16), "^group: scheme int4_g64 needs group 64"),
    (lambda: QuantizedWeight("int4_g64", torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), None, 64, (4, 8),
                             torch.float32), r"^mins: scheme int4_g64 needs a group minimum tensor \[4, 1\]"),
    (lambda: QuantizedWeight("int4_g64", torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1),
                             torch.zeros(4, 1, dtype=torch.uint8), 64, (4, 8), torch.float32),
     "^mins: expected dtype float32"),
    (lambda: QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), torch.ones(4), None, (4, 8),
                             torch.float16), "^mins: scheme int8 is symmetric, expected None"),
])
def test_quant_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- fused linear (interpreter) ---------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 5, 17, 70])
def test_fused_linear_matches_dequantized(triton_on_cpu, device, gen, scheme, M):
    N, K = 29, 200  # K is not a multiple of any group: the int4 tail is padding
    w = _randn((N, K), torch.float16, gen, device, scale=0.05)
    qw = quantize_weight(w, scheme)
    x, bias = _randn((M, K), torch.float16, gen, device), _randn((N,), torch.float16, gen, device)
    y = linear(x, qw, bias, activation="gelu")
    _check(y, reference.linear_ref(x, qw.dequantize(), bias, "gelu", acc_dtype=torch.float64), torch.float16)


@pytest.mark.parametrize("scheme,config", [
    ("int4_g32", LinearConfig(1, 16, 64, 3, 4, 1)), ("int4_g64", LinearConfig(2, 8, 128, 2, 4, 2)),
    ("int4_g128", LinearConfig(16, 16, 128, 2, 4, 1)), ("int8", LinearConfig(16, 32, 32, 4, 4, 1)),
    ("fp8", LinearConfig(4, 16, 32, 2, 4, 1)), ("int8", LinearConfig(1, 16, 256, 1, 4, 1)),
], ids=str)
def test_fused_linear_configs(triton_on_cpu, device, gen, scheme, config):
    M, N, K = 3, 37, 256  # K a multiple of 256: the unmasked (EVEN_K) loop where the config allows it
    w = _randn((N, K), torch.float32, gen, device, scale=0.05)
    qw = quantize_weight(w, scheme)
    x = _randn((M, K), torch.float32, gen, device)
    y = linear(x, qw, activation="relu", config=config)
    _check(y, reference.linear_ref(x, qw.dequantize(), None, "relu", acc_dtype=torch.float64), torch.float32)


@pytest.mark.parametrize("scheme,config,K", [
    ("int4_g32", LinearConfig(1, 16, 64, 3, 4, 1, words=True), 256),  # split-K, three K slices
    ("int4_g64", LinearConfig(1, 32, 128, 1, 4, 2, words=True), 200),  # padded tail group
    ("int4_g128", LinearConfig(1, 16, 256, 1, 4, 1, words=True), 384),  # two groups per tile
    ("int8", LinearConfig(1, 16, 64, 2, 4, 1, words=True), 212),  # masked tail words
    ("int8", LinearConfig(1, 32, 256, 1, 4, 1, words=True), 256),
    ("int4_g128", LinearConfig(1, 16, 1024, 1, 4, 1, words=True), 1100),  # a deep tile past K: masked words
], ids=str)
def test_word_kernel_configs(triton_on_cpu, device, gen, scheme, config, K):
    """M=1 through _linear_words_kernel (int32 words, bit-trick conversion, factored group scales)."""
    N = 37
    w = _randn((N, K), torch.float32, gen, device, scale=0.05)
    w[3] = -w[3].abs()  # a row of negative int8 values and a row at the int4 range's low end
    qw = quantize_weight(w, scheme)
    x, bias = _randn((1, K), torch.float32, gen, device), _randn((N,), torch.float32, gen, device)
    out = torch.full((1, N), float("nan"), device=device)
    linear(x, qw, bias, activation="silu", out=out, config=config)
    _check(out, reference.linear_ref(x, qw.dequantize(), bias, "silu", acc_dtype=torch.float64), torch.float32)


def test_word_kernel_rejects_what_it_cannot_read(triton_on_cpu, device):
    cfg = LinearConfig(1, 16, 64, words=True)
    with pytest.raises(ValueError, match="^config: words=True serves one row"):
        linear(torch.zeros(2, 64, device=device), quantize_weight(torch.randn(16, 64, device=device), "int8"),
               config=cfg)
    with pytest.raises(ValueError, match="^config: words=True serves one row"):
        linear(torch.zeros(1, 66, device=device), quantize_weight(torch.randn(16, 66, device=device), "int8"),
               config=cfg)
    with pytest.raises(ValueError, match="^config: words=True serves one row"):
        linear(torch.zeros(1, 64, device=device), quantize_weight(torch.randn(16, 64, device=device), "fp8"),
               config=cfg)
    with pytest.raises(ValueError, match="words needs block_m == 1"):
        LinearConfig(2, 16, 64, words=True)


def test_fused_linear_batched_and_cpu_fallback(gen):
    w = _randn((24, 64), torch.float32, gen, scale=0.05)
    qw = quantize_weight(w, "int4_g32")
    x = _randn((2, 3, 64), torch.float32, gen)
    y = linear(x, qw)  # CPU tensors, no forcing: the reference path
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, x @ qw.dequantize().T)


def test_fused_linear_validation(triton_on_cpu, device):
    qw = quantize_weight(torch.randn(16, 64, device=device), "int4_g64")
    with pytest.raises(ValueError, match="^x: expected last dimension 64"):
        linear(torch.zeros(2, 63, device=device), qw)
    with pytest.raises(ValueError, match="^config: block_k 32 must be a multiple of the quantization group 64"):
        linear(torch.zeros(2, 64, device=device), qw, config=LinearConfig(1, 16, 32))
    with pytest.raises(ValueError, match="^weight: expected a QuantizedWeight on meta"):
        linear(torch.zeros(2, 64, device="meta"), qw)


# ---- GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 16, 64, 300])
@pytest.mark.parametrize("N,K", [(14336, 4096), (4097, 4095)])
def test_fused_linear_bf16_gpu(gen, scheme, M, N, K):
    w = _randn((N, K), torch.bfloat16, gen, "cuda", 0.02)
    qw = quantize_weight(w, scheme)
    x, bias = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((N,), torch.bfloat16, gen, "cuda")
    y = linear(x, qw, bias, activation="silu")
    _check(y, reference.linear_ref(x, qw.dequantize(), bias, "silu", acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "int4_g128", "fp8"])
def test_fused_linear_every_candidate_gpu(gen, scheme):
    from warpforge.kernels.gemv import LINEAR_CONFIGS, _fits

    N, K = 4100, 4096
    w = _randn((N, K), torch.bfloat16, gen, "cuda", 0.02)
    qw = quantize_weight(w, scheme)
    for bm, cfgs in LINEAR_CONFIGS.items():
        M = 1 if bm == 1 else bm - 1
        x = _randn((M, K), torch.bfloat16, gen, "cuda")
        ref = reference.linear_ref(x, qw.dequantize(), acc_dtype=torch.float64)
        for cfg in cfgs:
            if not _fits(cfg, qw.group, words=scheme != "fp8" and M == 1):
                continue
            _check(linear(x, qw, config=cfg), ref, torch.bfloat16)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bench_weight_bytes_match_nbytes(gen, scheme):
    """The benchmark's analytic byte count is what a QuantizedWeight actually stores."""
    from warpforge.bench.suites._kernels_matmul import _weight_bytes

    for n, k in ((24, 4096), (7, 200)):
        qw = quantize_weight(_randn((n, k), torch.bfloat16, gen), scheme)
        assert _weight_bytes(scheme, n, k, torch.bfloat16) == qw.nbytes
