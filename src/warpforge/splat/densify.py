"""Densification: clone, split, prune and opacity reset on gsplat's DefaultStrategy schedule (the 3DGS paper's).

Between refinements every step adds, per Gaussian, the norm of its screen-space mean gradient (scaled to
[-1, 1] screen units and by the number of cameras, so the figure does not depend on the image size or the
batch) and how many cameras saw it. Every ``refine_every`` steps after ``refine_start_iter`` (until
``refine_stop_iter``), Gaussians whose mean gradient exceeds ``grow_grad2d`` are cloned when small (largest
scale <= ``grow_scale3d`` x scene scale) and split in two when large; then transparent ones (opacity <
``prune_opa``) and, after the first opacity reset, huge ones (> ``prune_scale3d`` x scene scale) are pruned.
Every ``reset_every`` steps opacities are clamped to 2 x ``prune_opa``.

gsplat 1.5.3 writes the reset condition as ``step % reset_every == 0 & step > 0``, which Python parses as a
chained comparison that is never true, so its opacity reset never runs; this module resets as the paper does.

Multi-GPU: the statistics are summed over ranks before any decision (``all_reduce``), and the split noise
comes from a generator seeded identically on every rank, so all ranks make the same edits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from warpforge.splat.optim import SelectiveAdam


@dataclass
class DensifyConfig:
    """gsplat's DefaultStrategy defaults."""

    prune_opa: float = 0.005
    grow_grad2d: float = 0.0002
    grow_scale3d: float = 0.01
    grow_scale2d: float = 0.05
    prune_scale3d: float = 0.1
    prune_scale2d: float = 0.15
    refine_scale2d_stop_iter: int = 0  # > 0: also split/prune by screen size until this step (off, as gsplat)
    refine_start_iter: int = 500
    refine_stop_iter: int = 15_000
    refine_every: int = 100
    reset_every: int = 3000
    absgrad: bool = False  # AbsGS: accumulate |dL/dmeans2d| (raise grow_grad2d to ~0.0008 with it)

    def __post_init__(self) -> None:
        for name in ("prune_opa", "grow_grad2d", "grow_scale3d", "grow_scale2d", "prune_scale3d", "prune_scale2d"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DensifyConfig.{name}: must be > 0, got {getattr(self, name)}")
        if self.prune_opa >= 0.5:
            raise ValueError(f"DensifyConfig.prune_opa: must be < 0.5, got {self.prune_opa}")
        if self.refine_every < 1 or self.reset_every < 1:
            raise ValueError(f"DensifyConfig: refine_every and reset_every must be >= 1, got {self.refine_every} "
                             f"and {self.reset_every}")
        if self.refine_start_iter < 0 or self.refine_stop_iter < self.refine_start_iter:
            raise ValueError(f"DensifyConfig: need 0 <= refine_start_iter <= refine_stop_iter, got "
                             f"{self.refine_start_iter} and {self.refine_stop_iter}")


def quat_to_rotmat(quats: Tensor) -> Tensor:  # [N, 4] (w, x, y, z) -> [N, 3, 3]
    w, x, y, z = torch.nn.functional.normalize(quats, dim=-1).unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).reshape(-1, 3, 3)


class Densifier:
    """Running statistics and the refinement schedule for one set of Gaussian parameters."""

    def __init__(self, config: DensifyConfig, scene_scale: float, *, seed: int = 0,
                 all_reduce: Callable[[Tensor, str], None] | None = None) -> None:
        if not scene_scale > 0:
            raise ValueError(f"Densifier: scene_scale must be > 0, got {scene_scale}")
        self.cfg, self.scene_scale = config, float(scene_scale)
        self.all_reduce = all_reduce  # (tensor, "sum" | "max") in place across ranks
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.grad2d: Tensor | None = None  # [N] summed normalised gradient norms
        self.count: Tensor | None = None  # [N] how many camera views saw each Gaussian
        self.radii: Tensor | None = None  # [N] largest normalised screen radius (only with scale2d refinement)

    # ---- every step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def accumulate(self, step: int,
                   means2d_grad: Tensor,  # [C, N, 2] gradient (or absgrad) of the projected means
                   radii: Tensor,  # [C, N, 2] (or [C, N]) screen radii, 0 when culled
                   width: int, height: int) -> None:
        if step >= self.cfg.refine_stop_iter:
            return
        c, n = means2d_grad.shape[:2]
        if radii.dim() == 3:
            vis = (radii > 0).all(-1)
            rad = radii.max(-1).values
        else:
            vis, rad = radii > 0, radii
        g = means2d_grad.clone()
        g[..., 0] *= width / 2.0 * c
        g[..., 1] *= height / 2.0 * c
        if self.grad2d is None or self.grad2d.shape[0] != n:
            self._reset_stats(n, g.device)
        cam, ids = torch.where(vis)
        grad2d, count = self._stats()
        grad2d.index_add_(0, ids, g[cam, ids].norm(dim=-1))
        count.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if self.radii is not None:
            r = rad[cam, ids].float() / float(max(width, height))
            self.radii.scatter_reduce_(0, ids, r, reduce="amax")

    @torch.no_grad()
    def step(self, step: int, params: dict[str, Tensor], optimizer: SelectiveAdam | None) -> dict[str, int]:
        """Refine and/or reset when the schedule says so; returns how many Gaussians each edit touched."""
        cfg = self.cfg
        out: dict[str, int] = {}
        if step >= cfg.refine_stop_iter:
            return out
        if step > cfg.refine_start_iter and step % cfg.refine_every == 0 and self.grad2d is not None:
            self._sync()
            out["cloned"], out["split"] = self._grow(step, params, optimizer)
            out["pruned"] = self._prune(step, params, optimizer)
            self._reset_stats(params["means"].shape[0], params["means"].device)
        if step > 0 and step % cfg.reset_every == 0:
            out["reset"] = reset_opacities(params, optimizer, value=2.0 * cfg.prune_opa)
        return out

    # ---- decisions --------------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.all_reduce is not None:
            self.all_reduce(self.grad2d, "sum")
            self.all_reduce(self.count, "sum")
            if self.radii is not None:
                self.all_reduce(self.radii, "max")

    def _stats(self) -> tuple[Tensor, Tensor]:
        """grad2d and count, which _reset_stats sets together (accumulate runs it first; step refines only
        once grad2d is there)."""
        assert self.grad2d is not None and self.count is not None, "no statistics yet"
        return self.grad2d, self.count

    def _radii(self) -> Tensor:
        """The screen radii, kept whenever refine_scale2d_stop_iter > 0 (which a step before it implies)."""
        assert self.radii is not None, "no screen radii: refine_scale2d_stop_iter is 0"
        return self.radii

    def _grow(self, step: int, params: dict[str, Tensor], opt: SelectiveAdam | None) -> tuple[int, int]:
        grad2d, count = self._stats()
        grads = grad2d / count.clamp_min(1)
        high = grads > self.cfg.grow_grad2d
        small = torch.exp(params["scales"]).max(-1).values <= self.cfg.grow_scale3d * self.scene_scale
        large = ~small
        if step < self.cfg.refine_scale2d_stop_iter:
            large |= self._radii() > self.cfg.grow_scale2d
        clone, split = high & small, high & large
        n_clone, n_split = int(clone.sum()), int(split.sum())
        if n_clone:
            self._edit_stats(duplicate(params, opt, clone))
        if n_split:
            # the clones just appended are never split in the same round
            mask = torch.cat([split, split.new_zeros(n_clone)])
            self._edit_stats(split_gaussians(params, opt, mask, self.generator))
        return n_clone, n_split

    def _prune(self, step: int, params: dict[str, Tensor], opt: SelectiveAdam | None) -> int:
        prune = torch.sigmoid(params["opacities"]) < self.cfg.prune_opa
        if step > self.cfg.reset_every:
            prune |= torch.exp(params["scales"]).max(-1).values > self.cfg.prune_scale3d * self.scene_scale
            if step < self.cfg.refine_scale2d_stop_iter:
                prune |= self._radii() > self.cfg.prune_scale2d
        n = int(prune.sum())
        if n:
            self._edit_stats(remove(params, opt, prune))
        return n

    def _reset_stats(self, n: int, device: torch.device) -> None:
        self.grad2d = torch.zeros(n, device=device)
        self.count = torch.zeros(n, device=device)
        self.radii = torch.zeros(n, device=device) if self.cfg.refine_scale2d_stop_iter > 0 else None

    def _edit_stats(self, index: Tensor) -> None:
        """Follow an edit of the Gaussians: new row i takes the statistics of old row ``index[i]``."""
        grad2d, count = self._stats()
        self.grad2d, self.count = grad2d[index], count[index]
        if self.radii is not None:
            self.radii = self.radii[index]

    def state_dict(self) -> dict:
        def snap(t: Tensor | None) -> Tensor | None:  # the statistics grow in place
            return None if t is None else t.detach().clone()

        return {"grad2d": snap(self.grad2d), "count": snap(self.count), "radii": snap(self.radii),
                "generator": self.generator.get_state(), "scene_scale": self.scene_scale}

    def load_state_dict(self, d: dict) -> None:
        self.grad2d, self.count, self.radii = d["grad2d"], d["count"], d["radii"]
        self.generator.set_state(d["generator"])
        self.scene_scale = float(d["scene_scale"])


# ---- edits of the parameters and their Adam moments ---------------------------------------------------------

def _apply(params: dict[str, Tensor], opt: SelectiveAdam | None, index: Tensor, new_rows: dict[str, Tensor],
           fresh: int) -> None:
    """Rows ``index`` of every tensor, then ``new_rows[name]`` (``fresh`` rows); moments of new rows are 0."""
    for name, p in params.items():
        parts = [p.detach()[index]] + ([new_rows[name]] if fresh else [])
        params[name] = torch.cat(parts).requires_grad_(p.requires_grad)
        if opt is not None:
            for key, v in opt.state[name].items():
                opt.state[name][key] = torch.cat([v[index], v.new_zeros((fresh, *v.shape[1:]))])


def duplicate(params: dict[str, Tensor], opt: SelectiveAdam | None, mask: Tensor) -> Tensor:
    """Append a copy of each masked Gaussian (fresh optimizer moments); returns the source row of every row."""
    sel = torch.where(mask)[0]
    n = mask.shape[0]
    _apply(params, opt, torch.arange(n, device=mask.device), {k: p.detach()[sel] for k, p in params.items()},
           len(sel))
    return torch.cat([torch.arange(n, device=mask.device), sel])


def split_gaussians(params: dict[str, Tensor], opt: SelectiveAdam | None, mask: Tensor,
                    generator: torch.Generator) -> Tensor:
    """Replace each masked Gaussian by two, centred at samples of itself, scales divided by 1.6 (3DGS)."""
    sel, rest = torch.where(mask)[0], torch.where(~mask)[0]
    means, scales = params["means"].detach(), torch.exp(params["scales"].detach()[sel])
    rot = quat_to_rotmat(params["quats"].detach()[sel])
    noise = torch.randn(2, len(sel), 3, generator=generator).to(means.device)
    samples = torch.einsum("nij,nj,bnj->bni", rot, scales, noise)  # [2, S, 3]
    new = {}
    for name, p in params.items():
        if name == "means":
            new[name] = (means[sel] + samples).reshape(-1, 3)
        elif name == "scales":
            new[name] = torch.log(scales / 1.6).repeat(2, 1)
        else:
            new[name] = p.detach()[sel].repeat(2, *([1] * (p.dim() - 1)))
    _apply(params, opt, rest, new, 2 * len(sel))
    return torch.cat([rest, sel, sel])


def remove(params: dict[str, Tensor], opt: SelectiveAdam | None, mask: Tensor) -> Tensor:
    keep = torch.where(~mask)[0]
    _apply(params, opt, keep, {}, 0)
    return keep


def reset_opacities(params: dict[str, Tensor], opt: SelectiveAdam | None, value: float) -> int:
    """Clamp opacities to at most ``value`` and zero their Adam moments; returns how many were lowered."""
    cap = math.log(value / (1.0 - value))
    p = params["opacities"]
    lowered = int((p > cap).sum())
    params["opacities"] = p.detach().clamp(max=cap).requires_grad_(p.requires_grad)
    if opt is not None:
        for key, v in opt.state["opacities"].items():
            opt.state["opacities"][key] = torch.zeros_like(v)
    return lowered
