"""The implicit-GEMM conv kernel: M = N*OH*OW output pixels, N = Cout/groups, K = KH*KW*C/groups, the im2col
gather done inside the K loop (fp32 accumulation through ``tl.dot``). Three K loops: MODE_PLAIN (1x1,
stride 1, no padding: a plain GEMM over [N*H*W, C]), MODE_TAPS (one (kh, kw) tap and a chunk of channels
per step: contiguous channel loads, for C/groups a multiple of 16) and MODE_FLAT (K walked as one flat
index: no padding of small C such as the RGB stem's 3). With the constexpr INT_ACC it takes int8 x and
weight, accumulates exactly in int32 and dequantizes in the epilogue (``conv2d_int8``, conv_int8.py);
QUANT_OUT stores int8 for the next int8 layer. Split K: partial sums in a workspace, then a small epilogue
kernel. :func:`launch_gemm` launches it, or the persistent pointwise kernel for a persistent tiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels.conv_common import MODE_TAPS, _Geometry, _out_pixels
from warpforge.kernels.conv_epilogue import _epilogue_store, _mma
from warpforge.kernels.conv_pointwise import _launch_pointwise
from warpforge.kernels.conv_tuning import ConvConfig


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
    # grid (cdiv(M, BM) * cdiv(COUT_G, BN), groups, SPLIT_K): tile [BM pixels, BN channels] of group g; with
    # SPLIT_K > 1 program z sums its K steps into ws[z] ([SPLIT_K, M, COUT]) for _splitk_epilogue_kernel.
    # INT_ACC: int8 x and w, exact int32 sums, dequantized by xs_ptr * wsc_ptr[co]; QUANT_OUT: int8 out at
    # os_ptr. X_ZERO fills x's padding (xpad_ptr: the row a padded pixel reads) and leaves the sums through
    # wsum_ptr; OUT_ZERO is the output's. DUAL_OUT: float out (o_ptr) and the same y as int8 (q_ptr).
    # F16_MMA: int8 codes minus X_ZERO to fp16 in registers, fp16 tensor cores into fp32 (exact below 2^24):
    # Triton 3.6 keeps such an MMA in flight across K steps, never an int32 one.
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
    nb, oh, ow = _out_pixels(offs_m, OH, OW)
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
        for _step in range(lo, hi):
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
def _splitk_epilogue_kernel(ws_ptr, b_ptr, r_ptr, o_ptr, xs_ptr, wsc_ptr, wsum_ptr, os_ptr, q_ptr,
                            M, COUT, SPLIT_STRIDE,
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
        x, wp, b_arg, r_arg, dst, ws, xs, wsc, wsum, os_, xpad, out_q,
        m, g.oh, g.ow, g.h, g.w, g.cin_g, cout_g, g.cout, m * g.cout,
        *x.stride(), *wp.stride(), *g.stride, *g.padding, *g.dilation, KH=g.kh, KW=g.kw, MODE=mode,
        EVEN_C=g.cin_g % cfg.block_k == 0, **epilogue, F16_MMA=cfg.f16_mma,
        # fp32 inputs: full-precision products (tf32 would miss the fp32 tolerance); ignored for 16-bit.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg or None, **q)
    if split > 1:
        egrid = (triton.cdiv(m, 32), triton.cdiv(g.cout, 128))
        _splitk_epilogue_kernel[egrid](ws, b_arg, r_arg, dst, xs, wsc, wsum, os_, out_q, m, g.cout, m * g.cout,
                                       **epilogue, SPLIT_K=split, BLOCK_M=32, BLOCK_N=128, num_warps=4, **q)
