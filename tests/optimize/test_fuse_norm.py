"""fuse_norm: LayerNorm onto the norm kernel with the residual add before it, outputs preserved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warpforge.kernels._dispatch import force_triton
from warpforge.zoo.layers import Block
from warpforge.optimize.passes.fuse_linear import FusedLinear
from warpforge.optimize.passes.fuse_norm import FusedLayerNorm, FuseNorm
from warpforge.optimize.pipeline import default_passes, float_passes, optimize_graph


class _Net(nn.Module):
    """Two pre-norm blocks and a final norm, plus what must not fuse: a broadcast add before a norm, a norm
    over two dims, a norm module called twice."""

    def __init__(self, d: int = 24, hidden: int = 40):
        super().__init__()
        self.blocks = nn.Sequential(Block(d, 4, hidden), Block(d, 2, hidden))
        self.ln_f = nn.LayerNorm(d)
        self.bias_like = nn.Parameter(torch.randn(d))
        self.ln_b = nn.LayerNorm(d)
        self.ln_2d = nn.LayerNorm((7, d))
        self.twice = nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln_f(self.blocks(x))
        y = self.ln_b(x + self.bias_like)  # broadcast add: the norm alone is rewritten
        return self.twice(self.twice(y)) + self.ln_2d(y)


def _inputs(b=2, n=7, d=24):
    return (torch.randn(b, n, d, generator=torch.Generator().manual_seed(5)),)


def _randomize(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(6)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):  # not the trivial 1 / 0 of a fresh norm
            m.weight.data = 1 + 0.3 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.2 * torch.randn(m.bias.shape, generator=g)
    return model.eval()


def test_fuses_norms_and_their_adds_and_keeps_outputs_fp32():
    model, inputs = _randomize(_Net()), _inputs()
    gm, rep = optimize_graph(model, inputs, [*default_passes(), FuseNorm()])
    fn = next(p for p in rep["passes"] if p["name"] == "fuse_norm")
    # fused: 4 block norms (3 with the residual add before them: blocks.0.ln_2, blocks.1.ln_1, blocks.1.ln_2;
    # blocks.0.ln_1 reads the input) + ln_f (after blocks.1's last add) + ln_b (alone: broadcast add);
    # skipped: ln_2d (two dims), twice (called twice, counted once per call)
    assert fn["counts"] == {"fused": 6, "skipped": 3}, fn["counts"]
    details = {c["where"]: c["detail"] for c in fn["changes"] if c["action"] == "fused"}
    with_add = sorted(w for w, d in details.items() if "in one norm kernel" in d)
    assert with_add == ["blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f"], with_add
    assert "in one norm kernel" not in details["ln_b"] and "in one norm kernel" not in details["blocks.0.ln_1"]
    with torch.no_grad():
        want, got = model(*inputs), gm(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(isinstance(m, FusedLayerNorm) and m.residual for m in gm.modules()) == 4


def test_float_passes_give_the_adds_to_the_norms_first():
    """In the float pipeline fuse_norm runs before fuse_linear, so the adds feeding a norm go to the norm and
    every residual add here does; outputs kept."""
    model, inputs = _randomize(_Net()), _inputs()
    gm, rep = optimize_graph(model, inputs, float_passes())
    names = [p["name"] for p in rep["passes"]]
    assert names.index("fuse_norm") < names.index("fuse_linear")
    fused_res = [m for m in gm.modules() if isinstance(m, FusedLinear) and m.has_residual]
    assert fused_res == []  # every residual add here feeds a norm
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", [False, True])
def test_fused_layer_norm_kernel_path_fp16(residual):
    """The Triton path (interpreter on CPU) against torch in fp16 on an odd width; NaN-poisoned inputs
    elsewhere would show up: the outputs are compared whole."""
    g = torch.Generator().manual_seed(7)
    ln = _randomize(nn.Sequential(nn.LayerNorm(37))).half()[0]
    x = torch.randn(3, 5, 37, generator=g).half()
    r = torch.randn(3, 5, 37, generator=g).half()
    mod = FusedLayerNorm(ln, residual=residual)
    with torch.no_grad():
        want_s = (x + r) if residual else x
        want = torch.nn.functional.layer_norm(want_s.float(), (37,), ln.weight.float(), ln.bias.float(), ln.eps)
        with force_triton():
            got = mod(x, r) if residual else mod(x)
    y = got[0] if residual else got
    assert y.dtype == torch.float16 and y.shape == x.shape
    torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=4e-3)
    if residual:
        assert torch.equal(got[1], x + r)  # the sum rounded to fp16, as torch's add


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [197, 32 * 197])
def test_gpu_fused_layer_norm_at_vit_sizes(tokens):
    """The norm kernel with the residual at ViT-B/16's widths (batch 1 and 32 tokens), in and out of a CUDA
    graph (the batch-32 ViT build faulted on the H200 with fuse_norm on, 2026-12-02: this isolates it)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    ln = _randomize(nn.Sequential(nn.LayerNorm(768))).half().cuda()[0]
    mod = FusedLayerNorm(ln, residual=True)
    x = torch.randn(tokens, 768, device="cuda", generator=g).half()
    r = torch.randn(tokens, 768, device="cuda", generator=g).half()
    with torch.no_grad():
        y, s = mod(x, r)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg, sg = mod(x, r)
        graph.replay()
        torch.cuda.synchronize()
    want = torch.nn.functional.layer_norm((x + r).float(), (768,), ln.weight.float(), ln.bias.float(), ln.eps)
    assert torch.equal(s, x + r) and torch.equal(sg, s) and torch.equal(yg, y)
    torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=4e-3)
