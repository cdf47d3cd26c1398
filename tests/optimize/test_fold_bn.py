import copy

import torch
from torch import nn

from warpforge.optimize import FoldBatchNorm, PassContext, capture

from .nets import SmallNet, conv_bn_act, image, make, randomize_bn


def _fold(model, x):
    ctx = PassContext(example_inputs=(x,))
    gm = FoldBatchNorm().apply(capture(model, (x,)).module, ctx)
    return gm, ctx


def _assert_fp32_exact(model, folded, x):
    """Folded fp32 vs the eval-mode original: within a few fp32 ulps of the output scale, and no worse
    against the float64 truth than the original fp32 model itself."""
    with torch.no_grad():
        want, got = model(x), folded(x)
        truth = copy.deepcopy(model).double()(x.double())
    scale = truth.abs().max().item()
    assert (got - want).abs().max().item() <= 8 * torch.finfo(torch.float32).eps * scale
    assert (got.double() - truth).abs().max().item() <= 4 * (want.double() - truth).abs().max().item() + 1e-12


def test_folds_every_bn_exactly():
    model, x = make(SmallNet()), image()
    folded, ctx = _fold(model, x)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in folded.modules())
    assert {c.action for c in ctx.changes} == {"folded"}
    assert len(ctx.changes) == 7  # 6 BatchNorm2d (stem, block x2, dw, pw, grouped) + the head's BatchNorm1d
    where = {c.where for c in ctx.changes}
    assert {"block.bn1 -> block.conv1", "dw.1 -> dw.0", "grouped.1 -> grouped.0", "fc_bn -> fc"} <= where
    assert folded.get_submodule("block.conv1").bias is not None  # bias-free conv gained one
    _assert_fp32_exact(model, folded, x)


def test_depthwise_and_affine_free_bn():
    gen = torch.Generator().manual_seed(3)
    model = conv_bn_act(6, 6, 3, groups=6)
    model[1] = nn.BatchNorm2d(6, affine=False)
    model = randomize_bn(model, gen).eval()
    x = image(c=6)
    folded, ctx = _fold(model, x)
    assert [c.action for c in ctx.changes] == ["folded"]
    _assert_fp32_exact(model, folded, x)


class _Tapped(nn.Module):
    """conv output feeds the BN and something else: folding would change the other user's input."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class _Linear3d(nn.Module):
    """BatchNorm1d on [N, C, L] normalizes C, not the Linear's features: must not fold."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_skips_with_reasons_and_preserves_outputs():
    for model, x, reason in ((make(_Tapped()), image(), "other users"),
                             (make(_Linear3d()), torch.randn(2, 4, 4), "3-D")):
        folded, ctx = _fold(model, x)
        assert [c.action for c in ctx.changes] == ["skipped"]
        assert reason in ctx.changes[0].detail
        with torch.no_grad():
            assert torch.equal(folded(x), model(x))


def test_training_mode_bn_is_skipped():
    model, x = make(SmallNet()), image()
    model.dw[1].train()
    folded, ctx = _fold(model, x)
    skipped = [c for c in ctx.changes if c.action == "skipped"]
    assert [c.where for c in skipped] == ["dw.1"] and "training" in skipped[0].detail
