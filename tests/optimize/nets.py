"""Tiny random nets for the optimize tests (built here: no torchvision): CNNs with non-trivial BN statistics, a
linear-heavy MLP with odd widths, and the zoo planner at a test size."""

from __future__ import annotations

import torch
from torch import nn


def randomize_bn(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """Running stats and affine params far from (0, 1, 1, 0), so a wrong fold shows in the outputs."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
            m.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.1)
            if m.affine:
                m.weight.data.copy_(torch.randn(c, generator=gen))
                m.bias.data.copy_(torch.randn(c, generator=gen))
    return model


def conv_bn_act(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: nn.Module | None = None,
                bias: bool = False) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=bias), nn.BatchNorm2d(cout),
                         act if act is not None else nn.ReLU(inplace=True))


class Residual(nn.Module):
    """ResNet basic block: relu(bn2(conv2(relu(bn1(conv1(x))))) + x)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class SmallNet(nn.Module):
    """stem (bias conv) -> residual block -> depthwise + pointwise (ReLU6, SiLU) -> grouped GELU -> Linear+BN1d head."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = conv_bn_act(3, c, 3, 2, bias=True)
        self.block = Residual(c)
        self.dw = conv_bn_act(c, c, 3, 1, groups=c, act=nn.ReLU6())
        self.pw = conv_bn_act(c, 2 * c, 1, act=nn.SiLU())
        self.grouped = conv_bn_act(2 * c, 2 * c, 3, 2, groups=2, act=nn.GELU())
        self.fc = nn.Linear(2 * c, classes)
        self.fc_bn = nn.BatchNorm1d(classes)

    def forward(self, x):
        x = self.grouped(self.pw(self.dw(self.block(self.stem(x)))))
        return self.fc_bn(self.fc(torch.flatten(x.mean((2, 3)), 1)))


class DataDependent(nn.Module):
    """Python control flow on tensor values: FX cannot trace it, so capture must leave it eager."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x):
        if x.sum() > 0:
            return self.conv(x)
        return -x


class WithEager(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.head = conv_bn_act(3, c)
        self.odd = DataDependent(c)
        self.tail = conv_bn_act(c, c)

    def forward(self, x):
        return self.tail(self.odd(self.head(x)))


def make(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * (1.0 / max(1, p[0].numel()) ** 0.5))
    return randomize_bn(model, gen).eval()


def image(n: int = 2, c: int = 3, hw: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, c, hw, hw, generator=torch.Generator().manual_seed(seed))


class LinearHeavy(nn.Module):
    """A planner-like MLP over tokens, odd widths: [B, T, 10] -> (steps [B, T, 37], logit [B, T, 1]).

    embed K=10 and logit N=1 are too small for a quantized kernel; fc1 has K=129 (one past a group of 128),
    head N=37 (no power of two)."""

    def __init__(self, features: int = 10, width: int = 129, hidden: int = 200, out: int = 37) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.head, self.logit = nn.Linear(width, out), nn.Linear(width, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h))))
        return self.head(h), self.logit(h)


def tokens(b: int = 2, t: int = 9, f: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, t, f, generator=torch.Generator().manual_seed(seed))


def small_planner(dim: int = 48, ffn: int = 80):
    """The zoo's planner (warpforge.zoo.planner) at a CPU-test size, with one seeded scene of batch 2."""
    from warpforge.zoo.planner import Planner, PlannerConfig, scene

    c = PlannerConfig(agents=4, history=5, polylines=6, points=7, dim=dim, heads=4, ffn=ffn, encoder_layers=1,
                      decoder_layers=1, modes=3, horizon=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Planner(c).eval()
    return model, scene(torch.Generator().manual_seed(1), 2, c), c


def tiny_zoo(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Zoo model ``name`` (warpforge.zoo) built from its own code at a CPU-test size, eval mode, with seeded
    inputs of batch 2. torch.export's cost grows with the number of operators, so the classifiers get fewer
    blocks than the published ones: MobileNetV2 and EfficientNet-Lite0 from shortened block tables (every
    block kind kept: expansion 1 and 6, stride 1 and 2, the residual add, EfficientNet's odd "SAME" pad),
    ResNet-50's bottlenecks one per stage. The others are tests/zoo's small configurations."""
    from unittest import mock

    from warpforge.zoo import bev_lss, detr, efficientnet_lite, mobilenet_v2, planner, resnet, vit
    from warpforge.zoo._common import calibrate_batchnorm

    g = torch.Generator().manual_seed(7)
    img = torch.randn(2, 3, 64, 64, generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "mobilenet_v2":
            with mock.patch.object(mobilenet_v2, "SETTINGS", ((1, 16, 1, 1), (6, 24, 2, 2))):
                model, inputs = mobilenet_v2.MobileNetV2(num_classes=10), (img,)
        elif name == "efficientnet_lite0":
            with mock.patch.object(efficientnet_lite, "BLOCKS", ((1, 3, 1, 1, 32, 16), (2, 5, 2, 6, 16, 320))):
                model, inputs = efficientnet_lite.EfficientNetLite(num_classes=10), (img,)
        elif name == "resnet50":
            model, inputs = resnet.ResNet(layers=(1, 1, 1, 1), num_classes=10), (img,)
        elif name == "vit_b16":
            model, inputs = vit.VisionTransformer(image_size=64, dim=64, depth=2, heads=4, hidden=128,
                                                  num_classes=10), (img,)
        elif name == "detr_small":
            c = detr.DetrConfig(image_size=(64, 96), widths=(8, 16, 32, 64), dim=32, heads=4, ffn=64,
                                encoder_layers=1, decoder_layers=1, queries=10, classes=5)
            model, inputs = detr.build(c), (torch.randn(2, 3, 64, 96, generator=g),)
        elif name == "bev_lss":
            c = bev_lss.LSSConfig(image_size=(32, 64), focal=50.0, principal=(32.0, 12.0), widths=(8, 16, 32, 32),
                                  depth=(4.0, 24.0, 4.0), context=8, grid=(-20.0, 20.0, 2.5), bev_width=8, classes=3)
            model, inputs = bev_lss.build(c), (torch.randn(2, c.cameras, 3, *c.image_size, generator=g),)
        elif name == "planner":
            c = planner.PlannerConfig(agents=4, history=3, polylines=8, points=4, dim=32, heads=4, ffn=64,
                                      encoder_layers=1, decoder_layers=1, modes=3, horizon=5)
            model, inputs = planner.build(c), planner.scene(g, 2, c)
        else:
            raise ValueError(f"no tiny configuration for zoo model {name!r}")
        if name in ("mobilenet_v2", "efficientnet_lite0", "resnet50"):  # the other builds calibrate their own
            # Random BatchNorms at (0, 1) shrink activations into float32 denormals, which CPUs run slowly.
            calibrate_batchnorm(model, inputs)
    return model.eval(), inputs
