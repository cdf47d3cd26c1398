"""The one attention inner loop every kernel in this package runs: online softmax over key blocks.

``flash_attention`` (contiguous K/V), ``chunked_prefill`` and ``paged_decode`` (K/V gathered through a
block table) differ only in which query rows a program owns and where its keys live. They all:

1. compute the key range a program's rows may see with :func:`key_range`, split into masked edges and
   an unmasked interior (no per-element mask math and no load masks in the hot loop);
2. run :func:`attend_span` (:func:`attend_blocks` over the three pieces), keeping (acc, l, m) in
   fp32 registers;
3. normalize with :func:`finalize`.

Logits live in the log2 domain (scale folded with log2(e)) so the loop uses ``exp2``. Row positions
(``q_pos``) are in key coordinates: a query at position p sees key j iff
``p - window_left <= j <= p + window_right`` and ``j < seqlen_k``; causal is ``window_right = 0``.
"""

from __future__ import annotations

import warpforge.kernels._dispatch  # noqa: F401  (chooses the interpreter before any @jit)

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Running-max start: finite so a row whose first blocks are all masked gives exp2(-inf - m) = 0 and
# alpha = exp2(0) = 1 instead of the NaN that (-inf) - (-inf) would give.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tanh through exp2 (no libdevice dependency, works in the interpreter); saturates to +-1 cleanly
    # because exp2 overflows to inf (-> 1) or underflows to 0 (-> -1).
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def key_range(min_pos, max_pos, seqlen_k, window_left, window_right,
              BLOCK_N: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Keys some valid row may see, [lo, hi), and keys all valid rows see, [full_lo, full_hi).

    min_pos/max_pos: smallest/largest key-coordinate position among the program's valid rows.
    lo, full_lo, full_hi are multiples of BLOCK_N (or equal hi); lo <= full_lo <= full_hi <= hi.
    """
    hi = seqlen_k
    if MASK_RIGHT:
        hi = tl.minimum(hi, max_pos + window_right + 1)
    lo = 0
    if MASK_LEFT:
        lo = tl.maximum(min_pos - window_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if MASK_LEFT:
        full_lo = tl.cdiv(tl.maximum(max_pos - window_left, 0), BLOCK_N) * BLOCK_N
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if MASK_RIGHT:
        full_hi = tl.minimum(full_hi, (tl.maximum(min_pos + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _load_tile(base, row_off, offs_d, n_ok, d_ok, MASK: tl.constexpr, PAD_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows at base + row_off; masks only where rows or padded dims can be invalid."""
    ptrs = base + row_off[:, None] + offs_d[None, :]
    if MASK:
        if PAD_D:
            return tl.load(ptrs, mask=n_ok[:, None] & d_ok, other=0.0)
        return tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    if PAD_D:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    return tl.load(ptrs)


@triton.jit
def head_scales(k_scale, v_scale, kvh, sm_scale, softcap, FP8: tl.constexpr):
    """(v_scale, qk_scale, cap_scale, cap_log2) of KV head ``kvh`` for the paged kernels. fp8 pages carry
    per-head scales: k's folds into the logit scales, v's multiplies the output (16-bit pages: 1). With
    fp8 pages the callers run the dots in fp16: e4m3 -> fp16 is one conversion per element pair, -> bf16
    costs a second one per element, and at fp8 streaming rates that ALU work matters (a bf16 query must
    then stay within fp16's +-65504, true of attention queries in practice)."""
    if FP8:
        ks = tl.load(k_scale + kvh)
        vs = tl.load(v_scale + kvh)
    else:
        ks = 1.0
        vs = 1.0
    qk_scale = sm_scale * ks * 1.4426950408889634  # log2(e): the loops work in exp2
    cap_scale = sm_scale * ks / softcap
    cap_log2 = softcap * 1.4426950408889634
    return vs, qk_scale, cap_scale, cap_log2


@triton.jit
def attend_blocks(acc, l_i, m_i, q, q_pos,
                  k_base, v_base, stride_kn, stride_vn,
                  page_row, num_pages, stride_kp, stride_vp,
                  k_desc, v_desc, desc_b, desc_row, desc_h,
                  lo, hi, seqlen_k, window_left, window_right,
                  qk_scale, cap_scale, cap_log2,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASK: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update over key blocks [lo, hi) (lo a multiple of BLOCK_N).

    acc [M, BLOCK_D] fp32, l_i/m_i [M] fp32 (m in log2 units), q [M, BLOCK_D], q_pos [M] int32.
    Where key n lives:
    * contiguous: k_base + n * stride_kn;
    * PAGED: k_base + page_row[n // PAGE_SIZE] * stride_kp + (n % PAGE_SIZE) * stride_kn, the page clamped
      to [0, num_pages): a table the launcher did not check (check_values=False) may give wrong
      values, but never reads outside the cache;
    * TMA: k_desc (a [B, S, H, D] tensor descriptor) at [desc_b, desc_row + n, desc_h, 0]; rows past
      the tensor read as zeros, rows of a neighbouring packed sequence are masked like any n >= seqlen_k.
    Logits: q.k * qk_scale (log2 units), or with SOFTCAP: cap_log2 * tanh(q.k * cap_scale).
    MASK=False promises every key in [lo, hi) is in bounds and visible to every row.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    d_ok = offs_d[None, :] < HEAD_DIM
    if PAGED:
        # Block-table entries are fetched one step ahead, so the K/V gathers of a step depend on a
        # loop-carried value instead of a load in the same step: the pipeliner can then keep
        # several K/V tiles in flight (a same-step index load limits it to one).
        page = tl.load(page_row + (lo + offs_n0) // PAGE_SIZE, mask=lo + offs_n0 < seqlen_k, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        n_ok = offs_n < seqlen_k
        if PAGED:
            next_n = offs_n + BLOCK_N
            page_next = tl.load(page_row + next_n // PAGE_SIZE, mask=next_n < seqlen_k, other=0)
            page = tl.minimum(tl.maximum(page.to(tl.int64), 0), num_pages - 1)
            tok = offs_n % PAGE_SIZE
            k_off = page * stride_kp + tok * stride_kn
            v_off = page * stride_vp + tok * stride_vn
        else:
            k_off = offs_n * stride_kn
            v_off = offs_n * stride_vn
        if TMA:
            k = k_desc.load([desc_b, desc_row + start_n, desc_h, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = _load_tile(k_base, k_off, offs_d, n_ok, d_ok, MASK, PAD_D)
        # fp8 pages: e4m3 values are exact in fp16/bf16; the per-head scale sits in qk_scale.
        k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, BLOCK_N] fp32
        if SOFTCAP:
            s = cap_log2 * _tanh(s * cap_scale)
        elif MASK:
            s = s * qk_scale
        if MASK:
            keep = n_ok[None, :]
            if MASK_RIGHT:
                keep = keep & (offs_n[None, :] <= q_pos[:, None] + window_right)
            if MASK_LEFT:
                keep = keep & (offs_n[None, :] >= q_pos[:, None] - window_left)
            s = tl.where(keep, s, float("-inf"))
        if SOFTCAP or MASK:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            # hot path: scale the row max instead of the tile, then one FMA per element
            # (s * qk_scale - m); valid because qk_scale > 0 (the launchers check it)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = v_desc.load([desc_b, desc_row + start_n, desc_h, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            v = _load_tile(v_base, v_off, offs_d, n_ok, d_ok, MASK, PAD_D)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
        if PAGED:
            page = page_next
    return acc, l_i, m_i


@triton.jit
def attend_span(acc, l_i, m_i, q, q_pos,
                k_base, v_base, stride_kn, stride_vn,
                page_row, num_pages, stride_kp, stride_vp,
                k_desc, v_desc, desc_b, desc_row, desc_h,
                lo, full_lo, full_hi, hi, seqlen_k, window_left, window_right,
                qk_scale, cap_scale, cap_log2,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """attend_blocks over a key_range: left edge masked, interior unmasked, right edge masked.

    Without MASK_LEFT the left edge is empty (key_range gives full_lo == lo, and decode's splits
    start at or after full_lo), so its loop is not compiled. It was dead code, and in the chunked
    kernel with 16-bit pages, a padded head dim (72..120, BLOCK_D 128), GQA group 2 or 4, no window
    and no softcap it made ptxas (CUDA 12.8, bundled with Triton 3.6) die with SIGSEGV: the kernel
    never compiled for sm_90. tests/kernels/attention/_sm90_compile.py compiles that case.
    """
    if MASK_LEFT:
        acc, l_i, m_i = attend_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, stride_kn, stride_vn, page_row,
                                      num_pages, stride_kp, stride_vp, k_desc, v_desc, desc_b, desc_row, desc_h,
                                      lo, full_lo, seqlen_k, window_left, window_right, qk_scale, cap_scale,
                                      cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                      PAGED, PAGE_SIZE, TMA, DOT_PRECISION)
    acc, l_i, m_i = attend_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, stride_kn, stride_vn,
                                  page_row, num_pages, stride_kp, stride_vp, k_desc, v_desc, desc_b, desc_row, desc_h,
                                  full_lo, full_hi, seqlen_k, window_left, window_right, qk_scale, cap_scale, cap_log2,
                                  BLOCK_N, BLOCK_D, HEAD_DIM, False, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                  PAGED, PAGE_SIZE, TMA, DOT_PRECISION)
    acc, l_i, m_i = attend_blocks(acc, l_i, m_i, q, q_pos, k_base, v_base, stride_kn, stride_vn,
                                  page_row, num_pages, stride_kp, stride_vp, k_desc, v_desc, desc_b, desc_row, desc_h,
                                  full_hi, hi, seqlen_k, window_left, window_right, qk_scale, cap_scale, cap_log2,
                                  BLOCK_N, BLOCK_D, HEAD_DIM, True, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                  PAGED, PAGE_SIZE, TMA, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def finalize(acc, l_i, m_i):
    """(out [M, BLOCK_D] fp32, lse [M] fp32 natural log); rows that saw no key give 0 and -inf."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    return out, lse
