"""PagedKVCache validation and store_kv: CPU through the interpreter, fp8 pages on the GPU."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.attention import PagedKVCache, check_page_tables, fp8_scales, store_kv
from warpforge.kernels.reference import quantize_kv_ref, store_kv_ref


def _tokens(T, Hkv, D, dtype, device, gen):
    k = torch.randn(T, Hkv, D, generator=gen).to(dtype).to(device)
    v = torch.randn(T, Hkv, D, generator=gen).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("Hkv,D,P", [(1, 64, 16), (3, 80, 4)])
def test_store_kv_cpu(triton_on_cpu, gen, Hkv, D, P):
    T, num_pages = 19, 9
    k, v = _tokens(T, Hkv, D, torch.float16, "cpu", gen)
    slots = torch.randperm(num_pages * P, generator=gen)[:T].to(torch.int32)
    slots[[3, 11]] = -1  # padding tokens are skipped
    cache = PagedKVCache.allocate(num_pages, P, Hkv, D, dtype=torch.float16, device="cpu")
    cache.k_cache.fill_(float("nan"))
    cache.v_cache.fill_(float("nan"))
    want_k, want_v = cache.k_cache.clone(), cache.v_cache.clone()
    store_kv_ref(k, v, want_k, want_v, slots)
    cache.store(k, v, slots)
    assert torch.equal(cache.k_cache.isnan(), want_k.isnan())  # exactly the slots were written
    assert torch.equal(cache.k_cache.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(cache.v_cache.nan_to_num(), want_v.nan_to_num())
    # head-major layout: token at slot s, head h is k_cache[s // P, h, s % P]
    s = int(slots[0])
    assert torch.equal(cache.k_cache[s // P, :, s % P], k[0])


def test_store_kv_int64_slots_and_strided_input_cpu(triton_on_cpu, gen):
    qkv = torch.randn(7, 3, 2, 64, generator=gen).half()  # fused projection output, k/v are strided views
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 5, 6, 7, 8, 30, 31], dtype=torch.int64)
    cache = PagedKVCache.allocate(4, 8, 2, 64, dtype=torch.float16, device="cpu")
    want = PagedKVCache.allocate(4, 8, 2, 64, dtype=torch.float16, device="cpu")
    store_kv(k, v, cache.k_cache, cache.v_cache, slots)
    store_kv_ref(k, v, want.k_cache, want.v_cache, slots)
    assert torch.equal(cache.k_cache, want.k_cache) and torch.equal(cache.v_cache, want.v_cache)


def test_paged_cache_validation():
    k = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v_cache"):
        PagedKVCache(k, torch.zeros(4, 2, 16, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="num_pages, num_kv_heads"):
        PagedKVCache(k[0], k[0])
    with pytest.raises(ValueError, match="only fp8"):
        PagedKVCache(k, k.clone(), torch.ones(2))
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache.allocate(4, 16, 2, 60, device="cpu")
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache.allocate(4, 0, 2, 64, device="cpu")
    f8 = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        PagedKVCache(f8, f8.clone(), torch.ones(3))
    c = PagedKVCache(f8, f8.clone())  # scales default to 1.0
    assert c.is_fp8 and torch.equal(c.k_scale, torch.ones(2))


def test_store_kv_validation():
    cache = PagedKVCache.allocate(4, 16, 2, 64, dtype=torch.float16, device="cpu")
    k = torch.zeros(3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="expected \\[T, 2, 64\\]"):
        cache.store(torch.zeros(3, 1, 64, dtype=torch.float16), k, slots)
    with pytest.raises(ValueError, match="dtype"):
        cache.store(k.bfloat16(), k.bfloat16(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.store(k, k, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.store(k, k, slots.float())
    with pytest.raises(ValueError, match="slots in"):
        cache.store(k, k, torch.tensor([0, 64, 1], dtype=torch.int32))


def test_check_page_tables():
    table = torch.tensor([[0, 1, -1], [2, -1, -1]], dtype=torch.int32)
    check_page_tables(table, torch.tensor([17, 16], dtype=torch.int32), num_pages=3, page_size=16)
    with pytest.raises(ValueError, match="seq_lens"):
        check_page_tables(table, torch.tensor([49, 1], dtype=torch.int32), num_pages=3, page_size=16)
    with pytest.raises(ValueError, match="block_tables"):
        check_page_tables(table, torch.tensor([33, 1], dtype=torch.int32), num_pages=3, page_size=16)
    with pytest.raises(ValueError, match="block_tables"):
        check_page_tables(table, torch.tensor([1, 1], dtype=torch.int32), num_pages=2, page_size=16)


def test_fp8_scales():
    x = torch.zeros(5, 2, 8)
    x[3, 1, 4] = -896.0
    x[0, 0, 0] = 44.8
    assert torch.allclose(fp8_scales(x), torch.tensor([0.1, 2.0]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_gpu(gen, dtype):
    k, v = _tokens(1000, 8, 128, dtype, "cuda", gen)
    slots = torch.randperm(64 * 16, generator=gen)[:1000].to(torch.int32).cuda()
    cache = PagedKVCache.allocate(64, 16, 8, 128, dtype=dtype)
    want = PagedKVCache.allocate(64, 16, 8, 128, dtype=dtype)
    cache.store(k, v, slots)
    store_kv_ref(k, v, want.k_cache, want.v_cache, slots)
    assert torch.equal(cache.k_cache, want.k_cache) and torch.equal(cache.v_cache, want.v_cache)


@pytest.mark.gpu
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_store_kv_fp8_gpu(gen, src):
    k, v = _tokens(777, 8, 128, src, "cuda", gen)
    k[5, 3, 7] = 1e4  # saturates to +448 * scale instead of becoming NaN
    scales = fp8_scales(k[100:]), fp8_scales(v[100:])  # row 5 is outside the calibration set
    cache = PagedKVCache.allocate(64, 16, 8, 128, dtype=torch.float8_e4m3fn, k_scale=scales[0], v_scale=scales[1])
    slots = torch.randperm(64 * 16, generator=gen)[:777].to(torch.int64).cuda()
    cache.store(k, v, slots)
    pages, rows = slots // 16, slots % 16
    got_k = cache.k_cache[pages, :, rows].float()
    got_v = cache.v_cache[pages, :, rows].float()
    assert torch.equal(got_k, quantize_kv_ref(k, scales[0]).float())
    assert torch.equal(got_v, quantize_kv_ref(v, scales[1]).float())
    assert got_k[5, 3, 7].item() == 448.0


def test_fp8_scales_must_be_positive():
    f8 = torch.zeros(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="positive"):
        PagedKVCache(f8, f8.clone(), torch.tensor([1.0, -1.0]), torch.ones(2))
    with pytest.raises(ValueError, match="fp8 pages need"):
        store_kv(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), f8, f8.clone(), torch.zeros(1, dtype=torch.int32))
