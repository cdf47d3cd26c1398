"""conv2d on channels_last tensors (implicit GEMM modes, depthwise, fused epilogue) vs the float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from warpforge.kernels import conv as conv_mod
from warpforge.kernels import conv_common, conv_stem
from warpforge.kernels import reference as ref
from warpforge.kernels.conv import ConvConfig, DepthwiseConfig, conv2d, prepare_conv_weight
from warpforge.kernels.tolerance import rel_err, tolerance

pytestmark = pytest.mark.usefixtures("triton_on_cpu")
CL = torch.channels_last
F64 = torch.float64


def tol(dtype: torch.dtype) -> float:
    # Straight from the table: fp32 allows for tf32 dots on the GPU.
    return tolerance(dtype)


def _out_hw(h, w, k, s, p, d):
    return (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1


def _run(device, dtype, n, cin, h, w, cout, k, s, p, d, g, act, res, bias=True, **kw):
    x = torch.randn(n, cin, h, w, device=device, dtype=dtype).to(memory_format=CL)
    wt = torch.randn(cout, cin // g, k, k, device=device, dtype=dtype) / (cin // g * k * k) ** 0.5
    b = torch.randn(cout, device=device, dtype=dtype) if bias else None
    oh, ow = _out_hw(h, w, k, s, p, d)
    r = torch.randn(n, cout, oh, ow, device=device, dtype=dtype).to(memory_format=CL) if res else None
    out = torch.full((n, cout, oh, ow), float("nan"), device=device, dtype=dtype).to(memory_format=CL)
    got = conv2d(x, wt, b, stride=s, padding=p, dilation=d, groups=g, activation=act, residual=r, out=out, **kw)
    assert got is out and out.is_contiguous(memory_format=CL)
    want = ref.conv2d_reference(x, wt, b, stride=s, padding=p, dilation=d, groups=g, activation=act,
                                residual=r, compute_dtype=F64)
    assert rel_err(out, want) <= tol(dtype), (n, cin, h, w, cout, k, s, p, d, g, act, res)


CASES = [  # n, cin, h, w, cout, k, stride, pad, dil, groups, act, residual
    (1, 3, 9, 9, 7, 3, 2, 1, 1, 1, "relu", False),  # flat K (C=3): RGB-stem-like, strided
    (1, 3, 5, 9, 7, 7, 2, 3, 1, 1, "relu", False),  # 7x7/2 stem shape, tiny
    (2, 32, 5, 9, 33, 3, 1, 1, 1, 1, "silu", True),  # taps mode (C % 16 == 0), odd Cout
    (2, 33, 5, 5, 16, 1, 1, 0, 1, 1, None, True),  # plain GEMM 1x1, odd C
    (1, 16, 9, 5, 20, 1, 2, 0, 1, 1, "gelu", False),  # strided 1x1 (downsample): plain on a strided view
    (2, 24, 7, 10, 9, 1, 3, 0, 1, 1, "relu", True),  # strided 1x1 (3, odd H), residual
    (1, 7, 9, 9, 33, 3, 1, 2, 2, 1, "relu6", False),  # dilation, flat K
    (1, 8, 5, 5, 12, 3, 1, 1, 1, 2, "relu", True),  # grouped (2 groups), flat K
    (1, 7, 9, 9, 7, 3, 1, 2, 2, 7, "relu6", True),  # depthwise, dilated
    (2, 6, 9, 5, 12, 5, 2, 2, 1, 6, None, False),  # depthwise with channel multiplier 2
    (1, 33, 5, 5, 33, 3, 2, 1, 1, 33, "silu", False),  # depthwise 3x3/2, odd C
    (2, 3, 9, 11, 10, 4, 4, 0, 1, 1, "gelu", False),  # patchify (ViT's 16x16/16 embedding): fp16 on the matmul
    (1, 5, 8, 8, 7, 2, 2, 0, 1, 1, None, True),  # patchify, whole windows, residual
    (1, 5, 8, 8, 7, 2, 2, 0, 1, 1, "relu", True),  # patchify shape with act + residual: the implicit GEMM
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:10])))
def test_conv_matches_reference(device, dtype, case):
    _run(device, dtype, *case)


@pytest.mark.parametrize("zero", [0, -128], ids=["symmetric", "unsigned"])
@pytest.mark.parametrize("case", [CASES[7], CASES[9], CASES[2], CASES[3]], ids=["dw", "dw-s2", "taps", "plain"])
def test_int8_out(device, case, zero):
    """out_scale: the epilogue stores int8 for the next int8 layer. With fp32 x it quantizes exactly the value
    conv2d stores in fp32 (same kernel, same epilogue), so it equals quantize_int8 of that output."""
    from warpforge.kernels.quantize import quantize_int8

    n, cin, h, w, cout, k, s, p, d, g, act, res = case
    act = "relu6" if zero else act  # unsigned codes are for non-negative data
    x = torch.randn(n, cin, h, w, device=device).to(memory_format=CL)
    wt = torch.randn(cout, cin // g, k, k, device=device) / (cin // g * k * k) ** 0.5
    b = torch.randn(cout, device=device)
    oh, ow = _out_hw(h, w, k, s, p, d)
    r = torch.randn(n, cout, oh, ow, device=device).to(memory_format=CL) if res and not zero else None
    scale = torch.tensor([6.0 / 255 if zero else 0.02], device=device)
    out = torch.full((n, cout, oh, ow), 77, dtype=torch.int8, device=device).to(memory_format=CL)
    geo = dict(stride=s, padding=p, dilation=d, groups=g, activation=act, residual=r)
    assert conv2d(x, wt, b, out=out, out_scale=scale, out_zero_point=zero, **geo) is out
    y = conv2d(x, wt, b, **geo)
    assert torch.equal(out, quantize_int8(y, scale, zero_point=zero))
    want = ref.quantize_int8_reference(ref.conv2d_reference(x, wt, b, **geo), scale, zero)
    diff = (out.int() - want.int()).abs()  # fp32 summation order may break a rounding tie the other way
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    with pytest.raises(ValueError, match="out must be"):
        conv2d(x, wt, b, out=torch.empty_like(y), out_scale=scale, **geo)
    with pytest.raises(ValueError, match="out_zero_point applies to int8 out"):
        conv2d(x, wt, b, out_zero_point=-128, **geo)


def test_patchify_runs_on_the_matmul(device, monkeypatch):
    """stride == kernel, no padding, 16-bit: one gather + kernels.matmul; an activation with a residual stays
    on the implicit GEMM (it adds the residual first), and so does fp32."""
    calls, real = [], conv_mod._patch_gemm
    monkeypatch.setattr(conv_mod, "_patch_gemm", lambda *a: (calls.append(1), real(*a))[1])
    _run(device, torch.float16, 2, 3, 9, 11, 10, 4, 4, 0, 1, 1, "gelu", False)
    _run(device, torch.float16, 2, 3, 9, 11, 10, 4, 4, 0, 1, 1, None, True)
    assert calls == [1, 1]
    _run(device, torch.float16, 1, 5, 8, 8, 7, 2, 2, 0, 1, 1, "relu", True)
    _run(device, torch.float32, 1, 5, 8, 8, 7, 2, 2, 0, 1, 1, None, False)
    assert calls == [1, 1]


def test_residual_added_in_place(device):
    # out == residual (the bottleneck's identity buffer reused): each element is read before it is written.
    x = torch.randn(2, 16, 5, 5, device=device).to(memory_format=CL)
    w = torch.randn(16, 16, 1, 1, device=device) / 4
    r = torch.randn(2, 16, 5, 5, device=device).to(memory_format=CL)
    want = ref.conv2d_reference(x, w, residual=r, activation="relu", compute_dtype=F64)
    assert conv2d(x, w, residual=r, activation="relu", out=r) is r
    assert rel_err(r, want) <= tol(torch.float32)


def test_empty_batch(device):
    x = torch.randn(0, 8, 5, 5, device=device).to(memory_format=CL)
    got = conv2d(x, torch.randn(4, 8, 3, 3, device=device), padding=1)
    assert got.shape == (0, 4, 5, 5)


def test_no_bias_and_asymmetric_geometry(device):
    x = torch.randn(1, 16, 9, 7, device=device).to(memory_format=CL)
    wt = torch.randn(10, 16, 3, 1, device=device) / 7
    got = conv2d(x, wt, None, stride=(2, 1), padding=(1, 0), dilation=(1, 1))
    want = ref.conv2d_reference(x, wt, None, stride=(2, 1), padding=(1, 0), compute_dtype=F64)
    assert got.shape == want.shape and rel_err(got, want) <= tol(torch.float32)


@pytest.mark.parametrize("mode_case", [(3, 3), (32, 3), (33, 1)])  # flat K, taps, plain GEMM
@pytest.mark.parametrize("split_k", [1, 3])
def test_explicit_configs(device, mode_case, split_k):
    cin, k = mode_case
    # split 3 over 2..9 K steps: uneven shares, and for short K an empty share that must add zeros.
    _run(device, torch.float32, 1, cin, 5, 5, 17, k, 1, k // 2, 1, 1, "relu", True,
         config=ConvConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1, split_k=split_k))
    _run(device, torch.float32, 1, 8, 5, 5, 8, 3, 1, 1, 1, 8, None, True,
         config=DepthwiseConfig(block_p=4, block_c=2, num_warps=1))


@pytest.mark.parametrize("geo", [
    (48, 3, 1, 1, 4),  # C/BK = 3 chunks per tap, split 4 of 27 steps: shares start mid-tap (tap 2, chunk 1)
    (16, 7, 1, 3, 1),  # 7x7 = 49 taps: more than the 32-bit padding mask holds (per-step bounds test)
    (32, 5, 2, 4, 2),  # 5x5, dilation 2, every tap of a border pixel padded
])
def test_taps_loop_counters(device, geo):
    # The taps loop carries (tap, channel chunk) across K steps instead of dividing the step index, and
    # tests padding with a per-row mask of taps: a split share must start at the right (tap, chunk).
    cin, k, d, p, split = geo
    _run(device, torch.float32, 1, cin, 7, 6, 9, k, 1, p, d, 1, "relu", True,
         config=ConvConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1, split_k=split))


def test_split_k_grouped(device):
    _run(device, torch.float16, 2, 32, 5, 5, 34, 3, 1, 1, 1, 2, "silu", True, config=ConvConfig(16, 16, 16, split_k=4))


def test_split_k_candidates_only_for_few_tiles():
    from warpforge.kernels.conv_tuning import CONV_CONFIGS, _fits

    split = [c for c in CONV_CONFIGS if c.split_k > 1]
    assert split and all(_fits(c, 49, 512, 4608, 1) for c in split)  # batch 1, 7x7, 3x3 512->512
    assert not any(_fits(c, 32 * 56 * 56, 64, 576, 1) for c in split)  # batch 32: tiles fill the GPU
    # the tuner's budget per layer: at most 8 one-program-per-tile tilings (persistent ones: pointwise convs only)
    assert len([c for c in CONV_CONFIGS if not c.persistent]) <= 8


def test_weight_layouts_and_repack_cache(device):
    x = torch.randn(1, 16, 6, 6, device=device).to(memory_format=CL)
    w_nchw = torch.randn(8, 16, 3, 3, device=device)  # torch's default layout: repacked once, cached
    want = ref.conv2d_reference(x, w_nchw, padding=1, compute_dtype=F64)
    assert rel_err(conv2d(x, w_nchw, padding=1), want) <= tol(torch.float32)
    packed = conv_common._PREPARED[id(w_nchw)][2]
    conv2d(x, w_nchw, padding=1)
    assert conv_common._PREPARED[id(w_nchw)][2] is packed  # cache hit: no second repack
    with torch.no_grad():
        w_nchw.mul_(2)  # in-place change bumps the version: the cache must not serve stale values
    assert rel_err(conv2d(x, w_nchw, padding=1), 2 * want) <= tol(torch.float32)
    # prepare_conv_weight keeps shape and values; the kernels read it without a copy; F.conv2d accepts it.
    wp = prepare_conv_weight(w_nchw)
    assert wp.shape == w_nchw.shape and torch.equal(wp, w_nchw) and wp.is_contiguous(memory_format=CL)
    assert conv_common._prepared(wp, 1, False) is wp
    dw = torch.randn(16, 1, 3, 3, device=device)
    dwp = prepare_conv_weight(dw, groups=16)
    assert torch.equal(dwp, dw) and (dwp.stride(0), dwp.stride(2), dwp.stride(3)) == (1, 48, 16)
    assert conv_common._prepared(dwp, 16, True) is dwp
    assert torch.allclose(F.conv2d(x, dwp, padding=1, groups=16), F.conv2d(x, dw, padding=1, groups=16), atol=1e-5)
    got = conv2d(x, dwp, padding=1, groups=16)
    assert rel_err(got, ref.conv2d_reference(x, dw, padding=1, groups=16, compute_dtype=F64)) <= tol(torch.float32)
    del w_nchw, packed
    import gc

    gc.collect()
    assert not any(v[0]() is None for v in conv_common._PREPARED.values())  # freed weights leave the cache


def test_validation(device):
    x = torch.randn(1, 4, 6, 6, device=device).to(memory_format=CL)
    w = torch.randn(8, 4, 3, 3, device=device)
    with pytest.raises(ValueError, match="channels_last"):
        conv2d(x.contiguous(), w)
    with pytest.raises(ValueError, match="4-D"):
        conv2d(torch.randn(4, 6, 6, device=device), w)
    with pytest.raises(ValueError, match="x must have dtype"):
        conv2d(x.double(), w.double())
    with pytest.raises(ValueError, match="weight must match"):
        conv2d(x, w.half())
    with pytest.raises(ValueError, match="groups must be"):
        conv2d(x, w, groups=3)
    with pytest.raises(ValueError, match="weight must be"):
        conv2d(x, torch.randn(8, 3, 3, 3, device=device))
    with pytest.raises(ValueError, match="bias must be"):
        conv2d(x, w, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="stride"):
        conv2d(x, w, stride=0)
    with pytest.raises(ValueError, match="padding"):
        conv2d(x, w, padding=(1, -1))
    with pytest.raises(ValueError, match="too small"):
        conv2d(torch.randn(1, 4, 2, 2, device=device).to(memory_format=CL), w)
    with pytest.raises(ValueError, match="activation"):
        conv2d(x, w, activation="tanh")
    with pytest.raises(ValueError, match="residual must be channels_last"):
        conv2d(x, w, residual=torch.randn(1, 8, 4, 4, device=device))
    with pytest.raises(ValueError, match="residual must be"):
        conv2d(x, w, residual=torch.randn(1, 8, 6, 6, device=device).to(memory_format=CL))
    with pytest.raises(ValueError, match="out must not share memory with x"):
        conv2d(x, torch.randn(4, 4, 1, 1, device=device), out=x)
    with pytest.raises(ValueError, match="out must be"):
        conv2d(x, w, out=torch.empty(1, 8, 4, 4, device=device, dtype=torch.float16).to(memory_format=CL))


def test_cpu_dispatch_without_force_runs_reference():
    from warpforge.kernels import _dispatch

    prev, _dispatch._forced = _dispatch._forced, False
    try:
        x = torch.randn(2, 5, 7, 7).to(memory_format=CL)
        w, b = torch.randn(6, 5, 3, 3), torch.randn(6)
        r = torch.randn(2, 6, 4, 4).to(memory_format=CL)
        got = conv2d(x, w, b, stride=2, padding=1, activation="relu", residual=r)
        want = ref.conv2d_reference(x, w, b, stride=2, padding=1, activation="relu", residual=r, compute_dtype=F64)
        assert got.is_contiguous(memory_format=CL) and rel_err(got, want) <= tol(torch.float32)
    finally:
        _dispatch._forced = prev


def test_int8_x_is_refused_with_the_int8_conv_named():
    q = torch.zeros(1, 8, 5, 5, dtype=torch.int8).to(memory_format=CL)
    with pytest.raises(ValueError,
                       match=r"x must have dtype in .*got torch.int8 \(int8 x with int8 weights: conv2d_int8\)"):
        conv2d(q, torch.randn(8, 1, 3, 3, dtype=torch.float16), groups=8, padding=1)


# ---- GPU: ResNet-50 layer shapes, bf16, depthwise at MobileNet sizes --------------------------

RESNET_LAYERS = [  # cin, hw, cout, k, stride
    (3, 224, 64, 7, 2), (64, 56, 64, 1, 1), (64, 56, 64, 3, 1), (64, 56, 256, 1, 1), (256, 56, 128, 1, 1),
    (128, 56, 128, 3, 2), (256, 56, 512, 1, 2), (512, 28, 128, 1, 1), (256, 14, 256, 3, 1),
    (1024, 14, 2048, 1, 2), (512, 7, 512, 3, 1), (2048, 7, 512, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("layer", RESNET_LAYERS, ids=lambda layer: "x".join(map(str, layer)))
def test_gpu_resnet50_layers(dtype, batch, layer):
    cin, hw, cout, k, s = layer
    _run("cuda", dtype, batch, cin, hw, hw, cout, k, s, k // 2, 1, 1, "relu", k == 1 and s == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer", [(32, 112, 3, 1), (144, 56, 3, 2), (960, 7, 3, 1), (96, 56, 7, 1)])
def test_gpu_depthwise(dtype, layer):
    c, hw, k, s = layer
    _run("cuda", dtype, 8, c, hw, hw, c, k, s, k // 2, 1, c, "relu6", s == 1)


@pytest.mark.gpu
def test_gpu_grouped_and_odd_shapes():
    _run("cuda", torch.float16, 4, 256, 28, 28, 256, 3, 1, 1, 1, 32, "relu", False)  # ResNeXt-style groups
    _run("cuda", torch.float16, 3, 33, 17, 19, 65, 3, 2, 2, 2, 1, "silu", False)
    _run("cuda", torch.float32, 2, 64, 15, 15, 96, 3, 1, 1, 1, 1, "gelu", True)


def test_taps_mode_drops_k_steps_wider_than_the_channels():
    """MODE_TAPS: one K step never straddles two taps, so block_k above C/groups only multiplies zeros."""
    from warpforge.kernels.conv_tuning import ConvConfig, _fits
    from warpforge.kernels.conv_int8 import INT8_CONV_CONFIGS

    wide, narrow = ConvConfig(128, 128, 128, 8, 8, 4), ConvConfig(128, 128, 64, 8, 8, 4)
    default = INT8_CONV_CONFIGS[0]
    m = 32 * 56 * 56  # a 3x3 conv 64->256 at 56x56, batch 32: K = 576, 64 channels a step
    assert _fits(wide, m, 256, 576, 1, default)  # judged by the whole K, as before
    assert not _fits(wide, m, 256, 576, 1, default, k_tile=64) and _fits(narrow, m, 256, 576, 1, default, k_tile=64)
    assert _fits(wide, m, 256, 256 * 9, 1, default, k_tile=256)  # 256 channels fill a 128-wide step
    assert _fits(default, m, 256, 576, 1, default, k_tile=64)  # the default is always kept
    # every int8 tile shape the tuner offers for C >= 128 has a block_k 64 twin for C = 64
    shapes64 = {(c.block_m, c.block_n) for c in INT8_CONV_CONFIGS if c.block_k == 64 and c.split_k == 1}
    assert {(128, 128), (128, 64), (64, 128), (64, 64)} <= shapes64


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32])
def test_gpu_patchify_vit_embedding(batch):
    """ViT-B/16's 16x16/16 patch embedding on the matmul path at the batch sizes the vision suite runs
    (the batch-32 ViT build faulted on the H200 with this path and fuse_norm on, 2026-12-02: this isolates it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 224, 224, device="cuda", generator=g).half().contiguous(memory_format=CL)
    w = (torch.randn(768, 3, 16, 16, device="cuda", generator=g) / 28).half()
    b = torch.randn(768, device="cuda", generator=g).half()
    out = conv2d(x, w, b, stride=16)
    torch.cuda.synchronize()
    want = ref.conv2d_reference(x, w, b, stride=16, compute_dtype=F64)
    assert rel_err(out, want) <= tol(torch.float16)


S2D_CASES = [  # n, cin, h, w, cout, k, pad, act, residual: stride-2 stems on few channels, odd sizes
    (1, 3, 9, 11, 7, 7, 3, "relu", False),  # ResNet-50's 7x7/2, tiny
    (2, 3, 10, 9, 17, 3, 1, None, True),  # MobileNetV2 / EfficientNet's 3x3/2, residual
    (1, 4, 13, 12, 33, 5, 2, "silu", False),  # 4 channels fill the 16 s2d channels exactly
    (1, 1, 8, 8, 5, 7, 3, "relu6", True),  # grey image
    (1, 2, 7, 9, 64, 3, 0, "gelu", False),  # no padding
]


@pytest.mark.parametrize("case", S2D_CASES, ids=lambda c: "x".join(map(str, c[:7])))
def test_stem_runs_space_to_depth(device, case, monkeypatch):
    """A strided stem on <= 4 channels runs as a stride-1 conv over the space-to-depth input; the result
    matches the float64 reference."""
    calls, real = [], conv_mod._space_to_depth
    monkeypatch.setattr(conv_mod, "_space_to_depth", lambda *a: (calls.append(1), real(*a))[1])
    n, cin, h, w, cout, k, p, act, res = case
    _run(device, torch.float16, n, cin, h, w, cout, k, 2, p, 1, 1, act, res)
    assert calls == [1]


@pytest.mark.parametrize("case", [c for c in S2D_CASES if not c[8]], ids=lambda c: "x".join(map(str, c[:7])))
def test_image_stem_reads_fp32_nchw_as_given(device, case):
    """An image stem on the space-to-depth path takes the network's fp32 NCHW input as it is: the pack casts
    what it gathers, so the result is the 16-bit conv of the 16-bit cast image, bit for bit (the same
    kernels on the same values), and within the fp16 bar of float64 on the fp32 image; its output is
    fp16 channels_last. Other convs still ask for x channels_last in the weight's dtype."""
    n, cin, h, w, cout, k, p, act, _ = case
    x = torch.randn(n, cin, h, w, device=device)  # fp32, NCHW contiguous: not channels_last when cin > 1
    wt = (torch.randn(cout, cin, k, k, device=device) / (cin * k * k) ** 0.5).half()
    b = torch.randn(cout, device=device).half()
    assert conv_mod.reads_image(x, wt, 2, 1, 1)
    got = conv2d(x, wt, b, stride=2, padding=p, activation=act)
    same = conv2d(x.half().contiguous(memory_format=CL), wt, b, stride=2, padding=p, activation=act)
    assert got.dtype == torch.float16 and got.is_contiguous(memory_format=CL)
    assert torch.equal(got, same)
    want = ref.conv2d_reference(x.double(), wt.double(), b.double(), stride=2, padding=p, activation=act)
    assert rel_err(got, want) <= tol(torch.float16)
    assert not conv_mod.reads_image(x, wt, 1, 1, 1)  # stride 1: not a stem
    with pytest.raises(ValueError, match="weight must match x"):
        conv2d(x.contiguous(memory_format=CL), wt, b, stride=1, padding=p)
    with pytest.raises(ValueError, match="channels_last"):
        conv2d(x.half(), wt, b, stride=1, padding=p)


def test_space_to_depth_only_for_strided_stems(device, monkeypatch):
    """fp32 (no 16-bit tensor cores to gain), stride 1, 5+ channels, dilation, groups, a 1-wide kernel:
    all stay on the paths they had."""
    calls, real = [], conv_mod._space_to_depth
    monkeypatch.setattr(conv_mod, "_space_to_depth", lambda *a: (calls.append(1), real(*a))[1])
    _run(device, torch.float32, 1, 3, 9, 11, 7, 7, 2, 3, 1, 1, "relu", False)
    _run(device, torch.float16, 1, 3, 9, 9, 7, 3, 1, 1, 1, 1, "relu", False)
    _run(device, torch.float16, 1, 5, 9, 9, 7, 3, 2, 1, 1, 1, "relu", False)
    _run(device, torch.float16, 1, 3, 11, 11, 7, 3, 2, 2, 2, 1, None, False)
    _run(device, torch.float16, 1, 4, 9, 9, 6, 3, 2, 1, 1, 2, None, False)
    assert calls == []


def test_s2d_weight_is_the_same_conv():
    """The repacked weight on the packed input is the original conv, in float64 through torch alone."""
    x = torch.randn(2, 3, 11, 10, dtype=F64)
    w = torch.randn(5, 3, 7, 7, dtype=F64)
    want = F.conv2d(x, w, stride=2, padding=3)
    xp = F.pad(x, (3, 3 + (10 + 6) % 2, 3, 3 + (11 + 6) % 2))  # even size: whole 2x2 blocks
    n, c, hp, wp = xp.shape
    s2d = xp.reshape(n, c, hp // 2, 2, wp // 2, 2).permute(0, 3, 5, 1, 2, 4).reshape(n, 4 * c, hp // 2, wp // 2)
    s2d = F.pad(s2d, (0, 0, 0, 0, 0, 16 - 4 * c))  # channel (2a + b) * C + c, zero-padded to 16
    w2 = conv_stem.s2d_weight(w)  # [Cout, 16 * 4, 4, 1]: kernel row kh2 reads 4 adjacent s2d pixels
    assert w2.shape == (5, 64, 4, 1) and w2.is_contiguous(memory_format=CL)
    w4 = w2.reshape(5, 4, 16, 4).permute(0, 2, 3, 1)  # [Cout, 16, kh2, kw2]
    got = F.conv2d(s2d, w4)[:, :, :want.shape[2], :want.shape[3]]
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 3, 224, 224, 64, 7, 3), (3, 3, 225, 223, 32, 3, 1), (1, 3, 224, 224, 32, 3, 1)],
                         ids=["resnet50-stem-b32", "odd-3x3", "mnv2-stem-b1"])
def test_gpu_stem_space_to_depth(dtype, shape):
    n, cin, h, w, cout, k, p = shape
    _run("cuda", dtype, n, cin, h, w, cout, k, 2, p, 1, 1, "relu", False)


def test_strided_1x1_runs_plain(device, monkeypatch):
    """Strided 1x1 convs without padding run MODE_PLAIN over x[:, :, ::s, ::s] (a view, no copy)."""
    modes, real = [], conv_mod.launch_gemm
    monkeypatch.setattr(conv_mod, "launch_gemm", lambda *a, **k: (modes.append((a[6], a[5].stride, a[0].shape)),
                                                                  real(*a, **k))[1])
    _run(device, torch.float16, 2, 24, 7, 10, 9, 1, 3, 0, 1, 1, "relu", True)
    assert modes and all(m == (conv_mod.MODE_PLAIN, (1, 1), (2, 24, 3, 4)) for m in modes)
    modes.clear()
    _run(device, torch.float16, 1, 16, 9, 9, 8, 1, 2, 1, 1, 1, None, False)  # padded: the taps loop
    assert modes and all(m[0] == conv_mod.MODE_TAPS for m in modes)


class _FakeTuner:
    """Records what choose_gemm_config asks a Tuner: the bucket and the candidates its ``valid`` keeps."""

    def __init__(self, kernel, configs, pick):
        self.kernel, self.configs, self.pick, self.asked = kernel, configs, pick, []

    def choose(self, bucket, device, run, valid=None):
        kept = [c for c in self.configs if valid is None or valid(c)]
        self.asked.append((bucket, kept))
        return self.pick(kept)


@pytest.mark.parametrize("res_dtype", [torch.float16, torch.float32])
def test_residual_tuner_after_the_base(monkeypatch, res_dtype):
    """A pointwise conv with a residual: the base tuning (the key without a residual, which shipped
    winners serve) first, then the residual tuner under the key + the residual's dtype + the base, offered
    the base and the persistent tilings that fit (res_dot twins only for a 16-bit or int8 residual).
    A conv that is not pointwise: the base alone."""
    from warpforge.kernels import conv_tuning as cm
    from warpforge.kernels.conv_common import MODE_PLAIN, MODE_TAPS, _geometry

    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "_CHOSEN", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch
    x = torch.randn(32, 64, 56, 56).to(memory_format=CL)  # 100352 pixels: persistent tilings qualify
    out = torch.empty(32, 256, 56, 56).to(memory_format=CL)
    r = torch.empty(32, 256, 56, 56, dtype=res_dtype).to(memory_format=CL)
    g = _geometry(x, torch.randn(256, 64, 1, 1), None, 1, 0, 1, 1, None)
    base = cm.CONV_CONFIGS[0]
    main = _FakeTuner("t", cm.CONV_CONFIGS, lambda kept: base)
    res = _FakeTuner("t_res", cm.residual_candidates(cm.CONV_CONFIGS, cm.RESIDUAL_TILINGS), lambda kept: kept[-1])
    got = cm.choose_gemm_config(None, main, None, x, g, MODE_PLAIN, out, r, lambda c, d: None, res)
    plain = ("torch.float32", MODE_PLAIN, 131072, 256, 64, 1, 1, 1, 1)
    assert main.asked[0][0] == plain
    (key, kept), = res.asked
    assert key[:9] == plain and key[9] == f"res:{str(res_dtype).removeprefix('torch.')}" and key[10].startswith("base:")
    assert base in kept and all(c == base or c.persistent for c in kept)
    assert all(c.block_k >= 64 for c in kept if c.persistent)  # the whole K (64) in one tile
    assert {c.block_k for c in kept if c.persistent} == {64}  # not twice as deep (conv._fits)
    assert any(c.res_dot for c in kept) == (res_dtype == torch.float16)
    assert any(c in cm.RESIDUAL_TILINGS for c in kept)
    assert got == kept[-1]
    assert cm.choose_gemm_config(None, main, None, x, g, MODE_PLAIN, out, r, lambda c, d: None, res) == got
    assert len(res.asked) == 1  # remembered for the process

    g3 = _geometry(x, torch.randn(256, 64, 3, 3), None, 1, 1, 1, 1, None)  # a 3x3: not pointwise
    assert cm.choose_gemm_config(None, main, None, x, g3, MODE_TAPS, out, r, lambda c, d: None, res) == base
    assert len(res.asked) == 1


def test_narrow_tuner_after_the_base(monkeypatch):
    """A narrow conv (MobileNetV2's 144->24 projection with its skip): the base tuning first (only the default
    fits so narrow an output), then the narrow tuner under the key + the residual's dtype + the base, offered
    the base and the narrow tilings that fit (persistent ones only where the whole K fits one tile); the
    residual tuner is not asked. A conv wider than NARROW_COUT, or one with fewer than NARROW_MIN_M output
    pixels: not asked."""
    from warpforge.kernels import conv_tuning as cm
    from warpforge.kernels.conv_common import MODE_PLAIN, _geometry

    monkeypatch.setattr(cm, "INTERPRET", False)
    monkeypatch.setattr(cm, "_CHOSEN", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU-only torch
    x = torch.randn(32, 144, 56, 56).to(memory_format=CL)
    out = torch.empty(32, 24, 56, 56, dtype=torch.float16).to(memory_format=CL)
    r = torch.empty(32, 24, 56, 56, dtype=torch.float16).to(memory_format=CL)
    g = _geometry(x, torch.randn(24, 144, 1, 1), None, 1, 0, 1, 1, None)
    base = cm.CONV_CONFIGS[0]
    main = _FakeTuner("t", cm.CONV_CONFIGS, lambda kept: kept[0])
    res = _FakeTuner("t_res", cm.residual_candidates(cm.CONV_CONFIGS, cm.RESIDUAL_TILINGS), lambda kept: kept[-1])
    narrow = _FakeTuner("t_narrow", [base] + cm.NARROW_TILINGS, lambda kept: kept[-1])
    got = cm.choose_gemm_config(None, main, None, x, g, MODE_PLAIN, out, r, lambda c, d: None, res, narrow)
    plain = ("torch.float32", MODE_PLAIN, 131072, 24, 144, 1, 1, 1, 1)
    (bucket, main_kept), = main.asked
    assert bucket == plain and main_kept == [base]  # nothing but the default is narrow enough
    (key, kept), = narrow.asked
    assert key == plain + ("res:float16", "base:" + cm._tag(base)) and res.asked == []
    assert kept[0] == base and all(c.block_n <= 32 for c in kept[1:])
    assert kept[1:] == [c for c in cm.NARROW_TILINGS if not c.persistent]  # K = 144 fits no persistent tile
    assert got == kept[-1]
    assert cm.choose_gemm_config(None, main, None, x, g, MODE_PLAIN, out, r, lambda c, d: None, res, narrow) == got
    assert len(narrow.asked) == 1  # remembered for the process

    wide = _geometry(x, torch.randn(64, 144, 1, 1), None, 1, 0, 1, 1, None)
    cm.choose_gemm_config(None, main, None, x, wide, MODE_PLAIN, out, None, lambda c, d: None, res, narrow)
    assert len(narrow.asked) == 1
    # 32->16 @112 at batch 32: K = 32 fits the persistent tile; at batch 1 (12544 pixels < NARROW_MIN_M) the
    # forward is launch-bound and the narrow tuner is not asked
    for n, asked in ((32, 2), (1, 2)):
        x1 = torch.randn(n, 32, 112, 112).to(memory_format=CL)
        o1 = torch.empty(n, 16, 112, 112, dtype=torch.float16).to(memory_format=CL)
        g1 = _geometry(x1, torch.randn(16, 32, 1, 1), None, 1, 0, 1, 1, None)
        cm.choose_gemm_config(None, main, None, x1, g1, MODE_PLAIN, o1, None, lambda c, d: None, res, narrow)
        assert len(narrow.asked) == asked
    (key1, kept1) = narrow.asked[1]
    assert key1[-2] == "res:None" and any(c.persistent for c in kept1)
    assert all(c.block_k <= 32 for c in kept1[1:] if not c.persistent)  # no K tile deeper than K


# MobileNetV2's narrow convs at test sizes (odd H, W and Cout): n, cin, h, w, cout, k, s, p, d, g, act, residual
NARROW_CASES = [
    (2, 32, 15, 17, 16, 1, 1, 0, 1, 1, None, False),  # 32->16 projection
    (2, 144, 9, 11, 24, 1, 1, 0, 1, 1, None, True),  # 144->24 projection + skip
    (1, 96, 7, 9, 20, 1, 1, 0, 1, 1, None, False),  # odd Cout
    (2, 3, 29, 31, 32, 3, 2, 1, 1, 1, "relu6", False),  # the 3->32 stem: space-to-depth, 12 channels per tap
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", conv_mod.NARROW_TILINGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_narrow_tilings(dtype, config):
    for case in NARROW_CASES:
        if config.persistent and (case[5] != 1 or case[1] > config.block_k):
            continue  # persistent tilings serve 1x1 convs whose K fits one tile (conv._fits)
        _run("cuda", dtype, *case, config=config)


def test_res_dot_names_itself_only_when_set():
    """ConvConfig.res_dot stays out of the repr unless set (the tuners' candidate hashes, and so the shipped
    winners, are what they were), and belongs to persistent tilings only."""
    c = ConvConfig(64, 64, 64, 8, 4, 3, persistent=4)
    assert "res_dot" not in repr(c)
    assert "res_dot=True" in repr(ConvConfig(64, 64, 64, 8, 4, 3, persistent=4, res_dot=True))
    with pytest.raises(ValueError, match="res_dot"):
        ConvConfig(64, 64, 64, res_dot=True)
