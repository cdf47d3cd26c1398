"""conv2d_int8 and quantize_int8 against their references (exact int32 conv, then the fp32 epilogue).

The int32 accumulation is exact, and the interpreter does the epilogue's fp32 operations in the
reference's order with IEEE rounding, so on CPU the results agree bit for bit without a transcendental
activation (silu, gelu: a few fp32 ulps). On the GPU the compiler may fuse ``acc * scale + bias`` into
one FMA (one rounding instead of two): fp16 outputs may then differ by an ulp and int8 outputs by one
step where y / out_scale lies within an fp32 ulp of a half-integer. Outputs are poisoned first (NaN, or
-128, a value the quantizer never produces) so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import reference as ref
from warpforge.kernels.conv import ConvConfig, conv2d
from warpforge.kernels.conv_int8 import INT8_CONV_CONFIGS, INT8_NARROW_TILINGS, conv2d_int8
from warpforge.kernels.quantize import quantize_int8

CL = torch.channels_last
EXACT_ACTS = (None, "relu", "relu6")  # no transcendental in the epilogue


def _int8(shape, gen, device, lo=-127, hi=127):
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int8).to(device)


def _out_hw(h, w, k, s, p, d):
    return (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1


def _poisoned(shape, dtype, device):
    fill = -128 if dtype == torch.int8 else float("nan")
    return torch.full(shape, fill, dtype=dtype, device=device).to(memory_format=CL)


def assert_conv_int8_close(got: torch.Tensor, want: torch.Tensor, activation: str | None) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.int8:
        if not (want == -128).any():  # symmetric: -128 is never produced
            assert not (got == -128).any(), "unwritten (poisoned) outputs"
        diff = (got.int() - want.int()).abs()
        if got.device.type == "cpu" and activation in EXACT_ACTS:
            assert torch.equal(got, want), f"{int((diff > 0).sum())} of {diff.numel()} differ"
        else:  # a rounding tie broken the other way (FMA on the GPU, transcendental ulps)
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3, (int(diff.max()),
                                                                                       float((diff > 0).float().mean()))
        return
    assert not torch.isnan(got).any(), "unwritten (NaN) outputs"
    if got.device.type == "cpu" and activation in EXACT_ACTS and got.dtype != torch.bfloat16:
        assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max():.3e}"
    else:
        # bf16 on CPU: the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even).
        rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[got.dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * want.float().abs().max().item())


def _problem(gen, device, n, cin, h, w, cout, k, s, p, d, groups, residual, res_dtype=torch.float16, x_zero=0):
    x = _int8((n, cin, h, w), gen, device, lo=-127 if x_zero == 0 else -128).to(memory_format=CL)
    wq = _int8((cout, cin // groups, k, k), gen, device)
    xs = torch.tensor([0.02], device=device)
    # acc has std ~ 5400 sqrt(K) (uniform int8 products): these scales bring y near N(0, 1), so int8 outputs
    # at out_scale 0.03 span the range without mostly saturating.
    ws = ((torch.rand(cout, generator=gen) + 0.5) * 0.01 / (k * k * cin // groups) ** 0.5).to(device)
    bias = torch.randn(cout, generator=gen).to(device)
    oh, ow = _out_hw(h, w, k, s, p, d)
    r = torch.randn(n, cout, oh, ow, generator=gen).to(device, res_dtype).to(memory_format=CL) if residual else None
    return x, wq, xs, ws, bias, r, (n, cout, oh, ow)


def run_case(gen, device, case, out_kind, config=None, x_zero=0, out_zero=0):
    n, cin, h, w, cout, k, s, p, d, groups, act, residual = case
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, n, cin, h, w, cout, k, s, p, d, groups, residual,
                                             x_zero=x_zero)
    geo = dict(stride=s, padding=p, dilation=d, groups=groups, x_zero_point=x_zero)
    if out_kind == "int8":
        out_scale = torch.tensor([0.03], device=device)
        out = _poisoned(shape, torch.int8, device)
        if out_zero != 0:
            out.fill_(77)  # -128 is unsigned's zero: poison with a mid code instead (hit by chance at ~1/255)
        got = conv2d_int8(x, wq, xs, ws, bias, activation=act, residual=r, out_scale=out_scale, out=out,
                          config=config, out_zero_point=out_zero, **geo)
        want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, activation=act, residual=r, out_scale=out_scale,
                                         out_zero_point=out_zero, **geo)
    else:
        dtype = getattr(torch, out_kind)
        out = _poisoned(shape, dtype, device)
        got = conv2d_int8(x, wq, xs, ws, bias, activation=act, residual=r, out_dtype=dtype, out=out, config=config,
                          **geo)
        want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, activation=act, residual=r, out_dtype=dtype, **geo)
    assert got is out and out.is_contiguous(memory_format=CL)
    assert_conv_int8_close(out, want, act)


CASES = [  # n, cin, h, w, cout, k, stride, pad, dil, groups, act, residual
    (1, 3, 9, 9, 5, 3, 2, 1, 1, 1, "relu", False),  # RGB stem: flat K (C=3), strided, Cout 5
    (2, 17, 7, 9, 31, 3, 1, 1, 1, 1, "relu6", True),  # flat K (17 % 16 != 0), residual
    (2, 32, 7, 7, 31, 3, 2, 1, 1, 1, "silu", False),  # taps (C % 16 == 0), stride 2
    (1, 33, 9, 7, 5, 1, 1, 0, 1, 1, None, True),  # plain GEMM 1x1, odd C: MobileNet's projection + skip
    (2, 16, 9, 9, 17, 1, 2, 0, 1, 1, "gelu", False),  # strided 1x1 (ResNet downsample): plain on a strided view
    (1, 17, 9, 9, 31, 3, 1, 2, 2, 1, "relu", False),  # dilation 2
    (1, 8, 7, 7, 12, 3, 1, 1, 1, 2, None, True),  # grouped (2 groups)
]


# ---- CPU (interpreter) ------------------------------------------------------------------------
@pytest.mark.parametrize("out_kind", ["float16", "float32", "int8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:10])) + f"-{c[10]}-{'res' if c[11] else ''}")
def test_conv_int8_matches_reference(triton_on_cpu, device, gen, case, out_kind):
    run_case(gen, device, case, out_kind)


@pytest.mark.parametrize("out_kind", ["float32", "int8"])
@pytest.mark.parametrize("case", CASES[:3] + CASES[5:], ids=lambda c: "x".join(map(str, c[:10])))
def test_conv_int8_unsigned_x(triton_on_cpu, device, gen, case, out_kind):
    """x_zero_point -128 (x = s * (x_q + 128)): padding must read as -128 and the weight sums come out of the
    accumulator; int8 out unsigned too (a ReLU's output feeding the next layer)."""
    run_case(gen, device, case, out_kind, x_zero=-128, out_zero=-128 if out_kind == "int8" else 0)


# Unsigned x in the two loops that load it without a masked ``other`` (kernels/conv_gemm.py): the taps loop, whose
# padded pixels read a row of -128s, and the plain 1x1 loop, whose masked rows and channels zero-fill.
UNSIGNED_CASES = [  # n, cin, h, w, cout, k, stride, pad, dil, groups, act, residual
    (2, 48, 7, 9, 33, 3, 1, 1, 1, 1, "relu", True),  # taps, padded borders, channel tail (48 % 32), residual
    (1, 32, 6, 5, 17, 3, 2, 1, 1, 1, None, False),  # taps, stride 2, odd sizes
    (2, 32, 5, 5, 16, 3, 1, 1, 1, 2, "relu6", False),  # taps per group (C/groups = 16): the group offset
    (1, 16, 5, 6, 9, 3, 1, 2, 2, 1, "relu", False),  # taps, dilation 2 and padding 2 (two padded rings)
    (3, 40, 5, 7, 19, 1, 1, 0, 1, 1, "relu", True),  # plain 1x1, M tail and channel tail
    (2, 40, 7, 8, 19, 1, 3, 0, 1, 1, "relu", True),  # strided 1x1 (3, odd H): plain over the subsampled view
]


def test_conv_int8_strided_1x1_runs_plain(triton_on_cpu, device, gen, monkeypatch):
    """A strided 1x1 conv runs MODE_PLAIN (no tap arithmetic) over the subsampled view of x, exact still."""
    from warpforge.kernels import conv_gemm
    from warpforge.kernels import conv_int8 as ci
    from warpforge.kernels.conv_common import MODE_PLAIN

    modes, real = [], conv_gemm.launch_gemm
    monkeypatch.setattr(ci, "launch_gemm", lambda *a, **k: (modes.append((a[6], a[5].stride)), real(*a, **k))[1])
    run_case(gen, device, (2, 40, 7, 8, 19, 1, 3, 0, 1, 1, "relu", True), "int8", x_zero=-128, out_zero=-128)
    assert modes and all(m == (MODE_PLAIN, (1, 1)) for m in modes)


@pytest.mark.parametrize("out_kind", ["float32", "int8"])
@pytest.mark.parametrize("case", UNSIGNED_CASES, ids=lambda c: "x".join(map(str, c[:10])))
def test_conv_int8_unsigned_taps_and_plain(triton_on_cpu, device, gen, case, out_kind):
    run_case(gen, device, case, out_kind, x_zero=-128, out_zero=-128 if out_kind == "int8" else 0)


@pytest.mark.parametrize("cin", [5, 32, 48], ids=["flat", "taps", "taps-tail"])
def test_conv_int8_unsigned_padding_is_zero(triton_on_cpu, device, cin):
    """All x_q = -128 (x = 0 everywhere) with padding: every output is exactly bias, border pixels included."""
    x = torch.full((1, cin, 4, 4), -128, dtype=torch.int8, device=device).to(memory_format=CL)
    w = torch.randint(-127, 128, (7, cin, 3, 3), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    w = w.to(device)
    bias = torch.arange(7, dtype=torch.float32, device=device)
    out = conv2d_int8(x, w, 0.5, torch.ones(7, device=device), bias, padding=1, out_dtype=torch.float32,
                      x_zero_point=-128)
    assert torch.equal(out, bias.view(1, 7, 1, 1).expand_as(out))
    w_sum = w.sum((1, 2, 3), dtype=torch.int32)
    assert torch.equal(conv2d_int8(x, w, 0.5, torch.ones(7, device=device), bias, padding=1, out_dtype=torch.float32,
                                   x_zero_point=-128, w_sum=w_sum), out)


def test_conv_int8_bf16_out_and_fp32_residual(triton_on_cpu, device, gen):
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, 1, 16, 5, 5, 9, 3, 1, 1, 1, 1, True, torch.float32)
    out = conv2d_int8(x, wq, xs, ws, bias, padding=1, activation="relu", residual=r, out_dtype=torch.bfloat16)
    want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, padding=1, activation="relu", residual=r,
                                     out_dtype=torch.bfloat16)
    assert_conv_int8_close(out, want, "relu")


@pytest.mark.parametrize("taps", [False, True], ids=["plain-1x1", "taps-3x3"])
def test_conv_int8_exact_accumulation(triton_on_cpu, device, taps):
    """Running sums far past 2^24 (where fp32 stops holding every integer) that come back to a small exact
    value: with unit scales and fp32 out the output is float(acc) exactly."""
    c, k = (2200, 1) if taps is False else (256, 3)
    K = c * k * k
    x = torch.full((1, c, 3, 3), 127, dtype=torch.int8, device=device).to(memory_format=CL)
    w = torch.full((3, c, k, k), 127, dtype=torch.int8, device=device)
    w[:, c // 2:] = -127  # the second half of the channels cancels the first ...
    w[:, -1, -1, -1] = -126  # ... but for one product
    one = torch.ones(3, device=device)
    out = conv2d_int8(x, w, one[:1], one, out_dtype=torch.float32)
    half = (c // 2) * k * k  # positive products: the first half of the channels, every tap
    expect = 127.0 * 127 * half - 127 * 127 * (K - half - 1) - 127 * 126
    assert 127 * 127 * half > 2 ** 24
    assert torch.equal(out, torch.full_like(out, expect)), (out.flatten()[0].item(), expect)
    assert torch.equal(ref.conv2d_int8_acc_reference(x, w).float(), out)


@pytest.mark.parametrize("cin", [ref.F32_EXACT_TAPS, ref.F32_EXACT_TAPS + 1, 960, 3 * ref.F32_EXACT_TAPS + 2])
@pytest.mark.parametrize("x_zero", [0, -128], ids=["signed", "unsigned"])
def test_int8_acc_reference_float32_path_is_exact(gen, cin, x_zero):
    """The reference accumulates a 1x1 int8 conv in float32 (chunks of <= F32_EXACT_TAPS channels summed in
    int32) instead of one float64 conv: the same integers, at random values and at the largest products
    (|x - zero| = 255 or 127 against w = -127: odd products of one sign, whose sums pass 2^24)."""
    lo = -128 if x_zero else -127
    x = _int8((2, cin, 5, 5), gen, "cpu", lo=lo).to(memory_format=CL)
    w = _int8((7, cin, 1, 1), gen, "cpu", lo=-128)
    for xq, wq in ((x, w), (torch.full_like(x, 127), torch.full_like(w, -127))):
        for stride in (1, 2):
            want = torch.nn.functional.conv2d(xq.double() - x_zero, wq.double(), stride=stride).to(torch.int32)
            assert torch.equal(ref.conv2d_int8_acc_reference(xq, wq, stride=stride, x_zero_point=x_zero), want)


@pytest.mark.parametrize("out_kind", ["float16", "int8"])
def test_conv_int8_split_k(triton_on_cpu, device, gen, out_kind):
    # 3 ways over 2..10 K steps: uneven shares, and an int32 workspace summed before the epilogue.
    for case in [(1, 40, 5, 5, 17, 3, 1, 1, 1, 1, "relu", True), (1, 64, 3, 3, 9, 1, 1, 0, 1, 1, None, False)]:
        run_case(gen, device, case, out_kind, config=ConvConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1,
                                                                split_k=3))


F16_MMA = ConvConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, f16_mma=True)


@pytest.mark.parametrize("out_kind", ["float32", "int8"])
@pytest.mark.parametrize("x_zero", [0, -128], ids=["signed", "unsigned"])
@pytest.mark.parametrize("case", CASES + UNSIGNED_CASES, ids=lambda c: "x".join(map(str, c[:10])))
def test_conv_int8_f16_mma(triton_on_cpu, device, gen, case, x_zero, out_kind):
    """f16_mma tilings: the int8 codes minus the zero point in fp16 against the weights' values in fp16 into
    fp32: every product and partial sum is an integer below 2^24 here, so the result is the int32 path's."""
    run_case(gen, device, case, out_kind, config=F16_MMA, x_zero=x_zero,
             out_zero=-128 if out_kind == "int8" and x_zero else 0)


def test_conv_int8_f16_mma_validation(device):
    with pytest.raises(ValueError, match="f16_mma takes split_k=1"):
        ConvConfig(64, 64, 64, f16_mma=True, split_k=2)
    x = torch.zeros(1, 16, 4, 4, device=device).to(memory_format=CL)
    with pytest.raises(ValueError, match="f16_mma .* is a conv2d_int8 tiling"):
        conv2d(x, torch.zeros(8, 16, 1, 1, device=device), config=F16_MMA)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("case", [
    (2, 40, 5, 7, 33, 1, 1, 0, 1, 1, "relu", True),  # plain 1x1 + residual: a ResNet block's last conv
    (1, 48, 6, 5, 17, 3, 1, 1, 1, 1, "relu6", False),  # taps, channel tail, padded borders
], ids=["plain-res", "taps"])
def test_conv_int8_dual_out(triton_on_cpu, device, gen, case, split_k):
    """out_q: the float output and its int8 copy from one epilogue, both of the same fp32 y (unsigned x and
    out, as between ResNet blocks)."""
    n, cin, h, w, cout, k, s, p, d, groups, act, residual = case
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, n, cin, h, w, cout, k, s, p, d, groups, residual,
                                             x_zero=-128)
    geo = dict(stride=s, padding=p, dilation=d, groups=groups, x_zero_point=-128, activation=act, residual=r)
    os_ = torch.tensor([0.03], device=device)
    out, out_q = _poisoned(shape, torch.float16, device), _poisoned(shape, torch.int8, device).fill_(77)
    cfg = ConvConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1, split_k=split_k) if split_k > 1 else None
    got = conv2d_int8(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=-128, out_dtype=torch.float16, out=out,
                      out_q=out_q, config=cfg, **geo)
    assert got is out
    assert_conv_int8_close(out, ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_dtype=torch.float16, **geo), act)
    assert_conv_int8_close(out_q, ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=-128,
                                                            **geo), act)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("res_zero", [0, -128], ids=["signed-res", "unsigned-res"])
@pytest.mark.parametrize("case", [
    (2, 40, 5, 7, 33, 1, 1, 0, 1, 1, "relu", True),  # plain 1x1 + residual + relu: a ResNet block's last conv
    (1, 33, 9, 7, 5, 1, 1, 0, 1, 1, None, True),  # MobileNetV2's projection + skip (no activation), odd C
    (1, 48, 6, 5, 17, 3, 1, 1, 1, 1, "relu6", True),  # taps, channel tail, padded borders
], ids=["plain-relu", "plain-linear", "taps"])
def test_conv_int8_int8_residual(triton_on_cpu, device, gen, case, res_zero, split_k):
    """An int8 residual (r = residual_scale * (r_q - zero)) dequantized in the epilogue equals the float
    residual path on the dequantized values, with int8 out (the int8 residual stream) and fp16 out."""
    n, cin, h, w, cout, k, s, p, d, groups, act, _ = case
    x, wq, xs, ws, bias, _, shape = _problem(gen, device, n, cin, h, w, cout, k, s, p, d, groups, False,
                                             x_zero=-128)
    r_q = _int8(shape, gen, device, lo=-128 if res_zero else -127).to(memory_format=CL)
    rs = torch.tensor([0.017], device=device)
    r_f = ((r_q.float() - res_zero) * rs).to(memory_format=CL)
    geo = dict(stride=s, padding=p, dilation=d, groups=groups, x_zero_point=-128, activation=act)
    cfg = ConvConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1, split_k=split_k) if split_k > 1 else None
    os_ = torch.tensor([0.03], device=device)
    out = _poisoned(shape, torch.int8, device).fill_(77)
    got = conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=rs, residual_zero_point=res_zero,
                      out_scale=os_, out_zero_point=-128, out=out, config=cfg, **geo)
    assert got is out
    assert_conv_int8_close(out, ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r_f, out_scale=os_,
                                                          out_zero_point=-128, **geo), act)
    out16 = _poisoned(shape, torch.float16, device)
    conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=rs, residual_zero_point=res_zero,
                out_dtype=torch.float16, out=out16, config=cfg, **geo)
    want16 = ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r_f, out_dtype=torch.float16, **geo)
    assert_conv_int8_close(out16, want16, act)
    # the residual counts: with it read as float zeros the outputs differ
    assert not torch.equal(out16, ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_dtype=torch.float16, **geo))


def test_conv_int8_int8_residual_validation(device, gen):
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, 1, 16, 5, 5, 16, 1, 1, 0, 1, 1, True)
    r_q = _int8(shape, gen, device).to(memory_format=CL)
    with pytest.raises(ValueError, match="int8 residual needs residual_scale"):
        conv2d_int8(x, wq, xs, ws, bias, residual=r_q)
    with pytest.raises(ValueError, match="apply to an int8 residual"):
        conv2d_int8(x, wq, xs, ws, bias, residual=r, residual_scale=0.1)
    with pytest.raises(ValueError, match="without a residual"):
        conv2d_int8(x, wq, xs, ws, bias, residual_scale=0.1)
    with pytest.raises(ValueError, match="residual_scale must be a finite positive"):
        conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=-1.0)
    with pytest.raises(ValueError, match="residual_zero_point"):
        conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=0.1, residual_zero_point=5)


def test_conv_int8_residual_in_place(triton_on_cpu, device, gen):
    x, wq, xs, ws, bias, r, _ = _problem(gen, device, 2, 16, 5, 5, 16, 1, 1, 0, 1, 1, True)
    want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r, activation="relu")
    assert conv2d_int8(x, wq, xs, ws, bias, residual=r, activation="relu", out=r) is r
    assert torch.equal(r, want)


def test_conv_int8_out_scale_chains_layers(triton_on_cpu, device, gen):
    """A's epilogue quantizing for B (out_scale=B's x_scale) equals A in fp32 then quantize_int8: the
    fused int8 activation is what B would have made itself."""
    x, wa, xs, wsa, ba, _, _ = _problem(gen, device, 1, 17, 7, 7, 32, 3, 1, 1, 1, 1, False)
    wb, wsb = _int8((9, 32, 1, 1), gen, device), ((torch.rand(9, generator=gen) + 0.5) * 1e-2).to(device)
    s_b = torch.tensor([0.05], device=device)
    h_q = conv2d_int8(x, wa, xs, wsa, ba, padding=1, activation="relu", out_scale=s_b)
    h = conv2d_int8(x, wa, xs, wsa, ba, padding=1, activation="relu", out_dtype=torch.float32)
    assert h_q.dtype == torch.int8 and h_q.is_contiguous(memory_format=CL)
    assert torch.equal(h_q, quantize_int8(h, s_b))
    assert (h_q >= 0).all() and h_q.max() > 0  # relu before the quantizer
    y = conv2d_int8(h_q, wb, s_b, wsb)
    assert_conv_int8_close(y, ref.conv2d_int8_reference(h_q, wb, s_b, wsb), None)


def test_conv_int8_float_scales_and_empty_batch(triton_on_cpu, device, gen):
    x, wq, _, ws, _, _, _ = _problem(gen, device, 1, 16, 5, 5, 8, 3, 1, 1, 1, 1, False)
    got = conv2d_int8(x, wq, 0.02, ws, padding=1, out_scale=0.1)
    want = ref.conv2d_int8_reference(x, wq, torch.tensor(0.02, device=device), ws, padding=1,
                                     out_scale=torch.tensor(0.1, device=device))
    assert torch.equal(got, want)
    empty = torch.zeros(0, 16, 5, 5, dtype=torch.int8, device=device).to(memory_format=CL)
    assert conv2d_int8(empty, wq, 0.02, ws, padding=1).shape == (0, 8, 5, 5)


def test_conv_int8_validation(device):
    x = torch.zeros(1, 16, 6, 6, dtype=torch.int8, device=device).to(memory_format=CL)
    w = torch.zeros(8, 16, 3, 3, dtype=torch.int8, device=device)
    ws = torch.ones(8, device=device)
    cases = [
        (dict(x=x.float()), "x must be an int8 tensor"),
        (dict(x=x.contiguous()), "x must be channels_last"),
        (dict(weight=w.float()), "weight must be an int8 tensor"),
        (dict(x_scale=torch.ones(2, device=device)), "x_scale must be a positive float or a one-element"),
        (dict(x_scale=-1.0), "x_scale must be a finite positive scale"),
        (dict(w_scale=torch.ones(7, device=device)), r"w_scale must be a float32 tensor \[8\]"),
        (dict(w_scale=torch.ones(8, device=device, dtype=torch.float16)), "w_scale must be a float32"),
        (dict(bias=torch.ones(7, device=device)), r"bias must be a float tensor \[8\]"),
        (dict(groups=3), "groups must be"),
        (dict(x=torch.zeros(1, 8, 6, 6, dtype=torch.int8, device=device).to(memory_format=CL),
              weight=torch.zeros(8, 1, 3, 3, dtype=torch.int8, device=device), groups=8), "depthwise"),
        (dict(stride=0), "stride"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(out_scale=0.1, out_dtype=torch.float16), "out_dtype must be torch.int8"),
        (dict(out_dtype=torch.int8), "int8 out needs out_scale"),
        (dict(residual=torch.zeros(1, 8, 4, 4, dtype=torch.int8, device=device).to(memory_format=CL)),
         "int8 residual needs residual_scale"),
        (dict(residual=torch.zeros(1, 8, 5, 4, device=device).to(memory_format=CL)), "residual must be"),
        (dict(out=torch.zeros(1, 8, 4, 4, device=device).to(memory_format=CL)),
         r"out must be \[1, 8, 4, 4\] torch.float16"),
        (dict(config=ConvConfig(32, 32, 16)), "block_k >= 32"),
        (dict(x_zero_point=5), "x_zero_point must be 0"),
        (dict(out_zero_point=-128), "out_zero_point applies to int8 out"),
        (dict(out_q=torch.zeros(1, 8, 4, 4, dtype=torch.int8, device=device).to(memory_format=CL)),
         "out_q .* needs out_scale"),
        (dict(out_scale=0.1, out_q=torch.zeros(1, 8, 4, 4, device=device).to(memory_format=CL)),
         r"out_q must be \[1, 8, 4, 4\] torch.int8"),
        (dict(out_scale=0.1, out_dtype=torch.int8, out_q=torch.zeros(1, 8, 4, 4, dtype=torch.int8,
                                                                      device=device).to(memory_format=CL)),
         "with out_q the int8 copy goes there"),
        (dict(x_zero_point=-128, w_sum=torch.ones(8, device=device)), r"w_sum must be an int32 tensor \[8\]"),
        (dict(weight=torch.zeros(8, 16, 100, 100, dtype=torch.int8, device=device),
              x=torch.zeros(1, 16, 100, 100, dtype=torch.int8, device=device).to(memory_format=CL)),
         "int32 accumulator could overflow"),
    ]
    for kw, match in cases:
        args = dict(x=x, weight=w, x_scale=0.1, w_scale=ws)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            conv2d_int8(args.pop("x"), args.pop("weight"), args.pop("x_scale"), args.pop("w_scale"), **args)


def test_conv_int8_cpu_dispatch_runs_reference(gen):
    """Without force_triton, CPU tensors take the exact reference (what optimize() runs on CPU)."""
    x, wq, xs, ws, bias, r, _ = _problem(gen, "cpu", 2, 5, 7, 7, 6, 3, 2, 1, 1, 1, True)
    got = conv2d_int8(x, wq, xs, ws, bias, stride=2, padding=1, activation="relu", residual=r)
    want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, stride=2, padding=1, activation="relu", residual=r)
    assert got.is_contiguous(memory_format=CL) and torch.equal(got, want)


# ---- quantize_int8 ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_quantize_int8(triton_on_cpu, device, gen, dtype, layout):
    x = (torch.randn(2, 17, 9, 7, generator=gen) * 3).to(device, dtype)
    x[0, :4, 0, 0] = torch.tensor([1000.0, -1000.0, 0.0, -0.0], dtype=dtype)  # clamped both ways, zeros
    if layout == "channels_last":
        x = x.to(memory_format=CL)
    s = torch.tensor([0.02], device=device)
    out = torch.full_like(x, -128, dtype=torch.int8)
    assert quantize_int8(x, s, out=out) is out and out.stride() == x.stride()
    want = torch.round(x.float() / 0.02).clamp(-127, 127).to(torch.int8)
    assert torch.equal(out, want) and torch.equal(out, ref.quantize_int8_reference(x, s))
    assert out[0, :4, 0, 0].tolist() == [127, -127, 0, 0]


def test_quantize_int8_unsigned(triton_on_cpu, device, gen):
    x = torch.rand(3, 7, 9, generator=gen).to(device) * 6  # a ReLU6 output
    x[0, 0, :4] = torch.tensor([0.0, 300.0, 2.5 * 0.02, -1.0])  # zero, clamped high, a tie, clamped low
    s = torch.tensor([0.02], device=device)
    q = quantize_int8(x, s, zero_point=-128)
    want = (torch.round(x / 0.02).clamp(0, 255) - 128).to(torch.int8)
    assert torch.equal(q, want) and torch.equal(q, ref.quantize_int8_reference(x, s, -128))
    assert q[0, 0, :4].tolist() == [-128, 127, 2 - 128, -128]  # 2.5 rounds to 2 (half to even)
    inside = (x >= 0) & (x <= 255 * 0.02)
    assert ((q.float() + 128) * 0.02 - x).abs()[inside].max() <= 0.01 + 1e-6  # half a step


def test_quantize_int8_rounds_half_to_even(triton_on_cpu, device):
    ties = torch.arange(-130, 130, dtype=torch.float32, device=device) + 0.5  # exact in fp32; scale 1
    got = quantize_int8(ties, 1.0)
    want = torch.round(ties).clamp(-127, 127).to(torch.int8)  # half to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    assert torch.equal(got, want) and got[130].item() == 0 and got[131].item() == 2
    odd = torch.randn(1001, device=device)  # not a multiple of the block
    inv = torch.reciprocal(torch.tensor(0.01, device=device))  # the kernel multiplies by the fp32 reciprocal
    assert torch.equal(quantize_int8(odd, 0.01), torch.round(odd * inv).clamp(-127, 127).to(torch.int8))


def test_quantize_int8_validation(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="x must be a float16"):
        quantize_int8(x.double(), 0.1)
    with pytest.raises(ValueError, match="x must be dense"):
        quantize_int8(x[:, ::2], 0.1)
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        quantize_int8(x, 0.0)
    with pytest.raises(ValueError, match="scale must be a positive float or a one-element float32"):
        quantize_int8(x, torch.tensor([0.1, 0.2], device=device))
    with pytest.raises(ValueError, match="out must be int8"):
        quantize_int8(x, 0.1, out=torch.empty(4, 6, device=device))
    with pytest.raises(ValueError, match="zero_point must be 0"):
        quantize_int8(x, 0.1, zero_point=128)


# ---- GPU: ResNet-50 layer shapes, every candidate, the quantizer at size ------------------------
RESNET_LAYERS = [  # cin, hw, cout, k, stride
    (3, 224, 64, 7, 2), (64, 56, 64, 1, 1), (64, 56, 64, 3, 1), (64, 56, 256, 1, 1), (256, 56, 128, 1, 1),
    (128, 56, 128, 3, 2), (256, 56, 512, 1, 2), (512, 28, 128, 1, 1), (256, 14, 256, 3, 1),
    (1024, 14, 2048, 1, 2), (512, 7, 512, 3, 1), (2048, 7, 512, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("out_kind", ["float16", "int8"])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("layer", RESNET_LAYERS, ids=lambda layer: "x".join(map(str, layer)))
def test_gpu_resnet50_layers_int8(gen, batch, layer, out_kind):
    cin, hw, cout, k, s = layer
    res = k == 1 and s == 1 and out_kind == "float16"  # the bottleneck's last 1x1 adds the identity
    run_case(gen, "cuda", (batch, cin, hw, hw, cout, k, s, k // 2, 1, 1, "relu", res), out_kind)


@pytest.mark.gpu
def test_gpu_int32_accumulator_exact(gen):
    """Unit scales, no bias, fp32 out: the output is float(acc), which must equal the exact conv."""
    for cin, hw, cout, k, s in [(256, 56, 128, 1, 1), (512, 14, 512, 3, 1), (2048, 7, 512, 1, 1)]:
        x = _int8((8, cin, hw, hw), gen, "cuda").to(memory_format=CL)
        w = _int8((cout, cin, k, k), gen, "cuda")
        one = torch.ones(cout, device="cuda")
        out = conv2d_int8(x, w, one[:1], one, stride=s, padding=k // 2, out_dtype=torch.float32)
        want = ref.conv2d_int8_acc_reference(x, w, stride=s, padding=k // 2).float()
        assert torch.equal(out, want), (cin, hw, cout, k)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in INT8_CONV_CONFIGS if not c.persistent], ids=str)
def test_gpu_conv_int8_every_candidate(gen, config):  # persistent (pointwise) ones: test_conv_pointwise.py
    for case, out_kind in [((4, 64, 28, 28, 128, 3, 1, 1, 1, 1, "relu", True), "float16"),  # taps
                           ((2, 256, 14, 14, 512, 1, 1, 0, 1, 1, "silu", False), "int8"),  # plain, int8 out
                           ((2, 3, 57, 57, 32, 3, 2, 1, 1, 1, "relu6", False), "float16"),  # stem: s2d + taps
                           ((2, 17, 15, 15, 32, 3, 1, 1, 1, 1, "relu", False), "int8"),  # flat (C % 16 != 0)
                           ((1, 512, 7, 7, 512, 3, 1, 1, 1, 1, None, True), "float16")]:  # batch 1, long K
        run_case(gen, "cuda", case, out_kind, config=config)
    # unsigned x (padding read as -128) and unsigned int8 out: MobileNet's projection after a ReLU6
    run_case(gen, "cuda", (4, 96, 28, 28, 64, 3, 1, 1, 1, 1, "relu", False), "int8", config=config, x_zero=-128,
             out_zero=-128)
    # unsigned x in MODE_FLAT (C % 16 != 0): padding read through a masked load with other=-128 (an int8
    # other=-128 gave wrong border maxima in the max-pool kernel on the H200, kernels/pool.py)
    run_case(gen, "cuda", (2, 24, 15, 15, 40, 3, 1, 1, 1, 1, "relu", False), "int8", config=config, x_zero=-128,
             out_zero=-128)


@pytest.mark.gpu
@pytest.mark.parametrize("config", INT8_NARROW_TILINGS, ids=str)
def test_gpu_conv_int8_narrow_tilings(gen, config):
    """MobileNetV2's narrow projections (conv_int8._NARROW_TUNER's tilings): after a ReLU6 (unsigned x), int8
    and fp16 out, with the skip; odd H, W and Cout."""
    for case, out_kind in [((2, 32, 15, 17, 16, 1, 1, 0, 1, 1, None, False), "int8"),
                           ((2, 144, 9, 11, 24, 1, 1, 0, 1, 1, None, True), "float16"),
                           ((1, 96, 7, 9, 20, 1, 1, 0, 1, 1, None, False), "int8")]:
        if config.persistent and case[1] > config.block_k:
            continue  # persistent tilings serve 1x1 convs whose K fits one tile (conv._fits)
        run_case(gen, "cuda", case, out_kind, config=config, x_zero=-128, out_zero=-128 if out_kind == "int8" else 0)


@pytest.mark.gpu
def test_gpu_grouped_odd_and_quantize():
    gen = torch.Generator().manual_seed(3)
    run_case(gen, "cuda", (4, 256, 28, 28, 256, 3, 1, 1, 1, 32, "relu", False), "float16")  # ResNeXt groups
    run_case(gen, "cuda", (3, 33, 17, 19, 65, 3, 2, 2, 2, 1, "silu", True), "int8")
    x = (torch.randn(32, 256, 56, 56, generator=gen) * 4).cuda().half().to(memory_format=CL)
    s = torch.tensor([0.03], device="cuda")
    q = quantize_int8(x, s)
    assert q.is_contiguous(memory_format=CL) and torch.equal(q, ref.quantize_int8_reference(x, s))


def _case_id(c) -> str:
    """A parameter's id: a case tuple's first ten fields joined by x; the zero point as it prints."""
    return "x".join(map(str, c[:10])) if isinstance(c, tuple) else str(c)


S2D_CASES = [  # image stems: stride 2 on <= 4 channels, 3x3+ (space-to-depth then the taps loop), odd sizes
    ((1, 3, 9, 9, 5, 3, 2, 1, 1, 1, "relu", False), 0),
    ((2, 3, 13, 11, 17, 7, 2, 3, 1, 1, "relu", False), 0),  # ResNet's 7x7/2, tiny
    ((1, 4, 10, 9, 9, 5, 2, 2, 1, 1, None, True), -128),  # 4 channels fill the 16 s2d channels; unsigned x
    ((1, 2, 7, 8, 6, 4, 2, 1, 1, 1, "relu6", False), -128),  # even kernel, 2 channels
]


@pytest.mark.parametrize("case,zero", S2D_CASES, ids=_case_id)
@pytest.mark.parametrize("out_kind", ["float16", "int8"])
def test_conv_int8_stem_space_to_depth(triton_on_cpu, device, gen, monkeypatch, case, zero, out_kind):
    """An int8 image stem runs as conv2d does it (space-to-depth pack padded with x's zero point, then the
    taps loop) and matches the int8 reference."""
    from warpforge.kernels import conv_stem

    calls = []
    real = conv_stem._s2d_pack_kernel
    monkeypatch.setattr(conv_stem, "_s2d_pack_kernel", _Spy(real, calls))
    run_case(gen, device, case, out_kind, x_zero=zero, out_zero=zero if out_kind == "int8" else 0)
    assert len(calls) == 1


class _Spy:
    """A kernel stand-in that records launches and forwards them (kernel[grid](...))."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


FOLD_CASES = [  # the folded int8-out epilogue: each activation it folds, both zero points, both residual kinds
    ((2, 32, 7, 7, 31, 3, 2, 1, 1, 1, "relu", False), 0),
    ((2, 17, 7, 9, 31, 3, 1, 1, 1, 1, "relu6", True), 0),
    ((1, 33, 9, 7, 5, 1, 1, 0, 1, 1, None, True), 0),
    ((2, 48, 7, 9, 33, 3, 1, 1, 1, 1, "relu", True), -128),
    ((3, 40, 5, 7, 19, 1, 1, 0, 1, 1, "relu", True), -128),
    ((2, 40, 7, 8, 19, 1, 3, 0, 1, 1, None, False), -128),
]


@pytest.mark.parametrize("case,zero", FOLD_CASES, ids=_case_id)
@pytest.mark.parametrize("split_k", [1, 2])
def test_conv_int8_folded_requant(triton_on_cpu, device, gen, case, zero, split_k):
    """int8 out through one folded FMA per element, ReLU / ReLU6 as the clamp's bounds; the same codes as the
    reference up to a rounding tie (the FMA rounds once)."""
    run_case(gen, device, case, "int8", config=ConvConfig(32, 32, 32, 4, 4, 1, split_k=split_k), x_zero=zero,
             out_zero=zero)
