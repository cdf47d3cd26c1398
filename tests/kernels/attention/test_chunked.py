"""chunked_prefill: prefill chunks and decodes mixed in one call over the paged cache."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.attention import AttentionConfig, chunked_prefill, flash_attention, store_kv
from warpforge.kernels.reference import paged_attention_ref
from warpforge.kernels.tolerance import check

from .conftest import build_paged


def _cu(q_lens, device):
    return torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _ref(q, p, cu, **kw):
    c = p.cache
    return paged_attention_ref(q, c.k_cache, c.v_cache, p.block_tables, p.seq_lens, cu, k_scale=c.k_scale,
                               v_scale=c.v_scale, **kw)


def _assert_close(out, ref, dtype):
    res = check(out, ref, dtype)
    assert res["ok"], f"rel_err {res['rel_err']:.3g} > tol {res['tol']:.3g}"


@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 64), (3, 1, 80), (2, 2, 64)])  # group 4, group 3, MHA
def test_chunked_mixed_batch_cpu(triton_on_cpu, gen, Hq, Hkv, D):
    # seq 0: a chunk after a cached prefix; 1: decode; 2: whole prompt; 3: idle; 4: decode on a shared prefix
    lens, q_lens = [33, 17, 2, 5, 21], [9, 1, 2, 0, 1]
    p = build_paged(lens, page_size=4, num_kv_heads=Hkv, head_dim=D, dtype=torch.float16, device="cpu",
                    gen=gen, shared_prefix_pages=0)
    cu = _cu(q_lens, "cpu")
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    assert chunked_prefill(q, p.cache, p.block_tables, p.seq_lens, cu, out=out) is out
    _assert_close(out, _ref(q, p, cu), torch.float16)


@pytest.mark.parametrize("window,softcap", [(4, None), (None, 10.0), (6, 25.0)])
def test_chunked_window_softcap_shared_prefix_cpu(triton_on_cpu, gen, window, softcap):
    lens, q_lens = [33, 29, 17], [17, 1, 3]
    p = build_paged(lens, page_size=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, device="cpu",
                    gen=gen, shared_prefix_pages=4)
    cu = _cu(q_lens, "cpu")
    q = torch.randn(int(cu[-1]), 4, 64, generator=gen)
    out = chunked_prefill(q, p.cache, p.block_tables, p.seq_lens, cu, window=window, softcap=softcap,
                          config=AttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1))
    _assert_close(out, _ref(q, p, cu, window=window, softcap=softcap), torch.float32)


def test_chunked_equals_flash_attention_on_a_fresh_prompt_cpu(triton_on_cpu, gen):
    # A whole prompt stored with store_kv and attended through pages == dense causal flash attention.
    T, Hq, Hkv, D, P = 23, 4, 2, 64, 4
    q = torch.randn(T, Hq, D, generator=gen).half()
    k = torch.randn(T, Hkv, D, generator=gen).half()
    v = torch.randn(T, Hkv, D, generator=gen).half()
    p = build_paged([T], page_size=P, num_kv_heads=Hkv, head_dim=D, dtype=torch.float16, device="cpu", gen=gen)
    row = p.block_tables[0].long()
    pos = torch.arange(T)
    store_kv(k, v, p.cache.k_cache, p.cache.v_cache, (row[pos // P] * P + pos % P).to(torch.int32))
    cu = _cu([T], "cpu")
    paged = chunked_prefill(q, p.cache, p.block_tables, p.seq_lens, cu)
    dense = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert check(paged, dense.float(), torch.float16)["ok"]


@pytest.mark.parametrize("page", [60000, -7])
def test_chunked_unchecked_page_ids_past_the_pool_never_crash_cpu(triton_on_cpu, gen, page):
    """As paged_decode: with check_values=False a bad page id reads a clamped page, never outside the cache."""
    lens, q_lens = [9, 6], [3, 6]
    p = build_paged(lens, page_size=4, num_kv_heads=1, head_dim=64, dtype=torch.float16, device="cpu", gen=gen)
    bad = p.block_tables.clone()
    bad[0, 1] = page
    cu = _cu(q_lens, "cpu")
    q = torch.randn(int(cu[-1]), 2, 64, generator=gen).half()
    out = chunked_prefill(q, p.cache, bad, p.seq_lens, cu, max_seqlen_q=6, check_values=False)
    assert out.shape == q.shape


def test_chunked_validation(gen):
    p = build_paged([5, 9], page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu", gen=gen)
    q = torch.randn(4, 4, 64, generator=gen).half()
    args = (p.cache, p.block_tables, p.seq_lens)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        chunked_prefill(q, *args, _cu([4], "cpu"))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        chunked_prefill(q, *args, _cu([1, 2], "cpu"))
    with pytest.raises(ValueError, match="q_len <= seq_len"):
        chunked_prefill(torch.randn(10, 4, 64).half(), *args, _cu([6, 4], "cpu"))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        chunked_prefill(q, *args, _cu([3, 1], "cpu"), max_seqlen_q=2)
    with pytest.raises(ValueError, match="packed"):
        chunked_prefill(q[None], *args, _cu([3, 1], "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_chunked_gpu(gen, D, dtype):
    lens, q_lens = [4097, 1000, 17, 2, 1, 600, 2000], [1000, 1, 17, 2, 1, 0, 1]
    p = build_paged(lens, page_size=16, num_kv_heads=2, head_dim=D, dtype=dtype, device="cuda", gen=gen,
                    shared_prefix_pages=30, fp8_scale=0.05)
    qdtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    cu = _cu(q_lens, "cuda")
    q = torch.randn(int(cu[-1]), 8, D, generator=gen).to(qdtype).cuda()
    for window, softcap in ((None, None), (300, None), (None, 30.0)):
        out = chunked_prefill(q, p.cache, p.block_tables, p.seq_lens, cu, max_seqlen_q=max(q_lens),
                              window=window, softcap=softcap, out=torch.full_like(q, float("nan")))
        _assert_close(out, _ref(q, p, cu, window=window, softcap=softcap), qdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 1), (14, 2)])
def test_chunked_heads_gpu(gen, Hq, Hkv):
    lens, q_lens = [4097, 333, 1], [2048, 333, 1]
    p = build_paged(lens, page_size=16, num_kv_heads=Hkv, head_dim=128, dtype=torch.bfloat16, device="cuda", gen=gen)
    cu = _cu(q_lens, "cuda")
    q = torch.randn(int(cu[-1]), Hq, 128, generator=gen).bfloat16().cuda()
    out = chunked_prefill(q, p.cache, p.block_tables, p.seq_lens, cu)
    _assert_close(out, _ref(q, p, cu), torch.bfloat16)
