"""The persistent pointwise conv kernel (ConvConfig.persistent > 0): 1x1 convs without padding whose whole K
is one tile, each program walking many M tiles, against the references of conv2d (float64) and
conv2d_int8 (exact int32 accumulation, then the fp32 epilogue: bit for bit on the interpreter).

The interpreter's "SM count" is 2 (kernels/conv_pointwise.py, _sm_count), so with a few dozen M tiles every
program walks several of them, and programs sharing output channels interleave: a wrong tile stride, a
tile visited twice or never, or weights loaded for the wrong channel block all show. Odd sizes everywhere:
M not a multiple of the tile, C below the pow2 K tile (masked channels), Cout not a multiple of BN.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from warpforge.kernels import conv_pointwise
from warpforge.kernels import reference as ref
from warpforge.kernels.conv import CONV_CONFIGS, ConvConfig, conv2d
from warpforge.kernels.conv_pointwise import _tma_epilogue
from warpforge.kernels.conv_tuning import _fits
from warpforge.kernels.conv_int8 import INT8_CONV_CONFIGS, conv2d_int8
from warpforge.kernels.tolerance import rel_err, tolerance

from .test_conv_int8 import _int8, _poisoned, _problem, assert_conv_int8_close

CL = torch.channels_last
F64 = torch.float64
# 16-row tiles: M = 2*7*9 = 126 pixels are 8 M tiles, 2 SMs x persistent programs walk them.
PW16 = ConvConfig(16, 16, 64, 1, 4, 2, persistent=1)
PW16_2 = ConvConfig(16, 32, 64, 1, 4, 1, persistent=2)
PW32 = ConvConfig(32, 16, 32, 1, 4, 1, persistent=3)  # block_k 32: the int8 MMA's K

CASES = [  # n, cin, h, w, cout, stride, act, residual
    (2, 40, 7, 9, 37, 1, "relu", True),  # C 40 of a 64-wide K tile, Cout 37 of 16-wide tiles, residual
    (1, 33, 9, 7, 5, 1, None, True),  # MobileNetV2's projection + skip: odd C, Cout below one tile
    (2, 16, 9, 9, 17, 2, "relu6", False),  # strided 1x1 (ResNet's downsample), C == 16
    (1, 64, 5, 11, 48, 1, "silu", False),  # C fills the K tile exactly (EVEN_C)
    (2, 40, 7, 9, 48, 1, "relu", True),  # Cout 48: 16-byte rows, so the residual and out go through TMA
]
IDS = ["c40-res", "c33-proj", "stride2", "even-c", "c40-res-tma"]


@pytest.mark.parametrize("config", [PW16, PW16_2], ids=["p1", "p2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pointwise_conv2d_matches_reference(triton_on_cpu, device, dtype, case, config):
    n, cin, h, w, cout, s, act, res = case
    x = torch.randn(n, cin, h, w, device=device, dtype=dtype).to(memory_format=CL)
    wt = torch.randn(cout, cin, 1, 1, device=device, dtype=dtype) / cin ** 0.5
    b = torch.randn(cout, device=device, dtype=dtype)
    oh, ow = (h - 1) // s + 1, (w - 1) // s + 1
    r = torch.randn(n, cout, oh, ow, device=device, dtype=dtype).to(memory_format=CL) if res else None
    out = torch.full((n, cout, oh, ow), float("nan"), device=device, dtype=dtype).to(memory_format=CL)
    got = conv2d(x, wt, b, stride=s, activation=act, residual=r, out=out, config=config)
    assert got is out and not torch.isnan(out).any(), "unwritten (NaN) outputs"
    want = ref.conv2d_reference(x, wt, b, stride=s, activation=act, residual=r, compute_dtype=F64)
    assert rel_err(out, want) <= tolerance(dtype), case


def test_pointwise_int8_out_of_float_x(triton_on_cpu, device, gen):
    """conv2d's out_scale (fp16 x, int8 out) through the persistent kernel equals quantizing its float output."""
    from warpforge.kernels.quantize import quantize_int8

    x = torch.randn(2, 40, 7, 9, generator=gen).to(device).to(memory_format=CL)
    wt = torch.randn(37, 40, 1, 1, generator=gen).to(device) / 40 ** 0.5
    scale = torch.tensor([6.0 / 255], device=device)
    y = conv2d(x, wt, activation="relu6", config=PW16)
    q = conv2d(x, wt, activation="relu6", out_scale=scale, out_zero_point=-128, config=PW16)
    assert torch.equal(q, quantize_int8(y, scale, zero_point=-128))


# every case with the 64-wide K tile; with the 32-wide one the cases whose C fits it (the tuner never offers a
# tiling whose K tile is narrower than C: test_pointwise_fits)
INT8_PAIRS = [(c, cfg) for cfg in (PW16, PW32) for c in CASES if c[1] <= cfg.block_k]
INT8_IDS = [f"{i}-bk{cfg.block_k}" for (c, cfg) in INT8_PAIRS for i in [IDS[CASES.index(c)]]]


@pytest.mark.parametrize("x_zero", [0, -128], ids=["signed", "unsigned"])
@pytest.mark.parametrize("out_kind", ["float16", "float32", "int8"])
@pytest.mark.parametrize(("case", "config"), INT8_PAIRS, ids=INT8_IDS)
def test_pointwise_conv2d_int8_matches_reference(triton_on_cpu, device, gen, case, out_kind, x_zero, config):
    n, cin, h, w, cout, s, act, res = case
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, n, cin, h, w, cout, 1, s, 0, 1, 1, res, x_zero=x_zero)
    geo = dict(stride=s, activation=act, residual=r, x_zero_point=x_zero, config=config)
    if out_kind == "int8":
        os_ = torch.tensor([0.03], device=device)
        out = _poisoned(shape, torch.int8, device)
        if x_zero:
            out.fill_(77)
        got = conv2d_int8(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=x_zero, out=out, **geo)
        want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=x_zero,
                                         **{k: v for k, v in geo.items() if k != "config"})
    else:
        dtype = getattr(torch, out_kind)
        out = _poisoned(shape, dtype, device)
        got = conv2d_int8(x, wq, xs, ws, bias, out_dtype=dtype, out=out, **geo)
        want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_dtype=dtype,
                                         **{k: v for k, v in geo.items() if k != "config"})
    assert got is out
    assert_conv_int8_close(out, want, act)


def _int8_residual_problem(gen, device, size, res_zero):
    """Unsigned int8 x (n, cin, h, w; 1x1 to cout), an int8 residual at zero point res_zero with its float
    value r_f, an int8 out scale, and the conv's keyword arguments (relu)."""
    n, cin, h, w, cout = size
    x, wq, xs, ws, bias, _, shape = _problem(gen, device, n, cin, h, w, cout, 1, 1, 0, 1, 1, False, x_zero=-128)
    r_q = _int8(shape, gen, device, lo=-128 if res_zero else -127).to(memory_format=CL)
    rs = torch.tensor([0.017], device=device)
    r_f = ((r_q.float() - res_zero) * rs).to(memory_format=CL)
    os_ = torch.tensor([0.03], device=device)
    return x, wq, xs, ws, bias, shape, r_q, rs, r_f, os_, dict(x_zero_point=-128, activation="relu")


@pytest.mark.parametrize("res_zero", [0, -128], ids=["signed-res", "unsigned-res"])
def test_pointwise_int8_residual_and_dual_out(triton_on_cpu, device, gen, res_zero):
    """The int8 residual stream and the float + int8 pair (out_q), both from the persistent kernel's epilogue."""
    x, wq, xs, ws, bias, shape, r_q, rs, r_f, os_, geo = _int8_residual_problem(gen, device, (2, 40, 5, 7, 33),
                                                                                res_zero)
    out = _poisoned(shape, torch.int8, device).fill_(77)
    conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=rs, residual_zero_point=res_zero, out_scale=os_,
                out_zero_point=-128, out=out, config=PW16, **geo)
    assert_conv_int8_close(out, ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r_f, out_scale=os_,
                                                          out_zero_point=-128, **geo), "relu")
    r16 = r_f.half()
    out16, out_q = _poisoned(shape, torch.float16, device), _poisoned(shape, torch.int8, device).fill_(77)
    conv2d_int8(x, wq, xs, ws, bias, residual=r16, out_scale=os_, out_zero_point=-128, out_dtype=torch.float16,
                out=out16, out_q=out_q, config=PW16_2, **geo)
    assert_conv_int8_close(out16, ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r16,
                                                            out_dtype=torch.float16, **geo), "relu")
    assert_conv_int8_close(out_q, ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r16, out_scale=os_,
                                                            out_zero_point=-128, **geo), "relu")


def test_tma_epilogue_where_rows_allow(triton_on_cpu, device):
    """The TMA epilogue serves an output (and residual) whose [M, Cout] rows are 16-byte multiples, one
    output; else the per-element epilogue (an empty dict: no descriptors, TMA_EPI off)."""
    def cl(c, dtype):
        return torch.empty(2, c, 7, 9, device=device, dtype=dtype).to(memory_format=CL)
    m = 2 * 7 * 9
    d = _tma_epilogue(cl(48, torch.int8), cl(48, torch.int8), None, m, 48, PW16)
    assert d["TMA_EPI"] and {"o_desc", "r_desc"} <= set(d)
    assert list(d["o_desc"].shape) == [m, 48] and list(d["o_desc"].block_shape) == [16, 16]
    assert "r_desc" not in _tma_epilogue(cl(48, torch.float16), None, None, m, 48, PW16)
    assert _tma_epilogue(cl(24, torch.int8), None, None, m, 24, PW16) == {}  # 24-byte rows
    assert _tma_epilogue(cl(48, torch.float16), None, cl(48, torch.int8), m, 48, PW16) == {}  # dual out
    nchw = torch.empty(2, 48, 7, 9, device=device, dtype=torch.float16)  # not channels_last: no [M, Cout] view
    assert _tma_epilogue(nchw, None, None, m, 48, PW16) == {}


# (TMA epilogue, residual through the MMA with the identity): the pointer epilogue (where no descriptor can
# serve), TMA residual and output, and ConvConfig.res_dot with either output path
EPILOGUES = {"ptr": (False, False), "tma": (True, False), "dot-tma": (True, True), "dot-ptr": (False, True)}


@pytest.mark.parametrize("res_zero", [0, -128], ids=["signed-res", "unsigned-res"])
@pytest.mark.parametrize("config", [PW16, PW16_2], ids=["p1", "p2"])
def test_pointwise_epilogues_agree(triton_on_cpu, device, gen, monkeypatch, config, res_zero):
    """Int8 in, int8 residual, int8 out (the folded epilogue) and fp16 out, Cout 48 (TMA rows), M = 126 (the
    last tile clipped; 8 M tiles, so each program walks several): the same codes from every epilogue in
    EPILOGUES, and the reference's."""
    x, wq, xs, ws, bias, shape, r_q, rs, r_f, os_, geo = _int8_residual_problem(gen, device, (2, 40, 7, 9, 48),
                                                                                res_zero)
    outs, real = {}, conv_pointwise._tma_epilogue
    for name, (tma, dot) in EPILOGUES.items():
        monkeypatch.setattr(conv_pointwise, "_tma_epilogue", real if tma else lambda *a: {})
        cfg = replace(config, res_dot=dot)
        out = _poisoned(shape, torch.int8, device).fill_(77)
        conv2d_int8(x, wq, xs, ws, bias, residual=r_q, residual_scale=rs, residual_zero_point=res_zero,
                    out_scale=os_, out_zero_point=-128, out=out, config=cfg, **geo)
        out16 = _poisoned(shape, torch.float16, device)
        conv2d_int8(x, wq, xs, ws, bias, residual=r_f.half(), out_dtype=torch.float16, out=out16, config=cfg,
                    **geo)
        outs[name] = (out, out16)
    for name in EPILOGUES:
        assert torch.equal(outs[name][0], outs["ptr"][0]) and torch.equal(outs[name][1], outs["ptr"][1]), name
    assert_conv_int8_close(outs["ptr"][0], ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r_f,
                                                                     out_scale=os_, out_zero_point=-128, **geo),
                           "relu")
    assert_conv_int8_close(outs["ptr"][1], ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r_f.half(),
                                                                     out_dtype=torch.float16, **geo), "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pointwise_res_dot_float(triton_on_cpu, device, dtype):
    """RES_DOT on float convs: an fp16 residual through the MMA with the identity gives the same outputs as
    the epilogue's load (exact: one non-zero term per sum); an fp32 one keeps the load (tf32 would round it)."""
    n, cin, h, w, cout, s, act, res = CASES[4]
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, cin, h, w, generator=gen).to(device, dtype).to(memory_format=CL)
    wt = (torch.randn(cout, cin, 1, 1, generator=gen) / cin ** 0.5).to(device, dtype)
    b = torch.randn(cout, generator=gen).to(device, dtype)
    r = (torch.randn(n, cout, h, w, generator=gen) * 3).to(device, dtype).to(memory_format=CL)
    outs = []
    for dot in (False, True):
        out = torch.full((n, cout, h, w), float("nan"), device=device, dtype=dtype).to(memory_format=CL)
        outs.append(conv2d(x, wt, b, activation=act, residual=r, out=out, config=replace(PW16_2, res_dot=dot)))
    assert torch.equal(outs[0], outs[1])
    want = ref.conv2d_reference(x, wt, b, activation=act, residual=r, compute_dtype=F64)
    assert rel_err(outs[1], want) <= tolerance(dtype)


@pytest.mark.parametrize("x_zero", [0, -128], ids=["signed", "unsigned"])
def test_pointwise_f16_mma(triton_on_cpu, device, gen, x_zero):
    """f16_mma (int8 codes on fp16 tensor cores) in the persistent kernel: the zero point taken out before
    the MMA, as in the implicit GEMM."""
    cfg = ConvConfig(16, 16, 64, 1, 4, 1, f16_mma=True, persistent=2)
    x, wq, xs, ws, bias, r, shape = _problem(gen, device, 2, 40, 7, 9, 37, 1, 1, 0, 1, 1, True, x_zero=x_zero)
    out = _poisoned(shape, torch.float32, device)
    conv2d_int8(x, wq, xs, ws, bias, residual=r, activation="relu", out_dtype=torch.float32, out=out, config=cfg,
                x_zero_point=x_zero)
    assert_conv_int8_close(out, ref.conv2d_int8_reference(x, wq, xs, ws, bias, residual=r, activation="relu",
                                                          out_dtype=torch.float32, x_zero_point=x_zero), "relu")


def test_pointwise_validation(triton_on_cpu, device, gen):
    x = torch.randn(1, 40, 5, 5, device=device).to(memory_format=CL)
    with pytest.raises(ValueError, match="1x1 convs without padding"):
        conv2d(x, torch.randn(8, 40, 3, 3, device=device), padding=1, config=PW16)
    with pytest.raises(ValueError, match="1x1 convs without padding"):
        conv2d(x, torch.randn(8, 40, 1, 1, device=device), padding=1, config=PW16)
    with pytest.raises(ValueError, match="C=40 exceeds its block_k=32"):
        conv2d(x, torch.randn(8, 40, 1, 1, device=device), config=PW32)
    with pytest.raises(ValueError, match="persistent must be in"):
        ConvConfig(64, 64, 64, persistent=9)
    with pytest.raises(ValueError, match="persistent takes split_k=1"):
        ConvConfig(64, 64, 64, split_k=2, persistent=1)


def test_pointwise_fits():
    """The tuner offers a persistent tiling only to pointwise convs whose C fits its K tile, and not to a C
    that a tiling of half the K tile (or the 64-wide one) holds."""
    pw = [c for c in CONV_CONFIGS if c.persistent]
    assert pw and all(c.split_k == 1 for c in pw)
    m = 32 * 56 * 56
    fit = {c.block_k for c in pw if _fits(c, m, 256, 64, 1, pointwise=True)}
    assert fit == {64}
    assert {c.block_k for c in pw if _fits(c, m, 256, 256, 1, pointwise=True)} == {256}
    assert not any(_fits(c, m, 256, 64, 1, pointwise=False) for c in pw)  # a 3x3 conv, or padded
    assert not any(_fits(c, m, 256, 512, 1, pointwise=True) for c in pw)  # C beyond every K tile
    int8_pw = [c for c in INT8_CONV_CONFIGS if c.persistent]
    assert {c.block_k for c in int8_pw if _fits(c, m, 256, 128, 1, INT8_CONV_CONFIGS[0], pointwise=True)} == {128}


def test_pointwise_not_offered_to_few_tiles():
    """Batch 1 (ResNet's 56x56 64->256: 25 x 2 tiles of 128): one program per tile already fills the GPU's
    SMs once; a persistent candidate there would only cost a compile."""
    assert not any(_fits(c, 56 * 56, 256, 64, 1, pointwise=True) for c in CONV_CONFIGS if c.persistent)


# ---- GPU: every persistent candidate at ResNet-50 / MobileNetV2 batch-32 pointwise shapes -------------
GPU_CASES = [  # n, cin, h, w, cout, stride, act, residual
    (32, 64, 56, 56, 256, 1, "relu", True),  # ResNet layer1's last conv + identity
    (32, 256, 56, 56, 64, 1, "relu", False),
    (32, 128, 28, 28, 512, 1, "relu", True),
    (32, 256, 56, 56, 512, 2, None, False),  # the downsample shortcut (strided)
    (32, 24, 56, 56, 144, 1, "relu6", False),  # MobileNetV2's expansion, C 24 of a 32/64-wide tile
    (31, 40, 29, 27, 37, 1, "silu", True),  # odd everything
]


def _gpu_cases(config: ConvConfig):
    """The GPU cases whose C fits the tiling's K tile."""
    return [c for c in GPU_CASES if c[1] <= config.block_k]


@pytest.mark.gpu
@pytest.mark.parametrize("res_dot", [False, True], ids=["res-load", "res-dot"])
@pytest.mark.parametrize("config", [c for c in CONV_CONFIGS if c.persistent], ids=str)
def test_gpu_pointwise_every_fp16_candidate(config, res_dot):
    config = replace(config, res_dot=res_dot)
    gen = torch.Generator().manual_seed(5)
    for n, cin, h, w, cout, s, act, res in _gpu_cases(config):
        x = torch.randn(n, cin, h, w, generator=gen).cuda().half().to(memory_format=CL)
        wt = (torch.randn(cout, cin, 1, 1, generator=gen) / cin ** 0.5).cuda().half()
        b = torch.randn(cout, generator=gen).cuda().half()
        oh, ow = (h - 1) // s + 1, (w - 1) // s + 1
        r = torch.randn(n, cout, oh, ow, generator=gen).cuda().half().to(memory_format=CL) if res else None
        out = torch.full((n, cout, oh, ow), float("nan"), device="cuda", dtype=torch.float16).to(memory_format=CL)
        conv2d(x, wt, b, stride=s, activation=act, residual=r, out=out, config=config)
        want = ref.conv2d_reference(x, wt, b, stride=s, activation=act, residual=r, compute_dtype=torch.float32)
        assert not torch.isnan(out).any() and rel_err(out, want) <= tolerance(torch.float16), (config, cin, cout)


@pytest.mark.gpu
@pytest.mark.parametrize("res_dot", [False, True], ids=["res-load", "res-dot"])
@pytest.mark.parametrize("config", [c for c in INT8_CONV_CONFIGS if c.persistent], ids=str)
def test_gpu_pointwise_every_int8_candidate(config, res_dot):
    config = replace(config, res_dot=res_dot)
    gen = torch.Generator().manual_seed(6)
    for n, cin, h, w, cout, s, act, res in _gpu_cases(config):
        for x_zero, out_kind in [(-128, "int8"), (0, "float16")]:
            x, wq, xs, ws, bias, r, shape = _problem(gen, "cuda", n, cin, h, w, cout, 1, s, 0, 1, 1, res,
                                                     x_zero=x_zero)
            geo = dict(stride=s, activation=act, residual=r, x_zero_point=x_zero)
            if out_kind == "int8":
                os_ = torch.tensor([0.03], device="cuda")
                out = _poisoned(shape, torch.int8, "cuda").fill_(77)
                conv2d_int8(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=-128, out=out, config=config, **geo)
                want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_scale=os_, out_zero_point=-128, **geo)
            else:
                out = _poisoned(shape, torch.float16, "cuda")
                conv2d_int8(x, wq, xs, ws, bias, out_dtype=torch.float16, out=out, config=config, **geo)
                want = ref.conv2d_int8_reference(x, wq, xs, ws, bias, out_dtype=torch.float16, **geo)
            assert_conv_int8_close(out, want, act)
