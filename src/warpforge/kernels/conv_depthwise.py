"""The depthwise conv kernel: groups == C (channel multiplier Cout/C), direct, vectorized over channels, fp32
sums; its tiling rule (depthwise_config) and launch. MobileNetV2's 17 depthwise convs run here in both the
fp16 and the int8 candidates (int8 out where an int8 projection reads them).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._checks import check_num_warps, check_pow2
from warpforge.kernels.conv_common import _cached_per_weight, _Geometry, _out_pixels, _prepared, prepare_conv_weight
from warpforge.kernels.conv_epilogue import _epilogue_store


@triton.jit
def _conv_depthwise_kernel(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, os_ptr, q_ptr,
                           M, OH, OW, H, W, COUT, MULT,
                           s_xn, s_xc, s_xh, s_xw, s_wo, s_wh, s_ww,
                           stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                           KH: tl.constexpr, KW: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                           QUANT_OUT: tl.constexpr = False, OUT_ZERO: tl.constexpr = 0,
                           DUAL_OUT: tl.constexpr = False):
    # grid (cdiv(M, BP), cdiv(COUT, BC)). Output channel co reads input channel co // MULT. QUANT_OUT: int8 out
    # at scale os_ptr (the next int8 layer's input quantizer, fused here). fp32 sums whatever w's dtype.
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    co = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_mask = offs_p < M
    c_mask = co < COUT
    ci = co // MULT
    nb, oh, ow = _out_pixels(offs_p, OH, OW)
    x_img = x_ptr + nb.to(tl.int64) * s_xn  # [BP]
    w_c = w_ptr + co * s_wo  # [BC]
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = oh * stride_h - pad_h + kh * dil_h
        h_ok = p_mask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * stride_w - pad_w + kw * dil_w
            valid = h_ok & (iw >= 0) & (iw < W)
            x_ok = valid[:, None] & c_mask[None, :]
            xv = tl.load((x_img + ih * s_xh + iw * s_xw)[:, None] + (ci * s_xc)[None, :], mask=x_ok, other=0.0)
            wv = tl.load(w_c + kh * s_wh + kw * s_ww, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]
    _epilogue_store(acc, offs_p, co, p_mask, c_mask, b_ptr, r_ptr, o_ptr, None, None, None, os_ptr, q_ptr, COUT,
                    HAS_BIAS, HAS_RES, ACT, False, QUANT_OUT, 0, OUT_ZERO, DUAL_OUT)


@dataclass(frozen=True)
class DepthwiseConfig:
    block_p: int
    block_c: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        check_pow2(self, "block_p", "block_c")
        check_num_warps(self)


def depthwise_config(cout: int) -> DepthwiseConfig:
    """Channels the contiguous (vectorized) axis, in blocks that divide Cout: 32 (16 where only that
    divides it, as MobileNetV2's 144), 1K outputs per program (8 fp32 accumulators a thread: a 7x7
    unrolled loop stays near 100 registers).

    Blocks that divide Cout leave no lanes idle: 64-channel blocks masked a quarter of theirs at MobileNetV2's
    96 and 144 channels (benchmarks/sweeps/depthwise_sweep.py; figures in benchmarks/notes/optimize.md)."""
    if cout % 32 == 0:
        bc = 32
    elif cout % 16 == 0:
        bc = 16
    else:
        bc = min(32, triton.next_power_of_2(cout))
    return DepthwiseConfig(block_p=max(1, 1024 // bc), block_c=bc, num_warps=4)


# A 16-bit depthwise weight read as an fp32 copy (_DW_F32, one per weight): the kernel's fp32 taps then take
# it without a conversion each. Same values, same sums. It pays only with int8 out (depthwise_sweep.py:
# with fp16 out the copy's extra bytes cost more than the conversions it saves), so for int8 out only
# (_dw_fp32_weights).
_DW_F32: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _dw_fp32_weights(int8_out: bool) -> bool:
    """Whether a depthwise conv reads the fp32 copy of a 16-bit weight (see _DW_F32): with int8 out."""
    return int8_out


def launch_depthwise(x: torch.Tensor, weight: torch.Tensor, b_arg: torch.Tensor, r_arg: torch.Tensor,
                     out: torch.Tensor, g: _Geometry, epilogue: dict, out_scale: torch.Tensor | None,
                     out_zero_point: int, config: DepthwiseConfig | None) -> None:
    """One ``_conv_depthwise_kernel`` launch (``config``: a pinned tiling, else depthwise_config's)."""
    m = g.n * g.oh * g.ow
    wp = _prepared(weight, g.groups, True)
    if _dw_fp32_weights(out_scale is not None) and wp.dtype != torch.float32:  # the same values, no conversion per tap
        wp = _cached_per_weight(_DW_F32, weight, "f32", lambda w: prepare_conv_weight(w.float(), g.groups))
    cfg = config or depthwise_config(g.cout)
    grid = (triton.cdiv(m, cfg.block_p), triton.cdiv(g.cout, cfg.block_c))
    _conv_depthwise_kernel[grid](
        x, wp, b_arg, r_arg, out, out_scale, None, m, g.oh, g.ow, g.h, g.w, g.cout, g.cout // g.cin,
        *x.stride(), wp.stride(0), wp.stride(2), wp.stride(3), *g.stride, *g.padding, *g.dilation, KH=g.kh,
        KW=g.kw, **epilogue, BLOCK_P=cfg.block_p, BLOCK_C=cfg.block_c, QUANT_OUT=out_scale is not None,
        OUT_ZERO=out_zero_point, num_warps=cfg.num_warps)


__all__ = ["DepthwiseConfig", "depthwise_config", "launch_depthwise"]
