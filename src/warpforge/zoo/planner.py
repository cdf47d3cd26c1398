"""Planner: a motion-prediction / planning transformer over agent and map tokens (MTR / Wayformer style).

Vectorised scene in, multi-modal futures out:

1. **Tokenise**: each agent's history and each map polyline is a polyline of points; a PointNet
   (per-point MLP, max-pool, concatenate the pooled vector back, MLP, max-pool; VectorNet's encoder)
   turns it into one token. A learned type embedding marks agent vs map tokens.
2. **Encode**: pre-norm transformer layers with global self-attention over all A + P tokens.
3. **Decode**: every agent gets ``modes`` queries (its encoded token + a learned mode embedding);
   each decoder layer lets an agent's modes attend to each other, then cross-attends to the scene.
4. **Heads**: per query, ``horizon`` 2-D steps, summed into a trajectory (metres, ego-frame axes,
   offsets from the agent's current position), and a mode logit.

Attention is written out as ``softmax(q @ k^T * scale) @ v`` (``Attention(explicit=True)``), the form
most research planners use, so the optimizer meets it beside ViT's and DETR's SDPA.

Defaults: 64 agents x 11 history steps (1 s at 10 Hz), 256 map polylines x 20 points, d=256,
8 heads, 4 encoder + 2 decoder layers, 6 modes x 12 future steps (6 s at 2 Hz). Every slot holds a
real agent or polyline (no padding masks). 5.6 M parameters, 3.0 GMACs per scene.

Weights: seeded random (no planner weights are installable offline); xavier linears, N(0, 1) mode
embeddings; pre-norm residuals and LayerNorm after the first point layer keep activations finite on
raw metre-scale inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from warpforge.zoo._common import random_spec, seeded
from warpforge.zoo.layers import Attention, Block, Mlp, init_transformer
from warpforge.zoo.registry import ModelSpec

AGENT_FEATURES = ("x", "y", "vx", "vy", "cos_heading", "sin_heading", "length", "width", "is_vehicle",
                  "is_pedestrian")
MAP_FEATURES = ("x", "y", "dir_x", "dir_y", "is_lane", "is_boundary")


@dataclass(frozen=True)
class PlannerConfig:
    agents: int = 64        # A: the ego (slot 0) and its neighbours
    history: int = 11       # T: past steps per agent, 0.1 s apart
    polylines: int = 256    # P: map elements (lane centrelines, road boundaries)
    points: int = 20        # L: points per polyline, about 1.5 m apart
    dim: int = 256
    heads: int = 8
    ffn: int = 1024
    encoder_layers: int = 4
    decoder_layers: int = 2
    modes: int = 6          # K: futures per agent
    horizon: int = 12       # future steps, 0.5 s apart

    def __post_init__(self):
        if self.dim % self.heads or self.dim % 2:
            raise ValueError(f"dim: expected an even multiple of heads={self.heads}, got {self.dim}")
        for name in ("agents", "history", "polylines", "points", "modes", "horizon"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")


class PolylineEncoder(nn.Module):
    """polylines [B, P, L, F] -> tokens [B, P, dim] (VectorNet / MTR PointNet)."""

    def __init__(self, features: int, dim: int):
        super().__init__()
        half = dim // 2
        self.point = nn.Sequential(nn.Linear(features, half), nn.LayerNorm(half), nn.ReLU(),
                                   nn.Linear(half, half), nn.LayerNorm(half), nn.ReLU())
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.point(x)                                                # [B, P, L, dim/2]
        pooled = h.amax(dim=2, keepdim=True).expand_as(h)               # [B, P, L, dim/2]
        return self.out(torch.cat([h, pooled], dim=-1)).amax(dim=2)     # [B, P, dim]


class DecoderLayer(nn.Module):
    """Pre-norm: self-attention among one agent's modes, cross-attention to the scene, MLP."""

    def __init__(self, c: PlannerConfig):
        super().__init__()
        self.modes, self.dim = c.modes, c.dim
        self.ln_1, self.ln_2, self.ln_3 = (nn.LayerNorm(c.dim) for _ in range(3))
        self.self_attn = Attention(c.dim, c.heads, explicit=True)
        self.cross_attn = Attention(c.dim, c.heads, explicit=True)
        self.mlp = Mlp(c.dim, c.ffn)

    def forward(self, q: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:  # [B, A*K, D], [B, A+P, D]
        h = self.ln_1(q).reshape(-1, self.modes, self.dim)                       # [B*A, K, D]
        q = q + self.self_attn(h, h, h).reshape(q.shape[0], -1, self.dim)
        q = q + self.cross_attn(self.ln_2(q), memory, memory)
        return q + self.mlp(self.ln_3(q))


class Planner(nn.Module):
    """(agents [B, A, T, 10], polylines [B, P, L, 6]) ->
    (trajectories [B, A, modes, horizon, 2], metres from each agent's position; mode logits [B, A, modes])."""

    def __init__(self, config: PlannerConfig = PlannerConfig()):
        super().__init__()
        c = self.config = config
        self.agent_encoder = PolylineEncoder(len(AGENT_FEATURES), c.dim)
        self.map_encoder = PolylineEncoder(len(MAP_FEATURES), c.dim)
        self.type_embed = nn.Parameter(torch.empty(2, c.dim))
        self.encoder = nn.Sequential(*(Block(c.dim, c.heads, c.ffn, explicit=True) for _ in range(c.encoder_layers)))
        self.encoder_norm = nn.LayerNorm(c.dim)
        self.mode_embed = nn.Parameter(torch.empty(c.modes, c.dim))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c.decoder_layers))
        self.decoder_norm = nn.LayerNorm(c.dim)
        self.traj_head = nn.Sequential(nn.Linear(c.dim, c.dim), nn.ReLU(), nn.Linear(c.dim, c.horizon * 2))
        self.mode_head = nn.Linear(c.dim, 1)
        init_transformer(self)
        nn.init.normal_(self.type_embed, std=0.02)
        nn.init.normal_(self.mode_embed)

    def forward(self, agents: torch.Tensor, polylines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        b = agents.shape[0]
        tokens = torch.cat([self.agent_encoder(agents) + self.type_embed[0],
                            self.map_encoder(polylines) + self.type_embed[1]], dim=1)  # [B, A+P, D]
        memory = self.encoder_norm(self.encoder(tokens))
        q = memory[:, :c.agents].unsqueeze(2) + self.mode_embed                        # [B, A, K, D]
        q = q.reshape(b, c.agents * c.modes, c.dim)
        for layer in self.decoder:
            q = layer(q, memory)
        q = self.decoder_norm(q)
        steps = self.traj_head(q).reshape(b, c.agents, c.modes, c.horizon, 2)
        return steps.cumsum(dim=3), self.mode_head(q).reshape(b, c.agents, c.modes)


def scene(g: torch.Generator, batch: int, c: PlannerConfig = PlannerConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """A random but plausible vectorised scene: (agents [B, A, T, 10], polylines [B, P, L, 6]).

    Agents within 40 m of the ego (slot 0, at the origin heading +x), a quarter pedestrians (up to
    1.5 m/s), the rest vehicles (up to 15 m/s), moving at constant velocity over the history with
    5 cm position noise. Polylines start within 60 m, run 1.5 m between points, gently curved.
    """
    A, T, P, L = c.agents, c.history, c.polylines, c.points
    pos = (torch.rand(batch, A, 2, generator=g) * 2 - 1) * 40
    heading = torch.rand(batch, A, generator=g) * 2 * math.pi
    pos[:, 0], heading[:, 0] = 0.0, 0.0
    ped = torch.rand(batch, A, generator=g) < 0.25
    ped[:, 0] = False
    speed = torch.rand(batch, A, generator=g) * torch.where(ped, 1.5, 15.0)
    direction = torch.stack([heading.cos(), heading.sin()], dim=-1)               # [B, A, 2]
    vel = speed[..., None] * direction
    t = (torch.arange(T) - (T - 1)) * 0.1                                           # -1.0 .. 0 s
    xy = pos[:, :, None] + vel[:, :, None] * t[:, None] + 0.05 * torch.randn(batch, A, T, 2, generator=g)
    size = torch.stack([torch.where(ped, 0.6, 4.5 + torch.rand(batch, A, generator=g)),
                        torch.where(ped, 0.6, 1.8 + 0.3 * torch.rand(batch, A, generator=g))], dim=-1)
    kind = torch.stack([~ped, ped], dim=-1).float()
    per_agent = torch.cat([vel, direction, size, kind], dim=-1)                     # [B, A, 8]
    agents = torch.cat([xy, per_agent[:, :, None].expand(batch, A, T, 8)], dim=-1)

    start = (torch.rand(batch, P, 1, 2, generator=g) * 2 - 1) * 60
    theta = (torch.rand(batch, P, 1, generator=g) * 2 * math.pi
             + 0.01 * torch.randn(batch, P, 1, generator=g) * torch.arange(L) * 1.5)  # [B, P, L]
    step = 1.5 * torch.stack([theta.cos(), theta.sin()], dim=-1)                   # [B, P, L, 2]
    pts = start + step.cumsum(dim=2) - step[:, :, :1]
    lane = (torch.rand(batch, P, 1, 1, generator=g) < 0.7).float().expand(batch, P, L, 1)
    polylines = torch.cat([pts, step / 1.5, lane, 1 - lane], dim=-1)
    return agents, polylines


def build(config: PlannerConfig = PlannerConfig(), seed: int = 0) -> Planner:
    with seeded(seed):
        return Planner(config).eval()


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no planner weights are reachable offline; the model is random either way.
    c = PlannerConfig()
    return random_spec("planner", "planner", build(c), lambda g: scene(g, batch, c), device, dtype)
