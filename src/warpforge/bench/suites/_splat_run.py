"""The measured side of suite ``splat``: scenes, the candidates that render them, and one session per case
that checks, measures memory and times them all together (the table is in ``splat.py``).

A case's callables (ours and each peer, ``EndToEndCase`` run functions) share one :class:`Session`. The
first call builds the scene once, renders it with every candidate (gsplat's first call builds its CUDA
extension), checks ours against gsplat (or, without gsplat, against warpforge's dense reference on tiny
scenes), measures each candidate's peak memory alone, times all of them interleaved with the bench
harness, and then each callable returns its own runs (one per timing block).

warpforge.splat and gsplat are imported inside functions: bench imports no product at import time, and a
machine without gsplat records the peer as missing (its error) while ours still runs.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from warpforge.bench.compare import error_line
from warpforge.bench.e2e import release_memory, sync
from warpforge.bench.suite import Run
from warpforge.bench.suites import _session
from warpforge.timing import time_interleaved

OURS = "ours"
GSPLAT = "gsplat"  # gsplat 1.5.3 rasterization(), dense mode (packed=False): the figures and target
GSPLAT_PACKED = "gsplat packed"  # its default packed=True
PARAMS = ("means", "quats", "scales", "opacities", "sh")
IMAGE_TOL = 1e-3  # mean |ours - gsplat| over the images (the bar)
GRAD_COSINE = 0.999  # every parameter's gradient against gsplat's
REFERENCE_MAX_WORK = 2e8  # Gaussians x pixels x cameras up to which the dense reference can check ours
STAGES = ("project", "sh", "intersect", "sort", "offsets", "rasterize", "backward")


class PeerMissing(RuntimeError):
    """A peer that cannot run on this machine (gsplat not installed): recorded as the peer's error."""


@dataclass(frozen=True)
class Workload:
    """N Gaussians in front of C pinhole cameras, SH degree ``sh_degree``; forward or forward + backward."""

    n: int
    cameras: int = 1
    width: int = 1920
    height: int = 1080
    sh_degree: int = 3
    backward: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "cameras", "width", "height"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Workload.{name} must be an int >= 1, got {v!r}")
        if self.sh_degree not in (0, 1, 2, 3):
            raise ValueError(f"Workload.sh_degree must be 0..3, got {self.sh_degree!r}")

    @property
    def label(self) -> str:
        n = f"{self.n // 1_000_000}M" if self.n % 1_000_000 == 0 else (
            f"{self.n // 1000}k" if self.n % 1000 == 0 else str(self.n))
        cams = f" {self.cameras} cameras" if self.cameras > 1 else ""
        return f"{'forward+backward' if self.backward else 'forward'} N={n}{cams} {self.width}x{self.height} " \
               f"SH{self.sh_degree}"


# ---- the scene ------------------------------------------------------------------------------------------

def cameras(n: int, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """viewmats [C,4,4] (world -> camera) and Ks [C,3,3]: camera 0 at the origin looking down +z, the others
    turned about y by 3 degree steps and moved sideways, so all of them see most of the scene."""
    f = 0.8 * width  # a 64 degree horizontal field of view
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    views = []
    for i in range(n):
        step = i - (n - 1) / 2 if n > 1 else 0.0
        th = math.radians(3.0 * step)
        R = torch.tensor([[math.cos(th), 0.0, math.sin(th)], [0.0, 1.0, 0.0], [-math.sin(th), 0.0, math.cos(th)]])
        centre = torch.tensor([0.4 * step, 0.0, 0.0])
        V = torch.eye(4)
        V[:3, :3] = R.T  # world -> camera
        V[:3, 3] = -R.T @ centre
        views.append(V)
    return torch.stack(views), K.expand(n, 3, 3).clone()


def make_scene(w: Workload, device: torch.device) -> dict[str, torch.Tensor]:
    """The case's scene, drawn on the CPU from its seed (the same on every device), then moved to ``device``:
    means in the view frustum at depths 2..20, anisotropic scales 3..30 mm (about 1..10 px), random
    rotations, opacities sigmoid(2 x normal), SH colours with a strong DC term."""
    g = torch.Generator().manual_seed(1000 + w.seed)
    u = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    n = w.n
    f = 0.8 * w.width
    z = 2.0 + 18.0 * u(n)
    x = (2.2 * u(n) - 1.1) * z * (w.width / 2) / f
    y = (2.2 * u(n) - 1.1) * z * (w.height / 2) / f
    scales = torch.exp(math.log(0.003) + (math.log(0.03) - math.log(0.003)) * u(n, 3))
    quats = torch.randn(n, 4, generator=g)
    quats = quats / quats.norm(dim=-1, keepdim=True)
    opacities = torch.sigmoid(2.0 * torch.randn(n, generator=g))
    k = (w.sh_degree + 1) ** 2
    sh = 0.05 * torch.randn(n, k, 3, generator=g)
    sh[:, 0] = 0.8 * torch.randn(n, 3, generator=g)
    viewmats, Ks = cameras(w.cameras, w.width, w.height)
    v_img = torch.rand(w.cameras, w.height, w.width, 3, generator=g) - 0.5  # d loss / d image (backward cases)
    scene = {"means": torch.stack([x, y, z], -1), "quats": quats, "scales": scales, "opacities": opacities,
             "sh": sh, "viewmats": viewmats, "Ks": Ks, "v_img": v_img}
    return {k: v.to(device) for k, v in scene.items()}


# ---- the candidates: (params..., viewmats, Ks) -> (images [C,H,W,3], alphas [C,H,W,1], n_isects) --------

Render = Callable[..., tuple[torch.Tensor, torch.Tensor, int]]


def ours_render(w: Workload) -> Render:
    from warpforge.splat import rasterize

    def render(means, quats, scales, opacities, sh, viewmats, Ks):
        img, alpha, meta = rasterize(means, quats, scales, opacities, sh, viewmats, Ks, w.width, w.height,
                                     sh_degree=w.sh_degree)
        return img, alpha, meta["isect_ids"].numel()
    return render


def gsplat_render(w: Workload, packed: bool) -> Render:
    try:
        from gsplat import rasterization
    except ImportError as e:
        raise PeerMissing(f"gsplat is not installed ({error_line(e)}): pip install gsplat==1.5.3") from None

    def render(means, quats, scales, opacities, sh, viewmats, Ks):
        img, alpha, meta = rasterization(means, quats, scales, opacities, sh, viewmats, Ks, w.width, w.height,
                                         sh_degree=w.sh_degree, packed=packed, tile_size=16, eps2d=0.3,
                                         near_plane=0.01, far_plane=1e10, rasterize_mode="classic")
        return img, alpha, meta["isect_ids"].numel()
    return render


def reference_render(w: Workload) -> Render:
    from warpforge.splat.reference import render_reference

    def render(means, quats, scales, opacities, sh, viewmats, Ks):
        img, alpha, _ = render_reference(means, quats, scales, opacities, sh, viewmats, Ks, w.width, w.height,
                                         sh_degree=w.sh_degree)
        return img, alpha, 0
    return render


BUILDERS: dict[str, Callable[[Workload], Render]] = {
    OURS: ours_render, GSPLAT: lambda w: gsplat_render(w, packed=False),
    GSPLAT_PACKED: lambda w: gsplat_render(w, packed=True)}


def make_call(render: Render, scene: dict[str, torch.Tensor], backward: bool) -> Callable[[], dict[str, Any]]:
    """One timed call: the forward (no autograd), or forward + backward of sum(images * v_img) to every
    parameter. Returns what the check compares."""
    inputs = [scene[k] for k in PARAMS]

    def forward() -> dict[str, Any]:
        with torch.no_grad():
            img, alpha, n_isects = render(*inputs, scene["viewmats"], scene["Ks"])
        return {"img": img, "alpha": alpha, "n_isects": n_isects}

    def forward_backward() -> dict[str, Any]:
        params = [t.detach().requires_grad_() for t in inputs]
        img, alpha, n_isects = render(*params, scene["viewmats"], scene["Ks"])
        grads = torch.autograd.grad((img * scene["v_img"]).sum(), params)
        return {"img": img.detach(), "alpha": alpha.detach(), "n_isects": n_isects, "grads": grads}
    return forward_backward if backward else forward


def compare(ours: dict[str, Any], other: dict[str, Any], against: str) -> dict[str, Any]:
    """Ours' images (and gradients) against another candidate's: the record's ``correct``."""
    diff = (ours["img"].float() - other["img"].float()).abs()
    out: dict[str, Any] = {"rel_err": _finite(diff.mean()), "tol": IMAGE_TOL, "against": against,
                           "image_mean_abs_diff": _finite(diff.mean()), "image_max_abs_diff": _finite(diff.max()),
                           "alpha_mean_abs_diff": _finite((ours["alpha"] - other["alpha"]).abs().mean())}
    ok = out["rel_err"] is not None and out["rel_err"] < IMAGE_TOL
    if "grads" in ours and "grads" in other:
        cos = {name: _finite(cosine(a, b)) for name, a, b in zip(PARAMS, ours["grads"], other["grads"])}
        out["grad_cosine"] = cos
        out["grad_cosine_min"] = min((c for c in cos.values() if c is not None), default=None)
        out["grad_cosine_tol"] = GRAD_COSINE
        ok = ok and all(c is not None and c > GRAD_COSINE for c in cos.values())
    out["ok"] = bool(ok)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return (a @ b) / (a.norm() * b.norm()).clamp_min(1e-300)


def _finite(x: Any) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def peak_memory_gb(call: Callable[[], Any], device: torch.device) -> float | None:
    """Peak device memory of one call above what was allocated before it (inputs excluded), in GB."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak / 1e9


# ---- per-stage breakdown: each pipeline called stage by stage, a CUDA event (host clock on CPU) between ----

class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device, self.marks = device, []

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def stages(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3
        return out


def _tiles(w: Workload) -> tuple[int, int]:
    return -(-w.width // 16), -(-w.height // 16)


def _sh_colors(spherical_harmonics: Callable, w: Workload, means, sh, viewmats, **kw) -> torch.Tensor:
    """Per-camera colours from SH as gsplat's rasterization() makes them: view dirs from the camera centre,
    +0.5, clamped at 0."""
    campos = torch.inverse(viewmats)[:, :3, 3]
    dirs = means[None] - campos[:, None]
    shs = sh[None].expand(w.cameras, *sh.shape)
    return torch.clamp_min(spherical_harmonics(w.sh_degree, dirs, shs, **kw) + 0.5, 0.0)


def ours_stages(w: Workload) -> Callable[[dict, _Clock], None]:
    from warpforge.splat import blend, tiles
    from warpforge.splat.project import project
    from warpforge.splat.sh import spherical_harmonics

    tw, th = _tiles(w)

    def run(scene: dict, clock: _Clock) -> None:
        params = [scene[k].detach().requires_grad_() for k in PARAMS]
        means, quats, scales, opacities, sh = params
        clock.mark("start")
        p = project(means, quats, scales, opacities, scene["viewmats"], scene["Ks"], w.width, w.height)
        clock.mark("project")
        colors = _sh_colors(spherical_harmonics, w, means, sh, scene["viewmats"])
        clock.mark("sh")
        _, keys, ids = tiles.intersect_tiles(p.means2d, p.radii, p.depths, p.conics, p.opacities, 16, tw, th,
                                             sort=False)
        clock.mark("intersect")
        keys, flatten_ids = tiles.sort_intersections(keys, ids)
        clock.mark("sort")
        offsets = tiles.tile_offsets(keys, w.cameras, tw, th)
        clock.mark("offsets")
        img, _ = blend.rasterize_to_pixels(p.means2d, p.conics, colors, p.opacities, w.width, w.height, 16,
                                           offsets, flatten_ids)
        clock.mark("rasterize")
        torch.autograd.grad((img * scene["v_img"]).sum(), params)
        clock.mark("backward")
    return run


def gsplat_stages(w: Workload) -> Callable[[dict, _Clock], None]:
    """gsplat's own stage functions in rasterization()'s order (dense mode). Its intersection sorts inside
    (cub radix sort): it runs once unsorted ("intersect") and once sorted ("intersect+sort"), and ``sort``
    is their difference."""
    try:
        from gsplat.cuda._wrapper import (fully_fused_projection, isect_offset_encode, isect_tiles,
                                          rasterize_to_pixels, spherical_harmonics)
    except ImportError as e:
        raise PeerMissing(f"gsplat is not installed ({error_line(e)}): pip install gsplat==1.5.3") from None
    tw, th = _tiles(w)

    def run(scene: dict, clock: _Clock) -> None:
        params = [scene[k].detach().requires_grad_() for k in PARAMS]
        means, quats, scales, opacities, sh = params
        clock.mark("start")
        radii, means2d, depths, conics, _ = fully_fused_projection(
            means, None, quats, scales, scene["viewmats"], scene["Ks"], w.width, w.height, eps2d=0.3,
            packed=False, opacities=opacities)
        clock.mark("project")
        colors = _sh_colors(spherical_harmonics, w, means, sh, scene["viewmats"], masks=(radii > 0).all(-1))
        clock.mark("sh")
        isect_tiles(means2d, radii, depths, 16, tw, th, sort=False)
        clock.mark("intersect")
        _, isect_ids, flatten_ids = isect_tiles(means2d, radii, depths, 16, tw, th, sort=True)
        clock.mark("intersect+sort")
        offsets = isect_offset_encode(isect_ids, w.cameras, tw, th)
        clock.mark("offsets")
        img, _ = rasterize_to_pixels(means2d, conics, colors, opacities[None].expand(w.cameras, -1), w.width,
                                     w.height, 16, offsets, flatten_ids)
        clock.mark("rasterize")
        torch.autograd.grad((img * scene["v_img"]).sum(), params)
        clock.mark("backward")
    return run


STAGE_BUILDERS: dict[str, Callable[[Workload], Callable[[dict, _Clock], None]]] = {
    OURS: ours_stages, GSPLAT: gsplat_stages}


def time_stages(run: Callable[[dict, _Clock], None], scene: dict, device: torch.device, warmup: int,
                rep: int) -> dict[str, float]:
    """Median ms of each stage over ``rep`` staged calls; ``total`` is the pipeline's (gsplat's unsorted
    intersection, run only to time its sort, is left out of it)."""
    for _ in range(warmup):
        run(scene, _Clock(device))
    samples: dict[str, list[float]] = {}
    for _ in range(rep):
        clock = _Clock(device)
        run(scene, clock)
        for k, v in clock.stages().items():
            samples.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in samples.items()}
    if "intersect+sort" in med:
        med["sort"] = max(med["intersect+sort"] - med["intersect"], 0.0)
        med["total"] = sum(v for k, v in med.items() if k not in ("intersect", "sort"))
    else:
        med["total"] = sum(med.values())
    return med


# ---- the session ------------------------------------------------------------------------------------------

class Protocol(_session.Protocol):
    def as_timing(self, device_note: str) -> dict[str, Any]:
        return {"method": f"warpforge.timing.time_interleaved, L2 flushed, host not hidden ({device_note})",
                "warmup": self.warmup, "rep": self.rep, "blocks": self.blocks, "interleaved": True,
                "statistic": "ms: median of the block medians; p20/p80 across blocks"}


class Session(_session.CaseSession):
    """Builds, checks, measures and times every candidate of one case once; each callable reads its share."""

    def __init__(self, workload: Workload, names: list[str], protocol: Protocol, *, stages: bool = False) -> None:
        if names[0] != OURS:
            raise ValueError(f"names must start with {OURS!r}, got {names}")
        super().__init__(names, workload.label)
        self.workload, self.protocol, self.stages = workload, protocol, stages

    def check(self, ours: Any, _peer: Any) -> dict[str, Any]:
        """EndToEndCase.check (check_against None): what the session compared in the same run."""
        return dict(ours["correct"])

    def _measure(self, device: torch.device) -> dict[str, list[Run] | str]:
        w, p = self.workload, self.protocol
        scene = make_scene(w, device)
        calls: dict[str, Callable[[], dict[str, Any]]] = {}
        outs: dict[str, dict[str, Any]] = {}
        info: dict[str, dict[str, Any]] = {}
        errors: dict[str, str] = {}
        for name in self.names:
            try:
                t0 = time.perf_counter()
                call = make_call(BUILDERS[name](w), scene, w.backward)
                outs[name] = call()  # gsplat's first call builds its CUDA extension
                sync(device)
                info[name] = {"first_call_s": time.perf_counter() - t0, "n_isects": outs[name]["n_isects"]}
                calls[name] = call
            except Exception as e:  # noqa: BLE001 - a candidate's failure (or absence) is data for the record
                errors[name] = error_line(e)
                if not isinstance(e, PeerMissing):
                    print(f"{w.label}: {name} failed:\n{traceback.format_exc(limit=-16)}", file=sys.stderr)
        if OURS in errors:
            return {n: errors.get(n, f"not run: ours failed ({errors[OURS]})") for n in self.names}
        correct = self._check(outs, scene, device, errors)
        del outs
        results: dict[str, list[Run] | str] = {n: errors[n] for n in errors}
        samples: dict[str, list[float]] = {}
        if self.stages:  # the stage-by-stage pipeline, timed on its own (its total is the case's ms)
            for name in calls:
                try:
                    info[name]["stages_ms"] = time_stages(STAGE_BUILDERS[name](w), scene, device, p.warmup, p.rep)
                    samples[name] = [info[name]["stages_ms"]["total"]]
                except Exception as e:  # noqa: BLE001
                    results[name] = f"stage timing failed: {error_line(e)}"
        else:
            for name, call in calls.items():
                info[name]["peak_mem_GB"] = peak_memory_gb(call, device)
            for _ in range(p.blocks):
                got = time_interleaved(calls, warmup=p.warmup, rep=p.rep, flush_l2=True, device=device,
                                       hide_host=False)
                for name, t in got.items():
                    samples.setdefault(name, []).append(t.median_ms)
        base = info.get(GSPLAT, {})
        for name, ms in samples.items():
            extra = {**info[name], "cameras": w.cameras, "gaussians": w.n}
            if name == OURS:  # the figures judged against gsplat (dense) besides time
                for key, other in (("peak_mem_vs_gsplat", "peak_mem_GB"), ("n_isects_vs_gsplat", "n_isects")):
                    a, b = info[OURS].get(other), base.get(other)
                    extra[key] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
            results[name] = [Run(ms=m, tokens=0, extra=extra, output={"correct": correct} if name == OURS else None)
                             for m in ms]
        del calls, scene
        release_memory(device)
        return results

    def _check(self, outs: dict[str, dict[str, Any]], scene: dict, device: torch.device,
               errors: dict[str, str]) -> dict[str, Any]:
        """Ours against gsplat (dense) when it ran; else against the dense reference where that is small
        enough to run; else not checked (ok: false, with the reason)."""
        w = self.workload
        if GSPLAT in outs:
            return compare(outs[OURS], outs[GSPLAT], f"peer:{GSPLAT}")
        why = errors.get(GSPLAT, "gsplat is not a peer of this case")
        if w.n * w.width * w.height * w.cameras <= REFERENCE_MAX_WORK:
            try:
                ref = make_call(reference_render(w), scene, w.backward)()
                return {**compare(outs[OURS], ref, "warpforge.splat.reference.render_reference"),
                        "note": f"gsplat did not run ({why}): checked against the dense reference"}
            except Exception as e:  # noqa: BLE001
                why = f"{why}; the dense reference failed too ({error_line(e)})"
        return {"rel_err": None, "ok": False, "note": f"not checked: {why}"}
