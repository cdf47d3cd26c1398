"""``conv2d_int8``: W8A8 convolution on channels_last tensors, exact int32 accumulation, fused epilogue.

    y = act(float(conv2d(x_q - x_zero_point, w_q)) * (x_scale * w_scale[co]) + bias + residual)
    out = y in out_dtype (fp16 by default), or with out_scale: int8 y quantized as ``quantize_int8`` does

x_q is int8 [N, C, H, W] channels_last, quantized with one static scale (``quantize_int8``,
kernels/quantize.py): symmetric (zero point 0), or unsigned (zero point -128, x = x_scale * (x_q + 128),
one more bit for data >= 0 such as a ReLU's output). w_q is int8 [Cout, C/groups, KH, KW] quantized per
output channel (symmetric, w_scale [Cout]). With zero point -128 the kernel reads padding as -128 (x = 0)
and subtracts -128 * sum(w_q[co]) (``w_sum``) from the accumulator, so the conv of (x_q + 128) stays exact.

It launches the implicit-GEMM kernel of kernels/conv_gemm.py with ``INT_ACC=True``: int8 tiles into
``tl.dot`` with an int32 accumulator (exact: the s8 tensor-core MMA on the GPU), converted to fp32 once,
in the epilogue. ``out_scale`` fuses the next int8 layer's input quantization into this
epilogue: an int8 activation is half the bytes of an fp16 one, for this store and the next layer's loads.
With int8 out and no activation, ReLU or ReLU6, the epilogue folds every per-channel factor into one FMA
per element and takes the activation as the clamp's bounds (``kernels.conv_epilogue._epilogue_factors``): the same
codes as dequantize -> activation -> requantize up to a rounding tie, in fewer instructions per element.

Depthwise convs (groups == C) are refused: a 3x3 depthwise conv does 9 MACs per loaded value, so it is
memory-bound and int8 tensor cores gain it little; it stays on ``conv2d`` (fp16). Other group counts
run the implicit GEMM per group.
"""

from __future__ import annotations

import weakref

import torch

from warpforge.kernels import reference as ref
from warpforge.kernels._autotune import Tuner
from warpforge.kernels._dispatch import use_triton
from warpforge.kernels.activation import ACTIVATIONS
from warpforge.kernels.conv_common import (MODE_TAPS, _check_out, _geometry, _into, _is_depthwise, _prepared,
                                           _shares_storage, gemm_mode, strided_pointwise)
from warpforge.kernels.conv_gemm import launch_gemm
from warpforge.kernels.conv_stem import _s2d_ok, _space_to_depth
from warpforge.kernels.conv_tuning import ConvConfig, choose_gemm_config, residual_candidates
from warpforge.kernels.quantize import check_scale, check_zero_point

FLOAT_OUT = (torch.float16, torch.bfloat16, torch.float32)
# |conv(x_q - zero_point, w_q)| <= K * 255 * 128 must stay below 2^31: K = KH * KW * C/groups up to 65793.
MAX_K = (2 ** 31 - 1) // (255 * 128)
# What a padded pixel of unsigned x (zero point -128) reads in the taps loop: one row of -128s, at least
# C/groups long (C/groups <= MAX_K), made once per device (kernels/conv_gemm.py, MODE_TAPS).
PAD_ROW_LEN = -(-MAX_K // 16) * 16
_PAD_ROWS: dict[tuple[str, int], torch.Tensor] = {}


def _pad_row(device: torch.device, zero_point: int) -> torch.Tensor:
    key = (str(device), zero_point)
    row = _PAD_ROWS.get(key)
    if row is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A fill recorded in a graph has not run yet: eager calls would read garbage.
            raise RuntimeError("conv2d_int8 with x_zero_point=-128 makes its padding row on the first call; "
                               "run it once outside CUDA-graph capture first (a warm-up call)")
        row = torch.full((PAD_ROW_LEN,), zero_point, dtype=torch.int8, device=device)
        _PAD_ROWS[key] = row
    return row

# int8 is half fp16's bytes: the fp16 candidates (kernels/conv_tuning.py) with block_k doubled to 128, the same
# shared memory per stage; every block_k >= 32, the s8 MMA's K. Each compiles for sm_90 without spills
# (tests/kernels/sm90_compile.py --all); fp16's (128, 256, 64) twin spilled and became (128, 128, 128), 4 stages.
# Triton 3.6 keeps a wgmma in flight across K steps only with an fp32 accumulator, so every int8 config waits
# for its MMA before the next step's loads; configs holding 2-5 blocks per SM (BN or BM 64, 4 warps) let
# another block's MMA fill that gap.
INT8_CONV_CONFIGS = [
    ConvConfig(128, 128, 128, 8, 8, 3),
    ConvConfig(128, 64, 128, 8, 4, 4),
    ConvConfig(64, 128, 128, 8, 4, 4),
    ConvConfig(128, 128, 128, 8, 8, 4),
    ConvConfig(64, 64, 128, 8, 4, 4),
    ConvConfig(64, 64, 32, 8, 4, 5),  # small Cout and short K (the RGB stem: K = 27)
    # block_k 64 twins for C/groups <= 64 (ResNet-50's layer1, MobileNetV2's 1x1s): a 128-wide K step
    # there is half zeros in as many steps (the tuner drops it for those layers, see conv_tuning._fits).
    ConvConfig(128, 128, 64, 8, 8, 4),
    ConvConfig(128, 64, 64, 8, 4, 4),
    ConvConfig(64, 128, 64, 8, 4, 4),
    ConvConfig(64, 64, 64, 8, 4, 5),
    # Batch-1 late layers (7x7 and 14x14 outputs, long K): too few output tiles to fill 132 SMs.
    ConvConfig(64, 64, 128, 8, 4, 4, split_k=4),
    ConvConfig(32, 64, 128, 4, 4, 4, split_k=8),
    # f16_mma twins of the fp16 tilings: int8 loads (half fp16's activation bytes), the codes converted to
    # fp16 in registers, fp16 tensor cores with the MMA in flight across K steps (sm_90 offline: mma_async,
    # no spill; (128, 128, 64) 172 registers and 1 block per SM, (128, 64, 64) 144-168 and 3, (64, 128, 64)
    # 148-167 and 2, (64, 64, 64) 90-96 and 5). At ~23% of the fp16 roof the convs are not MMA-bound.
    ConvConfig(128, 128, 64, 8, 8, 3, f16_mma=True),
    ConvConfig(128, 64, 64, 8, 4, 4, f16_mma=True),
    ConvConfig(64, 128, 64, 8, 4, 4, f16_mma=True),
    ConvConfig(64, 64, 64, 8, 4, 4, f16_mma=True),
    ConvConfig(64, 64, 32, 8, 4, 5, f16_mma=True),
    # Persistent pointwise tilings (1x1 convs, C <= block_k), ``persistent`` = the blocks one SM holds
    # (sm90_compile.py --all, every epilogue above and the int8 residual: no spills; the 64-row tiles hold
    # 2 blocks per SM, the 128-row ones 1).
    ConvConfig(128, 128, 64, 8, 8, 3, persistent=1),
    ConvConfig(64, 128, 64, 8, 4, 3, persistent=2),
    ConvConfig(128, 128, 128, 8, 8, 3, persistent=1),
    ConvConfig(64, 128, 256, 8, 4, 3, persistent=2),
    ConvConfig(128, 128, 256, 8, 8, 2, persistent=1),
]
INT8_INTERPRET_CONFIG = ConvConfig(32, 32, 32, 4, 4, 1)  # CPU interpreter: small tiles, odd sizes exercise masks
_TUNER: Tuner[ConvConfig] = Tuner("conv2d_int8_gemm", INT8_CONV_CONFIGS, ConvConfig)
# The residual tuner's extra persistent tilings (conv.RESIDUAL_TILINGS' int8 twins, K tiles 64-256; offline
# sm_90 with the int8 residual and folded int8 out: 4 or 2 blocks per SM, no spills): more warps per SM hide
# the epilogue's residual load, which the +res 1x1 convs wait on (benchmarks/notes/optimize.md).
INT8_RESIDUAL_TILINGS = [ConvConfig(64, 64, bk, 8, 4, st, persistent=4) for bk, st in ((64, 3), (128, 3), (256, 2))] + [
    ConvConfig(64, 128, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 3), (256, 2))] + [
    ConvConfig(128, 64, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 3), (256, 2))]
# (64, 128, 256) with 4 warps spills 8 B at 255 registers with res_dot (sm90_compile.py --all): no twin.
_RES_TUNER: Tuner[ConvConfig] = Tuner("conv2d_int8_gemm_residual", residual_candidates(
    INT8_CONV_CONFIGS, INT8_RESIDUAL_TILINGS, no_dot=(ConvConfig(64, 128, 256, 8, 4, 3, persistent=2),)), ConvConfig)

# Narrow int8 convs (Cout/groups <= conv.NARROW_COUT: MobileNetV2's projections): 32- and 16-wide tilings, K
# tiles of 32 bytes or more (int8 MMA steps 32 deep), under their own tuner as in conv_tuning.py: the default
# tile is 4-8x wider than their output. The six that won a bucket on MobileNetV2 b32, of nine tried.
INT8_NARROW_TILINGS = [
    ConvConfig(128, 32, 64, 8, 4, 4),
    ConvConfig(128, 32, 32, 8, 4, 5),
    ConvConfig(256, 32, 64, 8, 8, 3),
    ConvConfig(64, 32, 128, 8, 4, 4),
    ConvConfig(128, 16, 64, 8, 4, 4),
    ConvConfig(128, 32, 64, 8, 4, 3, persistent=4),
]
_NARROW_TUNER: Tuner[ConvConfig] = Tuner("conv2d_int8_gemm_narrow", [INT8_CONV_CONFIGS[0]] + INT8_NARROW_TILINGS,
                                         ConvConfig)


# id(weight) -> (weakref to it, (data_ptr, version), its values in fp16): the f16_mma tilings' weights
_F16_WEIGHTS: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _f16_weight(wp: torch.Tensor) -> torch.Tensor:
    """The int8 weight's values in fp16 (exact), same strides, made once per (tensor, version)."""
    key = (wp.data_ptr(), wp._version)
    hit = _F16_WEIGHTS.get(id(wp))
    if hit is not None and hit[0]() is wp and hit[1] == key:
        return hit[2]
    w16 = wp.detach().to(torch.float16)  # preserve_format: channels_last stays channels_last
    wid = id(wp)
    _F16_WEIGHTS[wid] = (weakref.ref(wp, lambda _r, wid=wid: _F16_WEIGHTS.pop(wid, None)), key, w16)
    return w16


def _validate(x, weight, x_scale, w_scale, bias, stride, padding, dilation, groups, activation, residual,
              out_scale, out_dtype, out, config, x_zero_point, w_sum, out_zero_point, out_q, residual_scale,
              residual_zero_point):
    if config is not None and (not isinstance(config, ConvConfig) or config.block_k < 32):
        raise ValueError(f"config must be a ConvConfig with block_k >= 32 (the K of the s8 MMA), got {config!r}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int8:
        raise ValueError("x must be an int8 tensor (quantize_int8 makes one), got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.device != x.device:
        raise ValueError(f"weight must be an int8 tensor on {x.device}, got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} on {getattr(weight, 'device', None)}")
    g = _geometry(x, weight, bias, stride, padding, dilation, groups, activation)
    if _is_depthwise(g.cin, g.cout, groups):
        raise ValueError(f"groups={groups}: depthwise convs are not served by conv2d_int8 (memory-bound, int8 "
                         "tensor cores gain them little); run them with conv2d in fp16")
    if g.cin_g * g.kh * g.kw > MAX_K:
        raise ValueError(f"weight: K = KH*KW*C/groups = {g.cin_g * g.kh * g.kw} exceeds {MAX_K}, where the int32 "
                         "accumulator could overflow")
    xs = check_scale("x_scale", x_scale, x.device)
    if (not isinstance(w_scale, torch.Tensor) or w_scale.dtype != torch.float32 or w_scale.shape != (g.cout,)
            or w_scale.device != x.device):
        raise ValueError(f"w_scale must be a float32 tensor [{g.cout}] on {x.device} (one scale per output channel), "
                         f"got {getattr(w_scale, 'dtype', type(w_scale).__name__)} "
                         f"{tuple(getattr(w_scale, 'shape', ()))}")
    os_ = None if out_scale is None else check_scale("out_scale", out_scale, x.device)
    check_zero_point("x_zero_point", x_zero_point)
    check_zero_point("out_zero_point", out_zero_point)
    if out_zero_point != 0 and out_scale is None:
        raise ValueError("out_zero_point applies to int8 out: give out_scale too")
    if out_q is not None and out_scale is None:
        raise ValueError("out_q (an int8 copy of the output) needs out_scale, the scale it is quantized at")
    if w_sum is not None and (not isinstance(w_sum, torch.Tensor) or w_sum.dtype != torch.int32
                              or w_sum.shape != (g.cout,) or w_sum.device != x.device):
        raise ValueError(f"w_sum must be an int32 tensor [{g.cout}] on {x.device} (weight.sum((1, 2, 3))), got "
                         f"{getattr(w_sum, 'dtype', type(w_sum).__name__)} {tuple(getattr(w_sum, 'shape', ()))}")
    int8_only = out_scale is not None and out_q is None
    if out_dtype is None:
        out_dtype = torch.int8 if int8_only else torch.float16
    if int8_only and out_dtype != torch.int8:
        raise ValueError(f"out_dtype must be torch.int8 (or None) with out_scale and no out_q, got {out_dtype}")
    if not int8_only and out_dtype not in FLOAT_OUT:
        raise ValueError(f"out_dtype must be one of {[str(d) for d in FLOAT_OUT]} (int8 out needs out_scale; "
                         f"with out_q the int8 copy goes there), got {out_dtype}")
    rs = None
    check_zero_point("residual_zero_point", residual_zero_point)
    if residual is not None:
        int8_res = isinstance(residual, torch.Tensor) and residual.dtype == torch.int8
        if not isinstance(residual, torch.Tensor) or not (residual.dtype in FLOAT_OUT or int8_res):
            raise ValueError(f"residual must be a float16/bfloat16/float32 tensor, or int8 with residual_scale, got "
                             f"{getattr(residual, 'dtype', type(residual).__name__)}")
        if int8_res and residual_scale is None:
            raise ValueError("residual: an int8 residual needs residual_scale (r = residual_scale * (r_q - "
                             "residual_zero_point))")
        if not int8_res and (residual_scale is not None or residual_zero_point != 0):
            raise ValueError(f"residual_scale / residual_zero_point apply to an int8 residual, got {residual.dtype}")
        if int8_res:
            rs = check_scale("residual_scale", residual_scale, x.device)
        _check_out(residual, "residual", g, residual.dtype, x.device)
    elif residual_scale is not None or residual_zero_point != 0:
        raise ValueError("residual_scale / residual_zero_point given without a residual")
    _check_out(out, "out", g, out_dtype, x.device)
    if out is not None and _shares_storage(out, x):
        raise ValueError("out must not share memory with x (other output pixels still read it)")
    _check_out(out_q, "out_q", g, torch.int8, x.device)
    if out_q is not None and any(t is not None and _shares_storage(out_q, t) for t in (x, out, residual)):
        raise ValueError("out_q must not share memory with x, out or residual")
    if out is not None and residual is not None and _shares_storage(out, residual) and out.dtype != residual.dtype:
        raise ValueError("out may share memory with residual (an in-place add) only in residual's dtype")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0):
        raise ValueError(f"x: int8 tensor-core convolution needs compute capability >= 8.0, device {x.device} has "
                         f"{torch.cuda.get_device_capability(x.device)}")
    return g, xs, os_, out_dtype, rs


def conv2d_int8(
    x: torch.Tensor,  # [N, C, H, W] int8, channels_last
    weight: torch.Tensor,  # [Cout, C/groups, KH, KW] int8 (channels_last is read without a repack)
    x_scale: torch.Tensor | float,  # one fp32 value: x ~= x_q * x_scale
    w_scale: torch.Tensor,  # [Cout] fp32: weight[co] ~= w_q[co] * w_scale[co]
    bias: torch.Tensor | None = None,  # [Cout], any float dtype
    *,
    stride=1, padding=0, dilation=1, groups: int = 1,
    activation: str | None = None,  # None | "relu" | "silu" | "gelu" | "relu6"
    residual: torch.Tensor | None = None,  # [N, Cout, OH, OW] channels_last, fp16/bf16/fp32, or int8 (below)
    out_scale: torch.Tensor | float | None = None,  # int8 out at this scale (the next layer's x_scale)
    out_dtype: torch.dtype | None = None,  # default fp16, or int8 with out_scale
    out: torch.Tensor | None = None,  # [N, Cout, OH, OW] channels_last of out_dtype
    config: ConvConfig | None = None,  # fixed tiling (skips autotuning; for sweeps and tests)
    x_zero_point: int = 0,  # 0: symmetric x; -128: unsigned x = x_scale * (x_q + 128)
    w_sum: torch.Tensor | None = None,  # [Cout] int32 = weight.sum((1, 2, 3)), for x_zero_point -128 (else computed)
    out_zero_point: int = 0,  # the int8 output's zero point (with out_scale)
    out_q: torch.Tensor | None = None,  # [N, Cout, OH, OW] int8 channels_last: with out_scale, y there too
    residual_scale: torch.Tensor | float | None = None,  # an int8 residual: r = residual_scale * (r_q - zero)
    residual_zero_point: int = 0,  # the int8 residual's zero point (-128: unsigned, a ReLU's output)
) -> torch.Tensor:  # [N, Cout, OH, OW] channels_last
    """W8A8 conv: ``act(float(conv(x_q - x_zero_point, w_q)) * x_scale * w_scale + bias + residual)``, the
    conv in int32. With ``out_q`` the output is float and the same y, quantized at ``out_scale`` /
    ``out_zero_point``, is also stored in out_q (one epilogue: for an output that both int8 layers and
    float ones, such as a residual add, read). An int8 ``residual`` (with ``residual_scale``) is dequantized
    in the epilogue: with int8 out too, a residual block's output stays int8 end to end (1 byte per element
    written and read instead of fp16's 2, or 3 for the float + int8 pair)."""
    g, xs, os_, out_dtype, rs = _validate(x, weight, x_scale, w_scale, bias, stride, padding, dilation, groups,
                                          activation, residual, out_scale, out_dtype, out, config, x_zero_point,
                                          w_sum, out_zero_point, out_q, residual_scale, residual_zero_point)
    given = out is not None
    if out is None:
        out = torch.empty(g.out_shape, dtype=out_dtype, device=x.device, memory_format=torch.channels_last)
    if not use_triton(x, weight, xs, w_scale, bias, residual, os_, out, out_q, rs):
        res = residual if rs is None else (residual.float() - residual_zero_point) * rs  # dequantized: fp32
        kw = dict(stride=g.stride, padding=g.padding, dilation=g.dilation, groups=groups, activation=activation,
                  residual=res, x_zero_point=x_zero_point)
        if out_q is None:
            return _into(ref.conv2d_int8_reference(x, weight, xs, w_scale, bias, out_scale=os_, out_dtype=out_dtype,
                                                   out_zero_point=out_zero_point, **kw), out, given)
        else:  # both from the one fp32 y, as the kernel's epilogue stores them
            y = ref.conv2d_int8_reference(x, weight, xs, w_scale, bias, out_dtype=torch.float32, **kw)
            out.copy_(y)
            out_q.copy_(ref.quantize_int8_reference(y, os_, out_zero_point))
        return out
    if g.n * g.oh * g.ow == 0 or g.cout == 0:
        return out
    epilogue = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=ACTIVATIONS[activation])
    b_arg = bias.contiguous() if bias is not None else None
    if x_zero_point != 0 and w_sum is None:
        w_sum = weight.sum((1, 2, 3), dtype=torch.int32)
    wp = _prepared(weight, groups, False)
    if _s2d_ok(g, x.dtype):
        # An image stem (stride 2, <= 4 channels): the taps loop on a space-to-depth view, padded with the
        # zero point. w_sum holds for the s2d weight too (its extra entries are zeros).
        x, wp, g = _space_to_depth(x, weight, g, fill=x_zero_point)
    x, g = strided_pointwise(x, g)
    mode = gemm_mode(g)
    quant = dict(x_scale=xs, w_scale=w_scale.contiguous(), x_zero=x_zero_point, w_sum=w_sum, out_scale=os_,
                 out_zero=out_zero_point, out_q=out_q, res_scale=rs, res_zero=residual_zero_point,
                 x_pad=_pad_row(x.device, x_zero_point) if x_zero_point != 0 and mode == MODE_TAPS else None)

    def launch(cfg: ConvConfig, dst: torch.Tensor) -> None:
        launch_gemm(x, _f16_weight(wp) if cfg.f16_mma else wp, b_arg, residual, dst, g, mode, cfg, epilogue, quant)

    cfg = choose_gemm_config(config, _TUNER, INT8_INTERPRET_CONFIG, x, g, mode, out, residual, launch, _RES_TUNER,
                             _NARROW_TUNER)
    launch(cfg, out)
    return out


__all__ = ["INT8_CONV_CONFIGS", "INT8_NARROW_TILINGS", "conv2d_int8"]
