"""Chunked-prefill attention over the paged KV cache: new query tokens see the cached prefix + themselves.

The engine packs, per step, each sequence's newest tokens (a prefill chunk, or 1 token for a decode)
into q [T, Hq, D] with ``cu_seqlens_q`` [B + 1], stores their K/V with ``store_kv`` first, then calls
:func:`chunked_prefill`. Sequence b holds ``seq_lens[b]`` tokens in the cache; its q_len queries are
the last q_len of them (positions seq_lens[b] - q_len ..), attention is causal. A prefix cached by
another sequence is reused by pointing the block table at the same pages.

One program per (query block, KV head, sequence). Its rows are (token, query head of this KV head)
pairs, row r = token r // group, head r % group (vLLM's unified-attention packing), so K/V pages are
read once per KV head and a decode token (q_len 1) still fills ``group`` rows of the dot.
"""

from __future__ import annotations


import torch

from warpforge.kernels._checks import refuse_interpreted_bf16, resolve_check_values
from warpforge.kernels._dispatch import INTERPRET, use_triton
from warpforge.kernels.attention._online_softmax import NEG_BIG, attend_span, finalize, head_scales, key_range
from warpforge.kernels.attention.kv_cache import PagedKVCache, check_paged_inputs
from warpforge.kernels.attention.prefill import (FP32_CONFIG, INTERPRET_CONFIG, AttentionConfig,
                                                 check_attention_options)
from warpforge.kernels.reference import attention_window, paged_attention_ref

import triton
import triton.language as tl

# 64 rows x 64 keys: decodes fill only `group` rows, so a taller tile mostly computes padding.
DEFAULT_CHUNKED_CONFIG = AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


@triton.jit
def _chunked_kernel(Q, KC, VC, block_tables, num_pages, seq_lens, cu_q, k_scale, v_scale, O,
                    stride_qt, stride_qh,
                    stride_kp, stride_kh, stride_kt,
                    stride_vp, stride_vh, stride_vt,
                    stride_bt, stride_ot, stride_oh,
                    sm_scale, softcap, window_left,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASK_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per program
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_start
    if pid_m * BLOCK_Q >= q_len:
        return
    L = tl.load(seq_lens + b)
    ctx = L - q_len  # position of this sequence's first new token

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = pid_m * BLOCK_Q + offs_r // GROUP
    heads = kvh * GROUP + offs_r % GROUP
    row_ok = (offs_r < BLOCK_Q * GROUP) & (tok < q_len)
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    t64 = (q_start + tok).to(tl.int64)
    q = tl.load(Q + t64[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = ctx + tok
    min_pos = ctx + pid_m * BLOCK_Q
    max_pos = ctx + tl.minimum(q_len, (pid_m + 1) * BLOCK_Q) - 1
    lo, full_lo, full_hi, hi = key_range(min_pos, max_pos, L, window_left, 0, BLOCK_N, MASK_LEFT, True)

    vs, qk_scale, cap_scale, cap_log2 = head_scales(k_scale, v_scale, kvh, sm_scale, softcap, FP8)
    if FP8:
        q = q.to(tl.float16)  # see head_scales

    k_base = KC + kvh.to(tl.int64) * stride_kh
    v_base = VC + kvh.to(tl.int64) * stride_vh
    page_row = block_tables + b.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    acc, l_i, m_i = attend_span(acc, l_i, m_i, q, q_pos, k_base, v_base, stride_kt, stride_vt,
                                page_row, num_pages, stride_kp, stride_vp, None, None, 0, 0, 0,
                                lo, full_lo, full_hi, hi, L, window_left, 0, qk_scale, cap_scale, cap_log2,
                                BLOCK_N, BLOCK_D, HEAD_DIM, MASK_LEFT, True, SOFTCAP,
                                True, PAGE_SIZE, False, DOT_PRECISION)
    out, _ = finalize(acc, l_i, m_i)
    out = out * vs
    tl.store(O + t64[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=io_mask)


def _check_query_lengths(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, total: int) -> int:
    """Value checks (one host sync); returns the longest query run."""
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    if cu[0] != 0 or cu[-1] != total or min(q_lens, default=0) < 0:
        raise ValueError(f"cu_seqlens_q: expected non-decreasing from 0 to {total} (rows of q), got {cu[0]}..{cu[-1]}")
    over = [b for b, (n, L) in enumerate(zip(q_lens, seq_lens.tolist(), strict=True)) if n > L]
    if over:
        raise ValueError(f"seq_lens: must count the new tokens too (q_len <= seq_len); sequences {over[:4]} violate it")
    return max(q_lens, default=0)


def chunked_prefill(q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, *, max_seqlen_q: int | None = None, scale: float | None = None,
                    softcap: float | None = None, window: int | None = None, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None, check_values: bool | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens q [T, Hq, D] over their sequences' paged K/V -> [T, Hq, D].

    cu_seqlens_q int32 [B + 1]; block_tables int32 [B, max_pages]; seq_lens int32 [B] (cached + new).
    ``max_seqlen_q`` (longest q run) sizes the grid without a host sync; ``window`` w: each query sees
    itself and the w keys before it. ``check_values``: see :func:`check_paged_inputs`.
    """
    check_paged_inputs(q, cache, block_tables, seq_lens, check_values=check_values)
    if q.dim() != 3:
        raise ValueError(f"q: expected packed [T, Hq, D], got {tuple(q.shape)}")
    B = block_tables.shape[0]
    if (not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32
            or cu_seqlens_q.shape != (B + 1,) or cu_seqlens_q.device != q.device):
        raise ValueError(f"cu_seqlens_q: expected int32 [{B + 1}] (B + 1 for B block-table rows) on {q.device}")
    if max_seqlen_q is None or resolve_check_values(check_values, q.device):
        longest = _check_query_lengths(cu_seqlens_q, seq_lens, q.shape[0])
        max_seqlen_q = longest if max_seqlen_q is None else max_seqlen_q
        if longest > max_seqlen_q:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is shorter than the longest query run {longest}")
    left, _ = attention_window(window, causal=True)
    scale = check_attention_options(q, scale, softcap, out)
    out = torch.empty_like(q) if out is None else out
    if not use_triton(q, cache.k_cache, block_tables, seq_lens, cu_seqlens_q):
        out.copy_(paged_attention_ref(q, cache.k_cache, cache.v_cache, block_tables, seq_lens, cu_seqlens_q,
                                      scale=scale, softcap=softcap, window=window,
                                      k_scale=cache.k_scale, v_scale=cache.v_scale))
        return out
    refuse_interpreted_bf16("chunked_prefill", q, cache.k_cache)
    if q.shape[0] == 0 or B == 0 or max_seqlen_q == 0:
        return out

    D, Hkv = q.shape[-1], cache.num_kv_heads
    group = q.shape[1] // Hkv
    if config is not None:
        cfg = config
    elif INTERPRET:
        cfg = INTERPRET_CONFIG
    else:
        cfg = FP32_CONFIG if q.dtype == torch.float32 else DEFAULT_CHUNKED_CONFIG
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    kc, vc = cache.k_cache, cache.v_cache
    _chunked_kernel[(triton.cdiv(max_seqlen_q, block_q), Hkv, B)](
        q, kc, vc, block_tables, cache.num_pages, seq_lens, cu_seqlens_q, cache.k_scale, cache.v_scale, out,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale, softcap or 1.0, left,
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PAGE_SIZE=cache.page_size, BLOCK_N=cfg.block_n,
        MASK_LEFT=left >= 0, SOFTCAP=softcap is not None, FP8=cache.is_fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
