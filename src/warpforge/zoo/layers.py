"""Transformer layers the zoo's ViT, DETR and planner share.

Attention comes in the two forms real code is written in, so the optimizer meets both:
``F.scaled_dot_product_attention`` (torchvision, HF) and the explicit ``softmax(q @ k^T * scale) @ v``
(most research code). ``Attention(explicit=True)`` selects the second; the choice is made when the
module is built, so ``forward`` has no data-dependent branch and traces with ``torch.fx``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head attention with separate q, k, v projections (self- or cross-attention)."""

    def __init__(self, dim: int, heads: int, *, explicit: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads: expected a divisor of dim={dim}, got {heads}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.explicit = explicit
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, D] -> [B, h, N, hd]
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # query [B, Nq, D], key and value [B, Nk, D] -> [B, Nq, D]
        q, k, v = self._split(self.q(query)), self._split(self.k(key)), self._split(self.v(value))
        if self.explicit:
            weights = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)  # [B, h, Nq, Nk]
            o = weights @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        o = o.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.dim)  # [B, Nq, D]
        return self.out(o)


class Mlp(nn.Sequential):
    """Linear -> activation -> Linear (the transformer feed-forward block)."""

    def __init__(self, dim: int, hidden: int, act: type[nn.Module] = nn.GELU):
        super().__init__(nn.Linear(dim, hidden), act(), nn.Linear(hidden, dim))


class Block(nn.Module):
    """Pre-norm transformer encoder layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, hidden: int, *, explicit: bool = False, eps: float = 1e-6):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, explicit=explicit)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, D]
        h = self.ln_1(x)
        x = x + self.attn(h, h, h)
        return x + self.mlp(self.ln_2(x))


def init_transformer(module: nn.Module, std: float = 0.02) -> None:
    """Initialise linears as trained transformers look: xavier weights, small non-zero biases.

    Biases are drawn (std 1e-3) rather than zeroed, so a kernel that drops a bias is caught.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.normal_(m.bias, std=1e-3)
        elif isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, std)
            nn.init.normal_(m.bias, 0.0, std)
