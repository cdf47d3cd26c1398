"""ResNet-50 (He et al. 2016), the torchvision architecture (v1.5: stride on the 3x3 conv), random weights.

The workhorse backbone of detection and BEV stacks: 16 bottleneck blocks (1x1 reduce, 3x3, 1x1
expand, BatchNorm after each conv, projection shortcut at each stage's first block), 25.6 M
parameters, 4.1 GMACs (multiply-adds) at 224. Module names follow torchvision's, so its checkpoints load as is.

Weights: seeded random (no ResNet-50 weights are installable offline here). Convs get torchvision's
Kaiming initialisation; BatchNorm statistics are calibrated on one random batch so eval-mode
activations keep unit scale, as in a trained network, instead of growing block by block.
"""

from __future__ import annotations

import torch
from torch import nn

from warpforge.zoo._common import build_calibrated, random_images, random_spec
from warpforge.zoo.registry import ModelSpec


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, cin, H, W] -> [B, 4*planes, H/s, W/s]
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """images [B, 3, H, W] -> logits [B, num_classes]; ``features`` gives the stride-32 map."""

    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (n, planes) in enumerate(zip(layers, (64, 128, 256, 512))):
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, planes, stride=2 if i > 0 and j == 0 else 1))
                cin = planes * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, 2048, H/32, W/32]
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1)  # [B, 2048]
        return self.fc(x)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no ResNet-50 weights are reachable offline; the model is random either way.
    model = build_calibrated(ResNet, random_images(1, 3, 224, 224))
    return random_spec("resnet50", "classifier", model, random_images(batch, 3, 224, 224), device, dtype)
