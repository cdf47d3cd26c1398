"""FCOS-small: an anchor-free one-stage detector (Tian et al. 2019) with its data-dependent post-processing.

A ResNet-style conv backbone (BasicBlocks, 32..256 channels) giving C3, C4, C5 at strides 8, 16, 32; an FPN
(1x1 laterals, nearest top-down upsampling, 3x3 outputs, ``fpn_dim`` channels) giving P3, P4, P5; one head
shared by the three levels (two conv-BN-ReLU towers, then class logits, box distances l/t/r/b and
centerness), applied level by level; then FCOS's post-processing, per image: score = sqrt(sigmoid(class) *
sigmoid(centerness)), a score threshold, the top-k candidates, box decoding from the locations, clipping to
the image, class-aware NMS written in torch ops, and the best ``max_det`` detections.

The head uses BatchNorm where FCOS uses GroupNorm (as YOLO-style heads do); the rest follows the paper.
The post-processing is what real detectors do and what graph capture cannot: how many boxes pass the
threshold, and which survive NMS, depends on the data, so torch.export and torch.fx both refuse the
whole model (``warpforge.optimize`` then captures the backbone, FPN and head as regions).

Output, per image of the batch: ``{"boxes": [K, 4] (x1, y1, x2, y2 pixels), "scores": [K], "labels": [K]
int64}``, best first, as torchvision's detectors return them.

Weights: seeded random (no FCOS weights are installable offline): Kaiming convs with BatchNorm statistics
calibrated on one random image, FCOS's head initialisation (N(0, 0.01) convs, the class bias at the 0.01
prior).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from warpforge.zoo._common import build_calibrated, random_images, random_spec
from warpforge.zoo.registry import ModelSpec

STRIDES = (8, 16, 32)


@dataclass(frozen=True)
class FcosConfig:
    image_size: tuple[int, int] = (640, 640)  # (H, W)
    widths: tuple[int, ...] = (32, 64, 128, 256)  # stem/stage widths; stages 2..4 give C3, C4, C5
    fpn_dim: int = 96
    tower_convs: int = 2
    classes: int = 80
    score_thresh: float = 0.05
    topk: int = 1000       # candidates per image before NMS
    nms_iou: float = 0.6
    max_det: int = 100

    def __post_init__(self):
        h, w = self.image_size
        if h % 32 or w % 32 or h < 32 or w < 32:
            raise ValueError(f"image_size: expected multiples of the largest stride 32, got {self.image_size}")
        if len(self.widths) != 4:
            raise ValueError(f"widths: expected 4 stage widths, got {self.widths}")
        if not 0.0 <= self.score_thresh < 1.0 or not 0.0 < self.nms_iou <= 1.0:
            raise ValueError(f"score_thresh in [0, 1) and nms_iou in (0, 1], got {self.score_thresh}, {self.nms_iou}")
        if self.topk < 1 or self.max_det < 1:
            raise ValueError(f"topk and max_det: expected >= 1, got {self.topk}, {self.max_det}")


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn_relu(cin, cout, stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(self.conv1(x))) + self.down(x))


class Backbone(nn.Module):
    """images [B, 3, H, W] -> (C3 [B, w1, H/8, W/8], C4 [B, w2, H/16, W/16], C5 [B, w3, H/32, W/32])."""

    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        w0, w1, w2, w3 = widths
        self.stem = nn.Sequential(conv_bn_relu(3, w0, 2), conv_bn_relu(w0, w0, 2))  # stride 4
        self.layer2 = nn.Sequential(BasicBlock(w0, w1, 2), BasicBlock(w1, w1, 1))   # stride 8
        self.layer3 = nn.Sequential(BasicBlock(w1, w2, 2), BasicBlock(w2, w2, 1))   # stride 16
        self.layer4 = nn.Sequential(BasicBlock(w2, w3, 2), BasicBlock(w3, w3, 1))   # stride 32

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c3 = self.layer2(self.stem(x))
        c4 = self.layer3(c3)
        return c3, c4, self.layer4(c4)


class FPN(nn.Module):
    """(C3, C4, C5) -> (P3, P4, P5), each [B, dim, H/s, W/s]: 1x1 laterals, nearest top-down sums, 3x3 outputs."""

    def __init__(self, widths: tuple[int, ...], dim: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, dim, 1) for c in widths[1:])
        self.output = nn.ModuleList(nn.Conv2d(dim, dim, 3, 1, 1) for _ in widths[1:])

    def forward(self, feats: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        c3, c4, c5 = feats
        p5 = self.lateral[2](c5)
        p4 = self.lateral[1](c4) + F.interpolate(p5, size=c4.shape[-2:], mode="nearest")
        p3 = self.lateral[0](c3) + F.interpolate(p4, size=c3.shape[-2:], mode="nearest")
        return self.output[0](p3), self.output[1](p4), self.output[2](p5)


class Head(nn.Module):
    """One FPN level [B, dim, h, w] -> (class logits [B, classes, h, w], distances [B, 4, h, w], centerness
    [B, 1, h, w]); the same weights serve every level."""

    def __init__(self, dim: int, classes: int, tower_convs: int):
        super().__init__()
        self.cls_tower = nn.Sequential(*(conv_bn_relu(dim, dim) for _ in range(tower_convs)))
        self.box_tower = nn.Sequential(*(conv_bn_relu(dim, dim) for _ in range(tower_convs)))
        self.cls_logits = nn.Conv2d(dim, classes, 3, 1, 1)
        self.bbox_pred = nn.Conv2d(dim, 4, 3, 1, 1)
        self.centerness = nn.Conv2d(dim, 1, 3, 1, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c, b = self.cls_tower(x), self.box_tower(x)
        return self.cls_logits(c), self.bbox_pred(b), self.centerness(b)


def box_iou(a: Tensor, b: Tensor) -> Tensor:  # [N, 4], [M, 4] (x1, y1, x2, y2) -> [N, M]
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter).clamp(min=1e-9)


def batched_nms(boxes: Tensor, scores: Tensor, labels: Tensor, iou: float) -> Tensor:
    """Greedy class-aware NMS (torchvision.ops.batched_nms's result): indices of the kept boxes, best first.

    Boxes of different classes are moved apart so that they never overlap; the IoU matrix is built on the
    device in one go, and the greedy sweep runs on the host over its thresholded rows (one transfer, not one
    per box)."""
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    order = scores.argsort(descending=True, stable=True)
    shifted = boxes + (labels.to(boxes) * (boxes.max() + 1))[:, None]
    sb = shifted[order]
    over = (box_iou(sb, sb) > iou).triu(1).cpu()  # over[i, j]: i (higher score) suppresses j
    keep = torch.ones(len(order), dtype=torch.bool)
    for i in range(len(order)):
        if keep[i]:
            keep &= ~over[i]
    return order[keep.to(order.device)]


class Fcos(nn.Module):
    """images [B, 3, H, W] (normalised) -> per image {"boxes" [K, 4], "scores" [K], "labels" [K]}."""

    def __init__(self, config: FcosConfig = FcosConfig()):
        super().__init__()
        c = self.config = config
        self.backbone = Backbone(c.widths)
        self.fpn = FPN(c.widths, c.fpn_dim)
        self.head = Head(c.fpn_dim, c.classes, c.tower_convs)
        self.scales = nn.Parameter(torch.ones(len(STRIDES)))  # FCOS's learnable per-level distance scale
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in (self.head.cls_logits, self.head.bbox_pred, self.head.centerness):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)
        nn.init.constant_(self.head.cls_logits.bias, -math.log((1 - 0.01) / 0.01))  # the 0.01 prior

    def forward(self, images: Tensor) -> list[dict[str, Tensor]]:
        feats = self.fpn(self.backbone(images))
        outs = [self.head(f) for f in feats]  # one call per level: the head is shared
        return self.postprocess(outs, images.shape[-2:])

    def postprocess(self, outs: list[tuple[Tensor, Tensor, Tensor]], size: torch.Size) -> list[dict[str, Tensor]]:
        """Threshold, top-k, decode, clip, NMS, per image: the data-dependent part."""
        c = self.config
        scores, boxes = [], []
        for level, ((cls, reg, ctr), stride) in enumerate(zip(outs, STRIDES)):
            n, k, h, w = cls.shape
            ys, xs = torch.meshgrid(torch.arange(h, device=cls.device), torch.arange(w, device=cls.device),
                                    indexing="ij")
            points = (torch.stack([xs, ys], -1).reshape(-1, 2).to(cls.dtype) + 0.5) * stride  # [h*w, 2]
            dist = F.relu(reg * self.scales[level]).flatten(2).transpose(1, 2) * stride  # [B, h*w, 4]
            boxes.append(torch.cat([points - dist[..., :2], points + dist[..., 2:]], -1))
            s = torch.sigmoid(cls) * torch.sigmoid(ctr)                                 # [B, K, h, w]
            scores.append(s.flatten(2).transpose(1, 2).sqrt())                           # [B, h*w, K]
        scores, boxes = torch.cat(scores, 1), torch.cat(boxes, 1)  # [B, P, K], [B, P, 4]
        hmax, wmax = size
        results = []
        for s, b in zip(scores, boxes):
            flat = s.flatten()
            idx = torch.nonzero(flat > c.score_thresh).squeeze(1)  # how many pass depends on the image
            top, pick = flat[idx].topk(min(c.topk, idx.numel()))
            idx = idx[pick]
            loc, labels = idx // s.shape[1], idx % s.shape[1]
            bb = b[loc]
            bb = torch.stack([bb[:, 0].clamp(0, wmax), bb[:, 1].clamp(0, hmax), bb[:, 2].clamp(0, wmax),
                              bb[:, 3].clamp(0, hmax)], 1)
            keep = batched_nms(bb, top, labels, c.nms_iou)[:c.max_det]
            results.append({"boxes": bb[keep], "scores": top[keep], "labels": labels[keep]})
        return results


def build(config: FcosConfig = FcosConfig(), seed: int = 0) -> Fcos:
    """A seeded random FCOS with BatchNorm statistics calibrated on one random image, in eval mode."""
    return build_calibrated(lambda: Fcos(config), random_images(1, 3, *config.image_size), seed)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no FCOS weights are reachable offline; the model is random either way.
    c = FcosConfig()
    return random_spec("fcos_small", "detector", build(c), random_images(batch, 3, *c.image_size), device, dtype)
