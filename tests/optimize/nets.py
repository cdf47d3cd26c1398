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
    """The zoo's planner (warpforge.models.planner) at a CPU-test size, with one seeded scene of batch 2."""
    from warpforge.models.planner import Planner, PlannerConfig, scene

    c = PlannerConfig(agents=4, history=5, polylines=6, points=7, dim=dim, heads=4, ffn=ffn, encoder_layers=1,
                      decoder_layers=1, modes=3, horizon=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Planner(c).eval()
    return model, scene(torch.Generator().manual_seed(1), 2, c), c
