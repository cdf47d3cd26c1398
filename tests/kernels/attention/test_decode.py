"""paged_decode against the float32 reference: shuffled pages, shared prefixes, NaN in every unused row.

The fused-reduce path (one launch, an atomic ticket per (sequence, KV head)) is also checked against the
two-kernel path it replaces, twice on the same counters (the kernel must leave them zeroed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from warpforge.kernels import programmatic_launch
from warpforge.kernels.attention import DecodeConfig, num_decode_splits, paged_decode
from warpforge.kernels.attention import decode as decode_mod
from warpforge.kernels.attention._qk_fp8 import quantize_rows_e4m3
from warpforge.kernels.attention.decode import default_decode_config
from warpforge.kernels.reference import paged_decode_ref, quantize_q_e4m3_ref
from warpforge.kernels.tolerance import FP8_QUERY_TOL, check

from .conftest import build_paged


def _ref(q, p, **kw):
    c = p.cache
    return paged_decode_ref(q, c.k_cache, c.v_cache, p.block_tables, p.seq_lens, k_scale=c.k_scale,
                            v_scale=c.v_scale, **kw)


def _assert_close(out, ref, dtype):
    res = check(out, ref, dtype)
    assert res["ok"], f"rel_err {res['rel_err']:.3g} > tol {res['tol']:.3g}"


# ---- CPU (interpreter) --------------------------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 64), (4, 1, 80), (3, 3, 64)])  # GQA 4:1, MQA, MHA
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_cpu(triton_on_cpu, gen, Hq, Hkv, D, num_splits):
    lens = [1, 2, 17, 33, 0, 20]  # 0: a padded batch slot (CUDA-graph capture pads with those)
    p = build_paged(lens, page_size=4, num_kv_heads=Hkv, head_dim=D, dtype=torch.float16, device="cpu",
                    gen=gen, shared_prefix_pages=0)
    q = torch.randn(len(lens), Hq, D, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    res = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=num_splits, out=out)
    assert res is out
    _assert_close(out, _ref(q, p), torch.float16)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # length 0 -> zeros, not NaN


@pytest.mark.parametrize("window,softcap,num_splits", [(5, None, 2), (None, 20.0, 4), (9, 30.0, 1), (0, None, 2)])
def test_decode_window_softcap_shared_prefix_cpu(triton_on_cpu, gen, window, softcap, num_splits):
    lens = [33, 23, 2, 17]
    p = build_paged(lens, page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, device="cpu",
                    gen=gen, shared_prefix_pages=5)
    q = torch.randn(len(lens), 4, 64, generator=gen)
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, window=window, softcap=softcap,
                       num_splits=num_splits)
    _assert_close(out, _ref(q, p, window=window, softcap=softcap), torch.float32)


def test_decode_large_page_and_block_config_cpu(triton_on_cpu, gen):
    # page 32 > block_n 16 and block_n 32 > page 8 both take the gather path correctly.
    for page_size, block_n in ((32, 16), (8, 32)):
        p = build_paged([33, 1, 40], page_size=page_size, num_kv_heads=1, head_dim=64, dtype=torch.float16,
                        device="cpu", gen=gen)
        q = torch.randn(3, 2, 64, generator=gen).half()
        out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=2,
                           config=DecodeConfig(block_n=block_n, num_warps=1, num_stages=1))
        _assert_close(out, _ref(q, p), torch.float16)


def _fused_and_split(q, p, *, cfg, num_splits, counters, **kw):
    """(fused out, two-kernel out), both written over NaN; the fused path runs twice on ``counters``."""
    two = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=num_splits, config=cfg,
                       out=torch.full_like(q, float("nan")), **kw)
    fused_cfg = DecodeConfig(**{**cfg.__dict__, "fused_reduce": True})
    outs = []
    for _ in range(2):  # a counter left non-zero would make the second call skip its merge (NaN stays)
        outs.append(paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=num_splits, config=fused_cfg,
                                 out=torch.full_like(q, float("nan")), split_counters=counters, **kw))
        assert not counters.any(), counters  # every launch resets what it used
    assert torch.equal(outs[0], outs[1])
    return outs[0], two


@pytest.mark.parametrize("Hq,Hkv,D,num_splits", [
    (8, 2, 64, 3),  # GQA 4: the 3 splits merge in one chunk (MERGE_S 8 at 1 warp)
    (8, 1, 64, 6),  # GQA 8, MERGE_S 4: two chunks, the online rescale across them
    (3, 3, 80, 2),  # MHA, padded head dim (BLOCK_D 128)
    (8, 2, 64, 16),  # more splits than any sequence has blocks: empty partials weigh 0
])
def test_decode_fused_reduce_cpu(triton_on_cpu, gen, Hq, Hkv, D, num_splits):
    lens = [1, 2, 17, 33, 0, 61, 20]
    p = build_paged(lens, page_size=4, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32, device="cpu", gen=gen)
    q = torch.randn(len(lens), Hq, D, generator=gen)
    counters = torch.zeros(len(lens) * Hkv + 5, dtype=torch.int32)
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1)
    fused, two = _fused_and_split(q, p, cfg=cfg, num_splits=num_splits, counters=counters)
    # same partials, same merge formula; only the order of fp32 additions may differ
    torch.testing.assert_close(fused, two, rtol=1e-6, atol=1e-6)
    _assert_close(fused, _ref(q, p), torch.float32)
    assert torch.equal(fused[4], torch.zeros_like(fused[4]))  # length 0 -> zeros, not NaN


@pytest.mark.parametrize("window,softcap,num_splits", [(5, None, 2), (None, 20.0, 4), (9, 30.0, 3), (0, None, 4)])
def test_decode_fused_reduce_window_softcap_fp16_cpu(triton_on_cpu, gen, window, softcap, num_splits):
    lens = [33, 23, 2, 17, 1]
    p = build_paged(lens, page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu", gen=gen,
                    shared_prefix_pages=5)
    q = torch.randn(len(lens), 4, 64, generator=gen).half()
    counters = torch.zeros(len(lens) * 2, dtype=torch.int32)
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1)
    fused, two = _fused_and_split(q, p, cfg=cfg, num_splits=num_splits, counters=counters, window=window,
                                  softcap=softcap)
    torch.testing.assert_close(fused, two, rtol=2e-3, atol=1e-3)  # at most an fp16 output rounding apart
    _assert_close(fused, _ref(q, p, window=window, softcap=softcap), torch.float16)


def test_decode_fused_reduce_needs_zeroed_counters_and_uses_the_module_buffer(triton_on_cpu, gen):
    p = build_paged([9, 30], page_size=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, device="cpu", gen=gen)
    q = torch.randn(2, 2, 64, generator=gen)
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1, fused_reduce=True)
    # a counter that is not zero at launch: no program draws the last ticket, so nothing is merged
    stale = torch.tensor([0, 7], dtype=torch.int32)
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=2, config=cfg,
                       out=torch.full_like(q, float("nan")), split_counters=stale)
    assert not out[0].isnan().any() and out[1].isnan().all()
    assert stale.tolist() == [0, 9]
    # default: the module's per-device buffer, left zeroed
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=2, config=cfg)
    _assert_close(out, _ref(q, p), torch.float32)
    assert not decode_mod.split_counter_buffer(torch.device("cpu"), 2).any()


def test_split_counter_buffer_grows_and_keeps_outgrown_buffers(monkeypatch):
    monkeypatch.setattr(decode_mod, "_COUNTERS", {})
    monkeypatch.setattr(decode_mod, "_OUTGROWN", [])
    cpu = torch.device("cpu")
    small = decode_mod.split_counter_buffer(cpu, 10)
    assert small.dtype == torch.int32 and small.numel() >= 10 and not small.any()
    assert decode_mod.split_counter_buffer(cpu, small.numel()) is small  # reused while it fits
    big = decode_mod.split_counter_buffer(cpu, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    # a CUDA graph captured with the old buffer replays into its address: it must stay allocated
    assert decode_mod._OUTGROWN == [small]
    assert decode_mod.split_counter_buffer(cpu, 3) is big
    # growing inside a CUDA-graph capture would bake a pool-owned address into the graph: refused
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="while capturing a CUDA graph.*split_counters="):
        decode_mod.split_counter_buffer(torch.device("cuda", 0), 8)


@triton.jit
def _quantize_rows_kernel(X, Y, S, M: tl.constexpr, K: tl.constexpr):
    om, ok = tl.arange(0, M), tl.arange(0, K)
    y, s = quantize_rows_e4m3(tl.load(X + om[:, None] * K + ok[None, :]))
    tl.store(Y + om[:, None] * K + ok[None, :], y)
    tl.store(S + om, s)


def test_quantize_rows_e4m3_is_bit_exact_with_torch_cpu(triton_on_cpu, gen):
    x = torch.randn(16, 64, generator=gen) * torch.logspace(-30, 30, 16)[:, None]
    x[3] = 0.0  # an all-zero row (a padded query head): scale 1, zeros
    # exact ties at scale 1 (row max 300): nearest-even picks 1.0, 1.25, 288 and -20, the interpreter's
    # own fp8 cast would not carry 1.9375 -> 2.0
    x[5, :6] = torch.tensor([1.0625, 1.1875, 300.0, 1.9375, 272.0 + 16.0, -19.0])
    x[5, 6:] = 1.0
    x[6, 0] = 448.0 * 1024 * 1.999  # a row max just under a power of two: still <= 448 after scaling
    y = torch.empty(16, 64, dtype=torch.float8_e4m3fn)
    s = torch.empty(16)
    _quantize_rows_kernel[(1,)](x, y, s, 16, 64)
    y_ref, s_ref = quantize_q_e4m3_ref(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(y.view(torch.uint8), y_ref.view(torch.uint8))
    assert y[5, :4].float().tolist() == [1.0, 1.25, 288.0, 2.0] and s[5] == 1.0
    assert (y.float().abs().amax(1)[s != 1.0] > 224).all()


def _quantized_q(q):
    q8, scale = quantize_q_e4m3_ref(q)
    return (q8.float() * scale[..., None]).to(q.dtype)


@pytest.mark.parametrize("Hq,Hkv,D,window,softcap,num_splits,fused", [
    (8, 2, 64, None, None, 3, False),
    (8, 1, 64, 5, None, 2, True),  # GQA 8, a window, the fused merge on top
    (3, 3, 80, None, 20.0, 1, False),  # MHA, padded head dim, softcap, one split
])
def test_decode_qk_fp8_cpu(triton_on_cpu, gen, Hq, Hkv, D, window, softcap, num_splits, fused):
    lens = [1, 2, 17, 33, 0, 20]
    p = build_paged(lens, page_size=4, num_kv_heads=Hkv, head_dim=D, dtype=torch.float8_e4m3fn, device="cpu",
                    gen=gen, fp8_scale=0.03)
    q = torch.randn(len(lens), Hq, D, generator=gen).half()  # unit-variance logits, as FP8_QUERY_TOL assumes
    cfg = DecodeConfig(block_n=16, num_warps=1, num_stages=1, qk_fp8=True, fused_reduce=fused)
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=num_splits, config=cfg, window=window,
                       softcap=softcap, out=torch.full_like(q, float("nan")))
    # exactly attention of the e4m3-rounded query (the same rounding torch does), to fp16 accuracy ...
    _assert_close(out, _ref(_quantized_q(q), p, window=window, softcap=softcap), torch.float16)
    # ... and within the quantization's own error of the query as given
    res = check(out, _ref(q, p, window=window, softcap=softcap), tol=FP8_QUERY_TOL[0])
    assert res["ok"], res
    assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("page", [6, 60000, -7])  # just past the pool, far past it (once SIGSEGV), negative
@pytest.mark.parametrize("kv,qk_fp8", [(torch.float16, False), (torch.float8_e4m3fn, False),
                                       (torch.float8_e4m3fn, True)])
def test_decode_unchecked_page_ids_past_the_pool_never_crash_cpu(triton_on_cpu, gen, page, kv, qk_fp8):
    """check_values=False trusts the table: a bad page id may give garbage out, but the kernel clamps the
    page address, so it reads inside the cache instead of killing the process."""
    p = build_paged([5, 9], page_size=4, num_kv_heads=2, head_dim=64, dtype=kv, device="cpu", gen=gen,
                    spare_pages=0)
    bad = p.block_tables.clone()
    bad[1, 1] = page
    q = torch.randn(2, 4, 64, generator=gen).half()
    cfg = dataclasses.replace(default_decode_config(64, kv != torch.float16, qk_fp8=qk_fp8), block_n=16)
    out = paged_decode(q, p.cache, bad, p.seq_lens, check_values=False, config=cfg)
    assert out.shape == q.shape  # finite or not: unchecked input may give anything but a crash
    good = paged_decode(q, p.cache, p.block_tables, p.seq_lens, check_values=False, config=cfg)
    torch.testing.assert_close(out[0], good[0])  # sequence 0 never reads the bad entry


def test_decode_reference_path_on_cpu_tensors(gen):
    p = build_paged([5, 9], page_size=4, num_kv_heads=1, head_dim=64, dtype=torch.float16, device="cpu", gen=gen)
    q = torch.randn(2, 2, 64, generator=gen).half()
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens)
    _assert_close(out, _ref(q, p), torch.float16)


def test_num_decode_splits_is_static_and_fills_the_gpu():
    # depends on sizes only; small batches split more, never below min_split_tokens per split
    assert num_decode_splits(256, 8, 8192, num_sms=132) == 1
    assert num_decode_splits(16, 8, 8192, num_sms=132) == 4  # 5 for 4 per SM, rounded down to a power of two
    assert num_decode_splits(1, 8, 131072, num_sms=132) == 64  # capped by max_splits
    assert num_decode_splits(1, 8, 512, num_sms=132) == 2  # capped by min_split_tokens
    assert num_decode_splits(1, 8, 100, num_sms=132) == 1
    cfg = DecodeConfig(programs_per_sm=8, min_split_tokens=128, max_splits=16)
    assert num_decode_splits(16, 8, 8192, num_sms=132, config=cfg) == 8  # 9, rounded down


def test_decode_validation(gen):
    p = build_paged([5, 9], page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu", gen=gen)
    c, bt, sl = p.cache, p.block_tables, p.seq_lens
    q = torch.randn(2, 4, 64, generator=gen).half()
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        paged_decode(q[:, :3], c, bt, sl)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode(torch.zeros(2, 4, 80, dtype=torch.float16), c, bt, sl)
    with pytest.raises(ValueError, match="pages of q's dtype"):
        paged_decode(q.bfloat16(), c, bt, sl)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode(q, c, bt.long(), sl)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode(q, c, bt, sl[:1])
    with pytest.raises(ValueError, match="one token per sequence"):
        paged_decode(q[:1], c, bt, sl)
    with pytest.raises(ValueError, match="seq_lens: expected values"):
        paged_decode(q, c, bt, torch.tensor([5, 999], dtype=torch.int32))
    bad = bt.clone()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="page indices"):
        paged_decode(q, c, bad, sl)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, c, bt, sl, num_splits=0)
    with pytest.raises(ValueError, match="cache"):
        paged_decode(q, c.k_cache, bt, sl)
    for bad in (torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), [0, 0, 0, 0]):
        with pytest.raises(ValueError, match=r"split_counters: expected a contiguous zeroed int32 tensor of >= 4"):
            paged_decode(q, c, bt, sl, split_counters=bad)
    with pytest.raises(ValueError, match="fused_reduce: expected a bool"):
        DecodeConfig(fused_reduce=1)
    with pytest.raises(ValueError, match="qk_fp8: needs fp8"):
        paged_decode(q, c, bt, sl, config=DecodeConfig(qk_fp8=True))
    with pytest.raises(ValueError, match="qk_fp8 needs fp8 pages"):
        default_decode_config(64, False, qk_fp8=True)


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu(gen, D, dtype):
    lens = [1, 2, 17, 1000, 4097, 0, 300]
    p = build_paged(lens, page_size=16, num_kv_heads=2, head_dim=D, dtype=dtype, device="cuda", gen=gen,
                    shared_prefix_pages=0)
    q = torch.randn(len(lens), 8, D, generator=gen).to(dtype).cuda()
    for splits in (None, 1, 8):
        out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=splits,
                           out=torch.full_like(q, float("nan")))
        _assert_close(out, _ref(q, p), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 1), (12, 12), (14, 2)])  # 4:1, MQA, MHA, group 7
def test_decode_heads_window_softcap_shared_prefix_gpu(gen, Hq, Hkv):
    lens = [4097, 1000, 17, 2, 1]
    p = build_paged(lens, page_size=16, num_kv_heads=Hkv, head_dim=128, dtype=torch.bfloat16, device="cuda",
                    gen=gen, shared_prefix_pages=40)
    q = torch.randn(len(lens), Hq, 128, generator=gen).bfloat16().cuda()
    for window, softcap in ((None, None), (511, None), (None, 50.0), (100, 30.0)):
        out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, window=window, softcap=softcap)
        _assert_close(out, _ref(q, p, window=window, softcap=softcap), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
def test_decode_fp8_pages_gpu(gen, qdtype):
    lens = [4097, 1000, 17, 2, 1, 0]
    p = build_paged(lens, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn, device="cuda",
                    gen=gen, shared_prefix_pages=20, fp8_scale=0.03)
    q = torch.randn(len(lens), 32, 128, generator=gen).to(qdtype).cuda()
    for splits in (None, 1, 16):
        out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=splits)
        # the reference dequantizes the same e4m3 values, so only the kernel's own rounding counts
        _assert_close(out, _ref(q, p), qdtype)


@pytest.mark.gpu
def test_decode_cuda_graph_replays_for_any_lengths(gen):
    B, Hq, Hkv, D = 4, 16, 4, 128
    p = build_paged([4097, 3000, 2000, 1000], page_size=16, num_kv_heads=Hkv, head_dim=D, dtype=torch.bfloat16,
                    device="cuda", gen=gen)
    q = torch.randn(B, Hq, D, generator=gen).bfloat16().cuda()
    seq_lens = p.seq_lens.clone()
    out = torch.empty_like(q)
    paged_decode(q, p.cache, p.block_tables, seq_lens, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, p.cache, p.block_tables, seq_lens, out=out)
    for lens in ([4097, 3000, 2000, 1000], [1, 2, 17, 1000], [0, 3000, 5, 0], [4097, 1, 1999, 999]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        c = p.cache
        ref = paged_decode_ref(q, c.k_cache, c.v_cache, p.block_tables, seq_lens)
        # lengths shorter than what was stored just see fewer keys; the NaN poison past the stored
        # lengths is never reached because every new length is within the stored ones
        _assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_fused_reduce_gpu(gen, dtype):
    lens = [4097, 1000, 17, 2, 1, 0, 300]
    fp8 = dtype == torch.float8_e4m3fn
    p = build_paged(lens, page_size=16, num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda", gen=gen,
                    shared_prefix_pages=20, fp8_scale=0.03 if fp8 else None)
    q = torch.randn(len(lens), 32, 128, generator=gen).bfloat16().cuda()
    counters = torch.zeros(len(lens) * 8, dtype=torch.int32, device="cuda")
    ref = _ref(q, p)
    for splits in (2, 16, 64):  # 64 > MERGE_S (16 at GQA 4, D 128, 4 warps): a chunked merge
        fused, two = _fused_and_split(q, p, cfg=default_decode_config(128, fp8), num_splits=splits, counters=counters)
        _assert_close(fused, ref, torch.bfloat16)
        # the same fp32 partials merged in another order: a few outputs one bf16 rounding apart at most
        res = check(fused, two.float(), tol=2e-3)
        assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [False, True])
def test_decode_fused_reduce_graph_chain_with_pdl(gen, mode):
    # two fused launches back to back in one graph (the second reads the first's output and reuses its
    # counters), replayed for new lengths with and without programmatic dependent launch
    B, Hq, Hkv, D = 4, 16, 4, 128
    p = build_paged([4097, 3000, 2000, 1000], page_size=16, num_kv_heads=Hkv, head_dim=D, dtype=torch.bfloat16,
                    device="cuda", gen=gen)
    c = p.cache
    q = torch.randn(B, Hq, D, generator=gen).bfloat16().cuda()
    seq_lens = p.seq_lens.clone()
    cfg = DecodeConfig(**{**default_decode_config(D, False).__dict__, "fused_reduce": True})
    mid, out = torch.empty_like(q), torch.empty_like(q)

    def step():
        paged_decode(q, c, p.block_tables, seq_lens, out=mid, config=cfg, num_splits=32)
        paged_decode(mid, c, p.block_tables, seq_lens, out=out, config=cfg, num_splits=32)

    with programmatic_launch(mode):
        step()  # compiles and allocates the module's counters outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for lens in ([4097, 3000, 2000, 1000], [1, 2, 17, 1000], [0, 3000, 5, 0], [4097, 1, 1999, 999]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for _ in range(2):
            mid.fill_(float("nan"))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref_mid = paged_decode_ref(q, c.k_cache, c.v_cache, p.block_tables, seq_lens)
            ref_out = paged_decode_ref(mid, c.k_cache, c.v_cache, p.block_tables, seq_lens)
            _assert_close(mid, ref_mid, torch.bfloat16)
            _assert_close(out, ref_out, torch.bfloat16)
    assert not decode_mod.split_counter_buffer(q.device, B * Hkv)[:B * Hkv].any()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
def test_decode_qk_fp8_gpu(gen, D, qdtype):
    lens = [4097, 1000, 17, 2, 1, 0, 300]
    p = build_paged(lens, page_size=16, num_kv_heads=8, head_dim=D, dtype=torch.float8_e4m3fn, device="cuda",
                    gen=gen, shared_prefix_pages=20, fp8_scale=0.03)
    q = torch.randn(len(lens), 32, D, generator=gen).to(qdtype).cuda()
    base = default_decode_config(D, True, qk_fp8=True)
    for window, softcap in ((None, None), (511, None), (None, 30.0)):
        ref_q8 = _ref(_quantized_q(q), p, window=window, softcap=softcap)
        ref = _ref(q, p, window=window, softcap=softcap)
        for splits, fused in ((None, False), (1, False), (16, True), (64, True)):
            cfg = dataclasses.replace(base, fused_reduce=fused)
            out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, num_splits=splits, config=cfg,
                               window=window, softcap=softcap, out=torch.full_like(q, float("nan")))
            _assert_close(out, ref_q8, qdtype)  # the e4m3 query's attention, to q's own precision
            res = check(out, ref, tol=FP8_QUERY_TOL[0])  # and the quantization's error of the raw query
            assert res["ok"], (window, softcap, splits, fused, res)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [(128, 4, 2), (64, 8, 3), (64, 4, 2), (64, 4, 3), (128, 8, 2)])
def test_decode_qk_fp8_every_sweep_tiling_gpu(gen, tiling):
    # the tilings decode_sweep.py --ab qk_fp8 times: each must be right before its speed means anything
    bn, w, st = tiling
    p = build_paged([4097, 1000, 17, 1], page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn,
                    device="cuda", gen=gen, fp8_scale=0.03)
    q = torch.randn(4, 32, 128, generator=gen).bfloat16().cuda()
    cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st, qk_fp8=True)
    out = paged_decode(q, p.cache, p.block_tables, p.seq_lens, config=cfg, num_splits=8)
    _assert_close(out, _ref(_quantized_q(q), p), torch.bfloat16)
