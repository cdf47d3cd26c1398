"""The jit pieces the conv kernels share: the MMA step (fp32, int32 or int8-on-fp16 accumulation) and the
fused epilogue (bias, residual, activation; int8 out, folded or not, or a float + int8 pair), for the
implicit GEMM (conv_gemm.py), the persistent pointwise kernel (conv_pointwise.py) and the depthwise
kernel (conv_depthwise.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels.activation import apply_activation
from warpforge.kernels.quantize import f2i_rn, i2f_exact, round_to_int8

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
# unit, which sm_90 issues at 16 per clock per SM: three conversions per output element made the int8 1x1
# convs conversion-bound. The same codes bit for bit (benchmarks/notes/optimize.md).


@triton.jit
def _epilogue_factors(co, n_mask, b_ptr, xs_ptr, wsc_ptr, os_ptr, rs_ptr, HAS_BIAS: tl.constexpr,
                      HAS_RES: tl.constexpr, INT_ACC: tl.constexpr, OUT_ZERO: tl.constexpr, RES_INT8: tl.constexpr,
                      RES_ZERO: tl.constexpr, FOLDS: tl.constexpr):
    # y = acc * f1[co] + f2[co] (+ r * f3), then the activation; f1, f2 [BN] fp32, f3 a scalar, f4 the folded
    # ReLU6's upper code; loaded once per program (the persistent kernel hoists them). r: the residual as stored.
    # FOLDS (int8 in and out; no activation, ReLU or ReLU6): every per-channel factor in one FMA in the output's
    # code domain, q = acc * (x_scale * w_scale[co] / out_scale) + (bias[co] / out_scale + OUT_ZERO) [+ r * f3],
    # the activation as the clamp's bounds, then a round to nearest even: unfolded, the int8 epilogue costs about
    # twice fp16's instructions per element. Same codes up to a rounding tie (the FMA rounds once).
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
