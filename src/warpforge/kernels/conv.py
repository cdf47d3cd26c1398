"""``conv2d`` on channels_last tensors with bias, residual add and activation fused into the epilogue.

Convention (drop-in for ``model.to(memory_format=torch.channels_last)`` torchvision models): x is
NCHW-shaped [N, C, H, W] and channels_last in memory (``x.is_contiguous(memory_format=
torch.channels_last)``, i.e. NHWC physically); the output is [N, Cout, OH, OW], channels_last too.
weight has torch's shape [Cout, C/groups, KH, KW]. The result is

    out = act(conv2d(x, weight) + bias + residual)          (residual [N, Cout, OH, OW], channels_last)

so a ResNet bottleneck's ``relu(bn3(conv3(h)) + identity)`` is one call once BN is folded into
(weight, bias).

This file is the launcher: it validates, runs the torch reference on CPU tensors, and sends each conv to
its kernel family:

* conv_gemm.py: the implicit GEMM (any groups), through the tiling conv_tuning.py chooses; a persistent
  tiling runs conv_pointwise.py's kernel (1x1 convs whose K fits one tile);
* conv_depthwise.py: groups == C;
* conv_stem.py: image stems through space-to-depth, patch embeddings through the matmul kernel.

conv_common.py holds what they share (the validated geometry, weight layouts), conv_epilogue.py the jit
epilogue; conv2d_int8 (conv_int8.py) launches the same implicit GEMM on int8 codes.
"""

from __future__ import annotations

import torch

from warpforge.kernels import reference as ref
from warpforge.kernels._checks import refuse_interpreted_bf16
from warpforge.kernels._dispatch import use_triton
from warpforge.kernels.activation import ACTIVATIONS
from warpforge.kernels.conv_common import (CONV_ACTIVATIONS, CONV_DTYPES, MODE_FLAT, MODE_PLAIN, MODE_TAPS,
                                           _check_out, _geometry, _Geometry, _into, _is_depthwise, _prepared,
                                           _shares_storage, gemm_mode, prepare_conv_weight, strided_pointwise)
from warpforge.kernels.conv_depthwise import DepthwiseConfig, depthwise_config, launch_depthwise
from warpforge.kernels.conv_gemm import launch_gemm
from warpforge.kernels.conv_stem import _patch_gemm, _patch_gemm_ok, _s2d_ok, _space_to_depth, is_s2d_stem, reads_image
from warpforge.kernels.conv_tuning import (_NARROW_TUNER, _RES_TUNER, _TUNER, CONV_CONFIGS, INTERPRET_CONFIG,
                                           NARROW_TILINGS, ConvConfig, choose_gemm_config)
from warpforge.kernels.quantize import check_scale, check_zero_point


def _validate(x, weight, bias, stride, padding, dilation, groups, activation, residual, out,
              int8_out: bool = False) -> _Geometry:
    if isinstance(x, torch.Tensor) and x.dtype not in CONV_DTYPES:
        raise ValueError(f"x must have dtype in {[str(d) for d in CONV_DTYPES]}, got {x.dtype}"
                         + (" (int8 x with int8 weights: conv2d_int8)" if x.dtype == torch.int8 else ""))
    image = reads_image(x, weight, stride, dilation, groups)
    geo = _geometry(x, weight, bias, stride, padding, dilation, groups, activation, any_layout=image)
    if (weight.dtype != x.dtype and not image) or weight.device != x.device:
        raise ValueError(f"weight must match x ({x.dtype} on {x.device}), got {weight.dtype} on {weight.device}")
    _check_out(residual, "residual", geo, weight.dtype, x.device)
    _check_out(out, "out", geo, torch.int8 if int8_out else weight.dtype, x.device)
    if out is not None and _shares_storage(out, x):
        raise ValueError("out must not share memory with x (other output pixels still read it)")
    return geo


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           stride=1, padding=0, dilation=1, groups: int = 1, activation: str | None = None,
           residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: ConvConfig | DepthwiseConfig | None = None, out_scale: torch.Tensor | float | None = None,
           out_zero_point: int = 0) -> torch.Tensor:
    """``act(conv2d(x, weight) + bias + residual)``; x [N, C, H, W] channels_last -> [N, Cout, OH, OW] channels_last
    in weight's dtype (an image stem, :func:`reads_image`, also takes x fp32 and in any layout).

    weight [Cout, C/groups, KH, KW] (any memory format; see :func:`prepare_conv_weight`), bias [Cout]
    (any float dtype), residual [N, Cout, OH, OW] channels_last in x's dtype (``out=residual`` adds in
    place). groups: 1, any divisor of C and Cout (implicit GEMM per group), or C (depthwise, its own
    direct kernel). activation: None, "relu", "silu", "gelu" (erf) or "relu6". ``config`` pins a
    tiling (otherwise tuned per shape on the GPU). ``out_scale`` (one fp32 value) stores int8 instead,
    quantized as ``quantize_int8`` does with ``out_zero_point``: the next int8 layer's input quantizer
    fused into this epilogue (a depthwise conv feeding a ``conv2d_int8``).
    """
    g = _validate(x, weight, bias, stride, padding, dilation, groups, activation, residual, out,
                  int8_out=out_scale is not None)
    if isinstance(config, ConvConfig) and config.f16_mma:
        raise ValueError("config: f16_mma (int8 operands on fp16 tensor cores) is a conv2d_int8 tiling")
    os_ = None
    if out_scale is not None:
        os_ = check_scale("out_scale", out_scale, x.device)
        check_zero_point("out_zero_point", out_zero_point)
    elif out_zero_point != 0:
        raise ValueError("out_zero_point applies to int8 out: give out_scale too")
    given = out is not None
    if out is None:
        out = torch.empty(g.out_shape, dtype=weight.dtype if os_ is None else torch.int8, device=x.device,
                          memory_format=torch.channels_last)
    if not use_triton(x):
        x = x.to(weight.dtype)  # (an image stem's fp32 x: the pack's cast)
        y = ref.conv2d_reference(x, weight, bias, stride=g.stride, padding=g.padding, dilation=g.dilation,
                                 groups=groups, activation=activation, residual=residual)
        y = y if os_ is None else ref.quantize_int8_reference(y, os_, out_zero_point)
        return _into(y, out, given)
    refuse_interpreted_bf16("conv2d", x, weight)
    m = g.n * g.oh * g.ow
    if m == 0 or g.cout == 0:
        return out
    epilogue = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=ACTIVATIONS[activation])
    b_arg = bias.contiguous() if bias is not None else out  # absent operands: any pointer, never read
    r_arg = residual if residual is not None else out
    if _is_depthwise(g.cin, g.cout, groups):
        launch_depthwise(x, weight, b_arg, r_arg, out, g, epilogue, os_, out_zero_point,
                         config if isinstance(config, DepthwiseConfig) else None)
        return out

    wp = _prepared(weight, groups, False)
    if config is None and os_ is None and _patch_gemm_ok(g, x.dtype, activation, residual is not None):
        _patch_gemm(x, wp, bias, activation, residual, out, g)
        return out
    quant = None if os_ is None else dict(out_scale=os_, out_zero=out_zero_point)
    if _s2d_ok(g, weight.dtype):
        x, wp, g = _space_to_depth(x, weight, g)
    x, g = strided_pointwise(x, g)
    mode = gemm_mode(g)

    def launch(cfg: ConvConfig, dst: torch.Tensor) -> None:
        launch_gemm(x, wp, b_arg, r_arg, dst, g, mode, cfg, epilogue, quant)

    cfg = choose_gemm_config(config if isinstance(config, ConvConfig) else None, _TUNER, INTERPRET_CONFIG, x, g, mode,
                             out, residual, launch, _RES_TUNER, _NARROW_TUNER)
    launch(cfg, out)
    return out


__all__ = ["CONV_ACTIVATIONS", "CONV_CONFIGS", "CONV_DTYPES", "MODE_FLAT", "MODE_PLAIN", "MODE_TAPS", "NARROW_TILINGS",
           "ConvConfig", "DepthwiseConfig", "conv2d", "depthwise_config", "is_s2d_stem", "prepare_conv_weight",
           "reads_image"]
