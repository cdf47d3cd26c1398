"""flash_attention against the float32 reference: CPU through the interpreter, full sizes on the GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from warpforge.kernels.attention import AttentionConfig, flash_attention
from warpforge.kernels.attention.prefill import _tma_descriptors, default_config
from warpforge.kernels.reference import flash_attention_ref
from warpforge.kernels.tolerance import check, tolerance


def _qkv(B, Sq, Sk, H, Hkv, D, dtype, device, gen):
    q = torch.randn(B, Sq, H, D, generator=gen).to(dtype).to(device)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).to(dtype).to(device)
    v = torch.randn(B, Sk, Hkv, D, generator=gen).to(dtype).to(device)
    return q, k, v


def _assert_close(out, ref, dtype, what=""):
    res = check(out, ref, dtype)
    assert res["ok"], f"{what} rel_err {res['rel_err']:.3g} > tol {res['tol']:.3g}"


def _assert_lse(lse, ref_lse):
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ from the reference"
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3


# ---- CPU (interpreter): small shapes, every feature ------------------------------------------

@pytest.mark.parametrize("S", [1, 2, 17, 33])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,H,Hkv", [(64, 4, 1), (80, 4, 4), (64, 8, 2)])  # MQA, MHA, GQA 4:1
def test_prefill_cpu(triton_on_cpu, gen, S, causal, D, H, Hkv):
    q, k, v = _qkv(2, S, S, H, Hkv, D, torch.float16, "cpu", gen)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, return_lse=True)
    _assert_close(out, ref, torch.float16)
    _assert_lse(lse, ref_lse)


@pytest.mark.parametrize("window,softcap,causal", [
    (5, None, True), ((3, 9), None, False), (4, None, False), (None, 15.0, True), (7, 30.0, False),
    ((-1, 2), None, False),
])
def test_prefill_window_softcap_cpu(triton_on_cpu, gen, window, softcap, causal):
    q, k, v = _qkv(1, 33, 33, 4, 2, 64, torch.float32, "cpu", gen)
    out, lse = flash_attention(q, k, v, causal=causal, window=window, softcap=softcap, return_lse=True)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, window=window, softcap=softcap, return_lse=True)
    _assert_close(out, ref, torch.float32)
    _assert_lse(lse, ref_lse)


@pytest.mark.parametrize("Sq,Sk", [(7, 40), (33, 17), (1, 33)])
def test_prefill_unequal_lengths_bottom_right_cpu(triton_on_cpu, gen, Sq, Sk):
    # Sq > Sk leaves the first queries without any key under causal masking: 0 and lse -inf.
    q, k, v = _qkv(1, Sq, Sk, 2, 1, 64, torch.float16, "cpu", gen)
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, return_lse=True)
        _assert_close(out, ref, torch.float16, f"causal={causal}")
        _assert_lse(lse, ref_lse)


def test_prefill_sdpa_layout_and_poisoned_out_cpu(triton_on_cpu, gen):
    # Vision models hold [B, H, S, D]; passing transposed views must work without copies.
    B, H, S, D = 2, 4, 17, 64
    q4, k4, v4 = (torch.randn(B, H, S, D, generator=gen).half() for _ in range(3))
    out4 = torch.full((B, H, S, D), float("nan"), dtype=torch.float16)
    out = flash_attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), causal=True,
                          out=out4.transpose(1, 2))
    assert out.data_ptr() == out4.data_ptr()
    ref = torch.nn.functional.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), is_causal=True)
    _assert_close(out4, ref, torch.float16)
    # without out=, the result keeps q's strides: transposing back gives a contiguous [B, H, S, D]
    res = flash_attention(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), causal=False)
    assert res.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 6)])
def test_prefill_varlen_cpu(triton_on_cpu, gen, causal, window):
    lens_q, lens_k = [1, 17, 2, 33, 0], [1, 20, 2, 33, 5]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    H, Hkv, D = 4, 2, 80
    q = torch.randn(int(cu_q[-1]), H, D, generator=gen).half()
    k = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).half()
    v = torch.randn(int(cu_k[-1]), Hkv, D, generator=gen).half()
    out = torch.full_like(q, float("nan"))
    res, lse = flash_attention(q, k, v, causal=causal, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                               return_lse=True, out=out)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, window=window, cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, return_lse=True)
    assert res is out and lse.shape == (H, q.shape[0])
    _assert_close(out, ref, torch.float16)
    _assert_lse(lse, ref_lse)


def test_prefill_config_override_cpu(triton_on_cpu, gen):
    # A tall/wide tile over odd lengths exercises partial blocks at both ends.
    q, k, v = _qkv(1, 33, 33, 2, 1, 64, torch.float16, "cpu", gen)
    out = flash_attention(q, k, v, causal=True, window=9,
                          config=AttentionConfig(block_m=32, block_n=16, num_warps=4, num_stages=2))
    _assert_close(out, flash_attention_ref(q, k, v, causal=True, window=9), torch.float16)


def test_prefill_reference_path_on_cpu_tensors(gen):
    # Without the fixture CPU tensors run the torch reference (product parts on CPU rely on it).
    q, k, v = _qkv(1, 5, 5, 2, 1, 64, torch.float16, "cpu", gen)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.float16
    _assert_close(out, ref, torch.float16)
    _assert_lse(lse, ref_lse)


def _f16(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


@pytest.mark.parametrize("q,k,kwargs,match", [
    (_f16(1, 5, 2, 64), _f16(1, 5, 3, 64), {}, "divide"),
    (_f16(1, 5, 2, 60), _f16(1, 5, 1, 60), {}, "head dim"),
    (_f16(1, 5, 2, 64).float(), _f16(1, 5, 1, 64), {}, "dtype"),
    (torch.zeros(1, 5, 2, 64, dtype=torch.int8), _f16(1, 5, 1, 64), {}, "dtype"),
    (_f16(1, 5, 64, 2).transpose(2, 3), _f16(1, 5, 1, 64), {}, "unit stride"),
    (_f16(1, 5, 2, 64), _f16(2, 5, 1, 64), {}, "batch"),
    (_f16(5, 2, 64), _f16(5, 1, 64), {}, "B, S, H, D"),
    (_f16(1, 5, 2, 64), _f16(1, 5, 1, 64), {"window": -2}, "window"),
    (_f16(1, 5, 2, 64), _f16(1, 5, 1, 64), {"window": (1, 2, 3)}, "window"),
    (_f16(1, 5, 2, 64), _f16(1, 5, 1, 64), {"softcap": 0.0}, "softcap"),
    (_f16(1, 5, 2, 64), _f16(1, 5, 1, 64), {"cu_seqlens_q": torch.tensor([0, 5], dtype=torch.int32)}, "both"),
    (_f16(1, 5, 2, 64), _f16(1, 5, 1, 64), {"out": _f16(1, 5, 2, 64).float()}, "out"),
])
def test_prefill_validation(q, k, kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, torch.zeros_like(k), causal=True, **kwargs)


def test_prefill_varlen_validation():
    q = torch.zeros(6, 2, 64, dtype=torch.float16)
    k = torch.zeros(6, 1, 64, dtype=torch.float16)
    good = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        flash_attention(q, k, k, causal=True, cu_seqlens_q=good.long(), cu_seqlens_k=good)
    with pytest.raises(ValueError, match="totals"):
        flash_attention(q, k, k, causal=True, cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                        cu_seqlens_k=good)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attention(q, k, k, causal=True, cu_seqlens_q=torch.tensor([0, 4, 2], dtype=torch.int32),
                        cu_seqlens_k=good)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attention(q, k, k, causal=True, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=3)
    with pytest.raises(ValueError, match="packed"):
        flash_attention(q[None], k[None], k[None], causal=True, cu_seqlens_q=good, cu_seqlens_k=good)


# ---- GPU: every head dim, bf16/fp16, long and ragged sequences --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("S", [1, 2, 17, 1000, 4097])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_gpu(gen, dtype, D, S, causal):
    q, k, v = _qkv(2, S, S, 8, 2, D, dtype, "cuda", gen)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, return_lse=True)
    _assert_close(out, ref, dtype)
    _assert_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("window,softcap", [(256, None), (None, 30.0), ((100, 7), 50.0)])
def test_prefill_window_softcap_gpu(gen, D, window, softcap):
    for causal in (False, True):
        q, k, v = _qkv(1, 1000, 1000, 4, 1, D, torch.bfloat16, "cuda", gen)
        out = flash_attention(q, k, v, causal=causal, window=window, softcap=softcap)
        ref = flash_attention_ref(q, k, v, causal=causal, window=window, softcap=softcap)
        _assert_close(out, ref, torch.bfloat16, f"causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_prefill_varlen_gpu(gen, D):
    lens = [1, 2, 17, 1000, 4097, 333]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T = int(cu[-1])
    q = torch.randn(T, 16, D, generator=gen).bfloat16().cuda()
    k = torch.randn(T, 4, D, generator=gen).bfloat16().cuda()
    v = torch.randn(T, 4, D, generator=gen).bfloat16().cuda()
    out, lse = flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                               return_lse=True, out=torch.full_like(q, float("nan")))
    ref, ref_lse = flash_attention_ref(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    _assert_close(out, ref, torch.bfloat16)
    _assert_lse(lse, ref_lse)


@pytest.mark.gpu
def test_prefill_matches_sdpa_gpu(gen):
    q, k, v = (torch.randn(2, 8, 1000, 128, generator=gen).bfloat16().cuda() for _ in range(3))
    for causal in (False, True):
        ours = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        assert check(ours.transpose(1, 2), sdpa, tol=tolerance(torch.bfloat16))["ok"]


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_tma_descriptors_cpu(triton_on_cpu, gen, causal):
    # The TMA path (Hopper tensor descriptors) through the interpreter: batched, SDPA layout, packed.
    cfg = AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, tma=True)
    q, k, v = _qkv(2, 33, 40, 4, 2, 64, torch.float16, "cpu", gen)
    assert _tma_descriptors(q, k, v, cfg, 64) is not None
    out = flash_attention(q, k, v, causal=causal, window=9, config=cfg)
    _assert_close(out, flash_attention_ref(q, k, v, causal=causal, window=9), torch.float16, "batched")
    q4 = torch.randn(2, 4, 33, 64, generator=gen).half()
    out = flash_attention(q4.transpose(1, 2), k, v, causal=causal, config=cfg)
    _assert_close(out, flash_attention_ref(q4.transpose(1, 2), k, v, causal=causal), torch.float16, "sdpa layout")
    cu = torch.tensor([0, 1, 18, 20, 53], dtype=torch.int32)
    qp, kp, vp = (torch.randn(53, h, 64, generator=gen).half() for h in (4, 1, 1))
    out, lse = flash_attention(qp, kp, vp, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, config=cfg,
                               return_lse=True)
    ref, ref_lse = flash_attention_ref(qp, kp, vp, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True)
    _assert_close(out, ref, torch.float16, "packed")
    _assert_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_tma_gpu(gen, D, causal):
    cfg = dataclasses.replace(default_config(D, causal), tma=True)
    q, k, v = _qkv(2, 1000, 1000, 8, 2, D, torch.bfloat16, "cuda", gen)
    out, lse = flash_attention(q, k, v, causal=causal, config=cfg, return_lse=True)
    ref, ref_lse = flash_attention_ref(q, k, v, causal=causal, return_lse=True)
    _assert_close(out, ref, torch.bfloat16)
    _assert_lse(lse, ref_lse)
    lens = [1, 17, 1000, 4097]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qp, kp, vp = (torch.randn(int(cu[-1]), h, D, generator=gen).bfloat16().cuda() for h in (8, 2, 2))
    out = flash_attention(qp, kp, vp, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, config=cfg)
    _assert_close(out, flash_attention_ref(qp, kp, vp, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu),
                  torch.bfloat16)
