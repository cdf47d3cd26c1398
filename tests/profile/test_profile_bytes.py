"""Bytes per operator on known ops: inputs read + outputs written at their dtypes, each tensor once."""

from __future__ import annotations

import pytest
import torch

from warpforge.profile.flops import count, tensor_bytes

F32 = 4


def one(fn, *inputs):
    """The single record of a call that runs one counted operator."""
    c = count(fn, *inputs)
    assert len(c.records) == 1, [(r.op, r.bytes) for r in c.records]
    return c.records[0]


def test_binary_reads_both_writes_one():
    assert one(torch.add, torch.randn(1000), torch.randn(1000)).bytes == 3 * 1000 * F32


def test_broadcast_bias_is_read_once():
    # x [8, 16] + b [16]: b is read once (its expanded view has stride 0), not 8 times
    assert one(torch.add, torch.randn(8, 16), torch.randn(16)).bytes == (128 + 16 + 128) * F32


def test_same_tensor_twice_is_read_once():
    x = torch.randn(1000)
    assert one(lambda a: a + a, x).bytes == 2 * 1000 * F32


def test_in_place_reads_and_writes_self():
    assert one(lambda a, b: a.add_(b), torch.randn(1000), torch.randn(1000)).bytes == 3 * 1000 * F32


def test_copy_does_not_read_its_destination():
    assert one(lambda d, s: d.copy_(s), torch.empty(1000), torch.randn(1000)).bytes == 2 * 1000 * F32


def test_fill_writes_only():
    assert one(lambda d: d.fill_(1.0), torch.empty(1000)).bytes == 1000 * F32


def test_out_argument_is_not_read():
    z = torch.empty(1000)
    assert one(lambda a, b: torch.add(a, b, out=z), torch.randn(1000), torch.randn(1000)).bytes == 3 * 1000 * F32


def test_dtype_conversion_at_both_dtypes():
    r = one(lambda a: a.to(torch.float16), torch.randn(1000))
    assert r.bytes == 1000 * 4 + 1000 * 2 and r.kind == "movement"


def test_views_and_no_op_conversions_move_nothing():
    c = count(lambda a: (a.view(10, 100), a.reshape(100, 10).t(), a.to(torch.float32), a[::2], a.unsqueeze(0)),
              torch.randn(1000))
    assert c.records == []


def test_contiguous_of_a_transpose_copies():
    r = one(lambda a: a.t().contiguous(), torch.randn(20, 30))
    assert r.bytes == 2 * 600 * F32


def test_gather_reads_rows_not_the_table():
    w, idx = torch.randn(100, 16), torch.tensor([1, 5, 7, 9, 3])
    r = one(torch.nn.functional.embedding, idx, w)
    assert r.bytes == 5 * 8 + 2 * 5 * 16 * F32  # indices + rows read + rows written


def test_matmul_minimal_traffic():
    assert one(torch.mm, torch.randn(4, 8), torch.randn(8, 16)).bytes == (32 + 128 + 64) * F32


def test_cat():
    assert one(lambda a, b: torch.cat([a, b]), torch.randn(10), torch.randn(20)).bytes == 2 * 30 * F32


def test_half_precision_sizes():
    x = torch.randn(64, 64).to(torch.bfloat16)
    assert one(torch.relu, x).bytes == 2 * 64 * 64 * 2


def test_tensor_bytes_strided():
    x = torch.randn(8, 16)
    assert tensor_bytes(x[:, ::2]) == 8 * 8 * F32
    assert tensor_bytes(torch.randn(16).expand(8, 16)) == 16 * F32
    assert tensor_bytes(torch.empty(0, 3)) == 0


def test_triton_launches_recorded_with_argument_bytes(triton_on_cpu):
    """warpforge's own kernels never reach the dispatcher; their launches are counted by name and bytes."""
    from warpforge.kernels import memory

    src = torch.randn(1000)
    out = torch.full((1000,), float("nan"))
    c = count(lambda s, o: memory.copy(s, out=o), src, out)
    triton = [r for r in c.records if r.op.startswith("triton::")]
    assert [r.op for r in triton] == ["triton::_copy_kernel"]
    assert triton[0].bytes == 2 * 1000 * F32 and triton[0].kind == "triton"
    assert torch.equal(out, src)  # the kernel still ran


@pytest.mark.parametrize("grad", [False, True])
def test_counting_leaves_results_unchanged(grad):
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = m(x)
    got = []
    count(lambda a: got.append(m(a)), x, grad=grad)
    torch.testing.assert_close(got[0].detach(), want)


def test_triton_gemm_flops_from_the_argument_convention(triton_on_cpu):
    """A Triton GEMM (integer M, N, K arguments) is counted 2*M*N*K, against the tensor-core roof."""
    from warpforge.kernels.matmul import matmul

    a, b = torch.randn(5, 9), torch.randn(9, 7)
    c = count(matmul, a, b)
    (rec,) = [r for r in c.records if r.op.startswith("triton::")]
    assert rec.kind == "matmul" and rec.flops == 2 * 5 * 7 * 9
    assert rec.bytes >= (5 * 9 + 9 * 7 + 5 * 7) * F32
    assert rec.ceiling in ("fp32", "tf32")  # from the kernel's DOT_PRECISION for fp32 inputs


def test_triton_gemm_flops_rules():
    from warpforge.profile.flops import triton_gemm_flops

    assert triton_gemm_flops("_linear_kernel", {"M": 8, "N": 4096, "K": 1024, "x_ptr": None}) == (2 * 8 * 4096 * 1024,
                                                                                                 "matmul")
    conv = {"M": 2 * 16 * 16, "COUT": 64, "CIN_G": 32, "KH": 3, "KW": 3}
    assert triton_gemm_flops("_conv_gemm_kernel", conv) == (2 * 512 * 64 * 32 * 9, "conv")
    assert triton_gemm_flops("_copy_kernel", {"n": 100}) == (0, "triton")
    assert triton_gemm_flops("_weird", {"M": 2, "N": 3, "K": True}) == (0, "triton")  # a bool is not a size
