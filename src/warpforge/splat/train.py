"""Training a Gaussian splat from posed images: one ``Trainer.train_step()`` is the whole loop.

The recipe is gsplat's ``simple_trainer`` default: parameters initialised from the point cloud (scales
from the mean distance to the 3 nearest neighbours, opacity 0.1), Adam per parameter group with gsplat's
learning rates (scaled by sqrt(batch); the means' decaying 100x over the run), L1 + 0.2 (1 - SSIM), SH
degree raised every 1000 steps, densification on the DefaultStrategy schedule. The optimizer step is
selective: only Gaussians some camera of the step saw are updated (see ``optim.py``).

Multi-GPU (``distributed.py``): every rank renders its own cameras of the step, gradients are averaged, the
visibility mask and the densification statistics are reduced, so all ranks hold identical Gaussians.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from pathlib import Path

import torch
from torch import Tensor

from warpforge.splat.densify import DensifyConfig, Densifier
from warpforge.splat.mcmc import MCMCConfig, MCMCDensifier
from warpforge.splat.metrics import psnr, ssim
from warpforge.splat.optim import SelectiveAdam
from warpforge.splat.scene import PosedImages, Splats, render, rgb_to_sh

STAGES = ("render", "loss", "backward", "optimizer", "densify")
STRATEGIES = ("default", "mcmc")
# What each densification strategy changes in TrainConfig: gsplat simple_trainer's presets. MCMC starts denser
# and brighter (opacity 0.5, scale 0.1 x the neighbour distance) and regularises opacity and scale so that
# Gaussians it does not need fade and get relocated.
STRATEGY_PRESETS: dict[str, dict[str, Any]] = {  # TrainConfig keywords (Any: each a different field's type)
    "default": {}, "mcmc": {"init_opacity": 0.5, "init_scale": 0.1, "opacity_reg": 0.01, "scale_reg": 0.01}}


@dataclass
class TrainConfig:
    """gsplat simple_trainer's defaults unless noted."""

    steps: int = 30_000
    batch: int = 1  # cameras per step on each rank
    sh_degree: int = 3
    sh_degree_interval: int = 1000  # raise the SH degree used by one every this many steps
    ssim_lambda: float = 0.2
    init_opacity: float = 0.1
    init_scale: float = 1.0  # x the mean distance to the 3 nearest initial points
    means_lr: float = 1.6e-4  # x scene scale, decays exponentially to 1% at the last step
    scales_lr: float = 5e-3
    quats_lr: float = 1e-3
    opacities_lr: float = 5e-2
    sh0_lr: float = 2.5e-3
    shN_lr: float = 2.5e-3 / 20
    densify: DensifyConfig = field(default_factory=DensifyConfig)
    strategy: str = "default"  # "default" (clone/split/prune: densify) or "mcmc" (relocation and noise: mcmc)
    mcmc: MCMCConfig = field(default_factory=MCMCConfig)
    opacity_reg: float = 0.0  # + opacity_reg * mean(sigmoid(opacities)) in the loss
    scale_reg: float = 0.0  # + scale_reg * mean(exp(scales))
    eval_every: int = 1000  # held-out PSNR/SSIM every this many steps, and after the last one
    log_every: int = 10
    seed: int = 0
    tile_size: int = 16
    antialiased: bool = False  # rasterize_mode="antialiased" (Mip-Splatting's 2D filter), as gsplat's flag

    def __post_init__(self) -> None:
        if isinstance(self.densify, dict):
            self.densify = DensifyConfig(**self.densify)
        if isinstance(self.mcmc, dict):
            self.mcmc = MCMCConfig(**self.mcmc)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"TrainConfig.strategy: one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        for name in ("opacity_reg", "scale_reg"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("steps", "batch", "sh_degree_interval", "eval_every", "log_every", "tile_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.sh_degree <= 3:
            raise ValueError(f"TrainConfig.sh_degree: must be in 0..3, got {self.sh_degree}")
        if not 0.0 <= self.ssim_lambda <= 1.0:
            raise ValueError(f"TrainConfig.ssim_lambda: must be in [0, 1], got {self.ssim_lambda}")
        if not 0.0 < self.init_opacity < 1.0:
            raise ValueError(f"TrainConfig.init_opacity: must be in (0, 1), got {self.init_opacity}")
        for name in ("init_scale", "means_lr", "scales_lr", "quats_lr", "opacities_lr", "sh0_lr", "shN_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name}: must be > 0, got {getattr(self, name)}")


@torch.no_grad()
def knn_mean_distance(points: Tensor, k: int = 3, chunk: int = 2048) -> Tensor:  # [P, 3] -> [P]
    """sqrt of the mean squared distance to the ``k`` nearest other points, in row chunks."""
    out = torch.empty(points.shape[0], device=points.device)
    kk = min(k + 1, points.shape[0])
    for i in range(0, points.shape[0], chunk):
        d2 = torch.cdist(points[i:i + chunk], points).square()
        near = d2.topk(kk, largest=False).values[:, 1:]  # the first is the point itself
        out[i:i + chunk] = near.mean(-1).sqrt() if near.shape[1] else torch.ones(near.shape[0], device=points.device)
    return out


def init_splats(points: Tensor, rgb: Tensor, cfg: TrainConfig, generator: torch.Generator) -> Splats:
    """Gaussians at the initial points, as gsplat's ``create_splats_with_optimizers`` makes them."""
    n = points.shape[0]
    dist = knn_mean_distance(points).clamp_min(1e-7)
    k = (cfg.sh_degree + 1) ** 2
    return Splats(means=points.clone().float(), scales=torch.log(dist * cfg.init_scale)[:, None].repeat(1, 3),
                  quats=torch.rand(n, 4, generator=generator).to(points.device),
                  opacities=torch.full((n,), math.log(cfg.init_opacity / (1 - cfg.init_opacity)), device=points.device),
                  sh0=rgb_to_sh(rgb.float())[:, None, :], shN=torch.zeros(n, k - 1, 3, device=points.device))


class Trainer:
    """Fits ``Splats`` to the training cameras of ``data``; ``world`` makes it one rank of a data-parallel job."""

    def __init__(self, data: PosedImages, config: TrainConfig | None = None, *, device: torch.device | str = "cpu",
                 world=None) -> None:
        self.cfg = cfg = config or TrainConfig()
        self.device = torch.device(device)
        self.data = data
        self.views = data.views.to(self.device)
        self.background = data.background.to(self.device)
        if self.views.width < 11 or self.views.height < 11:
            raise ValueError(f"Trainer: images must be at least 11x11 (the SSIM window), got "
                             f"{self.views.width}x{self.views.height}")
        self.world = world
        self.rank: int
        self.world_size: int
        self.rank, self.world_size = (world.rank, world.size) if world is not None else (0, 1)
        self.scene_scale = data.scene_scale
        gen = torch.Generator().manual_seed(cfg.seed)
        points, rgb = data.points, data.points_rgb
        if cfg.strategy == "mcmc" and points.shape[0] > cfg.mcmc.cap_max:  # start within the cap
            keep = torch.randperm(points.shape[0], generator=gen)[:cfg.mcmc.cap_max].sort().values
            points, rgb = points[keep.to(points.device)], rgb[keep.to(rgb.device)]
        s = init_splats(points.to(self.device), rgb.to(self.device), cfg, gen)
        self.params: dict[str, Tensor] = {k: v.requires_grad_() for k, v in s.as_dict().items()}
        bs = cfg.batch * self.world_size  # gsplat scales learning rates with the global batch like this
        self.base_lrs = {"means": cfg.means_lr * self.scene_scale, "scales": cfg.scales_lr, "quats": cfg.quats_lr,
                         "opacities": cfg.opacities_lr, "sh0": cfg.sh0_lr, "shN": cfg.shN_lr}
        self.base_lrs = {k: v * math.sqrt(bs) for k, v in self.base_lrs.items()}
        self.opt = SelectiveAdam(self.params, self.base_lrs, betas=(1 - bs * 0.1, 1 - bs * 0.001),
                                 eps=1e-15 / math.sqrt(bs))
        reduce = world.all_reduce_ if world is not None else None
        self.densifier: Densifier | MCMCDensifier
        if cfg.strategy == "mcmc":  # no statistics to reduce: identical seeds make identical moves on every rank
            self.densifier = MCMCDensifier(cfg.mcmc, seed=cfg.seed + 1, device=self.device)
        else:
            self.densifier = Densifier(cfg.densify, self.scene_scale, seed=cfg.seed + 1, all_reduce=reduce)
        self.camera_gen = torch.Generator().manual_seed(cfg.seed + 2)  # same on every rank: one global order
        self.order: list[int] = []
        self.step = 0
        self.history: list[dict] = []  # one row per logged step
        self.evals: list[dict] = []  # one row per held-out evaluation
        self.stage_ms = {k: 0.0 for k in STAGES}
        self.stage_steps = 0

    # ---- the loop -----------------------------------------------------------------------------------------

    @property
    def splats(self) -> Splats:
        return Splats.from_dict(self.params).detach()

    @property
    def rasterize_mode(self) -> str:
        return "antialiased" if self.cfg.antialiased else "classic"

    def sh_degree_now(self) -> int:
        return min(self.step // self.cfg.sh_degree_interval, self.cfg.sh_degree)

    def next_cameras(self) -> list[int]:
        """This rank's cameras of the step: a slice of one global shuffled order (identical on all ranks)."""
        need = self.cfg.batch * self.world_size
        if len(self.order) < need:
            train = self.data.train
            reps = -(-need // len(train))
            perms = [torch.randperm(len(train), generator=self.camera_gen) for _ in range(reps)]
            self.order = [train[int(i)] for i in torch.cat(perms)]
        take, self.order = self.order[:need], self.order[need:]
        return take[self.rank * self.cfg.batch:(self.rank + 1) * self.cfg.batch]

    def train_step(self) -> dict:
        """Render this step's cameras, L1 + SSIM loss, backward, selective Adam, densification."""
        cfg, step = self.cfg, self.step
        timed = self.device.type != "cuda" or step % 10 == 0  # on a GPU, sync for stage times 1 step in 10
        clock = _Clock(self.device, timed)
        cams = self.next_cameras()
        v = self.views.subset(cams)
        gt = self.data.batch(cams, self.device)
        images, _, meta = render(Splats.from_dict(self.params), v.viewmats, v.Ks, v.width, v.height,
                                 sh_degree=self.sh_degree_now(), background=self.background,
                                 absgrad=cfg.densify.absgrad, tile_size=cfg.tile_size,
                                 rasterize_mode=self.rasterize_mode)
        clock.lap("render")
        l1 = (images - gt).abs().mean()
        s = ssim(images, gt).mean()
        loss = (1 - cfg.ssim_lambda) * l1 + cfg.ssim_lambda * (1 - s)
        if cfg.opacity_reg:
            loss = loss + cfg.opacity_reg * torch.sigmoid(self.params["opacities"]).mean()
        if cfg.scale_reg:
            loss = loss + cfg.scale_reg * torch.exp(self.params["scales"]).mean()
        clock.lap("loss")
        loss.backward()
        visible = (meta["radii"] > 0).all(-1).any(0)  # [N] seen by some camera of the step
        if self.world is not None:
            self.world.average_grads(self.params)
            visible = self.world.any_(visible)
        clock.lap("backward")
        self.update(visible)
        clock.lap("optimizer")
        m2d = meta["means2d"]
        g2d = getattr(m2d, "absgrad", None) if cfg.densify.absgrad else m2d.grad
        if g2d is None:
            raise RuntimeError("rasterize returned meta['means2d'] without a gradient; densification needs it")
        self.densifier.accumulate(step, g2d, meta["radii"], v.width, v.height)
        edits = self.densifier.step(step, self.params, self.opt)
        clock.lap("densify")
        if timed:
            for k, ms in clock.ms.items():
                self.stage_ms[k] += ms
            self.stage_steps += 1
        self.step += 1
        row = {"step": step, "loss": loss.item(), "l1": l1.item(), "ssim": s.item(), "n": self.n,
               "psnr": float(psnr(images.detach().clamp(0, 1), gt).mean()), **edits}
        if step % cfg.log_every == 0 or edits or self.step == cfg.steps:
            self.history.append(row)
        return row

    def update(self, visible: Tensor) -> None:  # visible: [N] bool
        """Selective Adam on the (rank-averaged) gradients; the means' learning rate decays 100x over the run."""
        self.opt.lrs["means"] = self.base_lrs["means"] * 0.01 ** (self.step / self.cfg.steps)
        self.opt.step(visible)
        self.opt.zero_grad()

    @property
    def n(self) -> int:
        return self.params["means"].shape[0]

    @torch.no_grad()
    def evaluate(self, max_views: int | None = None) -> dict:
        """PSNR and SSIM on the held-out cameras (or the training ones when none are held out)."""
        idx = self.data.test or self.data.train
        idx = idx[:max_views] if max_views else idx
        splats, ps, ss = self.splats, [], []
        for i in idx:
            v = self.views.subset([i])
            img, _, _ = render(splats, v.viewmats, v.Ks, v.width, v.height, sh_degree=self.sh_degree_now(),
                               background=self.background, tile_size=self.cfg.tile_size,
                               rasterize_mode=self.rasterize_mode)
            gt = self.data.batch([i], self.device)
            img = img.clamp(0, 1)
            ps.append(float(psnr(img, gt)[0]))
            ss.append(float(ssim(img, gt)[0]))
        row = {"step": self.step, "psnr": sum(ps) / len(ps), "ssim": sum(ss) / len(ss), "n": self.n,
               "views": len(idx), "held_out": bool(self.data.test)}
        self.evals.append(row)
        return row

    def fit(self, steps: int | None = None, *, on_step: Callable[[dict], None] | None = None,
            on_eval: Callable[[dict], None] | None = None) -> dict:
        """Train until ``steps`` (default: the config's), evaluating every ``eval_every`` steps and at the end."""
        end = self.cfg.steps if steps is None else steps
        t0 = time.perf_counter()
        while self.step < end:
            row = self.train_step()
            if on_step:
                on_step(row)
            if self.rank == 0 and (self.step % self.cfg.eval_every == 0 or self.step == end):
                ev = self.evaluate()
                if on_eval:
                    on_eval(ev)
        self.wall_s = getattr(self, "wall_s", 0.0) + time.perf_counter() - t0
        return self.evals[-1] if self.evals else {}

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": "warpforge.splat.ckpt/1", "config": asdict(self.cfg), "step": self.step,
                "params": {k: v.detach().to("cpu", copy=True) for k, v in self.params.items()},  # a snapshot
                "optimizer": self.opt.state_dict(), "densify": self.densifier.state_dict(),
                "camera_gen": self.camera_gen.get_state(), "order": list(self.order),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "history": self.history, "evals": self.evals, "stage_ms": self.stage_ms,
                "stage_steps": self.stage_steps, "wall_s": getattr(self, "wall_s", 0.0),
                "views": {"viewmats": self.views.viewmats.cpu(), "Ks": self.views.Ks.cpu(),
                          "width": self.views.width, "height": self.views.height, "names": self.views.names,
                          "train": self.data.train, "test": self.data.test},
                "background": self.background.cpu(), "scene": self.data.name}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(path)  # never leave a half-written checkpoint where the last good one was
        return path

    def load_state_dict(self, d: dict) -> None:
        if d.get("format") != "warpforge.splat.ckpt/1":
            raise ValueError(f"not a warpforge splat checkpoint (format {d.get('format')!r})")
        saved = d["config"].get("strategy", "default")
        if saved != self.cfg.strategy:
            raise ValueError(f"the checkpoint was trained with --strategy {saved}, not {self.cfg.strategy}")
        self.params.clear()
        # copies: the optimizer and MCMC's noise update parameters in place, and a state dict held in memory
        # (loaded into two trainers, or kept by the caller) must not change under them
        self.params.update({k: v.to(self.device, copy=True).requires_grad_() for k, v in d["params"].items()})
        self.opt.load_state_dict(d["optimizer"])
        self.densifier.load_state_dict({k: (v.to(self.device) if isinstance(v, Tensor) and k != "generator" else v)
                                        for k, v in d["densify"].items()})
        self.camera_gen.set_state(d["camera_gen"])
        self.order = list(d["order"])
        torch.set_rng_state(d["torch_rng"])
        if d.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(d["cuda_rng"])
        self.step, self.history, self.evals = d["step"], list(d["history"]), list(d["evals"])
        self.stage_ms, self.stage_steps, self.wall_s = dict(d["stage_ms"]), d["stage_steps"], d["wall_s"]

    def resume(self, path: str | Path) -> None:
        """Restore everything a checkpoint holds: parameters, optimizer moments, statistics, step, RNG."""
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint's contents (CPU tensors), for rendering without the training data."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        d = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - pickle, zip and torch each raise their own type for a bad file
        raise ValueError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != "warpforge.splat.ckpt/1":
        raise ValueError(f"{path}: not a warpforge splat checkpoint")
    return d


class _Clock:
    """Per-stage wall time; on CUDA it synchronises at each lap, so it is only armed on sampled steps."""

    def __init__(self, device: torch.device, armed: bool) -> None:
        self.cuda, self.armed = device.type == "cuda", armed
        self.ms: dict[str, float] = {}
        self.t = time.perf_counter() if armed else 0.0

    def lap(self, name: str) -> None:
        if not self.armed:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.ms[name] = (now - self.t) * 1e3
        self.t = now
