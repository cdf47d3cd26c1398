"""The public kernel API on bad input: an index a kernel would read memory with (a rope position, a
page id) is a ValueError before the launch, never values read from outside a buffer or a crash; and the
Triton interpreter refuses bf16 where its dot products would be garbage."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels._checks import resolve_check_values
from warpforge.kernels.attention import PagedKVCache, chunked_prefill, flash_attention, paged_decode
from warpforge.kernels.conv import conv2d
from warpforge.kernels.gemv import LinearConfig, gemv, linear
from warpforge.kernels.matmul import matmul
from warpforge.kernels.quant_linear import quantize_weight
from warpforge.kernels.rope import rope, rope_cache

from .attention.conftest import build_paged


@pytest.mark.parametrize("triton_path", [True, False])
@pytest.mark.parametrize("bad", [32, -1, 100000])
def test_rope_position_out_of_range(request, gen, triton_path, bad):
    if triton_path:
        request.getfixturevalue("triton_on_cpu")
    q, k = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    before = q.clone()
    with pytest.raises(ValueError, match=rf"^positions must be in \[0, max_pos=32\), got min {min(bad, 0)} "
                                         rf"max {max(bad, 5)}"):
        rope(q, k, torch.tensor([0, bad, 5]), rope_cache(32, 16))
    assert torch.equal(q, before)  # refused before anything was written


def test_rope_edge_positions_still_rotate(triton_on_cpu, gen):
    from warpforge.kernels.reference import rope_reference

    q, k = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    pos, cache = torch.tensor([0, 31]), rope_cache(32, 16)
    want_q, want_k = rope_reference(q, k, pos, cache[:, :8], cache[:, 8:], layout="neox")
    rope(q, k, pos, cache)
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)


@pytest.mark.parametrize("page", [9, 10**6, -2])
def test_paged_attention_page_id_outside_the_cache(triton_on_cpu, gen, page):
    p = build_paged([5, 9], page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu", gen=gen)
    bad = p.block_tables.clone()
    bad[1, 2] = page  # the last page sequence 1 reads
    q = torch.randn(2, 4, 64, generator=gen).half()
    with pytest.raises(ValueError, match=rf"^block_tables: used entries must be page indices in \[0, "
                                         rf"{p.cache.num_pages}\)"):
        paged_decode(q, p.cache, bad, p.seq_lens)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_tables: used entries must be page indices"):
        chunked_prefill(q, p.cache, bad, p.seq_lens, cu)


def test_values_are_checked_on_the_gpu_except_during_graph_capture(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert resolve_check_values(None, cuda) is True  # the public default: checked (one host sync)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert resolve_check_values(None, cuda) is False  # values cannot be read inside a capture
    assert resolve_check_values(True, cuda) is True and resolve_check_values(False, torch.device("cpu")) is False
    assert resolve_check_values(None, torch.device("cpu")) is True


@pytest.mark.parametrize("scheme, name", [("int8", "int8"), ("int4_g32", "int4"), ("fp8", "fp8")])
def test_word_kernel_refusal_names_the_weight_format(triton_on_cpu, scheme, name):
    qw = quantize_weight(torch.randn(16, 64), scheme)
    with pytest.raises(ValueError, match=rf"got M=2 and a {name} weight with K=64$"):
        linear(torch.zeros(2, 64), qw, config=LinearConfig(1, 16, 64, words=True))


def test_bf16_through_the_interpreter_is_refused(triton_on_cpu, gen):
    bf = torch.bfloat16
    a, b = torch.randn(32, 64, generator=gen).to(bf), torch.randn(64, 48, generator=gen).to(bf)
    calls = {
        "matmul": lambda: matmul(a, b),
        "gemv": lambda: gemv(a[:4], b.T.contiguous()),
        "linear": lambda: linear(a[:4], quantize_weight(torch.randn(16, 64, generator=gen), "int8")),
        "flash_attention": lambda: flash_attention(*(torch.randn(1, 8, 2, 64, generator=gen).to(bf) for _ in "qkv"),
                                                   causal=True),
    }
    calls["conv2d"] = lambda: conv2d(torch.randn(1, 8, 6, 6, generator=gen).to(bf)
                                     .contiguous(memory_format=torch.channels_last),
                                     torch.randn(8, 8, 3, 3, generator=gen).to(bf), padding=1)
    p = build_paged([5], page_size=4, num_kv_heads=2, head_dim=64, dtype=bf, device="cpu", gen=gen)
    calls["paged_decode"] = lambda: paged_decode(torch.randn(1, 4, 64, generator=gen).to(bf), p.cache,
                                                 p.block_tables, p.seq_lens)
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{name}: bfloat16 is not supported through the Triton interpreter"):
            call()


def test_bf16_outside_the_interpreter_path_still_runs(gen):
    """CPU tensors without force_triton take the torch reference, where bf16 is fine."""
    a, b = torch.randn(8, 16, generator=gen).bfloat16(), torch.randn(16, 8, generator=gen).bfloat16()
    assert torch.allclose(matmul(a, b).float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
    cache = PagedKVCache.allocate(2, 4, 1, 16, dtype=torch.bfloat16, device="cpu")
    assert cache.dtype == torch.bfloat16
