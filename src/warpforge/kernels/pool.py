"""``max_pool2d``: max pooling of a channels_last tensor (fp16, bf16, fp32, or int8 codes) in one pass.

Why a kernel of our own: torch's channels_last fp16 max pool (``max_pool_forward_nhwc``) runs far below
the memory bandwidth on ResNet-50's 3x3/2 pool, a memory-bound op, and cost a visible share of the whole
fp16 forward (benchmarks/notes/optimize.md). This one reads each input row as 16-byte vectors along the
channels.

Int8: quantization (``q = clamp(round(x / s) + zero)``) never decreases with x, so the max of the codes is the code
of the max: a max pool after an int8-out conv gives exactly what quantizing the float max pool gives, at
half the bytes of fp16 read and a quarter written, and without a quantize kernel after it. (The int8 pass
uses it between ResNet's int8 stem and its first block: optimize/quant.py.) Padding never wins: a padded
tap reads the lowest value (-inf, or -128 for codes), and every window holds at least one real pixel
(padding <= kernel / 2, as torch requires). A NaN in a window makes its output NaN, as in torch.

The kernel: one program per BLOCK_P output pixels x BLOCK_C channels (channels the contiguous axis, 16
bytes per load), the KH x KW taps unrolled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._dispatch import use_triton
from warpforge.kernels.conv_common import _out_pixels, _pair


@triton.jit
def _max_pool2d_kernel(x_ptr, o_ptr, M, OH, OW, H, W, C, s_xn, s_xh, s_xw, s_on, s_oh, s_ow,
                       stride_h, stride_w, pad_h, pad_w, KH: tl.constexpr, KW: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, LOWEST: tl.constexpr, IS_INT: tl.constexpr):
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    p_mask = offs_p < M
    c_mask = c < C
    nb, oh, ow = _out_pixels(offs_p, OH, OW)
    x_img = x_ptr + nb.to(tl.int64) * s_xn
    # int8 codes compared as int32: vectors of i8 max are a lowering we do not need to trust
    best = tl.full((BLOCK_P, BLOCK_C), LOWEST, tl.int32 if IS_INT else x_ptr.dtype.element_ty)
    for kh in tl.static_range(KH):
        ih = oh * stride_h - pad_h + kh
        h_ok = p_mask & (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = ow * stride_w - pad_w + kw
            ok = h_ok & (iw >= 0) & (iw < W)
            mask = ok[:, None] & c_mask[None, :]
            if IS_INT:
                # masked int8 loads take other=0 and the padding is selected out in int32: an int8 other=-128
                # gave wrong maxima at the image border on the GPU (notes/optimize.md)
                v = tl.load((x_img + ih * s_xh + iw * s_xw)[:, None] + c[None, :], mask=mask, other=0)
                best = tl.where(mask, tl.maximum(best, v.to(tl.int32)), best)
            else:
                v = tl.load((x_img + ih * s_xh + iw * s_xw)[:, None] + c[None, :], mask=mask, other=LOWEST)
                best = tl.maximum(best, v, propagate_nan=tl.PropagateNan.ALL)
    dst = o_ptr + nb.to(tl.int64)[:, None] * s_on + (oh * s_oh + ow * s_ow)[:, None] + c[None, :]
    tl.store(dst, best.to(o_ptr.dtype.element_ty), mask=p_mask[:, None] & c_mask[None, :])


POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)


def max_pool2d(x: torch.Tensor, kernel_size, stride=None, padding=0) -> torch.Tensor:
    """``F.max_pool2d`` of x [N, C, H, W] (fp16, bf16, fp32 or int8 codes; any layout, read as channels_last)
    -> [N, C, OH, OW] channels_last in x's dtype; no dilation, floor mode (torch's defaults). stride defaults
    to kernel_size."""
    if not isinstance(x, torch.Tensor) or x.dtype not in POOL_DTYPES or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor [N, C, H, W] of dtype in {[str(d) for d in POOL_DTYPES]}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    kh, kw = _pair(kernel_size, "kernel_size", 1)
    sh, sw = _pair(kernel_size if stride is None else stride, "stride", 1)
    ph, pw = _pair(padding, "padding", 0)
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"padding must be at most half the kernel size ({kh}x{kw}), got {(ph, pw)}")
    n, c, h, w = x.shape
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"x spatial size {h}x{w} is too small for kernel {kh}x{kw} with padding {(ph, pw)}")
    x = x.contiguous(memory_format=torch.channels_last)
    if not use_triton(x):
        # int8 through fp32 (exact for codes): torch's CPU int8 max pool fails on some channels_last inputs
        y = F.max_pool2d(x.float() if x.dtype == torch.int8 else x, (kh, kw), (sh, sw), (ph, pw)).to(x.dtype)
        return y.contiguous(memory_format=torch.channels_last)
    out = torch.empty((n, c, oh, ow), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    m = n * oh * ow
    if m == 0 or c == 0:
        return out
    block_c = min(64, triton.next_power_of_2(c))
    block_p = max(1, 2048 // block_c)
    grid = (triton.cdiv(m, block_p), triton.cdiv(c, block_c))
    is_int = x.dtype == torch.int8
    _max_pool2d_kernel[grid](x, out, m, oh, ow, h, w, c, x.stride(0), x.stride(2), x.stride(3), out.stride(0),
                             out.stride(2), out.stride(3), sh, sw, ph, pw, KH=kh, KW=kw, BLOCK_P=block_p,
                             BLOCK_C=block_c, LOWEST=-128 if is_int else float("-inf"), IS_INT=is_int, num_warps=4)
    return out


__all__ = ["POOL_DTYPES", "max_pool2d"]
