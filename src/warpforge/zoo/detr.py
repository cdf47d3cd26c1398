"""DETR-small: a DETR-style set-prediction detector (Carion et al. 2020) at a front-camera resolution.

A ResNet-18-layout conv backbone at half width (BasicBlocks 2-2-2-2, 32..256 channels, stride 32),
a 1x1 projection to d=256, fixed 2-D sine position encodings, a post-norm transformer with 3
encoder and 3 decoder layers (8 heads, FFN 1024), 100 learned object queries, and DETR's heads:
a linear classifier over 91 COCO classes + "no object" and a 3-layer MLP giving sigmoid boxes
(cx, cy, w, h), normalised to the image. At 384x640 the encoder sees 12x20 = 240 tokens;
8.6 M parameters, 3.3 GMACs (multiply-adds) per image.

Weights: seeded random (no DETR weights are installable offline): Kaiming convs with calibrated
BatchNorm statistics, xavier transformer linears, N(0, 1) queries as in DETR's nn.Embedding.
The sine encoding is computed once for the configured image size (a buffer), as DETR does for
unpadded batches, so ``forward`` has no shape-dependent Python and traces with ``torch.fx``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from warpforge.zoo._common import build_calibrated, random_images, random_spec
from warpforge.zoo.layers import Attention, Mlp, init_transformer
from warpforge.zoo.registry import ModelSpec


@dataclass(frozen=True)
class DetrConfig:
    image_size: tuple[int, int] = (384, 640)  # (H, W): a 16:10 front camera, DETR's short side of 384..800
    widths: tuple[int, ...] = (32, 64, 128, 256)
    dim: int = 256
    heads: int = 8
    ffn: int = 1024
    encoder_layers: int = 3
    decoder_layers: int = 3
    queries: int = 100
    classes: int = 91  # COCO ids; the head adds one "no object" logit

    def __post_init__(self):
        h, w = self.image_size
        if h % 32 or w % 32:
            raise ValueError(f"image_size: expected multiples of the backbone stride 32, got {self.image_size}")
        if self.dim % self.heads or self.dim % 4:
            raise ValueError(f"dim: expected a multiple of heads={self.heads} and of 4, got {self.dim}")

    @property
    def feature_size(self) -> tuple[int, int]:
        return self.image_size[0] // 32, self.image_size[1] // 32


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x))


class Backbone(nn.Sequential):
    """images [B, 3, H, W] -> features [B, widths[-1], H/32, W/32] (ResNet-18 layout)."""

    def __init__(self, widths: tuple[int, ...]):
        stem = [nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1)]
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stages += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        super().__init__(*stem, *stages)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def sine_position_encoding(h: int, w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """DETR's normalised 2-D sine encoding of an h x w grid: [h * w, dim] (y half, then x half)."""
    feats = dim // 2
    y = (torch.arange(h, dtype=torch.float64) + 1) / h * 2 * math.pi
    x = (torch.arange(w, dtype=torch.float64) + 1) / w * 2 * math.pi
    t = temperature ** (2 * (torch.arange(feats, dtype=torch.float64) // 2) / feats)
    py, px = y[:, None] / t, x[:, None] / t  # [h, feats], [w, feats]
    py = torch.stack([py[:, 0::2].sin(), py[:, 1::2].cos()], dim=2).flatten(1)
    px = torch.stack([px[:, 0::2].sin(), px[:, 1::2].cos()], dim=2).flatten(1)
    pos = torch.cat([py[:, None, :].expand(h, w, feats), px[None, :, :].expand(h, w, feats)], dim=2)
    return pos.reshape(h * w, dim).float()


class EncoderLayer(nn.Module):
    """DETR's post-norm encoder layer; positions are added to queries and keys only."""

    def __init__(self, c: DetrConfig):
        super().__init__()
        self.self_attn = Attention(c.dim, c.heads)
        self.norm1, self.norm2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.ffn = Mlp(c.dim, c.ffn, nn.ReLU)

    def forward(self, src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [B, HW, D], [1, HW, D]
        qk = src + pos
        src = self.norm1(src + self.self_attn(qk, qk, src))
        return self.norm2(src + self.ffn(src))


class DecoderLayer(nn.Module):
    """Post-norm: self-attention among queries, cross-attention to the encoder memory, FFN."""

    def __init__(self, c: DetrConfig):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(c.dim, c.heads), Attention(c.dim, c.heads)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(c.dim) for _ in range(3))
        self.ffn = Mlp(c.dim, c.ffn, nn.ReLU)

    def forward(self, tgt, memory, pos, query_pos):  # [B, Q, D], [B, HW, D], [1, HW, D], [1, Q, D]
        qk = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(qk, qk, tgt))
        tgt = self.norm2(tgt + self.cross_attn(tgt + query_pos, memory + pos, memory))
        return self.norm3(tgt + self.ffn(tgt))


class Detr(nn.Module):
    """images [B, 3, H, W] -> (class logits [B, queries, classes + 1], boxes [B, queries, 4] in (0, 1))."""

    def __init__(self, config: DetrConfig = DetrConfig()):
        super().__init__()
        c = self.config = config
        self.backbone = Backbone(c.widths)
        self.input_proj = nn.Conv2d(c.widths[-1], c.dim, 1)
        self.register_buffer("pos", sine_position_encoding(*c.feature_size, c.dim)[None], persistent=False)
        self.query_embed = nn.Parameter(torch.empty(1, c.queries, c.dim))
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.dim)
        self.class_embed = nn.Linear(c.dim, c.classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(c.dim, c.dim), nn.ReLU(), nn.Linear(c.dim, c.dim), nn.ReLU(),
                                        nn.Linear(c.dim, 4))
        init_transformer(self)
        nn.init.normal_(self.query_embed)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.input_proj(self.backbone(images)).flatten(2).transpose(1, 2)  # [B, HW, D]
        for layer in self.encoder:
            src = layer(src, self.pos)
        query_pos = self.query_embed
        tgt = torch.zeros_like(query_pos).expand(images.shape[0], -1, -1)     # DETR starts from zeros
        for layer in self.decoder:
            tgt = layer(tgt, src, self.pos, query_pos)
        hs = self.decoder_norm(tgt)                                            # [B, Q, D]
        return self.class_embed(hs), self.bbox_embed(hs).sigmoid()


def build(config: DetrConfig = DetrConfig(), seed: int = 0) -> Detr:
    """A seeded random DETR with BatchNorm statistics calibrated on one random image, in eval mode."""
    return build_calibrated(lambda: Detr(config), random_images(1, 3, *config.image_size), seed)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no DETR weights are reachable offline; the model is random either way.
    c = DetrConfig()
    return random_spec("detr_small", "detector", build(c), random_images(batch, 3, *c.image_size), device, dtype)
