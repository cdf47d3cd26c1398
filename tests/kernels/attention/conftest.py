"""Builders shared by the attention tests: paged caches with shuffled pages and shared prefixes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from warpforge.kernels.attention import PagedKVCache


@dataclass
class Paged:
    cache: PagedKVCache
    block_tables: torch.Tensor  # int32 [B, max_pages], -1 past each sequence's pages
    seq_lens: torch.Tensor  # int32 [B]


def build_paged(lens, *, page_size, num_kv_heads, head_dim, dtype, device, gen, shared_prefix_pages=0,
                spare_pages=3, extra_table_cols=2, fp8_scale=None) -> Paged:
    """Random K/V in shuffled pages; every unused page row is NaN so a read past a length shows.

    With ``shared_prefix_pages`` n, sequence 1's first n block-table entries are sequence 0's pages
    (a cached prefix): both must be at least n full pages long.
    """
    P = page_size
    n_pages = [-(-L // P) for L in lens]
    shared = shared_prefix_pages
    if shared:
        assert len(lens) >= 2 and min(lens[0], lens[1]) >= shared * P
    total = sum(n_pages) - shared + spare_pages
    perm = torch.randperm(total, generator=gen).tolist()
    width = max(n_pages, default=0) + extra_table_cols
    table = torch.full((len(lens), max(width, 1)), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(n_pages):
        start = 0
        if b == 1 and shared:
            table[1, :shared] = table[0, :shared]
            start = shared
        for i in range(start, n):
            table[b, i] = perm[nxt]
            nxt += 1
    shape = (total, num_kv_heads, P, head_dim)
    store_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    k = torch.randn(shape, generator=gen).to(store_dtype)
    v = torch.randn(shape, generator=gen).to(store_dtype)
    used = torch.zeros(total, P, dtype=torch.bool)
    for b, L in enumerate(lens):
        for pos in range(L):
            used[table[b, pos // P], pos % P] = True
    unused = ~used[:, None, :, None].expand(shape)  # pages are [page, head, row, dim]
    k[unused] = float("nan")
    v[unused] = float("nan")
    scales = {}
    if dtype == torch.float8_e4m3fn:
        s = torch.full((num_kv_heads,), fp8_scale or 0.5, dtype=torch.float32)
        scales = {"k_scale": s.to(device), "v_scale": s.clone().to(device)}
        # NaN survives the clamp and becomes e4m3's NaN: unused rows stay poisoned.
        k = (k.float() / s[None, :, None, None]).clamp(-448, 448).to(dtype)
        v = (v.float() / s[None, :, None, None]).clamp(-448, 448).to(dtype)
    cache = PagedKVCache(k.to(device), v.to(device), **scales)
    return Paged(cache, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
