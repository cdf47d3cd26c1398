"""Attention kernels: flash prefill (incl. varlen), paged KV cache, paged decode, chunked prefill.

Layouts at a glance:

* ``flash_attention``: q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with any strides but a unit last one
  (SDPA's [B, H, S, D] goes in as ``x.transpose(1, 2)``), or packed q [Tq, H, D], k/v [Tk, Hkv, D]
  with int32 ``cu_seqlens_q/k``.
* ``PagedKVCache``: k/v pages [num_pages, Hkv, page_size, D] (head-major, so a KV head's page is one
  contiguous run), fp16/bf16/fp32 or fp8 e4m3 with per-KV-head fp32 scales; ``store_kv`` writes tokens
  at slots ``page * page_size + row``.
* ``paged_decode``: q [B, Hq, D], one token per sequence, block_tables int32 [B, max_pages],
  seq_lens int32 [B]; fixed grid per batch size (CUDA-graph friendly).
* ``chunked_prefill``: packed new tokens q [T, Hq, D] + cu_seqlens_q over the same paged cache.
"""

from warpforge.kernels.attention.chunked import chunked_prefill
from warpforge.kernels.attention.decode import DECODE_SWEEP, DecodeConfig, num_decode_splits, paged_decode
from warpforge.kernels.attention.kv_cache import PagedKVCache, check_page_tables, fp8_scales, store_kv
from warpforge.kernels.attention.prefill import PREFILL_SWEEP, AttentionConfig, flash_attention

__all__ = [
    "AttentionConfig",
    "DECODE_SWEEP",
    "DecodeConfig",
    "PREFILL_SWEEP",
    "PagedKVCache",
    "check_page_tables",
    "chunked_prefill",
    "flash_attention",
    "fp8_scales",
    "num_decode_splits",
    "paged_decode",
    "store_kv",
]
