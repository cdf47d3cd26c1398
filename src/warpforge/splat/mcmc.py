"""MCMC densification (3DGS-MCMC, "3D Gaussian Splatting as Markov Chain Monte Carlo"), gsplat's MCMCStrategy.

Instead of cloning and splitting by gradient, the Gaussians are samples of a distribution:

- **relocation**: every ``refine_every`` steps in (``refine_start_iter``, ``refine_stop_iter``), dead Gaussians
  (opacity <= ``min_opacity``) are moved onto live ones drawn with probability proportional to opacity. A live
  Gaussian drawn k times becomes k + 1 copies whose opacity and scale are chosen so that together they render
  as the original did (the paper's Eq. 9: opacity 1 - (1 - o)^(1/(k+1)), scale times o / a binomial sum);
- **growth**: then 5% more Gaussians are added the same way (sampled from all of them), up to ``cap_max``;
- **noise**: after every step each mean moves by its covariance times Gaussian noise, scaled by the means'
  learning rate x ``noise_lr`` and by sigmoid(100 (1 - opacity - 0.995)): nearly dead Gaussians explore, opaque
  ones stay put.

The random draws come from one generator on the parameters' device, seeded alike on every rank, so ranks of a
data-parallel run make the same moves, and its state is checkpointed so a resumed run is the same run.
Gaussians start at opacity 0.5 and scale 0.1 x the neighbour distance, with opacity and scale regularisers in the
loss (``train.STRATEGY_PRESETS["mcmc"]``: gsplat simple_trainer's mcmc settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from warpforge.splat.densify import _apply, quat_to_rotmat
from warpforge.splat.optim import SelectiveAdam

N_MAX = 51  # copies per source Gaussian the relocation formula distinguishes (gsplat's binomial table size)


@dataclass
class MCMCConfig:
    """gsplat's MCMCStrategy defaults."""

    cap_max: int = 1_000_000  # the most Gaussians there will ever be
    noise_lr: float = 5e5  # noise scale: x the means' current learning rate
    refine_start_iter: int = 500
    refine_stop_iter: int = 25_000
    refine_every: int = 100
    min_opacity: float = 0.005  # at or below: dead, relocated
    grow_rate: float = 0.05  # each refinement adds this fraction, up to cap_max

    def __post_init__(self) -> None:
        if self.cap_max < 1:
            raise ValueError(f"MCMCConfig.cap_max: must be >= 1, got {self.cap_max}")
        if not self.noise_lr >= 0:
            raise ValueError(f"MCMCConfig.noise_lr: must be >= 0, got {self.noise_lr}")
        if not 0.0 < self.min_opacity < 0.5:
            raise ValueError(f"MCMCConfig.min_opacity: must be in (0, 0.5), got {self.min_opacity}")
        if self.refine_every < 1:
            raise ValueError(f"MCMCConfig.refine_every: must be >= 1, got {self.refine_every}")
        if self.refine_start_iter < 0 or self.refine_stop_iter < self.refine_start_iter:
            raise ValueError(f"MCMCConfig: need 0 <= refine_start_iter <= refine_stop_iter, got "
                             f"{self.refine_start_iter} and {self.refine_stop_iter}")
        if not self.grow_rate >= 0:
            raise ValueError(f"MCMCConfig.grow_rate: must be >= 0, got {self.grow_rate}")


def _scale_table() -> Tensor:  # [N_MAX + 1, N_MAX] float64
    """coef[n, k] = sum over i in 1..n of C(i-1, k) (-1)^k / sqrt(k + 1): Eq. 9's denominator is
    sum_k coef[n, k] * o_new^(k + 1)."""
    coef = torch.zeros(N_MAX + 1, N_MAX, dtype=torch.float64)
    for n in range(1, N_MAX + 1):
        for i in range(1, n + 1):
            for k in range(i):
                coef[n, k] += math.comb(i - 1, k) * (-1) ** k / math.sqrt(k + 1)
    return coef


_COEF: Tensor | None = None


@torch.no_grad()
def compute_relocation(opacities: Tensor,  # [S] in (0, 1)
                       scales: Tensor,  # [S, 3] linear
                       copies: Tensor,  # [S] how many Gaussians share the source after the move (>= 1)
                       ) -> tuple[Tensor, Tensor]:  # new opacities [S], new linear scales [S, 3]
    """The paper's Eq. 9 (gsplat's ``compute_relocation``): ``copies`` Gaussians of opacity o_new =
    1 - (1 - o)^(1/n) and scale s * o / sum_k coef[n, k] o_new^(k+1) blend like the one they replace. In float64:
    the binomial sum alternates in sign."""
    global _COEF
    if _COEF is None:
        _COEF = _scale_table()
    n = copies.clamp(1, N_MAX).long()
    o = opacities.double()
    o_new = 1.0 - torch.pow(1.0 - o, 1.0 / n.double())
    powers = o_new[:, None] ** torch.arange(1, N_MAX + 1, dtype=torch.float64, device=o.device)
    denom = (_COEF.to(o.device)[n] * powers).sum(-1)
    return o_new.to(opacities.dtype), (scales.double() * (o / denom)[:, None]).to(scales.dtype)


class MCMCDensifier:
    """Relocation, growth and noise for one set of Gaussian parameters (``Densifier``'s interface)."""

    def __init__(self, config: MCMCConfig, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.cfg = config
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def accumulate(self, step: int, means2d_grad: Tensor, radii: Tensor, width: int, height: int) -> None:
        """Nothing to gather: MCMC decides from opacities alone."""

    @torch.no_grad()
    def step(self, step: int, params: dict[str, Tensor], optimizer: SelectiveAdam | None) -> dict[str, int]:
        """After the optimizer's step: relocate and grow on the schedule, then move every mean by the noise."""
        cfg, out = self.cfg, {}
        if cfg.refine_start_iter < step < cfg.refine_stop_iter and step % cfg.refine_every == 0:
            out["relocated"] = self.relocate(params, optimizer)
            out["added"] = self.grow(params, optimizer)
        lr = optimizer.lrs["means"] if optimizer is not None else 0.0
        self.inject_noise(params, lr * cfg.noise_lr)
        return out

    def _sample(self, probs: Tensor, n: int) -> Tensor:
        return torch.multinomial(probs, n, replacement=True, generator=self.generator)

    def _moved(self, params: dict[str, Tensor], sources: Tensor) -> dict[str, Tensor]:
        """Detached copies of ``params`` with the new logit opacities and log scales of ``sources`` once they
        are shared: Eq. 9 with the count of each source among ``sources`` plus itself."""
        eps = torch.finfo(torch.float32).eps
        opac = torch.sigmoid(params["opacities"].detach())
        copies = torch.bincount(sources, minlength=opac.shape[0])[sources] + 1
        o_new, s_new = compute_relocation(opac[sources], torch.exp(params["scales"].detach())[sources], copies)
        o_new = o_new.clamp(min=self.cfg.min_opacity, max=1.0 - eps)
        new = {"opacities": torch.logit(o_new), "scales": torch.log(s_new)}
        out = {}
        for name, p in params.items():
            out[name] = v = p.detach().clone()
            if name in new:
                v[sources] = new[name]
        return out

    def relocate(self, params: dict[str, Tensor], opt: SelectiveAdam | None) -> int:
        """Move every dead Gaussian onto a live one sampled by opacity; returns how many moved."""
        opac = torch.sigmoid(params["opacities"].detach())
        dead = opac <= self.cfg.min_opacity
        dead_idx, alive_idx = torch.where(dead)[0], torch.where(~dead)[0]
        if len(dead_idx) == 0 or len(alive_idx) == 0:
            return 0
        src = alive_idx[self._sample(opac[alive_idx], len(dead_idx))]
        for name, v in self._moved(params, src).items():
            v[dead_idx] = v[src]
            params[name] = v.requires_grad_(params[name].requires_grad)
            if opt is not None:  # the sources changed and the dead start afresh: no stale Adam moments
                for m in opt.state[name].values():
                    m[src] = 0
                    m[dead_idx] = 0
        return len(dead_idx)

    def grow(self, params: dict[str, Tensor], opt: SelectiveAdam | None) -> int:
        """Add ``grow_rate`` more Gaussians (up to ``cap_max``) as shared copies of ones sampled by opacity."""
        n = params["means"].shape[0]
        add = max(0, min(self.cfg.cap_max, int((1.0 + self.cfg.grow_rate) * n)) - n)
        if add == 0:
            return 0
        src = self._sample(torch.sigmoid(params["opacities"].detach()), add)
        for name, v in self._moved(params, src).items():
            params[name] = v.requires_grad_(params[name].requires_grad)
        _apply(params, opt, torch.arange(n, device=src.device), {k: v.detach()[src] for k, v in params.items()},
               add)
        return add

    def inject_noise(self, params: dict[str, Tensor], scale: float) -> None:
        """means += Sigma (noise * sigmoid(100 (1 - opacity - 0.995)) * scale), Sigma the world covariance."""
        if scale == 0:
            return
        opac = torch.sigmoid(params["opacities"].detach())
        gate = torch.sigmoid(100.0 * ((1.0 - opac) - 0.995))
        m = quat_to_rotmat(params["quats"].detach()) * torch.exp(params["scales"].detach())[:, None, :]  # R S
        noise = torch.randn(params["means"].shape, generator=self.generator, device=opac.device)
        noise = noise * (gate * scale)[:, None]
        params["means"].add_(torch.einsum("nij,nj->ni", m @ m.transpose(1, 2), noise))

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, d: dict) -> None:
        self.generator.set_state(d["generator"])
