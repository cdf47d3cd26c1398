"""rope (in place, neox/interleaved, partial rotary) and rope_cache (default, linear, llama3 scaling)."""

from __future__ import annotations

import math

import pytest
import torch

from warpforge.kernels import reference as ref
from warpforge.kernels.rope import RopeConfig, rope, rope_cache, rope_inv_freq
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err, tolerance

pytestmark = pytest.mark.usefixtures("triton_on_cpu")
F64 = torch.float64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def tol(dtype: torch.dtype) -> float:
    # A rotation is elementwise fp32 math: rounding-level bound in fp32; the table otherwise.
    return FP32_ELEMENTWISE_TOL[0] if dtype == torch.float32 else tolerance(dtype)


def _check(q, k, q0, k0, positions, cache, layout, dtype):
    """Rotated dims match the float64 reference; dims past the rotary dim are untouched, bit for bit."""
    half = cache.shape[1] // 2
    rot = 2 * half
    cos, sin = cache[:, :half], cache[:, half:]
    rq, rk = ref.rope_reference(q0[..., :rot], None if k0 is None else k0[..., :rot], positions, cos, sin,
                                layout=layout, compute_dtype=F64)
    assert rel_err(q[..., :rot], rq) <= tol(dtype)
    assert torch.equal(q[..., rot:], q0[..., rot:])
    if k0 is not None:
        assert rel_err(k[..., :rot], rk) <= tol(dtype)
        assert torch.equal(k[..., rot:], k0[..., rot:])


SHAPES = [  # T, Hq, Hk, D, rotary_dim
    (1, 1, 1, 8, 8),
    (7, 5, 1, 24, 16),  # partial rotary, MQA
    (33, 4, 2, 64, 64),
    (5, 3, 3, 80, 32),  # head_dim not a power of two, partial
]


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_reference(device, layout, dtype, shape):
    T, hq, hk, d, rot = shape
    cache = rope_cache(100, rot, device=device)
    q = torch.randn(T, hq, d, device=device, dtype=dtype)
    k = torch.randn(T, hk, d, device=device, dtype=dtype)
    pos = torch.randint(0, 100, (T,), device=device, dtype=torch.int32 if T % 2 else torch.int64)
    q0, k0 = q.clone(), k.clone()
    got = rope(q, k, pos, cache, layout=layout)
    assert got[0] is q and got[1] is k
    _check(q, k, q0, k0, pos, cache, layout, dtype)


def test_cos_sin_pair_equals_cache_and_k_none(device):
    cache = rope_cache(50, 32, base=500000.0, device=device, scaling=LLAMA3)
    pos = torch.randint(0, 50, (9,), device=device)
    q = torch.randn(9, 6, 32, device=device)
    q1, q2 = q.clone(), q.clone()
    rope(q1, None, pos, cache, rotary_dim=32)
    rope(q2, None, pos, (cache[:, :16].contiguous(), cache[:, 16:].contiguous()))
    assert torch.equal(q1, q2)
    _check(q1, None, q, None, pos, cache, "neox", torch.float32)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_views_into_fused_qkv_buffer(device, layout):
    T, hq, hk, d = 11, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=device)
    ref_qkv = qkv.clone()
    q = qkv[:, : hq * d].view(T, hq, d)  # token stride (hq + 2hk) * d, not contiguous
    k = qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    cache = rope_cache(64, d, device=device)
    pos = torch.arange(T, device=device) * 5
    rope(q, k, pos, cache, layout=layout, config=RopeConfig(block_h=1, num_warps=1))
    _check(q, k, ref_qkv[:, : hq * d].view(T, hq, d), ref_qkv[:, hq * d:(hq + hk) * d].view(T, hk, d),
           pos, cache, layout, torch.float32)
    assert torch.equal(qkv[:, (hq + hk) * d:], ref_qkv[:, (hq + hk) * d:])  # v untouched


def test_rope_cache_default_and_linear():
    c = rope_cache(10, 8, base=100.0)
    inv = 1.0 / (100.0 ** (torch.arange(0, 8, 2, dtype=F64) / 8))
    ang = torch.arange(10, dtype=F64)[:, None] * inv
    assert c.shape == (10, 8) and c.dtype == torch.float32
    assert torch.allclose(c.double(), torch.cat([ang.cos(), ang.sin()], -1), atol=1e-7)
    lin = rope_cache(10, 8, base=100.0, scaling={"type": "linear", "factor": 4.0})
    assert torch.allclose(lin.double(), torch.cat([(ang / 4).cos(), (ang / 4).sin()], -1), atol=1e-7)


def test_llama3_inv_freq_bands():
    # HF's llama3 rule, per frequency: keep short wavelengths, divide long ones by factor, and blend
    # linearly in 1/wavelength between old_ctx/high and old_ctx/low.
    base, dim = 500000.0, 128
    got = rope_inv_freq(dim, base, LLAMA3)
    inv = [1.0 / base ** (i / dim) for i in range(0, dim, 2)]
    old, lo, hi, factor = 64.0, 1.0, 4.0, 8.0
    for g, f in zip(got.tolist(), inv):
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            want = f
        elif wavelen > old / lo:
            want = f / factor
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            want = (1 - smooth) * f / factor + smooth * f
        assert g == pytest.approx(want, rel=1e-12)
    assert (got < torch.tensor(inv, dtype=F64)).any() and (got == torch.tensor(inv, dtype=F64)).any()


def test_validation(device):
    cache = rope_cache(16, 8, device=device)
    q = torch.randn(3, 2, 8, device=device)
    pos = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        rope(q.view(3, 16), None, pos, cache)
    with pytest.raises(ValueError, match="int32 or int64"):
        rope(q, None, pos.float(), cache)
    with pytest.raises(ValueError, match="positions must be"):
        rope(q, None, pos[:2], cache)
    with pytest.raises(ValueError, match="layout"):
        rope(q, None, pos, cache, layout="gptj")
    with pytest.raises(ValueError, match="rotary_dim=4 does not match"):
        rope(q, None, pos, cache, rotary_dim=4)
    with pytest.raises(ValueError, match="rotary dim 16 must be"):
        rope(q, None, pos, rope_cache(16, 16, device=device))
    with pytest.raises(ValueError, match="k must be"):
        rope(q, torch.randn(3, 2, 4, device=device), pos, cache)
    with pytest.raises(ValueError, match="head_dim"):
        rope(torch.randn(3, 8, 2, device=device).transpose(1, 2), None, pos, cache)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rope(q, None, pos, torch.randn(16, 7, device=device))
    with pytest.raises(ValueError, match="cos and sin"):
        rope(q, None, pos, (torch.randn(16, 4, device=device), torch.randn(16, 3, device=device)))
    with pytest.raises(ValueError, match="q must be float16"):
        rope(q.double(), None, pos, cache)
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        rope_cache(8, 8, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="llama3 rope scaling needs"):
        rope_cache(8, 8, scaling={"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ValueError, match="power of two"):
        RopeConfig(block_h=3, num_warps=4)


def test_cpu_dispatch_without_force_rotates_in_place():
    from warpforge.kernels import _dispatch

    prev, _dispatch._forced = _dispatch._forced, False
    try:
        cache = rope_cache(20, 8)
        q, k = torch.randn(4, 2, 12), torch.randn(4, 1, 12)
        q0, k0 = q.clone(), k.clone()
        pos = torch.tensor([0, 3, 19, 7])
        rope(q, k, pos, cache, layout="interleaved")
        _check(q, k, q0, k0, pos, cache, "interleaved", torch.float32)
        with pytest.raises(ValueError, match="max_pos"):
            rope(q, k, torch.tensor([0, 1, 2, 20]), cache)
    finally:
        _dispatch._forced = prev


# ---- GPU: bf16 at LLM shapes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("T,hq,hk,d,rot", [(4096, 32, 8, 128, 128), (1, 32, 8, 128, 128), (777, 16, 16, 256, 64)])
def test_gpu_rope_bf16(layout, T, hq, hk, d, rot):
    scaling = {**LLAMA3, "original_max_position_embeddings": 8192}
    cache = rope_cache(131072, rot, base=500000.0, device="cuda", scaling=scaling)
    q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, hk, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 131072, (T,), device="cuda")
    q0, k0 = q.clone(), k.clone()
    rope(q, k, pos, cache, layout=layout)
    _check(q, k, q0, k0, pos, cache, layout, torch.bfloat16)


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_with_the_fused_kv_store_equals_rope_then_store(device, layout, dtype, shape):
    """rope(..., v=, cache=, slot_mapping=) rotates q and k as rope does and leaves the cache pages exactly
    as cache.store(k, v, slots) after the rotation would: shuffled slots, a skipped (-1) token, partial
    rotary dims, head counts that do not fill a head block."""
    from warpforge.kernels.attention import PagedKVCache

    T, hq, hk, d, rot = shape
    page = 4
    cache_rot = rope_cache(100, rot, device=device)
    q = torch.randn(T, hq, d, device=device, dtype=dtype)
    k = torch.randn(T, hk, d, device=device, dtype=dtype)
    v = torch.randn(T, hk, d, device=device, dtype=dtype)
    pos = torch.randint(0, 100, (T,), device=device, dtype=torch.int64)
    n_pages = (T + 3) // page + 2
    slots = torch.randperm(n_pages * page, device=device)[:T]
    if T > 1:
        slots[T // 2] = -1
    fused = PagedKVCache.allocate(n_pages, page, hk, d, dtype=dtype, device=device)
    plain = PagedKVCache.allocate(n_pages, page, hk, d, dtype=dtype, device=device)
    for c in (fused, plain):  # poison: rows nobody writes must stay as they were in both
        c.k_cache.fill_(7.0)
        c.v_cache.fill_(-7.0)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    rope(q1, k1, pos, cache_rot, layout=layout, v=v, cache=fused, slot_mapping=slots)
    rope(q2, k2, pos, cache_rot, layout=layout)
    plain.store(k2, v, slots)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(fused.k_cache, plain.k_cache) and torch.equal(fused.v_cache, plain.v_cache)


def test_rope_fused_store_rejects_incomplete_arguments(device):
    from warpforge.kernels.attention import PagedKVCache

    cache_rot = rope_cache(16, 8, device=device)
    q, k = torch.randn(2, 2, 8, device=device), torch.randn(2, 1, 8, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    kv = PagedKVCache.allocate(2, 4, 1, 8, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="needs k, v and slot_mapping"):
        rope(q, k, pos, cache_rot, cache=kv)
    with pytest.raises(ValueError, match="only used with cache="):
        rope(q, k, pos, cache_rot, v=k.clone())
    with pytest.raises(ValueError, match="slot_mapping"):
        rope(q, k, pos, cache_rot, v=k.clone(), cache=kv, slot_mapping=torch.zeros(3, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_fused_kv_store_on_the_gpu_bf16_and_fp8_pages(fp8):
    """bf16 and e4m3 pages (the interpreter has neither): the fused store equals rope then cache.store."""
    from warpforge.kernels.attention import PagedKVCache
    from warpforge.kernels.attention.kv_cache import fp8_scales

    T, hq, hk, d, page = 37, 32, 8, 128, 16
    dev, dt = torch.device("cuda"), torch.bfloat16
    cache_rot = rope_cache(4096, d, device=dev)
    q = torch.randn(T, hq, d, device=dev, dtype=dt)
    k = torch.randn(T, hk, d, device=dev, dtype=dt)
    v = torch.randn(T, hk, d, device=dev, dtype=dt)
    pos = torch.randint(0, 4096, (T,), device=dev)
    slots = torch.randperm(8 * page, device=dev)[:T]
    slots[5] = -1
    kw = dict(dtype=torch.float8_e4m3fn, k_scale=fp8_scales(k), v_scale=fp8_scales(v)) if fp8 else dict(dtype=dt)
    fused, plain = (PagedKVCache.allocate(8, page, hk, d, device=dev, **kw) for _ in range(2))
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    rope(q1, k1, pos, cache_rot, v=v, cache=fused, slot_mapping=slots)
    rope(q2, k2, pos, cache_rot)
    plain.store(k2, v, slots)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(fused.k_cache.view(torch.uint8), plain.k_cache.view(torch.uint8))
    assert torch.equal(fused.v_cache.view(torch.uint8), plain.v_cache.view(torch.uint8))
