"""Programmatic dependent launch (kernels/_dispatch.py): off by default, never on CPU or in the
interpreter, and on the GPU bit-identical results for a chain of dependent kernels in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import programmatic_launch
from warpforge.kernels._dispatch import pdl


def test_pdl_is_off_unless_asked_and_never_on_cpu():
    x = torch.ones(4)
    assert pdl(x) == 0
    with programmatic_launch(True):
        assert pdl(x) == 0  # CPU tensors (and the interpreter) never launch with PDL
        with programmatic_launch(False):
            assert pdl(x) == 0
    assert pdl(x) == 0


def test_pdl_takes_a_bool():
    for bad in ("late", "yes", 1, None):
        with pytest.raises(ValueError, match="pdl: expected True or False, got"):
            with programmatic_launch(bad):
                pass


def test_engine_config_reads_pdl_from_the_settings(monkeypatch):
    from warpforge.llm.engine_config import EngineConfig

    monkeypatch.delenv("WARPFORGE_PDL", raising=False)
    assert EngineConfig().pdl is False
    monkeypatch.setenv("WARPFORGE_PDL", "1")
    assert EngineConfig().pdl is True and EngineConfig(pdl=False).pdl is False  # an explicit field wins
    monkeypatch.setenv("WARPFORGE_PDL", "late")
    with pytest.raises(ValueError, match="^WARPFORGE_PDL: expected 1/on/true/yes or 0/off/false/no, got 'late'"):
        EngineConfig()
    monkeypatch.delenv("WARPFORGE_PDL")
    with pytest.raises(ValueError, match="^pdl: expected a bool"):
        EngineConfig(pdl="late")


def _chain(x, r, w_norm, w1, w2):
    """norm(+residual) -> linear -> silu_and_mul -> linear -> argmax: each kernel reads the one before."""
    from warpforge.kernels.activation import silu_and_mul
    from warpforge.kernels.argmax import argmax_rows
    from warpforge.kernels.gemv import linear
    from warpforge.kernels.norm import rms_norm

    h, res = rms_norm(x, w_norm, 1e-6, residual=r)
    y = linear(silu_and_mul(linear(h, w1)), w2)
    return y, res, argmax_rows(y)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_pdl_chain_in_a_cuda_graph_is_bit_identical(m):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    g = torch.Generator(device="cuda").manual_seed(m)
    dt = torch.bfloat16
    x = torch.randn(m, 2048, device="cuda", generator=g).to(dt)
    r = torch.randn(m, 2048, device="cuda", generator=g).to(dt)
    w_norm = torch.rand(2048, device="cuda", generator=g).to(dt)
    w1 = (torch.randn(2 * 5632, 2048, device="cuda", generator=g) / 45).to(dt)
    w2 = (torch.randn(2048, 5632, device="cuda", generator=g) / 75).to(dt)
    want = _chain(x, r, w_norm, w1, w2)
    outs = {}
    for on in (False, True):
        with programmatic_launch(on):
            _chain(x, r, w_norm, w1, w2)  # compile outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[on] = _chain(x, r, w_norm, w1, w2)
        for _ in range(20):  # a race would show as a moving result
            outs[on][0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(outs[on], want):
                assert torch.equal(a, b), f"pdl={on}"


@pytest.mark.parametrize("m, n, k, split", [(1, 37, 300, None), (1, 64, 1024, 4), (5, 50, 129, None)])
def test_linear_pdl_path_prefetches_the_first_weight_tile_and_stays_exact(monkeypatch, m, n, k, split):
    """With PDL the GEMV loads its first weight tile before the wait and peels that K step off the loop:
    run that code path (the interpreter skips the wait itself) on odd sizes and split-K."""
    from warpforge.kernels import force_triton
    from warpforge.kernels import gemv
    from warpforge.kernels.gemv import LinearConfig, linear

    monkeypatch.setattr(gemv, "pdl", lambda x: 1)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    cfg = None if split is None else LinearConfig(1, 16, 128, split_k=split)
    out = torch.full((m, n), float("nan"))
    with force_triton():
        linear(x, w, bias=b, out=out, config=cfg)
    want = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
