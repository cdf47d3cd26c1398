"""Prefill / encoder attention forward: FlashAttention-2 style, one program per (query block, head, batch).

Layouts (both read in place, no copies):

* batched: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with any strides except a unit last-dim stride. A
  vision model holding SDPA's [B, H, S, D] passes ``x.transpose(1, 2)``; the output is allocated with
  q's strides, so ``out.transpose(1, 2)`` is again a contiguous [B, H, S, D].
* packed (variable length, what the LLM engine holds): q [Tq, H, D], k/v [Tk, Hkv, D] with int32
  ``cu_seqlens_q/k`` [B + 1]; no padding anywhere.

Grouped-query / multi-query attention: q head h reads KV head h // (H // Hkv). Causal masking is
bottom-right aligned (query i of Sq sits at key position Sk - Sq + i, as in FlashAttention >= 2.1; the
same as SDPA's ``is_causal`` when Sq == Sk). Softmax runs online in fp32; no S x S matrix exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from warpforge.kernels._checks import check_num_warps, check_pow2, refuse_interpreted_bf16
from warpforge.kernels._dispatch import INTERPRET, use_triton
from warpforge.kernels.attention._online_softmax import LOG2E, NEG_BIG, attend_span, finalize, key_range
from warpforge.kernels.reference import attention_window, flash_attention_ref

import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TESTED_HEAD_DIMS = (64, 80, 96, 128, 256)
# In-sequence offsets are int32 inside the loop (cheaper address math); base offsets are int64.
_I32 = 2**31


@dataclass(frozen=True)
class AttentionConfig:
    """Launch knobs of the prefill and chunked-prefill kernels (sweep these on the GPU)."""

    block_m: int = 128  # query rows per program
    block_n: int = 64  # keys per inner-loop step
    num_warps: int = 8
    num_stages: int = 3
    # Load Q/K/V through Hopper TMA descriptors instead of pointer loads (cp.async). Used where the
    # layout allows it (power-of-two head dim, 16-byte aligned base and strides), else ignored.
    tma: bool = False

    def __post_init__(self) -> None:
        check_pow2(self, "block_m", "block_n", lo=16)  # 16: tl.dot's smallest operand
        check_num_warps(self)
        if self.num_stages < 1:
            raise ValueError(f"AttentionConfig.num_stages: expected >= 1, got {self.num_stages}")


# The interpreter runs programs one by one in numpy: small tiles keep CPU tests fast.
INTERPRET_CONFIG = AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)

# Starting points for H200 (FA2-style Triton on Hopper: 128x64..128x128 tiles, 8 warps, 3-4 stages;
# the fp32 accumulator of D=256 needs a 64-row tile to stay in registers). The lead sweeps
# PREFILL_SWEEP and updates this table.
_DEFAULTS: dict[tuple[int, bool], AttentionConfig] = {
    (64, False): AttentionConfig(128, 64, 4, 4),
    (64, True): AttentionConfig(128, 64, 4, 4),
    (128, False): AttentionConfig(128, 64, 8, 3),
    (128, True): AttentionConfig(128, 64, 8, 3),
    (256, False): AttentionConfig(64, 64, 8, 2),
    (256, True): AttentionConfig(64, 64, 8, 2),
}

PREFILL_SWEEP: tuple[AttentionConfig, ...] = tuple(
    AttentionConfig(bm, bn, w, s, tma)
    for bm in (64, 128)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3, 4)
    for tma in (False, True)
    if not (bm * bn < 128 * 64 and w == 8)
)


# fp32 inputs run an IEEE (non-tensor-core) dot: a small tile keeps it from spilling.
FP32_CONFIG = AttentionConfig(64, 32, 4, 2)


def default_config(head_dim: int, causal: bool, dtype: torch.dtype = torch.bfloat16) -> AttentionConfig:
    """The launch config used when ``config`` is not given (interpreter: tiny tiles)."""
    if INTERPRET:
        return INTERPRET_CONFIG
    if dtype == torch.float32:
        return FP32_CONFIG
    padded = max(16, triton.next_power_of_2(head_dim))
    return _DEFAULTS.get((min(padded, 256), causal), _DEFAULTS[(128, causal)])


@triton.jit
def _flash_fwd_kernel(Q, K, V, O, LSE, cu_q, cu_k, q_desc, k_desc, v_desc,
                      stride_qb, stride_qs, stride_qh,
                      stride_kb, stride_ks, stride_kh,
                      stride_vb, stride_vs, stride_vh,
                      stride_ob, stride_os, stride_oh,
                      stride_lb, stride_lh,
                      seqlen_q, seqlen_k, group,
                      qk_scale, cap_scale, cap_log2, window_left, window_right,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                      VARLEN: tl.constexpr, STORE_LSE: tl.constexpr, TMA: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    # Heaviest query blocks first: under causal masking the last blocks see the most keys, and
    # starting them early keeps the tail of the launch short.
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // group
    q_off = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_off = b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_off = b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    o_off = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    lse_off = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    if VARLEN:
        q_start = tl.load(cu_q + b)
        seqlen_q = tl.load(cu_q + b + 1) - q_start
        k_start = tl.load(cu_k + b)
        seqlen_k = tl.load(cu_k + b + 1) - k_start
        q_off += q_start.to(tl.int64) * stride_qs
        o_off += q_start.to(tl.int64) * stride_os
        k_off += k_start.to(tl.int64) * stride_ks
        v_off += k_start.to(tl.int64) * stride_vs
        lse_off += q_start.to(tl.int64)
        desc_b = 0  # packed tensors are described as [1, T, H, D]
    else:
        q_start = 0
        k_start = 0
        desc_b = b
    if start_m * BLOCK_M >= seqlen_q:
        return

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if TMA:  # rows past this sequence are zeros or a neighbour's: computed, never stored
        q = q_desc.load([desc_b, q_start + start_m * BLOCK_M, h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(Q + q_off + offs_m[:, None] * stride_qs + offs_d[None, :], mask=io_mask, other=0.0)

    shift = seqlen_k - seqlen_q  # bottom-right alignment
    q_pos = offs_m + shift
    min_pos = start_m * BLOCK_M + shift
    max_pos = tl.minimum(seqlen_q, (start_m + 1) * BLOCK_M) - 1 + shift
    lo, full_lo, full_hi, hi = key_range(min_pos, max_pos, seqlen_k, window_left, window_right,
                                         BLOCK_N, MASK_LEFT, MASK_RIGHT)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    acc, l_i, m_i = attend_span(acc, l_i, m_i, q, q_pos, K + k_off, V + v_off, stride_ks, stride_vs,
                                None, 0, 0, 0, k_desc, v_desc, desc_b, k_start, kvh,
                                lo, full_lo, full_hi, hi, seqlen_k, window_left, window_right,
                                qk_scale, cap_scale, cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM,
                                MASK_LEFT, MASK_RIGHT, SOFTCAP, False, 1, TMA, DOT_PRECISION)
    out, lse = finalize(acc, l_i, m_i)
    tl.store(O + o_off + offs_m[:, None] * stride_os + offs_d[None, :], out.to(O.dtype.element_ty), mask=io_mask)
    if STORE_LSE:
        tl.store(LSE + lse_off + offs_m, lse, mask=row_ok)


def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride on the head dimension, got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (same as q), got {t.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    D = q.shape[-1]
    if D % 8 or not 8 <= D <= 256:
        raise ValueError(f"q: head dim must be a multiple of 8 in [8, 256] (tested: {TESTED_HEAD_DIMS}), got {D}")
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"k, v: expected head dim {D} (q's), got {k.shape[-1]} and {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    H, Hkv = q.shape[-2], k.shape[-2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"k: number of KV heads ({Hkv}) must divide the number of query heads ({H})")


def _check_cu(name: str, cu: torch.Tensor, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: expected an int32 tensor [B + 1] of cumulative lengths starting at 0")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (same as q), got {cu.device}")


def _check_cu_values(cu_q: torch.Tensor, cu_k: torch.Tensor, tq: int, tk: int) -> int:
    """Value checks of the cumulative lengths (one host sync); returns the longest query sequence."""
    lq, lk = cu_q.diff(), cu_k.diff()
    first = torch.stack([cu_q[0], cu_k[0]]).tolist()
    last = torch.stack([cu_q[-1], cu_k[-1]]).tolist()
    if first != [0, 0] or (lq < 0).any() or (lk < 0).any():
        raise ValueError("cu_seqlens_q/k: expected non-decreasing cumulative lengths starting at 0")
    if last != [tq, tk]:
        raise ValueError(f"cu_seqlens_q/k: expected totals ({tq}, {tk}) = rows of q and k, got {tuple(last)}")
    return int(lq.max())


def _tma_descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig, block_d: int):
    """[B, S, H, D] descriptors (packed [T, H, D] as [1, T, H, D]) for Q, K, V; None if TMA cannot apply.

    A 4-D descriptor keeps any batch/sequence/head strides and zero-fills rows past a sequence.
    """
    if block_d != q.shape[-1] or not (q.is_cuda or INTERPRET):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older Triton: pointer loads only
        return None
    descs = []
    for t, rows in ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n)):
        t4 = t if t.dim() == 4 else t.unsqueeze(0)
        size = t4.element_size()
        if t4.data_ptr() % 16 or any(st * size % 16 for st in t4.stride()[:-1]):
            return None
        descs.append(TensorDescriptor(t4, list(t4.shape), list(t4.stride()), [1, rows, 1, block_d]))
    return tuple(descs)



def check_attention_options(q: torch.Tensor, scale: float | None, softcap: float | None,
                            out: torch.Tensor | None) -> float:
    """The checks every attention launcher shares; returns the softmax scale (default D^-0.5)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected a positive float or None, got {softcap}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite float > 0, got {scale}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or out.stride(-1) != 1):
        raise ValueError(f"out: expected {tuple(q.shape)} {q.dtype} on {q.device} with unit last stride")
    return scale

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scale: float | None = None, window: int | tuple[int, int] | None = None,
                    softcap: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                    return_lse: bool = False, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None):
    """softmax(q k^T * scale [+ masks]) v for fp16/bf16 (fp32 accepted) q, k, v.

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (batched), or q [Tq, H, D], k/v [Tk, Hkv, D] with int32
    ``cu_seqlens_q/k`` [B + 1] (packed variable-length; ``max_seqlen_q`` avoids a host sync).
    ``window``: None, int w (w keys each side) or (left, right), -1 unbounded; causal caps right at 0.
    ``softcap``: logits become softcap * tanh(logits / softcap) (Gemma 2 style) before masking.
    Returns out shaped like q (with q's strides), and with ``return_lse`` also the fp32 natural-log
    log-sum-exp, [B, H, Sq] or [H, Tq]; rows that see no key give 0 and -inf.
    """
    _check_common(q, k, v)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q, cu_seqlens_k: expected both or neither")
        if q.dim() != 3 or k.dim() != 3:
            raise ValueError(f"q, k: packed inputs must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
        _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
        _check_cu("cu_seqlens_k", cu_seqlens_k, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_k: expected {cu_seqlens_q.numel()} entries like cu_seqlens_q, "
                             f"got {cu_seqlens_k.numel()}")
        if max_seqlen_q is None or not q.is_cuda:
            # Needs a host sync: done when the caller did not give max_seqlen_q (the engine and
            # CUDA-graph capture pass it and vouch for the lengths) and always on CPU, where it is free.
            longest = _check_cu_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
            max_seqlen_q = longest if max_seqlen_q is None else max_seqlen_q
            if longest > max_seqlen_q:
                raise ValueError(f"max_seqlen_q: {max_seqlen_q} is shorter than the longest query sequence {longest}")
    else:
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q, k: expected [B, S, H, D] (or packed [T, H, D] with cu_seqlens), "
                             f"got {tuple(q.shape)} and {tuple(k.shape)}")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k: expected batch {q.shape[0]} (q's), got {k.shape[0]}")
    left, right = attention_window(window, causal)
    scale = check_attention_options(q, scale, softcap, out)

    if not use_triton(q, k, v):
        res = flash_attention_ref(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, return_lse=return_lse)
        o_ref, lse = res if return_lse else (res, None)
        out = torch.empty_like(q) if out is None else out
        out.copy_(o_ref)
        return (out, lse) if return_lse else out
    refuse_interpreted_bf16("flash_attention", q, k, v)

    H, D = q.shape[-2], q.shape[-1]
    Hkv = k.shape[-2]
    if varlen:
        B = cu_seqlens_q.numel() - 1
        Sq, Sk = max_seqlen_q, 0
        rows_q, rows_k = q.shape[0], k.shape[0]
        sq = (0, q.stride(0), q.stride(1))
        sk = (0, k.stride(0), k.stride(1))
        sv = (0, v.stride(0), v.stride(1))
    else:
        B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
        rows_q, rows_k = Sq, Sk
        sq, sk, sv = q.stride()[:3], k.stride()[:3], v.stride()[:3]
    if rows_k * max(k.stride(-3), v.stride(-3)) >= _I32 or rows_q * q.stride(-3) >= _I32:
        raise ValueError("q/k/v: a sequence's extent must stay below 2**31 elements (int32 in-loop offsets)")

    out = torch.empty_like(q) if out is None else out
    so = (0, out.stride(0), out.stride(1)) if varlen else out.stride()[:3]
    if return_lse:
        lse = torch.empty((H, q.shape[0]) if varlen else (B, H, Sq), dtype=torch.float32, device=q.device)
        sl = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    else:
        lse, sl = None, (0, 0)
    cfg = config or default_config(D, causal, q.dtype)
    block_d = max(16, triton.next_power_of_2(D))
    descs = _tma_descriptors(q, k, v, cfg, block_d) if cfg.tma else None
    grid = (triton.cdiv(max(Sq, 1), cfg.block_m), H, B)
    _flash_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *(descs or (None, None, None)),
        *sq, *sk, *sv, *so, *sl,
        Sq, Sk, H // Hkv,
        scale * LOG2E, scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0,
        left, right,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        MASK_LEFT=left >= 0, MASK_RIGHT=right >= 0, SOFTCAP=softcap is not None,
        VARLEN=varlen, STORE_LSE=return_lse, TMA=descs is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (out, lse) if return_lse else out
