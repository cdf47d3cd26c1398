"""``conv2d`` on channels_last tensors with bias, residual add and activation fused into the epilogue.

Convention (drop-in for ``model.to(memory_format=torch.channels_last)`` torchvision models): x is
NCHW-shaped [N, C, H, W] and channels_last in memory (``x.is_contiguous(memory_format=
torch.channels_last)``, i.e. NHWC physically); the output is [N, Cout, OH, OW], channels_last too.
weight has torch's shape [Cout, C/groups, KH, KW]. The result is

    out = act(conv2d(x, weight) + bias + residual)          (residual [N, Cout, OH, OW], channels_last)

so a ResNet bottleneck's ``relu(bn3(conv3(h)) + identity)`` is one call once BN is folded into
(weight, bias).

Kernels:
- ``_conv_gemm_kernel``: implicit GEMM, M = N*OH*OW output pixels, N = Cout/groups, K = KH*KW*C/groups,
  the im2col gather done inside the K loop (fp32 accumulation through ``tl.dot``). Three K loops:
  MODE_PLAIN (1x1, stride 1, no padding: a plain GEMM over [N*H*W, C]), MODE_TAPS (one (kh, kw) tap
  and a chunk of channels per step: contiguous channel loads, for C/groups a multiple of 16) and
  MODE_FLAT (K walked as one flat index: no padding of small C such as the RGB stem's 3). With the
  constexpr INT_ACC it takes int8 x and weight, accumulates exactly in int32 and dequantizes in the
  epilogue (``conv2d_int8``, kernels/conv_int8.py); QUANT_OUT stores int8 for the next int8 layer.
- ``_conv_depthwise_kernel``: groups == C (channel multiplier Cout/C), direct, vectorized over channels.

Rewrites before the launch (same result, a cheaper loop): a strided stem on <= 4 channels (ResNet's 7x7/2,
MobileNet's 3x3/2) runs as a stride-1 ceil(KH/2) x 1 conv over a space-to-depth packing of x
(``_s2d_pack_kernel``); a strided 1x1 conv without padding (a ResNet downsample) runs MODE_PLAIN over the
subsampled view x[:, :, ::s, ::s]; a patch embedding (stride == kernel, no padding) runs as one gather and
the matmul kernel.

Weight layout the kernels want: channels_last ([Cout, KH, KW, C/groups] physically) for the GEMM, and
[KH, KW, Cout] physically for depthwise. :func:`prepare_conv_weight` returns that (same torch shape,
kernel-friendly strides, usable by ``F.conv2d`` too); ``conv2d`` repacks any other weight once and
caches it per weight tensor (invalidated when the tensor changes in place or is freed).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels._dispatch import INTERPRET, use_triton
from warpforge.kernels.activation import ACTIVATIONS, apply_activation
from warpforge.kernels.matmul import _descriptor, _tma_arch_ok, matmul, num_sms, tma_layout
from warpforge.kernels.quantize import check_scale, check_zero_point, f2i_rn, i2f_exact, round_to_int8

CONV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONV_ACTIVATIONS = (None, "relu", "silu", "gelu", "relu6")
MODE_PLAIN, MODE_TAPS, MODE_FLAT = 0, 1, 2


# ---- kernels ---------------------------------------------------------------------------------

@triton.jit
def _mma(a, b, acc, INT_ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_MMA: tl.constexpr = False,
         X_ZERO: tl.constexpr = 0):
    if F16_MMA:  # int8 x (codes minus zero point, exact in fp16: |v| <= 255) on fp16 tensor cores, b fp16
        return tl.dot(a.to(tl.float16) - X_ZERO, b, acc)
    elif INT_ACC:  # int8 x int8 -> int32: exact, whatever the summation order (s8 tensor-core MMA)
        return tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


# The int8 epilogues convert through integer and float adds (quantize.i2f_exact, f2i_rn), not the conversion
# unit, which sm_90 issues at 16 per clock per SM: the int8 ResNet-50 b32 forward 994.4 -> 950.3 us on the
# H200 (2026-12-03), the same codes bit for bit.


@triton.jit
def _epilogue_factors(co, n_mask, b_ptr, xs_ptr, wsc_ptr, os_ptr, rs_ptr, HAS_BIAS: tl.constexpr,
                      HAS_RES: tl.constexpr, INT_ACC: tl.constexpr, OUT_ZERO: tl.constexpr, RES_INT8: tl.constexpr,
                      RES_ZERO: tl.constexpr, FOLDS: tl.constexpr):
    # The epilogue of output channels co is y = acc * f1[co] + f2[co] (+ r * f3), then the activation: f1, f2
    # [BN] fp32, f3 a scalar, f4 the folded ReLU6's upper code. Loaded once per program (the persistent
    # kernel hoists them out of its tile loop). r: the residual as stored (int8 codes with RES_INT8).
    # FOLDS, the folded int8-out epilogue (int8 in and out, no activation, ReLU or ReLU6): every per-channel
    # factor in one FMA, y in the output's code domain,
    # q = acc * (x_scale * w_scale[co] / out_scale) + (bias[co] / out_scale + OUT_ZERO) [+ r * f3], then one
    # clamp and a round to nearest even (_epilogue_apply). ReLU is the clamp's lower bound in the code domain
    # (y >= 0 <=> q >= OUT_ZERO), ReLU6 its upper one too. Unfolded, dequantize, bias, activation and
    # requantize cost ~18 instructions per output element in the int8 1x1 convs (Nsight Compute, H200,
    # 2026-12-02), twice fp16's; folded, ResNet-50 b32's int8 convs went 907 -> 864 us. Same codes as
    # ``dequantize -> act -> round_to_int8`` up to a rounding tie broken the other way (the FMA rounds once).
    f3 = 1.0
    f4 = 127.0
    if FOLDS:
        inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.load(os_ptr))
        f1 = (tl.load(xs_ptr) * tl.load(wsc_ptr + co, mask=n_mask, other=0.0)) * inv
        f2 = tl.zeros_like(f1) + OUT_ZERO
        if HAS_BIAS:
            f2 += tl.load(b_ptr + co, mask=n_mask, other=0.0).to(tl.float32) * inv
        f3 = inv
        f4 = tl.minimum(6.0 * inv + OUT_ZERO, 127.0)
    else:
        if INT_ACC:  # dequantize: one fp32 rounding of the exact sum, times x_scale * w_scale[co]
            f1 = tl.load(xs_ptr) * tl.load(wsc_ptr + co, mask=n_mask, other=0.0)
        else:
            f1 = tl.zeros((co.shape[0],), dtype=tl.float32) + 1.0
        f2 = tl.zeros_like(f1)
        if HAS_BIAS:
            f2 += tl.load(b_ptr + co, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_RES and RES_INT8:  # r = rs * (r_q - RES_ZERO): the zero point's share joins f2
        f3 = f3 * tl.load(rs_ptr)
        f2 -= RES_ZERO * f3
    return f1, f2, f3, f4


@triton.jit
def _epilogue_apply(acc, r, f1, f2, f3, f4, HAS_RES: tl.constexpr, ACT: tl.constexpr, RES_INT8: tl.constexpr,
                    OUT_ZERO: tl.constexpr, FOLDS: tl.constexpr):
    # _epilogue_factors' y, activated: fp32, or with FOLDS the int8 codes
    y = acc.to(tl.float32) * f1[None, :] + f2[None, :]
    if HAS_RES:
        if RES_INT8:
            # through int16 first: Triton then moves the tile into the accumulator's layout as int8 (16 KB of
            # shared memory a 128x128 tile), not as the fp32 it becomes (64 KB: sm_90 TTGIR, triton 3.6)
            y += i2f_exact(r.to(tl.int16).to(tl.int32)) * f3
        else:
            y += r.to(tl.float32) * f3
    if FOLDS:
        # the lowest code: -128 unsigned (OUT_ZERO -128, where it is also ReLU's 0), else -127, or ReLU's 0
        lo: tl.constexpr = -128.0 if OUT_ZERO != 0 else (0.0 if ACT != 0 else -127.0)
        y = tl.maximum(y, lo)
        if ACT == 5:
            y = tl.minimum(y, f4)
        else:
            y = tl.minimum(y, 127.0)
        return f2i_rn(y).to(tl.int8)  # |y| <= 128
    else:
        return apply_activation(y, ACT)


@triton.jit
def _epilogue_store(acc, offs_m, co, m_mask, n_mask, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr, q_ptr,
                    COUT, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, INT_ACC: tl.constexpr,
                    QUANT_OUT: tl.constexpr, X_ZERO: tl.constexpr, OUT_ZERO: tl.constexpr,
                    DUAL_OUT: tl.constexpr = False, rs_ptr=None, RES_INT8: tl.constexpr = False,
                    RES_ZERO: tl.constexpr = 0):
    # acc [BM, BN] fp32 (int32 with INT_ACC) for output pixels offs_m and output channels co; out/residual
    # are [M, COUT] (channels_last [N, Cout, OH, OW] is exactly that matrix). RES_INT8: the residual is int8,
    # r = rs * (r_q - RES_ZERO) (an int8 residual stream: 1 byte read per element instead of 2).
    # FOLDS: the folded int8-out epilogue, for int8 in and out with ReLU, ReLU6 or no activation
    FOLDS: tl.constexpr = INT_ACC and QUANT_OUT and (ACT == 0 or ACT == 1 or ACT == 5)
    f1, f2, f3, f4 = _epilogue_factors(co, n_mask, b_ptr, xs_ptr, wsc_ptr, os_ptr, rs_ptr, HAS_BIAS, HAS_RES, INT_ACC,
                                       OUT_ZERO, RES_INT8, RES_ZERO, FOLDS)
    _epilogue_tile(acc, offs_m, co, 0, 0, m_mask, n_mask, r_ptr, o_ptr, wsum_ptr, os_ptr, q_ptr, COUT, f1, f2, f3, f4,
                   HAS_RES, ACT, QUANT_OUT, X_ZERO, OUT_ZERO, DUAL_OUT, RES_INT8, RES_ZERO, FOLDS)


@triton.jit
def _epilogue_tile(acc, offs_m, co, m0, n0, m_mask, n_mask, r_ptr, o_ptr, wsum_ptr, os_ptr, q_ptr, COUT, f1, f2, f3, f4,
                   HAS_RES: tl.constexpr, ACT: tl.constexpr, QUANT_OUT: tl.constexpr, X_ZERO: tl.constexpr,
                   OUT_ZERO: tl.constexpr, DUAL_OUT: tl.constexpr, RES_INT8: tl.constexpr, RES_ZERO: tl.constexpr,
                   FOLDS: tl.constexpr, r_desc=None, o_desc=None, TMA_EPI: tl.constexpr = False, r_in=None,
                   R_IN: tl.constexpr = False, SMALL_ACC: tl.constexpr = False):
    # One output tile through the epilogue (factors from _epilogue_factors), per-element pointers and masks, or
    # with TMA_EPI (not with DUAL_OUT) through descriptors over the [M, COUT] matrices (block [BM, BN], TMA
    # clips at M) at the tile's first row m0 and channel n0. R_IN: the residual tile is r_in already (the
    # persistent kernel's RES_DOT): no residual load here. SMALL_ACC: acc is an int32 sum of at most 256 int8
    # products (|acc| < 2^22), converted by i2f_exact; the zero point's correction, an integer below 2^22 too,
    # is then subtracted in fp32, exactly (the difference of two integers below 2^24).
    if SMALL_ACC:
        acc = i2f_exact(acc)
        if X_ZERO != 0:
            acc -= i2f_exact(X_ZERO * tl.load(wsum_ptr + co, mask=n_mask, other=0))[None, :]
    elif X_ZERO != 0:  # x = s * (x_q - X_ZERO), padding read as X_ZERO: subtract X_ZERO * sum of w[co], exactly
        acc -= X_ZERO * tl.load(wsum_ptr + co, mask=n_mask, other=0)[None, :]
    if TMA_EPI:
        r = 0
        if R_IN:
            r = r_in
        elif HAS_RES:
            r = r_desc.load([m0, n0])
        y = _epilogue_apply(acc, r, f1, f2, f3, f4, HAS_RES, ACT, RES_INT8, OUT_ZERO, FOLDS)
        if not FOLDS:
            if QUANT_OUT:
                y = round_to_int8(y, tl.load(os_ptr), OUT_ZERO)
            else:
                y = y.to(o_ptr.dtype.element_ty)
        o_desc.store([m0, n0], y)
    else:
        o_off = offs_m.to(tl.int64)[:, None] * COUT + co[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        r = 0
        if R_IN:
            r = r_in
        elif HAS_RES:
            r = tl.load(r_ptr + o_off, mask=mask, other=RES_ZERO if RES_INT8 else 0.0)
        y = _epilogue_apply(acc, r, f1, f2, f3, f4, HAS_RES, ACT, RES_INT8, OUT_ZERO, FOLDS)
        if FOLDS:
            tl.store(o_ptr + o_off, y, mask=mask)
        elif QUANT_OUT:  # int8 out for the next int8 layer: clamp(round(y * (1 / out_scale)), -127, 127)
            tl.store(o_ptr + o_off, round_to_int8(y, tl.load(os_ptr), OUT_ZERO), mask=mask)
        else:
            tl.store(o_ptr + o_off, y.to(o_ptr.dtype.element_ty), mask=mask)
            if DUAL_OUT:  # and an int8 copy (q_ptr, [M, COUT]) for the int8 layers among this output's users
                tl.store(q_ptr + o_off, round_to_int8(y, tl.load(os_ptr), OUT_ZERO), mask=mask)


@triton.jit
def _conv_gemm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, ws_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr, xpad_ptr, q_ptr,
                      M, OH, OW, H, W, CIN_G, COUT_G, COUT, SPLIT_STRIDE,
                      s_xn, s_xc, s_xh, s_xw,  # x strides for [N, C, H, W] indices (channels_last: s_xc == 1)
                      s_wo, s_wc, s_wh, s_ww,  # weight strides for [Cout, C/g, KH, KW] (prepared: s_wc == 1)
                      stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                      KH: tl.constexpr, KW: tl.constexpr, MODE: tl.constexpr, EVEN_C: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SPLIT_K: tl.constexpr, INT_ACC: tl.constexpr = False, QUANT_OUT: tl.constexpr = False,
                      X_ZERO: tl.constexpr = 0, OUT_ZERO: tl.constexpr = 0, DUAL_OUT: tl.constexpr = False,
                      F16_MMA: tl.constexpr = False, rs_ptr=None, RES_INT8: tl.constexpr = False,
                      RES_ZERO: tl.constexpr = 0):
    # grid (cdiv(M, BM) * cdiv(COUT_G, BN), groups, SPLIT_K). Output tile [BM pixels, BN channels] of
    # group g; with SPLIT_K > 1 program z sums its share of the K steps into workspace slice z (fp32, int32
    # with INT_ACC; ws [SPLIT_K, M, COUT], SPLIT_STRIDE = M * COUT) and _splitk_epilogue_kernel finishes.
    # INT_ACC (conv2d_int8): int8 x and w, exact int32 accumulator, dequantized by x_scale (xs_ptr, one
    # value) and w_scale (wsc_ptr, [COUT]) in the epilogue; QUANT_OUT: int8 out at scale os_ptr. Zero
    # points (x = scale * (q - zero), 0 or -128 for unsigned data): X_ZERO fills x's padding and is taken
    # out of the accumulator with the weight sums (wsum_ptr, [COUT] int32); OUT_ZERO is the output's.
    # xpad_ptr (MODE_TAPS with X_ZERO != 0): >= CIN_G bytes of X_ZERO, the row a padded pixel reads.
    # DUAL_OUT: float out (o_ptr) and the same y as int8 at os_ptr / OUT_ZERO (q_ptr), from one epilogue.
    # F16_MMA (with INT_ACC, SPLIT_K 1): int8 x, its codes minus X_ZERO converted to fp16 in registers, times
    # fp16 w (the int8 weights' values) on fp16 tensor cores into fp32: Triton 3.6 keeps such an MMA in
    # flight across K steps, never an int32 one. Integer products, sums exact below 2^24.
    pid = tl.program_id(0)
    g = tl.program_id(1)
    pid_k = tl.program_id(2)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(COUT_G, BLOCK_N)
    # Grouped ordering: GROUP_M consecutive M tiles share each weight tile while it is in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < COUT_G
    ow = offs_m % OW
    t = offs_m // OW
    oh = t % OH
    nb = t // OH
    x_img = x_ptr + nb.to(tl.int64) * s_xn + (g * CIN_G).to(tl.int64) * s_xc  # [BM] image base pointers
    w_col = w_ptr + (g * COUT_G + offs_n).to(tl.int64) * s_wo  # [BN] weight row pointers
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    if INT_ACC and not F16_MMA:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_steps = tl.cdiv(CIN_G, BLOCK_K)
    if MODE == 0:
        total = c_steps
    elif MODE == 1:
        total = KH * KW * c_steps
    else:
        total = tl.cdiv(KH * KW * CIN_G, BLOCK_K)
    per_split = tl.cdiv(total, SPLIT_K)
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, total)

    if MODE == 0:  # plain GEMM: pixel m reads x[n, :, oh, ow]
        a_row = x_img + oh * s_xh + ow * s_xw
        for step in range(lo, hi):
            c = step * BLOCK_K + offs_k
            c_mask = (c < CIN_G) | EVEN_C  # EVEN_C (BLOCK_K divides C/groups): no channel tail to mask
            # other=0 even with a zero point: masked rows (m >= M) are never stored and masked channels meet
            # zero weights. A non-zero ``other`` would cost a copy of every A tile (see MODE_TAPS).
            a = tl.load(a_row[:, None] + c[None, :] * s_xc, mask=m_mask[:, None] & c_mask[None, :], other=0)
            b = tl.load(w_col[None, :] + c[:, None] * s_wc, mask=c_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _mma(a, b, acc, INT_ACC, DOT_PRECISION, F16_MMA, X_ZERO)
    elif MODE == 1:  # one flat loop over (tap, channel chunk) so the pipeliner sees every step
        # The step's (tap, channel chunk) are carried as counters (a runtime division per K step costs ~25
        # instructions on sm_90), and each row's padding test is one bit of a mask made once per block:
        # bit t of ``inside_bits`` says tap t of that output pixel reads inside the image.
        x_row0 = x_img + ih0 * s_xh + iw0 * s_xw  # [BM] where tap (0, 0) reads; out of the image when padded
        BITS: tl.constexpr = KH * KW <= 32
        if BITS:
            inside_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
            for t in tl.static_range(KH * KW):
                ih_t = ih0 + (t // KW) * dil_h
                iw_t = iw0 + (t % KW) * dil_w
                ok = (ih_t >= 0) & (ih_t < H) & (iw_t >= 0) & (iw_t < W)
                inside_bits = inside_bits | (ok.to(tl.int32) << t)
        tap = lo // c_steps
        c0 = (lo - tap * c_steps) * BLOCK_K
        kh = tap // KW
        kw = tap - kh * KW
        for step in range(lo, hi):
            if BITS:
                inside = ((inside_bits >> tap) & 1) != 0
            else:
                ih = ih0 + kh * dil_h
                iw = iw0 + kw * dil_w
                inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            tap_row = x_row0 + (kh * dil_h * s_xh + kw * dil_w * s_xw)
            c = c0 + offs_k
            c_mask = (c < CIN_G) | EVEN_C
            if X_ZERO != 0:
                # Padding must read X_ZERO. A masked load with a non-zero ``other`` compiles (sm_90, triton 3.6)
                # to cp.async + a copy of the whole A tile smem -> registers -> select -> smem every K step;
                # instead a padded pixel's row pointer moves to a row of X_ZERO bytes, so the mask (rows past
                # M, the channel tail: never stored / zero weights) zero-fills.
                a_row = tl.where(inside, tap_row, xpad_ptr)
                a_mask = m_mask[:, None] & c_mask[None, :]
            else:
                a_row = tap_row
                a_mask = (m_mask & inside)[:, None] & c_mask[None, :]
            a = tl.load(a_row[:, None] + c[None, :] * s_xc, mask=a_mask, other=0)
            b = tl.load(w_col[None, :] + (kh * s_wh + kw * s_ww) + c[:, None] * s_wc,
                        mask=c_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _mma(a, b, acc, INT_ACC, DOT_PRECISION, F16_MMA, X_ZERO)
            # next step: the next channel chunk, or channel 0 of the next tap
            c0 += BLOCK_K
            wrap = c0 >= CIN_G
            c0 = tl.where(wrap, 0, c0)
            tap += wrap.to(tl.int32)
            kw += wrap.to(tl.int32)
            row_wrap = kw == KW
            kw = tl.where(row_wrap, 0, kw)
            kh += row_wrap.to(tl.int32)
    else:  # flat K = (kh, kw, c) with c fastest, decomposed per element of the K block
        K = KH * KW * CIN_G
        for step in range(lo, hi):
            k = step * BLOCK_K + offs_k
            k_mask = k < K
            c = k % CIN_G
            tap = k // CIN_G
            kh = tap // KW
            kw = tap - kh * KW
            ih = ih0[:, None] + (kh * dil_h)[None, :]  # [BM, BK]
            iw = iw0[:, None] + (kw * dil_w)[None, :]
            valid = (m_mask[:, None] & k_mask[None, :]) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_img[:, None] + ih * s_xh + iw * s_xw + (c * s_xc)[None, :], mask=valid, other=X_ZERO)
            w_off = kh * s_wh + kw * s_ww + c * s_wc
            b = tl.load(w_col[None, :] + w_off[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _mma(a, b, acc, INT_ACC, DOT_PRECISION, F16_MMA, X_ZERO)

    co = g * COUT_G + offs_n
    if SPLIT_K == 1:
        # F16_MMA took the zero point out before the MMA: no weight-sum correction left
        _epilogue_store(acc, offs_m, co, m_mask, n_mask, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr,
                        q_ptr, COUT, HAS_BIAS, HAS_RES, ACT, INT_ACC, QUANT_OUT, 0 if F16_MMA else X_ZERO, OUT_ZERO,
                        DUAL_OUT, rs_ptr, RES_INT8, RES_ZERO)
    else:
        ws_off = pid_k * SPLIT_STRIDE + offs_m.to(tl.int64)[:, None] * COUT + co[None, :]
        tl.store(ws_ptr + ws_off, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _splitk_epilogue_kernel(ws_ptr, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr, q_ptr, M, COUT, SPLIT_STRIDE,
                            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                            SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            INT_ACC: tl.constexpr = False, QUANT_OUT: tl.constexpr = False,
                            X_ZERO: tl.constexpr = 0, OUT_ZERO: tl.constexpr = 0,
                            DUAL_OUT: tl.constexpr = False, rs_ptr=None, RES_INT8: tl.constexpr = False,
                            RES_ZERO: tl.constexpr = 0):
    # out [M, COUT] = epilogue(sum over z of ws[z]); fixed summation order: deterministic.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < COUT
    off = offs_m.to(tl.int64)[:, None] * COUT + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for z in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + z * SPLIT_STRIDE + off, mask=mask, other=0)
    _epilogue_store(acc, offs_m, offs_n, m_mask, n_mask, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr,
                    q_ptr, COUT, HAS_BIAS, HAS_RES, ACT, INT_ACC, QUANT_OUT, X_ZERO, OUT_ZERO, DUAL_OUT,
                    rs_ptr, RES_INT8, RES_ZERO)


@triton.jit
def _conv_pointwise_persistent_kernel(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr, q_ptr,
                                      M, OH, OW, CIN, COUT, PROGS_M,
                                      s_xn, s_xc, s_xh, s_xw,  # x strides for [N, C, H, W] (channels_last: s_xc == 1)
                                      s_wo, s_wc,  # weight strides for [Cout, C] (prepared: s_wc == 1)
                                      stride_h, stride_w,
                                      EVEN_C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                                      ACT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                      INT_ACC: tl.constexpr = False, QUANT_OUT: tl.constexpr = False,
                                      X_ZERO: tl.constexpr = 0, OUT_ZERO: tl.constexpr = 0,
                                      DUAL_OUT: tl.constexpr = False, F16_MMA: tl.constexpr = False, rs_ptr=None,
                                      RES_INT8: tl.constexpr = False, RES_ZERO: tl.constexpr = 0,
                                      r_desc=None, o_desc=None, TMA_EPI: tl.constexpr = False,
                                      RES_DOT: tl.constexpr = False):
    # A 1x1 conv without padding (any stride) whose whole K is one tile (C <= BLOCK_K): grid
    # (PROGS_M * cdiv(COUT, BN),). Program p owns the output channels pid_n = p % num_n, loads their weights
    # once, and walks the M tiles p // num_n, + PROGS_M, ... The tile loop has no inner loop, so the
    # pipeliner prefetches the next tiles' x (num_stages deep) while this one's MMA and epilogue run. A
    # short-K layer (ResNet's 64->256, 256->64, ...) is one load, one MMA and a long epilogue per tile,
    # which one program per tile cannot overlap at 1-3 resident blocks per SM. Operands and epilogue as
    # _conv_gemm_kernel's MODE_PLAIN. TMA_EPI (not with DUAL_OUT): the residual tile arrives and the output
    # tile leaves through TMA descriptors over the [M, COUT] matrices (r_desc, o_desc, block [BM, BN]): no
    # per-element addresses in registers (a 128x128 tile's int64 pointers alone are 128 registers a thread
    # in the accumulator's layout) and no masks; TMA clips the tile at M. A residual loaded in the epilogue
    # stalls every tile on DRAM (Triton 3.6 pipelines only the loads that feed an MMA). RES_DOT (with
    # HAS_RES, a 16-bit or int8 residual): the residual tile goes through an MMA with the identity, r @ I
    # (exact: each sum has one non-zero term), so the pipeliner prefetches its load like x's, num_stages
    # deep into shared memory, and the MMA leaves it in the accumulator's layout. It helps some tilings and
    # hurts others: the residual tuner chooses it per tiling (ConvConfig.res_dot).
    pid = tl.program_id(0)
    num_n = tl.cdiv(COUT, BLOCK_N)
    pid_n = pid % num_n
    num_m = tl.cdiv(M, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < COUT
    c = tl.arange(0, BLOCK_K)
    c_mask = (c < CIN) | EVEN_C  # EVEN_C: BLOCK_K == C, no channel tail
    b = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * s_wo + c[:, None] * s_wc,
                mask=c_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN], for every tile of this program
    FOLDS: tl.constexpr = INT_ACC and QUANT_OUT and (ACT == 0 or ACT == 1 or ACT == 5)  # as _epilogue_store's
    if TMA_EPI:  # once, for every tile (the pointer epilogue has no registers to spare for them: per tile)
        f1, f2, f3, f4 = _epilogue_factors(offs_n, n_mask, b_ptr, xs_ptr, wsc_ptr, os_ptr, rs_ptr, HAS_BIAS, HAS_RES,
                                           INT_ACC, OUT_ZERO, RES_INT8, RES_ZERO, FOLDS)
    DOT_RES: tl.constexpr = RES_DOT and HAS_RES
    eye = 0
    if DOT_RES:
        ii = tl.arange(0, BLOCK_N)
        eye = (ii[:, None] == ii[None, :]).to(r_ptr.dtype.element_ty)
    for tile_m in tl.range(pid // num_n, num_m, PROGS_M):
        r_cur = 0
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        if DOT_RES:  # other=0 (rows past M are never stored): a plain masked load the pipeliner keeps in smem
            r_tile = tl.load(r_ptr + offs_m.to(tl.int64)[:, None] * COUT + offs_n[None, :],
                             mask=m_mask[:, None] & n_mask[None, :], other=0)
            if RES_INT8:  # int32 codes: _epilogue_apply's r.to(int16) narrows them back exactly
                r_cur = tl.dot(r_tile, eye, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32), out_dtype=tl.int32)
            else:
                r_cur = tl.dot(r_tile, eye, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        ow = offs_m % OW
        t = offs_m // OW
        oh = t % OH
        nb = t // OH
        a_row = x_ptr + nb.to(tl.int64) * s_xn + (oh * stride_h) * s_xh + (ow * stride_w) * s_xw
        # other=0 with a zero point too: masked rows are never stored, masked channels meet zero weights
        a = tl.load(a_row[:, None] + c[None, :] * s_xc, mask=m_mask[:, None] & c_mask[None, :], other=0)
        if INT_ACC and not F16_MMA:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _mma(a, b, acc, INT_ACC, DOT_PRECISION, F16_MMA, X_ZERO)
        if not TMA_EPI:
            f1, f2, f3, f4 = _epilogue_factors(offs_n, n_mask, b_ptr, xs_ptr, wsc_ptr, os_ptr, rs_ptr, HAS_BIAS,
                                               HAS_RES, INT_ACC, OUT_ZERO, RES_INT8, RES_ZERO, FOLDS)
        _epilogue_tile(acc, offs_m, offs_n, tile_m * BLOCK_M, pid_n * BLOCK_N, m_mask, n_mask, r_ptr, o_ptr, wsum_ptr,
                       os_ptr, q_ptr, COUT, f1, f2, f3, f4, HAS_RES, ACT, QUANT_OUT, 0 if F16_MMA else X_ZERO, OUT_ZERO,
                       DUAL_OUT, RES_INT8, RES_ZERO, FOLDS, r_desc, o_desc, TMA_EPI, r_cur, DOT_RES,
                       INT_ACC and not F16_MMA and BLOCK_K <= 256)  # K = C <= BLOCK_K: |acc| <= 256 * 128 * 127


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
    ow = offs_p % OW
    t = offs_p // OW
    oh = t % OH
    nb = t // OH
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


# ---- configs ---------------------------------------------------------------------------------

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


@dataclass(frozen=True, repr=False)
class ConvConfig:
    """Implicit-GEMM tiling: BM output pixels x BN output channels, K in BK steps, K split ``split_k`` ways."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # > 1: partial sums in an fp32 workspace, then a small epilogue kernel
    f16_mma: bool = False  # conv2d_int8 only: int8 operands on fp16 tensor cores (an MMA kept in flight)
    # > 0: the persistent pointwise kernel (1x1 convs without padding, C <= block_k: the whole K in one
    # tile), ``persistent`` programs per SM each walking many M tiles, the next tiles' loads in flight
    # during this one's epilogue. 0: one program per output tile.
    persistent: int = 0
    # > 0: cap registers per thread (ptxas .maxnreg) so more blocks share an SM: 128 lets two 8-warp blocks
    # sit on one SM, one block's MMA running while the other waits (an int32-accumulator MMA is never kept
    # in flight across K steps by Triton 3.6, so each block alone idles the tensor cores between steps).
    # 0: no cap. The repr names it only when set, so the tuner's hash of a candidate list without caps stays
    # what it was before the field existed (the shipped winners stay valid).
    maxnreg: int = 0
    # persistent tilings with a residual add: the residual through an MMA with the identity (RES_DOT in
    # _conv_pointwise_persistent_kernel: prefetched by the pipeliner). Offered by the residual tuner only
    # (residual_candidates); named in the repr only when set, as maxnreg.
    res_dot: bool = False

    def __repr__(self) -> str:
        names = [f.name for f in fields(self) if f.name not in ("maxnreg", "res_dot") or getattr(self, f.name)]
        return f"ConvConfig({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def __post_init__(self) -> None:
        for f, lo in (("block_m", 16), ("block_n", 16), ("block_k", 16), ("group_m", 1)):
            v = getattr(self, f)
            if v < lo or v & (v - 1):
                raise ValueError(f"ConvConfig.{f} must be a power of two >= {lo}, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ConvConfig.num_warps must be in (1, 2, 4, 8, 16), got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"ConvConfig.num_stages must be in [1, 8], got {self.num_stages}")
        if not 1 <= self.split_k <= 32:
            raise ValueError(f"ConvConfig.split_k must be in [1, 32], got {self.split_k}")
        if self.f16_mma and self.split_k != 1:
            raise ValueError("ConvConfig.f16_mma takes split_k=1 (its partial sums would be fp32, the int8 split-K "
                             f"workspace is int32), got split_k={self.split_k}")
        if not 0 <= self.persistent <= 8:
            raise ValueError(f"ConvConfig.persistent must be in [0, 8] (programs per SM), got {self.persistent}")
        if self.maxnreg and not 32 <= self.maxnreg <= 255:
            raise ValueError(f"ConvConfig.maxnreg must be 0 (no cap) or in [32, 255], got {self.maxnreg}")
        if self.res_dot and not self.persistent:
            raise ValueError("ConvConfig.res_dot is a persistent pointwise tiling's option (persistent >= 1)")
        if self.persistent and self.split_k != 1:
            raise ValueError(f"ConvConfig.persistent takes split_k=1 (one program owns each tile's whole K), got "
                             f"split_k={self.split_k}")


# Candidates for sm_90 fp16/bf16 (first = default when tuning is off). The lead sweeps by editing this.
# Offline sm_90 compiles (tests/kernels/sm90_compile.py --all, triton 3.6, 2026-12-01; fp16, bias + residual
# + silu epilogue): all fit shared memory; all but two are spill-free: (128, 256, 64) spills 124 B, and
# (32, 64, 64, split 8) 8 B; that one also runs mma.sync (BM 32 is below wgmma's 64 rows), the rest wgmma.
CONV_CONFIGS = [
    ConvConfig(128, 128, 64, 8, 8, 3),
    ConvConfig(128, 64, 64, 8, 4, 4),
    ConvConfig(64, 128, 64, 8, 4, 4),
    ConvConfig(128, 256, 64, 8, 8, 3),
    ConvConfig(64, 64, 64, 8, 4, 4),
    ConvConfig(64, 64, 32, 8, 4, 5),  # small Cout (stem) and short K
    # Batch-1 late layers (7x7 and 14x14 outputs, long K): too few output tiles to fill 132 SMs.
    ConvConfig(64, 64, 64, 8, 4, 4, split_k=4),
    ConvConfig(32, 64, 64, 4, 4, 4, split_k=8),
    # Persistent pointwise tilings (1x1, C <= block_k), ``persistent`` = the blocks one SM holds. Offline
    # sm_90 (sm90_compile.py --all, triton 3.6, 2026-12-02; bias + residual + silu): the weights stay in
    # shared memory, x is prefetched num_stages - 1 tiles ahead, no spills; (128, 128, 64) 178 registers,
    # 98 KB, 1 block per SM (100 registers and 2 blocks with bias + relu alone); (64, 128, 64) 182, 49 KB,
    # 2; (128, 128, 128, 2 stages) 131 KB, 1; (64, 128, 256, 2 stages) 139 KB, 1.
    ConvConfig(128, 128, 64, 8, 8, 3, persistent=1),
    ConvConfig(64, 128, 64, 8, 4, 3, persistent=2),
    ConvConfig(128, 128, 128, 8, 8, 2, persistent=1),
    ConvConfig(64, 128, 256, 8, 4, 2, persistent=1),
]
SPLIT_K_MAX_TILES = 66  # split K only when the output tiles fill at most half of the H200's 132 SMs
PERSISTENT_MIN_TILES = 264  # persistent tilings only where the output tiles fill the H200's 132 SMs twice over
INTERPRET_CONFIG = ConvConfig(32, 32, 16, 4, 4, 1)  # CPU interpreter: small tiles, odd sizes exercise masks


def residual_candidates(configs: list[ConvConfig], extra: list[ConvConfig],
                        no_dot: tuple[ConvConfig, ...] = ()) -> list[ConvConfig]:
    """The residual tuner's list: ``configs`` (so every base is among them), the ``extra`` persistent
    tilings, and a res_dot twin of every persistent tiling but those in ``no_dot`` (they spill with it)."""
    persistent = [c for c in configs if c.persistent] + list(extra)
    return list(configs) + list(extra) + [replace(c, res_dot=True) for c in persistent if c not in no_dot]


_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm", CONV_CONFIGS, ConvConfig)
# Persistent tilings holding 16 warps per SM (offline sm_90, triton 3.6: 80-100 registers, no spills), for the
# residual tuner only: H200 (2026-12-03) fp16 64->256 @56 +res 41.7 -> 38.1 us (64x64, 4 blocks per SM),
# 128->512 @28 +res 34.2 -> 26.4 us (64x128, 8 warps). Tuned for every conv they would serve, they would
# void the shipped winners (the tuner's candidate hash) for a gain seen with the residual only.
RESIDUAL_TILINGS = [ConvConfig(64, 64, bk, 8, 4, st, persistent=4) for bk, st in ((64, 3), (128, 2))] + [
    ConvConfig(64, 128, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 2))] + [
    ConvConfig(128, 64, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 2))]
_RES_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm_residual", residual_candidates(CONV_CONFIGS, RESIDUAL_TILINGS),
                                      ConvConfig)
# Narrow convs (Cout/groups <= NARROW_COUT): MobileNetV2's projections (32->16 @112, 96->24 and 144->24 + skip
# @56, 144->32 @28) and its 3->32 stem. No CONV_CONFIGS tiling but the default is narrow enough to pass _fits
# (block_n <= 32), so they all ran the default's 128x128x64 tile, 4-8x wider than their output: H200
# (2026-12-04, forward timeline, batch 32) 32->16 @112 51.3 us, 144->24 + skip @56 57.4 us, the stem 73.4 us,
# ~230 of the fp16 forward's 774 us, against ~40 us of HBM traffic. A third tuner (its own cache, so the
# shipped winners of the main list stay valid) picks among the base and these 32-wide tilings; the 16-deep K
# tile serves the space-to-depth stem (12 channels per tap). H200, b32 (6bba348): stem 73.4 -> 22.5 us,
# 32->16 @112 51.3 -> 11.1, 144->24 + skip @56 57.4 -> 15.8; the fp16 forward 773.6 -> ~620 us, the suite's
# row 0.784 -> 0.631 ms. The list holds the four tilings that won a bucket there, of nine tried (128x32x64,
# 256x32x64, 128x16x64 and two deeper persistent ones never won). Only for convs of NARROW_MIN_M output
# pixels or more: at batch 1 the forward is launch-bound (MobileNetV2 b1 0.250 ms before, 0.255 after) and
# the tuning's compiles cost the cold optimize run ~35 s (optimize wall time 35.1 -> 70.7 s).
NARROW_COUT = 32
NARROW_MIN_M = 16384
NARROW_TILINGS = [
    ConvConfig(128, 32, 32, 8, 4, 5),
    ConvConfig(128, 32, 16, 8, 4, 6),
    ConvConfig(64, 32, 64, 8, 4, 4),
    ConvConfig(128, 32, 64, 8, 4, 3, persistent=4),
]
_NARROW_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm_narrow", [CONV_CONFIGS[0]] + NARROW_TILINGS, ConvConfig)
# Winners seen by this process: the Tuner answers its default during CUDA-graph capture, but a graph
# captured after a warm-up call should replay the tuned tiling.
_CHOSEN: dict[tuple, ConvConfig] = {}


@dataclass(frozen=True)
class DepthwiseConfig:
    block_p: int
    block_c: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for f in ("block_p", "block_c"):
            v = getattr(self, f)
            if v < 1 or v & (v - 1):
                raise ValueError(f"DepthwiseConfig.{f} must be a power of two >= 1, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DepthwiseConfig.num_warps must be in (1, 2, 4, 8, 16), got {self.num_warps}")


def depthwise_config(cout: int) -> DepthwiseConfig:
    """Channels the contiguous (vectorized) axis, in blocks that divide Cout: 32 (16 where only that
    divides it, as MobileNetV2's 144), 1K outputs per program (8 fp32 accumulators a thread: a 7x7
    unrolled loop stays near 100 registers).

    Measured on the H200 (benchmarks/sweeps/depthwise_sweep.py, MobileNetV2 b32's 17 depthwise convs,
    2026-12-04): the 64-channel blocks used before wasted a quarter of the lanes at 96 and 144 channels
    (96 @112/2 fp16: 47.9 us against 42.1 in 32-channel blocks, 144 @56: 61.0 against 47.8 in 16s); sums
    over the 17: fp16 301 -> 272 us, int8 out 296 -> 263. With fp16 weights read as given
    (_dw_fp32_weights) fp16 is at 248 us; int8 out, 284 in 1K programs, 277 in 2K, 263 with fp32 weights
    in 1K (kept: fp32 weights in 2K programs were not measured)."""
    if cout % 32 == 0:
        bc = 32
    elif cout % 16 == 0:
        bc = 16
    else:
        bc = min(32, triton.next_power_of_2(cout))
    return DepthwiseConfig(block_p=max(1, 1024 // bc), block_c=bc, num_warps=4)


# ---- weight preparation ------------------------------------------------------------------------

def _is_depthwise(cin: int, cout: int, groups: int) -> bool:
    return groups > 1 and groups == cin and cout % cin == 0


def prepare_conv_weight(weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """weight [Cout, C/groups, KH, KW] with the strides the kernels read fastest; same values and shape.

    GEMM convs: channels_last. Depthwise (C/groups == 1 and groups > 1): [KH, KW, Cout] physically.
    The result is a valid ``F.conv2d`` weight too, so a model can keep it as its parameter.
    """
    if weight.dim() != 4:
        raise ValueError(f"weight must be [Cout, C/groups, KH, KW], got shape {tuple(weight.shape)}")
    if weight.shape[1] == 1 and groups > 1:
        return weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)
    return weight.contiguous(memory_format=torch.channels_last)


def _is_prepared(weight: torch.Tensor, depthwise: bool) -> bool:
    cout, cg, kh, kw = weight.shape
    if depthwise:
        want = {0: 1, 2: kw * cout, 3: cout}
        return all(weight.stride(d) == s or weight.shape[d] == 1 for d, s in want.items())
    return weight.is_contiguous(memory_format=torch.channels_last)


# id(weight) -> (weakref to it, (data_ptr, version, tag), derived tensor): one cache per kind of repack
# (_PREPARED: the kernel layout, tag = depthwise; _S2D_WEIGHTS: the space-to-depth weight), each entry made
# once per (tensor, version) and dropped when the tensor is freed.
_PREPARED: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}
# A 16-bit depthwise weight read as an fp32 copy (_DW_F32, one per weight): the kernel's fp32 taps then take
# it without a conversion each. Same values, same sums. Measured on the H200 (depthwise_sweep.py, MobileNetV2
# b32's 17 depthwise convs, 2026-12-04): fp16 in and out 270 us with it, 248 without; fp16 in, int8 out
# 263 with it, 284 without. So for int8 out only (_dw_fp32_weights).
_DW_F32: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}
_S2D_WEIGHTS: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _dw_fp32_weights(int8_out: bool) -> bool:
    """Whether a depthwise conv reads the fp32 copy of a 16-bit weight (see _DW_F32): with int8 out."""
    return int8_out


def _cached_per_weight(cache: dict, weight: torch.Tensor, tag, make) -> torch.Tensor:
    key = (weight.data_ptr(), weight._version, tag)
    hit = cache.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == key:
        return hit[2]
    derived = make(weight.detach())
    wid = id(weight)
    cache[wid] = (weakref.ref(weight, lambda _r, wid=wid: cache.pop(wid, None)), key, derived)
    return derived


def _prepared(weight: torch.Tensor, groups: int, depthwise: bool) -> torch.Tensor:
    """The weight in the kernel layout, repacked at most once per (tensor, version)."""
    if _is_prepared(weight, depthwise):
        return weight
    return _cached_per_weight(_PREPARED, weight, depthwise, lambda w: prepare_conv_weight(w, groups))


# ---- launcher --------------------------------------------------------------------------------

def _pair(v, name: str, lo: int) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v, v)
    if (not isinstance(v, (tuple, list)) or len(v) != 2
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= lo for e in v)):
        raise ValueError(f"{name} must be an int >= {lo} or a pair of them, got {v!r}")
    return int(v[0]), int(v[1])


def _check_nchw_cl(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [N, C, H, W] (channels_last memory), got shape {tuple(t.shape)}")
    if not t.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"{name} must be channels_last contiguous (t.contiguous(memory_format="
                         f"torch.channels_last)), got strides {tuple(t.stride())}")


@dataclass(frozen=True)
class _Geometry:
    """A validated conv problem: sizes, stride/padding/dilation pairs, output size."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    cin_g: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    oh: int
    ow: int

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cout, self.oh, self.ow)


def _geometry(x, weight, bias, stride, padding, dilation, groups, activation, any_layout: bool = False) -> _Geometry:
    """Shape checks shared by conv2d and conv2d_int8 (dtypes are each launcher's own); ``any_layout``: x
    may have any strides (an image read by the space-to-depth pack)."""
    if any_layout:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x must be a 4-D torch.Tensor [N, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
    else:
        _check_nchw_cl(x, "x")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        raise ValueError("weight must be a 4-D tensor [Cout, C/groups, KH, KW], got "
                         f"{getattr(weight, 'shape', weight)}")
    sh, sw = _pair(stride, "stride", 1)
    ph, pw = _pair(padding, "padding", 0)
    dh, dw = _pair(dilation, "dilation", 1)
    n, cin, h, w = x.shape
    cout, cin_g, kh, kw = weight.shape
    if not isinstance(groups, int) or groups < 1 or cin % groups or cout % groups:
        raise ValueError(f"groups must be an int >= 1 dividing C={cin} and Cout={cout}, got {groups!r}")
    if cin_g * groups != cin:
        raise ValueError(f"weight must be [Cout, C/groups={cin // groups}, KH, KW] for x with C={cin} and "
                         f"groups={groups}, got shape {tuple(weight.shape)}")
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"x spatial size {h}x{w} is too small for kernel {kh}x{kw} with padding {(ph, pw)} "
                         f"and dilation {(dh, dw)} (output would be {oh}x{ow})")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (cout,)
                             or bias.device != x.device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float tensor [{cout}] on {x.device}, got {getattr(bias, 'shape', bias)}")
    return _Geometry(n, cin, h, w, cout, cin_g, kh, kw, (sh, sw), (ph, pw), (dh, dw), groups, oh, ow)


def _check_out(t: torch.Tensor | None, name: str, geo: _Geometry, dtype: torch.dtype, device: torch.device) -> None:
    if t is None:
        return
    _check_nchw_cl(t, name)
    if tuple(t.shape) != geo.out_shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {list(geo.out_shape)} {dtype} on {device}, got "
                         f"{list(t.shape)} {t.dtype} on {t.device}")


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
    if out is None:
        out = torch.empty(g.out_shape, dtype=weight.dtype if os_ is None else torch.int8, device=x.device,
                          memory_format=torch.channels_last)
    if not use_triton(x):
        x = x.to(weight.dtype)  # (an image stem's fp32 x: the pack's cast)
        y = ref.conv2d_reference(x, weight, bias, stride=g.stride, padding=g.padding, dilation=g.dilation,
                                 groups=groups, activation=activation, residual=residual)
        out.copy_(y if os_ is None else ref.quantize_int8_reference(y, os_, out_zero_point))
        return out
    m = g.n * g.oh * g.ow
    if m == 0 or g.cout == 0:
        return out
    epilogue = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=ACTIVATIONS[activation])
    b_arg = bias.contiguous() if bias is not None else out  # absent operands: any pointer, never read
    r_arg = residual if residual is not None else out
    geom = (*g.stride, *g.padding, *g.dilation)

    if _is_depthwise(g.cin, g.cout, groups):
        wp = _prepared(weight, groups, True)
        if _dw_fp32_weights(os_ is not None) and wp.dtype != torch.float32:  # the same values, no conversion per tap
            wp = _cached_per_weight(_DW_F32, weight, "f32", lambda w: prepare_conv_weight(w.float(), groups))
        cfg = config if isinstance(config, DepthwiseConfig) else depthwise_config(g.cout)
        grid = (triton.cdiv(m, cfg.block_p), triton.cdiv(g.cout, cfg.block_c))
        _conv_depthwise_kernel[grid](
            x, wp, b_arg, r_arg, out, os_, None, m, g.oh, g.ow, g.h, g.w, g.cout, g.cout // g.cin,
            *x.stride(), wp.stride(0), wp.stride(2), wp.stride(3), *geom, KH=g.kh, KW=g.kw, **epilogue,
            BLOCK_P=cfg.block_p, BLOCK_C=cfg.block_c, QUANT_OUT=os_ is not None, OUT_ZERO=out_zero_point,
            num_warps=cfg.num_warps)
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

    cfg = choose_gemm_config(config, _TUNER, INTERPRET_CONFIG, x, g, mode, out, residual, launch, _RES_TUNER,
                             _NARROW_TUNER)
    launch(cfg, out)
    return out


# ---- patchify convs (stride == kernel, no padding): one gather, then the matmul kernel ---------------

PATCH_ACTIVATIONS = (None, "relu", "gelu", "silu")  # what kernels.matmul's epilogue has


def _patch_gemm_ok(g: _Geometry, dtype: torch.dtype, activation: str | None, residual: bool) -> bool:
    """A ViT-style patch embedding: non-overlapping KHxKW windows (stride == kernel, no padding, no
    dilation, one group), 16-bit, an activation the matmul epilogue has, and not both an activation and a
    residual (conv2d adds the residual before the activation, the matmul after it). Its channels (3 for
    RGB) are too few for the taps loop, and MODE_FLAT decomposes every K index: on the H200 ViT-B/16's
    16x16/16 patch embedding at batch 32 ran 172 us there (43 TFLOP/s, 2026-12-02); with this path and the
    fuse_norm pass ViT-B/16 went 3.18 -> 2.78 ms at batch 32, 0.675 -> 0.524 ms at batch 1."""
    return (g.groups == 1 and g.stride == (g.kh, g.kw) and g.padding == (0, 0)
            and g.dilation == (1, 1) and g.kh * g.kw > 1 and dtype in (torch.float16, torch.bfloat16) and activation in PATCH_ACTIVATIONS
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


# ---- strided stems on few channels (an RGB image's 7x7/2 or 3x3/2): space-to-depth, then the taps loop ----

# Through MODE_FLAT (one K index decomposed per element) ResNet-50's 7x7/2 stem at batch 32 ran 224 us on the
# H200 (33 TFLOP/s, 2026-12-02); through space-to-depth, 86 us (pack 15.4 + conv 71.8).
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


# ---- the implicit-GEMM launch, shared with conv2d_int8 (kernels/conv_int8.py) -------------------

def strided_pointwise(x: torch.Tensor, g: _Geometry) -> tuple[torch.Tensor, _Geometry]:
    """A strided 1x1 conv without padding (ResNet's downsample shortcuts) is the stride-1 1x1 conv of the
    subsampled view x[:, :, ::sh, ::sw] (no copy: channels_last rows stay contiguous), which MODE_PLAIN runs
    without the taps loop's per-step tap arithmetic. Other convs: (x, g) unchanged."""
    if not (g.kh == 1 and g.kw == 1 and g.padding == (0, 0) and g.stride != (1, 1)):
        return x, g
    xv = x[:, :, ::g.stride[0], ::g.stride[1]][:, :, :g.oh, :g.ow]
    return xv, _Geometry(g.n, g.cin, g.oh, g.ow, g.cout, g.cin_g, 1, 1, (1, 1), (0, 0), (1, 1), g.groups, g.oh, g.ow)


def gemm_mode(g: _Geometry) -> int:
    """MODE_PLAIN for 1x1/stride-1/unpadded, MODE_TAPS when C/groups is a multiple of 16, else MODE_FLAT."""
    if g.kh == 1 and g.kw == 1 and g.stride == (1, 1) and g.padding == (0, 0):
        return MODE_PLAIN
    return MODE_TAPS if g.cin_g % 16 == 0 else MODE_FLAT


def launch_gemm(x: torch.Tensor, wp: torch.Tensor, b_arg: torch.Tensor, r_arg: torch.Tensor, dst: torch.Tensor,
                g: _Geometry, mode: int, cfg: ConvConfig, epilogue: dict,
                quant: dict | None = None) -> None:
    """One ``_conv_gemm_kernel`` launch (and the split-K epilogue). ``quant``: x_scale [1], w_scale [Cout],
    x_zero (0 or -128) with w_sum [Cout] int32 for int8 x and wp (exact int32 accumulator), and with
    x_zero != 0 in MODE_TAPS x_pad (>= C/groups int8 values of x_zero: what padded pixels read); out_scale
    [1] and out_zero for an int8 dst (float or int8 x), or with out_q (int8, dst's shape) for a float dst
    and its int8 copy in out_q."""
    m, cout_g = g.n * g.oh * g.ow, g.cout // g.groups
    qd = quant or {}
    xs, wsc, wsum, os_, xpad, out_q = (qd.get(k) for k in ("x_scale", "w_scale", "w_sum", "out_scale", "x_pad",
                                                           "out_q"))
    q = dict(INT_ACC=xs is not None, QUANT_OUT=os_ is not None and out_q is None, X_ZERO=qd.get("x_zero", 0),
             OUT_ZERO=qd.get("out_zero", 0), DUAL_OUT=out_q is not None)
    if qd.get("res_scale") is not None:  # an int8 residual: r = res_scale * (r_q - res_zero)
        q.update(rs_ptr=qd["res_scale"], RES_INT8=True, RES_ZERO=qd.get("res_zero", 0))
    if cfg.f16_mma and (xs is None or wp.dtype != torch.float16):
        raise ValueError("config: f16_mma runs int8 x against the int8 weights' values in fp16 (conv2d_int8 passes "
                         f"them), got x {x.dtype} and weight {wp.dtype}")
    if mode == MODE_TAPS and q["X_ZERO"] != 0 and xpad is None:
        raise ValueError("quant: x_pad (a row of x_zero values, >= C/groups long) is needed with x_zero != 0 in "
                         "the taps loop")
    if cfg.persistent:
        _launch_pointwise(x, wp, b_arg, r_arg, dst, g, cfg, epilogue, q, xs, wsc, wsum, os_, out_q)
        return
    split = cfg.split_k
    if split > 1:
        ws = torch.empty((split, m, g.cout), dtype=torch.int32 if xs is not None else torch.float32,
                         device=x.device)
    else:
        ws = dst
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(cout_g, cfg.block_n), g.groups, split)
    _conv_gemm_kernel[grid](
        x, wp, b_arg, r_arg, dst, ws, xs, wsc, wsum, os_, xpad, out_q, m, g.oh, g.ow, g.h, g.w, g.cin_g, cout_g, g.cout, m * g.cout,
        *x.stride(), *wp.stride(), *g.stride, *g.padding, *g.dilation, KH=g.kh, KW=g.kw, MODE=mode,
        EVEN_C=g.cin_g % cfg.block_k == 0, **epilogue, F16_MMA=cfg.f16_mma,
        # fp32 inputs: full-precision products (tf32 would miss the fp32 tolerance); ignored for 16-bit.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg or None, **q)
    if split > 1:
        egrid = (triton.cdiv(m, 32), triton.cdiv(g.cout, 128))
        _splitk_epilogue_kernel[egrid](ws, b_arg, r_arg, dst, xs, wsc, wsum, os_, out_q, m, g.cout, m * g.cout, **epilogue,
                                       SPLIT_K=split, BLOCK_M=32, BLOCK_N=128, num_warps=4, **q)


def pointwise_ok(g: _Geometry) -> bool:
    """A 1x1 conv without padding, one group: what the persistent pointwise kernel serves (any stride)."""
    return g.kh == 1 and g.kw == 1 and g.padding == (0, 0) and g.groups == 1


def _sm_count(device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return 2  # the interpreter: a few programs, so each walks several tiles
    return num_sms(device)


def _launch_pointwise(x, wp, b_arg, r_arg, dst, g: _Geometry, cfg: ConvConfig, epilogue: dict, q: dict,
                      xs, wsc, wsum, os_, out_q) -> None:
    """The persistent pointwise kernel: ``cfg.persistent`` programs per SM (rounded to whole columns of
    output-channel tiles), each loading its channels' weights once and walking M tiles."""
    if not pointwise_ok(g):
        raise ValueError(f"config: persistent tilings serve 1x1 convs without padding in one group, got "
                         f"{g.kh}x{g.kw}, padding {g.padding}, groups {g.groups}")
    if g.cin_g > cfg.block_k:
        raise ValueError(f"config: a persistent tiling holds the whole K in one tile: C={g.cin_g} exceeds its "
                         f"block_k={cfg.block_k}")
    m = g.n * g.oh * g.ow
    num_m, num_n = triton.cdiv(m, cfg.block_m), triton.cdiv(g.cout, cfg.block_n)
    progs_m = max(1, min(num_m, (_sm_count(x.device) * cfg.persistent) // num_n))
    # the narrowest power-of-two K tile holding C (>= 32: the K of the s8 MMA, >= 16 for 16-bit)
    bk = min(cfg.block_k, max(32 if x.dtype == torch.int8 else 16, triton.next_power_of_2(g.cin_g)))
    # RES_DOT for 16-bit and int8 residuals (an fp32 one would meet the MMA as tf32: not exact)
    dot = (epilogue["HAS_RES"] and cfg.res_dot and r_arg.dtype in (torch.float16, torch.bfloat16, torch.int8))
    descs = _tma_epilogue(dst, r_arg if epilogue["HAS_RES"] and not dot else None, out_q, m, g.cout, cfg)
    if dot:
        descs["RES_DOT"] = True
    _conv_pointwise_persistent_kernel[(progs_m * num_n,)](
        x, wp, b_arg, r_arg, dst, xs, wsc, wsum, os_, out_q, m, g.oh, g.ow, g.cin_g, g.cout, progs_m,
        *x.stride(), wp.stride(0), wp.stride(1), *g.stride, EVEN_C=g.cin_g == bk, **epilogue,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=bk, F16_MMA=cfg.f16_mma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        maxnreg=cfg.maxnreg or None, **q, **descs)


# The persistent pointwise kernel's epilogue through TMA (see _conv_pointwise_persistent_kernel) wherever the
# output and residual matrices allow a descriptor, else per-element loads and stores. H200 (ResNet-50 b32
# forward timelines, 2026-12-02, TMA / pointers): fp16 pointwise convs 141.8 / 145.2 us, int8 168.8 / 169.2
# (its residual TMA load is not prefetched: each tile waits for it). A residual loaded one tile ahead through
# pointers changed nothing in the forward (int8 1018.9 us, fp16 1308.7 us, 255 registers on 64x128) and was
# removed; res_dot on every persistent launch made fp16 slower (1317.5 -> 1343.5 us), so it is a per-tiling
# choice of the residual tuner (ConvConfig.res_dot).


def _tma_epilogue(dst: torch.Tensor, residual: torch.Tensor | None, out_q, m: int, cout: int,
                  cfg: ConvConfig) -> dict:
    """The TMA_EPI launch arguments (descriptors over dst and residual as [M, Cout] matrices), or {} where
    TMA cannot serve: no TMA (pre-Hopper, the interpreter), a second (int8) output, or rows not 16-byte
    aligned (Cout * element size, e.g. MobileNetV2's 24 int8 channels)."""
    if out_q is not None or not _tma_arch_ok(dst.device):
        return {}
    mats = [t.permute(0, 2, 3, 1).reshape(m, cout) for t in ((dst,) if residual is None else (dst, residual))]
    if any(tma_layout(t) != "row" or t.data_ptr() != u.data_ptr() for t, u in
           zip(mats, (dst, residual))):
        return {}
    block = [cfg.block_m, cfg.block_n]
    descs = dict(o_desc=_descriptor(mats[0], block), TMA_EPI=True)
    if residual is not None:
        descs["r_desc"] = _descriptor(mats[1], block)
    return descs


def tune_bucket(x: torch.Tensor, g: _Geometry, mode: int) -> tuple:
    """The tuner's key for a conv: dtype, mode, M (power-of-two bucket), channels, kernel, stride, groups."""
    m, cout_g = g.n * g.oh * g.ow, g.cout // g.groups
    return (str(x.dtype), mode, pow2_bucket(m, 16), cout_g, g.cin_g, g.kh, g.kw, g.stride[0], g.groups)


# A 1x1 conv with a residual add (a ResNet block's last conv, MobileNetV2's projection + skip) reads one more
# [M, Cout] tensor than the same conv without it, in the epilogue of every tile: its best tiling differs
# (H200, ResNet-50 b32, 2026-12-03, benchmarks/sweeps/residual_epilogue.py: int8 64->256 @56 +res 43.6 us
# on the tiling tuned without the residual, 37.3-37.5 us on a 16-warps-per-SM tiling or with RES_DOT; fp16
# 128->512 @28 +res 34.2 -> 26.4 us). Such convs take the tuning without the residual (the base: shipped
# winners serve it), then a second tuner (_RES_TUNER here, conv_int8._RES_TUNER for int8; their own caches)
# picks among the base and the persistent tilings, each also with res_dot, under the key plus the residual's
# dtype and the base. H200 (2026-12-03): the ResNet-50 b32 forward fp16 1317.5 -> 1285.3 us, int8 1015.0 ->
# 994.4 us with it.


def _tag(cfg: ConvConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}k{cfg.split_k}"
            f"{'h' if cfg.f16_mma else ''}p{cfg.persistent}r{cfg.maxnreg}")


def choose_gemm_config(config: ConvConfig | DepthwiseConfig | None, tuner: Tuner[ConvConfig],
                       interpret_config: ConvConfig, x: torch.Tensor, g: _Geometry, mode: int, out: torch.Tensor,
                       residual: torch.Tensor | None, launch,
                       res_tuner: Tuner[ConvConfig] | None = None,
                       narrow_tuner: Tuner[ConvConfig] | None = None) -> ConvConfig:
    """``config`` when it is a ConvConfig, the interpreter's tiling, or the tuned one for this shape bucket
    (``launch(cfg, dst)`` runs a trial; the first candidate of ``tuner`` is always allowed); with a
    residual, a pointwise conv and ``res_tuner``, that tuner's choice among the base and the persistent
    tilings (see RESIDUAL_TILINGS); for a narrow conv (Cout/groups <= NARROW_COUT, NARROW_MIN_M output
    pixels or more) and ``narrow_tuner``, that tuner's choice among the base and its narrow tilings instead
    (see NARROW_TILINGS)."""
    if isinstance(config, ConvConfig):
        return config
    if INTERPRET:
        return interpret_config
    m, cout_g = g.n * g.oh * g.ow, g.cout // g.groups
    bucket = tune_bucket(x, g, mode)
    narrow = narrow_tuner is not None and cout_g <= NARROW_COUT and m >= NARROW_MIN_M
    by_res = not narrow and residual is not None and res_tuner is not None and pointwise_ok(g)
    res_dtype = str(residual.dtype).removeprefix("torch.") if residual is not None else None
    memo = (tuner.kernel, str(x.device), bucket, res_dtype if by_res or narrow else None, narrow)
    cfg = _CHOSEN.get(memo)
    if cfg is None:
        # Tuning runs the kernel many times: with out == residual (in-place add) it must write elsewhere.
        scratch = torch.empty_like(out) if residual is not None and _shares_storage(out, residual) else out

        def fits(c: ConvConfig) -> bool:
            return _fits(c, m, cout_g, g.cin_g * g.kh * g.kw, g.groups, tuner.configs[0],
                         k_tile=g.cin_g if mode == MODE_TAPS else None, pointwise=pointwise_ok(g))

        cfg = tuner.choose(bucket, x.device, lambda c: launch(c, scratch), valid=fits)
        base, key = cfg, bucket + (f"res:{res_dtype}", f"base:{_tag(cfg)}")  # the second tuner's key
        if narrow:
            cfg = narrow_tuner.choose(key, x.device, lambda c: launch(c, scratch),
                                      valid=lambda c: c == base or fits(c))
        elif by_res:
            dot_ok = residual.dtype in (torch.float16, torch.bfloat16, torch.int8)
            cfg = res_tuner.choose(key, x.device, lambda c: launch(c, scratch),
                                   valid=lambda c: c == base or (c.persistent > 0 and (dot_ok or not c.res_dot)
                                                                 and fits(replace(c, res_dot=False))))
        if not torch.cuda.is_current_stream_capturing():
            _CHOSEN[memo] = cfg
    return cfg


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _fits(cfg: ConvConfig, m: int, cout_g: int, k: int, groups: int, default: ConvConfig | None = None,
          k_tile: int | None = None, pointwise: bool = False) -> bool:
    """Drop tiles far larger than the problem (all-masked work) and split-K where the output tiles
    already fill the GPU or K is too short to share; always keeps the default (CONV_CONFIGS[0]).
    ``k_tile``: the most channels one K step can hold (MODE_TAPS: C/groups, a step never straddles two
    taps), so a wider block_k only multiplies zeros in the same number of steps. ``pointwise``: a 1x1 conv
    without padding in one group (:func:`pointwise_ok`), the only kind a persistent tiling serves, and only
    while its whole K fits one tile (block_k >= C) but not a tile half as deep (the next narrower
    persistent candidate serves that), and with enough output tiles (PERSISTENT_MIN_TILES) for a program to
    walk several: at batch 1 a one-shot grid is as good, and each candidate costs a compile."""
    if cfg == (CONV_CONFIGS[0] if default is None else default):
        return True
    if cfg.persistent:
        if not pointwise or k > cfg.block_k or (k <= cfg.block_k // 2 and cfg.block_k > 64):
            return False
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(cout_g, cfg.block_n)
        return tiles >= PERSISTENT_MIN_TILES and cfg.block_n <= max(32, triton.next_power_of_2(cout_g))
    if cfg.split_k > 1:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(cout_g, cfg.block_n) * groups
        if tiles > SPLIT_K_MAX_TILES or triton.cdiv(k, cfg.block_k) < 4 * cfg.split_k:
            return False
    return (cfg.block_n <= max(32, triton.next_power_of_2(cout_g))
            and cfg.block_m <= max(32, triton.next_power_of_2(m))
            and cfg.block_k <= max(16, triton.next_power_of_2(k if k_tile is None else k_tile)))


__all__ = ["CONV_CONFIGS", "NARROW_TILINGS", "ConvConfig", "DepthwiseConfig", "conv2d", "depthwise_config", "prepare_conv_weight"]
