"""Convs that read an image, rewritten before the launch (the same result, a cheaper loop):

* a strided stem on <= 4 channels (ResNet's 7x7/2, MobileNet's 3x3/2) runs as a stride-1 ceil(KH/2) x 1
  conv over a space-to-depth packing of x (``_s2d_pack_kernel``), through the implicit GEMM's taps loop;
  the pack reads the image in any layout and casts it, so the network's fp32 NCHW input needs no cast
  and no channels_last copy first (:func:`reads_image`);
* a patch embedding (stride == kernel, no padding: ViT's) runs as one gather and the matmul kernel.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels.conv_common import _cached_per_weight, _Geometry, _pair
from warpforge.kernels.matmul import matmul


@triton.jit
def _s2d_pack_kernel(x_ptr, o_ptr, P, HS, WS, H, W, C, s_xn, s_xc, s_xh, s_xw, pad_h, pad_w,
                     BLOCK_P: tl.constexpr, CS: tl.constexpr, FILL: tl.constexpr = 0):
    # Space-to-depth by 2 of the padded input: o [N, HS, WS, CS] (contiguous), s2d pixel (i, j) channel
    # (2a + b) * C + c = x[n, c, 2i + a - pad_h, 2j + b - pad_w] (FILL outside x: 0, or int8 x's zero point),
    # channels >= 4C FILL too (they meet zero weights).
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ch = tl.arange(0, CS)
    pm = p < P
    j = p % WS
    t = p // WS
    i = t % HS
    n = t // HS
    phase = ch // C
    c = ch - phase * C
    a = phase // 2
    b = phase - a * 2
    ih = 2 * i[:, None] - pad_h + a[None, :]
    iw = 2 * j[:, None] - pad_w + b[None, :]
    valid = pm[:, None] & (phase < 4)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    src = x_ptr + n.to(tl.int64)[:, None] * s_xn + (c * s_xc)[None, :] + ih * s_xh + iw * s_xw
    v = tl.load(src, mask=valid, other=FILL).to(o_ptr.dtype.element_ty)  # (an fp32 image: cast to the weight's)
    tl.store(o_ptr + p.to(tl.int64)[:, None] * CS + ch[None, :], v, mask=pm[:, None])


# ---- strided stems on few channels (an RGB image's 7x7/2 or 3x3/2): space-to-depth, then the taps loop ----

# the space-to-depth weights (s2d_weight), one per weight tensor (conv_common._cached_per_weight)
_S2D_WEIGHTS: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}

# MODE_FLAT decomposes one K index per element, so a stem on 3 channels runs far below the tensor cores' rate;
# through space-to-depth the taps loop reads 16-channel pixels, a fraction of the time (notes/optimize.md).
S2D_CHANNELS = 16  # one s2d pixel: 2x2 input pixels x C <= 4 channels, zero-padded to a 16-channel K quantum


def is_s2d_stem(groups: int, stride, dilation, cin: int, kh: int, kw: int) -> bool:
    """The convs the space-to-depth path serves: stride 2 on at most 4 channels with a kernel of 3x3 or
    more (an image stem), one group, no dilation (too few channels for the taps loop, and MODE_FLAT
    decomposes every K index)."""
    return (groups == 1 and tuple(stride) == (2, 2) and tuple(dilation) == (1, 1) and 4 * cin <= S2D_CHANNELS
            and min(kh, kw) >= 3)


def _s2d_ok(g: _Geometry, dtype: torch.dtype) -> bool:
    """An image stem (:func:`is_s2d_stem`) in 16-bit or int8."""
    return (dtype in (torch.float16, torch.bfloat16, torch.int8)
            and is_s2d_stem(g.groups, g.stride, g.dilation, g.cin, g.kh, g.kw))


def s2d_weight(weight: torch.Tensor) -> torch.Tensor:
    """[Cout, C, KH, KW] -> the equivalent weight of the conv on the space-to-depth input: [Cout,
    16 * ceil(KW/2), ceil(KH/2), 1] channels_last, input channel kw2 * 16 + (2a + b) * C + c holding
    w[co, c, 2 kh2 + a, 2 kw2 + b] (zero past the kernel and in the padding channels)."""
    cout, cin, kh, kw = weight.shape
    kh2, kw2 = -(-kh // 2), -(-kw // 2)
    wpad = weight.new_zeros(cout, cin, 2 * kh2, 2 * kw2)
    wpad[:, :, :kh, :kw] = weight
    t = wpad.reshape(cout, cin, kh2, 2, kw2, 2).permute(0, 2, 4, 3, 5, 1).reshape(cout, kh2, kw2, 4 * cin)
    t = torch.nn.functional.pad(t, (0, S2D_CHANNELS - 4 * cin))
    return t.reshape(cout, kh2, 1, kw2 * S2D_CHANNELS).contiguous().permute(0, 3, 1, 2)


def _space_to_depth(x: torch.Tensor, weight: torch.Tensor, g: _Geometry, fill: int = 0):
    """The stride-2 KHxKW conv on C channels as a stride-1 ceil(KH/2) x 1 conv over 16 * ceil(KW/2)
    channels: one kernel packs x (its padding as ``fill``: 0, or int8 x's zero point) into [N, HS, WS, 16]
    space-to-depth pixels; for a
    kernel row, the ceil(KW/2) s2d pixels an output pixel reads are adjacent in memory, so the taps loop
    reads them as one contiguous 16 * ceil(KW/2)-channel row of an overlapping view (pixel stride 16).
    ResNet-50's 7x7/2 stem: K = 4 steps of 64 (147 of 256 non-zero) instead of 147 decomposed indices."""
    kh2, kw2 = -(-g.kh // 2), -(-g.kw // 2)
    hs, ws = g.oh + kh2 - 1, g.ow + kw2 - 1
    buf = torch.empty((g.n, hs, ws, S2D_CHANNELS), dtype=weight.dtype, device=x.device)  # x fp32: cast here
    p = g.n * hs * ws
    block_p = 128
    _s2d_pack_kernel[(triton.cdiv(p, block_p),)](x, buf, p, hs, ws, g.h, g.w, g.cin, *x.stride(), *g.padding,
                                                 BLOCK_P=block_p, CS=S2D_CHANNELS, FILL=fill, num_warps=4)
    cs = S2D_CHANNELS * kw2
    xv = torch.as_strided(buf, (g.n, cs, hs, g.ow), (hs * ws * S2D_CHANNELS, 1, ws * S2D_CHANNELS, S2D_CHANNELS))
    g2 = _Geometry(g.n, cs, hs, g.ow, g.cout, cs, kh2, 1, (1, 1), (0, 0), (1, 1), 1, g.oh, g.ow)
    return xv, _cached_per_weight(_S2D_WEIGHTS, weight, None, s2d_weight), g2


def reads_image(x, weight, stride, dilation, groups) -> bool:
    """True when conv2d takes ``x`` as given: an image stem on the space-to-depth path (:func:`is_s2d_stem`,
    16-bit weight) reads x in any layout, fp32 or the weight's dtype, through its pack kernel (which casts),
    so the network's fp32 NCHW input needs no cast and no channels_last copy first (optimize's
    image_input pass hands it over so)."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and x.dim() == 4 and weight.dim() == 4):
        return False
    return (weight.dtype in (torch.float16, torch.bfloat16)
            and x.dtype in (torch.float32, weight.dtype) and x.device == weight.device
            and isinstance(groups, int) and is_s2d_stem(groups, _pair(stride, "stride", 1),
                                                        _pair(dilation, "dilation", 1), x.shape[1], *weight.shape[2:]))


# ---- patchify convs (stride == kernel, no padding): one gather, then the matmul kernel ---------------

PATCH_ACTIVATIONS = (None, "relu", "gelu", "silu")  # what kernels.matmul's epilogue has


def _patch_gemm_ok(g: _Geometry, dtype: torch.dtype, activation: str | None, residual: bool) -> bool:
    """A ViT-style patch embedding: non-overlapping KHxKW windows (stride == kernel, no padding, no
    dilation, one group), 16-bit, an activation the matmul epilogue has, and not both an activation and a
    residual (conv2d adds the residual before the activation, the matmul after it). Its channels (3 for
    RGB) are too few for the taps loop, and MODE_FLAT decomposes every K index, far below the tensor cores'
    rate; as one gather and a matmul the patch embedding runs at matmul speed (benchmarks/notes/optimize.md)."""
    return (g.groups == 1 and g.stride == (g.kh, g.kw) and g.padding == (0, 0)
            and g.dilation == (1, 1) and g.kh * g.kw > 1 and dtype in (torch.float16, torch.bfloat16)
            and activation in PATCH_ACTIVATIONS
            and not (residual and activation is not None))


def _patch_gemm(x: torch.Tensor, wp: torch.Tensor, bias, activation, residual, out: torch.Tensor,
                g: _Geometry) -> None:
    """out [M, Cout] = patches [M, KH*KW*C] @ w [Cout, KH*KW*C]^T, epilogue fused (kernels.matmul).

    x channels_last is NHWC in memory: rows (oh, kh) and columns (ow, kw) split without a copy, and one
    gather makes each output pixel's window a contiguous row in (kh, kw, c) order, the order of the
    channels_last weight's [Cout, KH, KW, C] memory. Pixels past the last whole window are never read."""
    n, c, oh, ow, kh, kw = g.n, g.cin, g.oh, g.ow, g.kh, g.kw
    nhwc = x.permute(0, 2, 3, 1)[:, :oh * kh, :ow * kw, :]  # [N, H', W', C] view
    patches = nhwc.reshape(n, oh, kh, ow, kw, c).permute(0, 1, 3, 2, 4, 5).reshape(n * oh * ow, kh * kw * c)
    w2 = wp.permute(0, 2, 3, 1).reshape(g.cout, kh * kw * c)  # a view of the channels_last weight
    out2 = out.permute(0, 2, 3, 1).reshape(n * oh * ow, g.cout)  # a view: out is channels_last
    res2 = None if residual is None else residual.permute(0, 2, 3, 1).reshape(n * oh * ow, g.cout)
    matmul(patches, w2.t(), bias=bias, activation=activation, residual=res2, out=out2)


__all__ = ["S2D_CHANNELS", "is_s2d_stem", "reads_image", "s2d_weight"]
