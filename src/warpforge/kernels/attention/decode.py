"""Decode attention over the paged KV cache: one new query token per sequence, split-KV + reduce.

One program per (sequence, KV head, split) owns ALL query heads of its KV head (the q tile is
[group, D]), so each K/V page is read from HBM once per KV head, not once per query head. Each split
takes an equal share of the sequence's visible pages, computed in the kernel from ``seq_lens``; the
launch grid (B, Hkv, num_splits) depends only on the batch size and the static table capacity, never
on the actual lengths, so one CUDA-graph capture replays for any lengths. Splits with nothing to do
write an empty partial (lse = -inf) and exit; a second kernel merges the partials per query head.

``DecodeConfig(fused_reduce=True)`` merges in the same launch instead: each split program writes its
partial, then draws a ticket from an int32 counter per (sequence, KV head); the program drawing the
last ticket merges that KV head's GROUP query heads, writes O and resets the counter to 0, so the
next launch (or CUDA-graph replay) finds it zeroed without a memset. One kernel launch less per call
(a kernel's fixed cost inside a graph, as `probe` measures it), paid for by the merging program's read
of the partials on one SM. Not yet measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from warpforge.kernels._checks import check_num_warps, check_pow2, refuse_interpreted_bf16
from warpforge.kernels._dispatch import INTERPRET, pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.attention._online_softmax import NEG_BIG, attend_span, finalize, head_scales, key_range
from warpforge.kernels.attention._qk_fp8 import attend_span_qk8, quantize_rows_e4m3
from warpforge.kernels.attention.kv_cache import PagedKVCache, check_paged_inputs
from warpforge.kernels.attention.prefill import check_attention_options
from warpforge.kernels.reference import attention_window, paged_decode_ref

import triton
import triton.language as tl


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs of paged decode (sweep these on the GPU)."""

    block_n: int = 64  # tokens per inner step: 4 pages of 16, 16 KiB of bf16 K at D=128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4  # split until B * Hkv * splits reaches this many programs per SM
    min_split_tokens: int = 256  # a split shorter than this costs more in merging than it gains
    max_splits: int = 64
    # merge the splits in the same launch (the last split program of each KV head, through an atomic
    # ticket) instead of a second kernel; off until measured on the GPU
    fused_reduce: bool = False
    # fp8 pages only: quantize q per head to e4m3 and run QK^T as an e4m3 x e4m3 dot (no K conversion;
    # attention/_qk_fp8.py); off until measured on the GPU
    qk_fp8: bool = False

    def __post_init__(self) -> None:
        for name in ("fused_reduce", "qk_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        check_pow2(self, "block_n", lo=16)
        check_num_warps(self)
        for name in ("num_stages", "programs_per_sm", "min_split_tokens", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeConfig.{name}: expected >= 1, got {getattr(self, name)}")


INTERPRET_DECODE_CONFIG = DecodeConfig(block_n=16, num_warps=1, num_stages=1, programs_per_sm=1,
                                       min_split_tokens=16, max_splits=4)

# Knobs for the GPU sweep (tile height x pipeline depth x warps; splits via programs_per_sm).
DECODE_SWEEP: tuple[DecodeConfig, ...] = tuple(
    DecodeConfig(block_n=bn, num_warps=w, num_stages=s, programs_per_sm=pps)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
    for pps in (2, 4, 8)
)


def default_decode_config(head_dim: int, fp8: bool, *, qk_fp8: bool = False) -> DecodeConfig:
    """Defaults from the H200 sweep (``benchmarks/sweeps/decode_sweep.py``, 32/8 heads, D 128, pages of 16):

    * bf16 pages: 64 tokens (16 KiB of K) per step, double-buffered (3 stages cost occupancy: B1 ctx32k
      2.63 -> 3.31 TB/s, B64 ctx512 2.67 -> 3.56 TB/s going from 3 stages to 2), ~4 programs per SM.
    * fp8 pages: 128 tokens per step (the same 16 KiB), 3 stages, ~2 programs per SM: the in-register
      e4m3 -> fp16 conversion makes each program heavier, and fewer, longer splits won at every shape.
    * D > 128: 32 tokens per step (keeps 2-3 programs per SM within 228 KiB of shared memory).
    * ``qk_fp8`` (fp8 pages, e4m3 QK^T; not yet measured): 128 tokens, 4 warps, 2 stages. Offline sm_90
      compile (interior loop, SASS): 27.3 warp instructions per token against the plain fp8 loop's 35.7,
      242 registers without spills, so 2 programs per SM as today's 208. The fp8 default's 3 stages
      spill with it (255); 64 tokens x 8 warps fits in 121 registers but issues 57.9 per token: what
      the keys-major loop saves on K it partly spends transposing V (byte permutes, a shared-memory
      round trip) into the fp16 dot's register operand.
    """
    if qk_fp8:
        if not fp8:
            raise ValueError("default_decode_config: qk_fp8 needs fp8 pages (fp8=True)")
        if INTERPRET:
            return dataclasses.replace(INTERPRET_DECODE_CONFIG, qk_fp8=True)
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=2, qk_fp8=True)
    if INTERPRET:
        return INTERPRET_DECODE_CONFIG
    if head_dim > 128:
        return DecodeConfig(block_n=32)
    if fp8:
        return DecodeConfig(block_n=128, num_stages=3, programs_per_sm=2)
    return DecodeConfig(block_n=64, num_stages=2, programs_per_sm=4)


def _merge_splits_per_step(g_p2: int, block_d: int, num_warps: int) -> int:
    """Splits the fused merge reads per step: a [G_P2, MERGE_S, BLOCK_D] fp32 tile of ~64 registers a
    thread (32 KiB at 4 warps, D 128), so up to 16 splits of a GQA-4 head group take one round trip."""
    return max(1, (64 * 32 * num_warps) // (g_p2 * block_d))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, *, num_sms: int,
                      config: DecodeConfig | None = None) -> int:
    """Splits per (sequence, KV head), a function of static sizes only (so a CUDA graph stays valid).

    About ``num_sms * programs_per_sm`` programs, rounded down (a split count that leaves a partial
    wave of programs was slower than one split fewer), but no split shorter than ``min_split_tokens``
    of the largest context the grid is built for, and at most ``max_splits``; then rounded down to a
    power of two, so a sequence's blocks divide evenly among its splits (uneven splits left SMs idle:
    notes/attention.md). The count is a runtime argument of the kernel: any value reuses the same
    compiled kernel.
    """
    cfg = config or DecodeConfig()
    want = num_sms * cfg.programs_per_sm // max(1, batch * num_kv_heads)
    cap = min(cfg.max_splits, max(1, max_seq_len // cfg.min_split_tokens))
    n = max(1, min(want, cap))
    return 1 << (n.bit_length() - 1)


@triton.jit
def _merge_when_last(counter, O_part, LSE_part, O, b, kvh, num_splits, stride_ob, stride_oh,
                     GROUP: tl.constexpr, G_P2: tl.constexpr, MERGE_S: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Fused reduce: take a ticket; the program that draws the last one merges the KV head's splits.

    The barrier puts every thread's partial stores before the ticket, and the ticket's release (gpu
    scope) publishes them; the last program's acquire puts its loads after every other program's
    release (the counter's read-modify-writes form one release sequence). The loads bypass L1 (.cg):
    the partials were written by other SMs. Same math as _decode_reduce_kernel, over chunks of MERGE_S
    splits at a time (one chunk: exactly its formula; more: online rescaling by the running max).
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_splits - 1:
        offs_g = tl.arange(0, G_P2)
        offs_s = tl.arange(0, MERGE_S)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        rows = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits  # [G_P2] split 0's row
        m = tl.zeros([G_P2], dtype=tl.float32) + float("-inf")
        total = tl.zeros([G_P2], dtype=tl.float32)
        acc = tl.zeros([G_P2, BLOCK_D], dtype=tl.float32)
        # not pipelined: staged copies would add shared memory to the whole kernel (occupancy)
        for s0 in tl.range(0, num_splits, MERGE_S, num_stages=1):
            r = rows[:, None] + (s0 + offs_s)[None, :]  # [G_P2, MERGE_S]
            ok = g_ok[:, None] & ((s0 + offs_s) < num_splits)[None, :]
            lse = tl.load(LSE_part + r, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(O_part + r[:, :, None] * BLOCK_D + offs_d[None, None, :],
                        mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0, no NaN
            alpha = tl.exp(m - m_ref)
            w = tl.exp(lse - m_ref[:, None])  # [G_P2, MERGE_S]; empty splits weigh 0
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
            total = total * alpha + tl.sum(w, 1)
            m = m_new
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        o_ptrs = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(counter, 0)  # every split has drawn: ready for the next launch or graph replay


@triton.jit
def _decode_kernel(Q, KC, VC, block_tables, num_pages, seq_lens, k_scale, v_scale, O, O_part, LSE_part, counters,
                   stride_qb, stride_qh,
                   stride_kp, stride_kh, stride_kt,
                   stride_vp, stride_vh, stride_vt,
                   stride_bt, stride_ob, stride_oh,
                   sm_scale, softcap, window_left, num_splits,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   MASK_LEFT: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = 0,
                   FUSED_REDUCE: tl.constexpr = False, G_P2: tl.constexpr = 1, MERGE_S: tl.constexpr = 1,
                   QK_FP8: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(seq_lens + b)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_ok = offs_g < GROUP
    io_mask = g_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (L - 1)

    # The query sits at L - 1 and sees [max(0, L - 1 - window_left), L); this split gets an equal
    # run of whole key blocks of that range.
    lo, full_lo, full_hi, hi = key_range(L - 1, L - 1, L, window_left, 0, BLOCK_N, MASK_LEFT, False)
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    s_lo = tl.minimum(lo + split * per_split, hi)
    s_hi = tl.minimum(s_lo + per_split, hi)
    a = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    c = tl.minimum(tl.maximum(full_hi, a), s_hi)

    vs, qk_scale, cap_scale, cap_log2 = head_scales(k_scale, v_scale, kvh, sm_scale, softcap, FP8)
    if FP8:
        if not QK_FP8:
            q = q.to(tl.float16)  # see head_scales

    k_base = KC + kvh.to(tl.int64) * stride_kh
    v_base = VC + kvh.to(tl.int64) * stride_vh
    page_row = block_tables + b.to(tl.int64) * stride_bt
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) + NEG_BIG
    if QK_FP8:  # e4m3 q rows, each with its power-of-two scale folded into its logit scale
        q8, q_scale = quantize_rows_e4m3(q.to(tl.float32))
        acc_t = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)
        acc_t, l_i, m_i = attend_span_qk8(acc_t, l_i, m_i, q8, q_pos, k_base, v_base, stride_kt, stride_vt,
                                          page_row, num_pages, stride_kp, stride_vp, s_lo, a, c, s_hi, L, window_left,
                                          qk_scale * q_scale, cap_scale * q_scale, cap_log2,
                                          BLOCK_N, BLOCK_D, HEAD_DIM, MASK_LEFT, SOFTCAP, PAGE_SIZE)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        acc, l_i, m_i = attend_span(acc, l_i, m_i, q, q_pos, k_base, v_base, stride_kt, stride_vt,
                                    page_row, num_pages, stride_kp, stride_vp, None, None, 0, 0, 0,
                                    s_lo, a, c, s_hi, L, window_left, 0, qk_scale, cap_scale, cap_log2,
                                    BLOCK_N, BLOCK_D, HEAD_DIM, MASK_LEFT, False, SOFTCAP,
                                    True, PAGE_SIZE, False, DOT_PRECISION)
    pdl_release(PDL)
    out, lse = finalize(acc, l_i, m_i)
    out = out * vs
    if not SPLIT:
        o_ptrs = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=io_mask)
    else:
        # partials: O_part [B, Hq, num_splits, BLOCK_D] fp32, LSE_part [B, Hq, num_splits] fp32
        row = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(O_part + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=io_mask)
        tl.store(LSE_part + row, lse, mask=g_ok)
        if FUSED_REDUCE:  # counters int32 [B, Hkv], zero between launches
            _merge_when_last(counters + b * tl.num_programs(1) + kvh, O_part, LSE_part, O, b, kvh, num_splits,
                             stride_ob, stride_oh, GROUP, G_P2, MERGE_S, HEAD_DIM, BLOCK_D)


@triton.jit
def _decode_reduce_kernel(O_part, LSE_part, O, stride_ob, stride_oh, num_heads, num_splits,
                          BLOCK_S: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    # out = sum_s exp(lse_s - max) * out_s / sum_s exp(lse_s - max); empty splits weigh 0.
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    row = (b.to(tl.int64) * num_heads + h) * num_splits
    lse = tl.load(LSE_part + row + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    o = tl.load(O_part + (row + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    pdl_release(PDL)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Fused-reduce ticket counters, one zeroed int32 buffer per device, grown on demand. A buffer that is
# outgrown stays referenced: a CUDA graph captured with it keeps its address and replays into it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def split_counter_buffer(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters on ``device``, shared by every fused-reduce
    launch there (each launch leaves the counters it used at 0). Launches on one stream may share it;
    launches that may run concurrently (two streams) must pass their own ``split_counters``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"paged_decode(fused_reduce): {n} split counters needed while capturing a CUDA "
                               f"graph, {0 if buf is None else buf.numel()} allocated; run the same call once "
                               f"before capture or pass split_counters= (a zeroed int32 buffer you keep)")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(1024, triton.next_power_of_2(n)), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _check_counters(counters: torch.Tensor, n: int, device: torch.device) -> None:
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or counters.device != device
            or not counters.is_contiguous() or counters.numel() < n):
        got = (f"{counters.dtype} {tuple(counters.shape)} on {counters.device}" if isinstance(counters, torch.Tensor)
               else type(counters).__name__)
        raise ValueError(f"split_counters: expected a contiguous zeroed int32 tensor of >= {n} elements "
                         f"(B x Hkv) on {device}, got {got}")


def paged_decode(q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 *, scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 max_seq_len: int | None = None, num_splits: int | None = None,
                 out: torch.Tensor | None = None, config: DecodeConfig | None = None,
                 check_values: bool | None = None, split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its paged K/V: q [B, Hq, D] -> [B, Hq, D].

    block_tables int32 [B, max_pages], seq_lens int32 [B] (0 allowed: gives zeros, e.g. CUDA-graph
    padding). The query sits at position seq_lens[b] - 1 (its K/V already stored). ``window`` w: it
    sees the last w + 1 keys. ``max_seq_len`` (default: the table's capacity) and the batch size fix
    the number of splits, hence the grid; ``num_splits`` overrides. ``check_values``: see
    :func:`check_paged_inputs`. ``split_counters`` (with ``config.fused_reduce``): a zeroed int32
    buffer of >= B * Hkv counters that the kernel leaves zeroed; default: a per-device buffer
    (:func:`split_counter_buffer`), allocated on first use, so the first call must not be inside a capture.
    """
    check_paged_inputs(q, cache, block_tables, seq_lens, check_values=check_values)
    if q.dim() != 3 or q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q: expected [B={block_tables.shape[0]}, Hq, D] (one token per sequence), "
                         f"got {tuple(q.shape)}")
    left, _ = attention_window(window, causal=True)
    scale = check_attention_options(q, scale, softcap, out)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits: expected an int >= 1, got {num_splits!r}")
    if split_counters is not None:
        _check_counters(split_counters, q.shape[0] * cache.num_kv_heads, q.device)
    if config is not None and config.qk_fp8 and not cache.is_fp8:
        raise ValueError(f"DecodeConfig.qk_fp8: needs fp8 (e4m3) pages, the cache holds {cache.dtype}")
    out = torch.empty_like(q) if out is None else out
    if not use_triton(q, cache.k_cache, block_tables, seq_lens):
        out.copy_(paged_decode_ref(q, cache.k_cache, cache.v_cache, block_tables, seq_lens, scale=scale,
                                   softcap=softcap, window=window, k_scale=cache.k_scale, v_scale=cache.v_scale))
        return out
    refuse_interpreted_bf16("paged_decode", q, cache.k_cache)

    B, Hq, D = q.shape
    Hkv, group = cache.num_kv_heads, q.shape[1] // cache.num_kv_heads
    if B == 0:
        return out
    cfg = config or default_decode_config(D, cache.is_fp8)
    if num_splits is None:
        capacity = block_tables.shape[1] * cache.page_size if max_seq_len is None else max_seq_len
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 4
        num_splits = num_decode_splits(B, Hkv, capacity, num_sms=sms, config=cfg)
    block_d = max(32 if cfg.qk_fp8 else 16, triton.next_power_of_2(D))  # an e4m3 dot needs K >= 32
    fused = cfg.fused_reduce and num_splits > 1
    counters = None
    if fused:
        counters = split_counters if split_counters is not None else split_counter_buffer(q.device, B * Hkv)
    if num_splits > 1:
        o_part = torch.empty((B, Hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = None
    g_p2 = triton.next_power_of_2(group)
    kc, vc = cache.k_cache, cache.v_cache
    _decode_kernel[(B, Hkv, num_splits)](
        q, kc, vc, block_tables, cache.num_pages, seq_lens, cache.k_scale, cache.v_scale, out, o_part, lse_part,
        counters,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale, softcap or 1.0, left, num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=D, BLOCK_D=block_d, PAGE_SIZE=cache.page_size, BLOCK_N=cfg.block_n,
        SPLIT=num_splits > 1, MASK_LEFT=left >= 0, SOFTCAP=softcap is not None, FP8=cache.is_fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl(q), launch_pdl=pdl(q) > 0,
        FUSED_REDUCE=fused, G_P2=g_p2, MERGE_S=_merge_splits_per_step(g_p2, block_d, cfg.num_warps),
        QK_FP8=cfg.qk_fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1 and not fused:
        _decode_reduce_kernel[(B, Hq)](
            o_part, lse_part, out, out.stride(0), out.stride(1), Hq, num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=D, BLOCK_D=block_d, PDL=pdl(q),
            launch_pdl=pdl(q) > 0, num_warps=4,
        )
    return out
