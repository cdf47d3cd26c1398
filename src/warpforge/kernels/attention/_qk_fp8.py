"""Paged decode's inner loop with QK^T as an e4m3 x e4m3 dot (fp8 pages, ``DecodeConfig.qk_fp8``).

With fp8 pages the plain loop (``_online_softmax.attend_blocks``) converts every K and V element to
fp16 in registers before its dots; at fp8 streaming rates that ALU work costs what the halved bytes
save (H200: 2.8-3.2 TB/s-equivalent of fp8 bytes, against 3.4-4.2 for bf16 pages). Here the query
rows are quantized once per program to e4m3 (per head, a power-of-two scale), so K goes from shared
memory straight into the tensor cores.

The loop runs keys-major: S^T = K q^T ([BLOCK_N, G]) and O^T += V^T P^T ([D, G]). Triton (3.6) lowers
an fp8 dot to Hopper's wgmma only when M is a multiple of 64; decode's q tile has 16 rows (GQA group,
padded), where it falls back to mma.sync after converting BOTH operands to fp16. With the keys as M
(BLOCK_N >= 64) the QK dot is a wgmma m64nGk32 e4m3 (checked by tests/kernels/attention/
_sm90_compile.py) with N = G = 16; the PV dot stays fp16 (V converted as today) with M = D. Its A
operand V^T is built in registers: Triton transposes the fp8 V with byte permutes and a shared-memory
round trip, which gives back part of what skipping K's conversion saves (offline SASS of the interior
loop at 128 tokens x 4 warps: 27.3 warp instructions per token against the plain fp8 loop's 35.7).

Accuracy: e4m3 keeps 3 mantissa bits, so each q element moves by up to 2^-4 of itself; the logits move
by about that fraction of their typical size (see the tolerance in kernels/tolerance.py).
"""

from __future__ import annotations

import warpforge.kernels._dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels.attention._online_softmax import _load_tile, _tanh

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def _pow2(e):
    """2.0 ** e (int32 in [-126, 127]) built from its bits: exact, unlike exp2 on some backends."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def quantize_rows_e4m3(x):
    """x [M, K] fp32 -> (x8 [M, K] e4m3, scale [M] fp32) with x ~= x8 * scale[:, None].

    scale is a power of two (so x / scale is exact) putting each row's max |x| in (224, 448]; an
    all-zero row gets scale 1. The rounding to e4m3 (nearest, ties to even; subnormals below 2^-6)
    is done in fp32 arithmetic, so the final conversion only casts exact values: the same bits on
    the GPU (cvt.rn.satfinite) and in Triton's interpreter (whose fp8 cast drops a rounding carry).
    """
    amax = tl.max(tl.abs(x), 1)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)) for a normal amax
    s = e - 8  # amax / 2^s in [256, 512)
    s = tl.where(amax * _pow2(-s) > E4M3_MAX, s + 1, s)
    s = tl.where(e > -127, tl.minimum(tl.maximum(s, -120), 120), 0)
    y = x * _pow2(-s)[:, None]
    # round y to a multiple of its e4m3 ulp, 2^max(exp - 3, -9): adding 1.5 * 2^(k + 23) pushes the
    # bits below 2^k out of an fp32 mantissa (round to nearest even), subtracting it back is exact
    ey = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(ey - 3, -9)
    magic = (((k + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (y + magic) - magic
    r = tl.where(r == 0.0, y * 0.0, r)  # keep the sign of a value rounded to zero, as a cast would
    return r.to(tl.float8e4nv), _pow2(s)


@triton.jit
def _attend_blocks_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kn, stride_vn,
                       page_row, num_pages, stride_kp, stride_vp, lo, hi, seqlen_k, window_left,
                       qk_scale, cap_scale, cap_log2,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                       MASK: tl.constexpr, MASK_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
                       PAGE_SIZE: tl.constexpr):
    """Online softmax over key blocks [lo, hi), keys-major (see the module docstring).

    acc_t [BLOCK_D, G] fp32 (O^T), l_i/m_i [G] fp32 (m in log2 units), q8 [G, BLOCK_D] e4m3, q_pos [G].
    qk_scale, cap_scale: [G] (the query rows' own scales folded in); cap_log2 scalar. Causal at q_pos
    (decode: every key < seqlen_k is at or before the query), left window under MASK_LEFT.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    d_ok = offs_d[None, :] < HEAD_DIM
    q8_t = tl.trans(q8)  # [BLOCK_D, G]: the dot's B operand, K-major as an fp8 wgmma needs
    page = tl.load(page_row + (lo + offs_n0) // PAGE_SIZE, mask=lo + offs_n0 < seqlen_k, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        n_ok = offs_n < seqlen_k
        next_n = offs_n + BLOCK_N  # block-table entries one step ahead (see attend_blocks)
        page_next = tl.load(page_row + next_n // PAGE_SIZE, mask=next_n < seqlen_k, other=0)
        page = tl.minimum(tl.maximum(page.to(tl.int64), 0), num_pages - 1)  # see attend_blocks
        tok = offs_n % PAGE_SIZE
        k = _load_tile(k_base, page * stride_kp + tok * stride_kn, offs_d, n_ok, d_ok, MASK, PAD_D)
        s = tl.dot(k, q8_t)  # [BLOCK_N, G] fp32, e4m3 x e4m3
        if SOFTCAP:
            s = cap_log2 * _tanh(s * cap_scale[None, :])
        elif MASK:
            s = s * qk_scale[None, :]
        if MASK:
            keep = n_ok[:, None]
            if MASK_LEFT:
                keep = keep & (offs_n[:, None] >= q_pos[None, :] - window_left)
            s = tl.where(keep, s, float("-inf"))
        if SOFTCAP or MASK:
            m_new = tl.maximum(m_i, tl.max(s, 0))
            p = tl.math.exp2(s - m_new[None, :])
        else:  # one FMA per element; qk_scale > 0 (launcher-checked scale, power-of-two q scale)
            m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
            p = tl.math.exp2(s * qk_scale[None, :] - m_new[None, :])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = _load_tile(v_base, page * stride_vp + tok * stride_vn, offs_d, n_ok, d_ok, MASK, PAD_D)
        acc_t = acc_t * alpha[None, :]
        acc_t = tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16), acc_t)  # [BLOCK_D, G]
        m_i = m_new
        page = page_next
    return acc_t, l_i, m_i


@triton.jit
def attend_span_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kn, stride_vn,
                    page_row, num_pages, stride_kp, stride_vp, lo, full_lo, full_hi, hi, seqlen_k, window_left,
                    qk_scale, cap_scale, cap_log2,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                    MASK_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """_attend_blocks_qk8 over a key_range: masked left edge (windows only), interior, masked right edge."""
    if MASK_LEFT:
        acc_t, l_i, m_i = _attend_blocks_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kn, stride_vn,
                                             page_row, num_pages, stride_kp, stride_vp,
                                             lo, full_lo, seqlen_k, window_left,
                                             qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, True,
                                             MASK_LEFT, SOFTCAP, PAGE_SIZE)
    acc_t, l_i, m_i = _attend_blocks_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kn, stride_vn,
                                         page_row, num_pages, stride_kp, stride_vp,
                                         full_lo, full_hi, seqlen_k, window_left,
                                         qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, False,
                                         MASK_LEFT, SOFTCAP, PAGE_SIZE)
    acc_t, l_i, m_i = _attend_blocks_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kn, stride_vn,
                                         page_row, num_pages, stride_kp, stride_vp,
                                         full_hi, hi, seqlen_k, window_left,
                                         qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, True,
                                         MASK_LEFT, SOFTCAP, PAGE_SIZE)
    return acc_t, l_i, m_i
