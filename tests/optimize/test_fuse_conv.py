import pytest
import torch
import torch.nn.functional as F
from torch import nn

from warpforge.optimize import FoldBatchNorm, FuseConvEpilogue, FusedConv2d, PassContext, capture

from .nets import SmallNet, image, make


def _fuse(model, x, fold=True):
    ctx = PassContext(example_inputs=(x,))
    gm = capture(model, (x,)).module
    if fold:
        gm = FoldBatchNorm().apply(gm, ctx)
    start = len(ctx.changes)
    gm = FuseConvEpilogue().apply(gm, ctx)
    return gm, ctx.changes[start:]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_small_net_every_conv_fused_with_its_epilogue():
    model, x = make(SmallNet()), image()
    gm, changes = _fuse(model, x)
    fused = {name: m for name, m in gm.named_modules() if isinstance(m, FusedConv2d)}
    assert not any(type(m) is nn.Conv2d for m in gm.modules())
    assert [c.action for c in changes] == ["fused"] * 6
    acts = {name: (m.activation, m.has_residual) for name, m in fused.items()}
    assert acts == {"stem_0_fused": ("relu", False), "block_conv1_fused": ("relu", False),
                    "block_conv2_fused": ("relu", True), "dw_0_fused": ("relu6", False),
                    "pw_0_fused": ("silu", False), "grouped_0_fused": ("gelu", False)}
    assert fused["dw_0_fused"].groups == 8 and fused["grouped_0_fused"].groups == 2
    residual_change = next(c for c in changes if c.where.startswith("block.conv2"))
    assert "+ " in residual_change.where and residual_change.detail.startswith("3 op(s)")
    with torch.no_grad():
        out = gm(x)
        _close(out, model(x))


class _Patterns(nn.Module):
    """Functional activations, a tanh GELU (not the kernel's erf form), and a broadcast add (not a residual)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1)
        self.shift = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x):
        y = F.silu(self.a(x))
        y = F.gelu(self.b(y), approximate="tanh")
        return torch.relu(self.c(y) + self.shift)


def test_functional_patterns_and_non_matches():
    model, x = make(_Patterns()), image()
    gm, changes = _fuse(model, x, fold=False)
    by_conv = {c.where.split(" ")[0]: c for c in changes}
    assert by_conv["a"].action == "fused" and by_conv["a"].where == "a -> silu"
    assert by_conv["b"].action == "replaced"  # tanh GELU stays a separate op
    assert by_conv["c"].action == "replaced"  # + shift broadcasts: not the kernel's residual
    assert gm.get_submodule("c_fused").has_residual is False
    with torch.no_grad():
        _close(gm(x), model(x))


def test_fused_output_is_channels_last_and_accepts_nchw():
    conv = nn.Conv2d(4, 6, 3, padding=1)
    fused = FusedConv2d(conv, "relu", has_residual=True)
    x, r = torch.randn(2, 4, 5, 7), torch.randn(2, 6, 5, 7)
    with torch.no_grad():
        out = fused(x, r)
        _close(out, torch.relu(conv(x) + r))
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_skips_shared_conv_and_string_padding():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.same = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding="same")

        def forward(self, x):
            return self.same(self.conv(self.conv(x)))

    model, x = make(Twice()), image()
    gm, changes = _fuse(model, x, fold=False)
    assert [c.action for c in changes] == ["skipped"] * 3
    assert "more than once" in changes[0].detail and "padding='same'" in changes[2].detail
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


class _Downsample(nn.Module):
    """ResNet downsample block: relu(bn(conv(x)) + bn_d(conv_d(x))), two convs meet at the add."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, 2, 1, bias=False), nn.BatchNorm2d(6)
        self.down, self.bn_d = nn.Conv2d(3, 6, 1, 2, bias=False), nn.BatchNorm2d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + self.bn_d(self.down(x)))


def test_two_convs_meeting_at_an_add():
    model, x = make(_Downsample()), image()
    gm, changes = _fuse(model, x)
    assert sorted(c.action for c in changes) == ["fused", "replaced"]
    fused = next(m for m in gm.modules() if isinstance(m, FusedConv2d) and m.has_residual)
    assert fused.activation == "relu"
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "call_module", "output"]
    with torch.no_grad():
        _close(gm(x), model(x))


def test_float64_conv_is_left_alone():
    model, x = make(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())).double(), image().double()
    gm, changes = _fuse(model, x, fold=False)
    assert [c.action for c in changes] == ["skipped"] and "float64" in changes[0].detail
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))


def test_needs_a_graph():
    with pytest.raises(ValueError, match="GraphModule"):
        FuseConvEpilogue().apply(nn.Conv2d(1, 1, 1), PassContext(example_inputs=()))
