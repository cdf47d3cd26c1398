"""The persistent pointwise conv kernel: a 1x1 conv without padding (any stride) whose whole K is one tile,
each program keeping its output channels' weights and walking many M tiles (ResNet's short-K 1x1 convs,
MobileNetV2's projections). Reached through ``ConvConfig.persistent`` from the implicit GEMM's launch
(conv_gemm.launch_gemm), for float and int8 alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._dispatch import INTERPRET
from warpforge.kernels.conv_common import _Geometry, _out_pixels, pointwise_ok
from warpforge.kernels.conv_epilogue import _epilogue_factors, _epilogue_tile, _mma
from warpforge.kernels.conv_tuning import ConvConfig
from warpforge.kernels.matmul import _descriptor, _tma_arch_ok, num_sms, tma_layout


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
    # A 1x1 conv without padding whose whole K is one tile (C <= BLOCK_K). Program p owns output channels
    # p % num_n, loads their weights once and walks the M tiles p // num_n, + PROGS_M, ...: with no inner loop
    # the pipeliner prefetches the next tiles' x while this one's MMA and epilogue run, which one program per
    # tile cannot overlap for short-K layers. TMA_EPI (not with DUAL_OUT): residual in, output out through TMA
    # descriptors over [M, COUT] (no per-element pointers in registers, no masks). RES_DOT: the residual tile
    # through an MMA with the identity (exact), so the pipeliner prefetches it; chosen per tiling by the tuner.
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
        nb, oh, ow = _out_pixels(offs_m, OH, OW)
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
# output and residual matrices allow a descriptor, else per-element loads and stores: it frees the pointer
# registers, and was no slower anywhere (its residual load is still not prefetched). Prefetching the residual
# by hand gained nothing and was removed; res_dot helps some tilings and slows others, so the residual tuner
# chooses it per tiling (ConvConfig.res_dot). Figures: benchmarks/notes/optimize.md.


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
