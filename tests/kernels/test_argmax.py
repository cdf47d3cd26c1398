"""argmax_rows against torch.argmax: odd widths across chunk edges, ties, -inf rows, NaN, dtypes."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.argmax import argmax_rows

pytestmark = pytest.mark.usefixtures("triton_on_cpu")


@pytest.mark.parametrize("m,n", [(1, 1), (1, 7), (3, 255), (3, 256), (2, 257), (5, 1000), (1, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_on_odd_sizes(m, n, dtype, gen):
    x = torch.randn(m, n, generator=gen).to(dtype)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (m,)
    assert torch.equal(got, x.float().argmax(dim=-1))


def test_ties_go_to_the_first_index_across_chunks(gen):
    x = torch.randn(4, 1000, generator=gen)
    x[0, [3, 700]] = 50.0  # two chunks hold the max: the earlier wins
    x[1, [600, 900]] = 50.0
    x[2] = 1.0  # all equal: index 0
    x[3] = float("-inf")  # all -inf: index 0, like torch
    assert argmax_rows(x, chunk=256).tolist() == [3, 600, 0, 0]
    assert argmax_rows(x, chunk=256).tolist() == x.argmax(dim=-1).tolist()


def test_nan_ranks_highest_and_batch_dims_are_kept(gen):
    x = torch.randn(2, 3, 600, generator=gen)
    x[0, 1, 444] = float("nan")
    got = argmax_rows(x, chunk=128)
    assert got.shape == (2, 3) and got[0, 1] == 444
    assert torch.equal(got, x.argmax(dim=-1))


def test_strided_rows_and_bad_input(gen):
    base = torch.randn(6, 900, generator=gen)
    view = base[::2, 100:800]  # row stride 1800, unit last stride
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    with pytest.raises(ValueError, match="empty row"):
        argmax_rows(torch.empty(3, 0))
    with pytest.raises(ValueError, match="chunk"):
        argmax_rows(base, chunk=100)
    with pytest.raises(ValueError, match="x"):
        argmax_rows(torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_sized_rows_on_the_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 7, 64):
        x = torch.randn(m, 128256, generator=g, device="cuda").to(dtype)
        assert torch.equal(argmax_rows(x), x.float().argmax(dim=-1))
