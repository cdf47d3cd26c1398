"""ViT-B/16 (Dosovitskiy et al. 2021), the torchvision architecture, random weights.

A 16x16-patch embedding (one strided conv), a class token and learned position embeddings, then
12 pre-norm encoder layers (768 wide, 12 heads of 64, MLP 3072 with GELU) and a linear head on the
class token: 86.6 M parameters, 16.9 GMACs at 224 (197 tokens). Attention is
``F.scaled_dot_product_attention``, as in torchvision's fast path.

Weights: seeded random (no ViT weights are installable offline here): xavier linears, position
embeddings and class token N(0, 0.02), as trained ViTs are initialised; the pre-norm residual
stream keeps activations finite in every dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from warpforge.zoo._common import random_images, random_spec, seeded
from warpforge.zoo.layers import Block, init_transformer
from warpforge.zoo.registry import ModelSpec


class VisionTransformer(nn.Module):
    """images [B, 3, image_size, image_size] -> logits [B, num_classes]."""

    def __init__(self, image_size: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 hidden: int = 3072, num_classes: int = 1000):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size: expected a multiple of patch={patch}, got {image_size}")
        tokens = (image_size // patch) ** 2 + 1
        self.conv_proj = nn.Conv2d(3, dim, patch, patch)
        self.class_token = nn.Parameter(torch.empty(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim))
        self.layers = nn.Sequential(*(Block(dim, heads, hidden) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        init_transformer(self)
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1.0 / (3 * patch * patch)))
        nn.init.normal_(self.conv_proj.bias, std=1e-3)
        nn.init.normal_(self.class_token, std=0.02)
        nn.init.normal_(self.pos_embedding, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)                 # [B, 196, 768]
        cls = self.class_token.expand(x.shape[0], -1, -1)                # [B, 1, 768]
        x = torch.cat([cls, x], dim=1) + self.pos_embedding              # [B, 197, 768]
        x = self.ln(self.layers(x))
        return self.head(x[:, 0])                                        # [B, num_classes]


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no ViT weights are reachable offline; the model is random either way.
    with seeded(0):
        model = VisionTransformer()
    return random_spec("vit_b16", "classifier", model, random_images(batch, 3, 224, 224), device, dtype)
