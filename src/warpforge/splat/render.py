"""The public render: ``rasterize`` runs the named stages in order.

    project -> colours (SH + 0.5, clamped at 0) -> intersect_tiles (+ the key sort) -> tile_offsets
    -> rasterize_to_pixels

``packed=True`` runs the same stages on the visible pairs only (``packed.project_packed`` and
``packed.intersect_tiles_packed`` around the same kernels).

Each stage is a function of its own module, dispatched as ``warpforge.kernels`` does: Triton kernels on CUDA
tensors, their torch reference on CPU. ``reference.render_reference`` is the same render with no tiles (every
Gaussian at every pixel), the ground truth the tests hold this one to.
"""

from __future__ import annotations

import os

import torch

from warpforge.splat.blend import rasterize_to_pixels
from warpforge.splat.camera import camera_centers
from warpforge.splat.checks import DeferredCheck, gaussian_bounds
from warpforge.splat.packed import PACK_PAIRS, intersect_tiles_packed, project_packed
from warpforge.splat.project import check_projection_inputs, project_checked
from warpforge.splat.reference import RASTERIZE_MODES, RENDER_MODES
from warpforge.splat.sh import MAX_DEGREE, sh_colors
from warpforge.splat.tiles import intersect_tiles, tile_offsets

__all__ = ["rasterize", "RASTERIZE_MODES", "RENDER_MODES"]


def rasterize(means: torch.Tensor,  # [N, 3]
              quats: torch.Tensor,  # [N, 4] (w, x, y, z), normalized inside
              scales: torch.Tensor,  # [N, 3] linear (not log)
              opacities: torch.Tensor,  # [N] in [0, 1] (after the sigmoid)
              colors: torch.Tensor,  # [N, K, 3] / [C, N, K, 3] SH (with sh_degree), or [N, D] / [C, N, D] features
              viewmats: torch.Tensor,  # [C, 4, 4] world -> camera
              Ks: torch.Tensor,  # [C, 3, 3]
              width: int, height: int, *,
              sh_degree: int | None = None, near: float = 0.01, far: float = 1e10, tile_size: int = 16,
              background: torch.Tensor | None = None,  # [D] or [C, D] behind the colour channels
              render_mode: str = "RGB", camera_model: str = "pinhole", absgrad: bool = False,
              eps2d: float = 0.3, rasterize_mode: str = "classic",
              packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Render N Gaussians into C cameras: images [C, H, W, D'], alphas [C, H, W, 1], meta.

    ``render_mode``: "RGB" (D' = D, the colour channels), "D" (accumulated camera-space depth), "ED" (expected
    depth: accumulated depth / alpha), "RGB+ED" (D + 1 channels). With ``sh_degree`` the colours are SH
    evaluated along mean - camera centre, plus 0.5, clamped at 0. ``meta["means2d"]`` is the tensor the blend
    consumed; after backward its ``.grad`` (and, with ``absgrad=True``, ``.absgrad``: the sum over pixels of
    |dL/dmeans2d|) are what densification reads. Differentiable in means, quats, scales, opacities, colors,
    background and viewmats (Ks on the CPU path only). ``rasterize_mode="antialiased"``: gsplat's mode of that
    name (Mip-Splatting's 2D filter), each camera's opacity times sqrt(det(Sigma2d) / det(Sigma2d + eps2d I)),
    so small or distant splats fade instead of swelling to the eps2d blur. ``packed=True``: gsplat's packed mode,
    only the visible (camera, Gaussian) pairs in a flat list (``warpforge.splat.packed``); the same images, and
    meta's per-pair fields are [nnz, ...] with ``camera_ids`` and ``gaussian_ids`` [nnz]. Bad input raises
    ValueError with one line naming what is wrong.
    """
    C, N, D, values = check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, width, height, sh_degree,
                                   near, far, tile_size, background, render_mode, camera_model, eps2d)
    if rasterize_mode not in RASTERIZE_MODES:
        raise ValueError(f"rasterize_mode must be one of {', '.join(map(repr, RASTERIZE_MODES))}, "
                         f"got {rasterize_mode!r}")
    if not isinstance(packed, bool):
        raise ValueError(f"packed must be a bool, got {packed!r}")
    # packed: the pairs' memory is counted for one group of cameras (the visible pairs are not known yet)
    check_memory(min(C, max(1, PACK_PAIRS // max(N, 1))) if packed else C, N, D + (render_mode != "RGB"), width,
                 height, tile_size, means.device)
    tile_width, tile_height = -(-width // tile_size), -(-height // tile_size)
    args = (means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d, camera_model,
            rasterize_mode == "antialiased")
    centres = None if sh_degree is None else _centres(values, viewmats)
    if packed:
        # colours per camera group in the dense layout, then only the visible rows kept (see packed.py)
        def group_features(c0: int, c1: int, depths: torch.Tensor) -> torch.Tensor:  # -> [c1 - c0, N, D']
            own = colors[c0:c1] if colors.dim() == (3 if sh_degree is None else 4) else colors  # per camera
            group = None if centres is None else centres[c0:c1]
            return _features(own, means, group, sh_degree, depths, render_mode, c1 - c0)

        values.resolve()  # packed mode sizes its pair list from the projection: the values are checked first
        pk = project_packed(*args, features=group_features)
        proj, feats, ids = pk.proj, pk.features, (pk.camera_ids, pk.gaussian_ids)
        tiles_per_gauss, isect_ids, flatten_ids = intersect_tiles_packed(pk, C, tile_size, tile_width, tile_height)
    else:
        proj, ids = project_checked(*args), None
        feats = _features(colors, means, centres, sh_degree, proj.depths, render_mode, C)
        tiles_per_gauss, isect_ids, flatten_ids = intersect_tiles(proj.means2d, proj.radii, proj.depths,
                                                                  proj.conics, proj.opacities, tile_size,
                                                                  tile_width, tile_height, deferred=values)
    backgrounds = _backgrounds(background, render_mode, C)
    offsets = tile_offsets(isect_ids, C, tile_width, tile_height)
    means2d = proj.means2d
    if means2d.requires_grad:
        means2d.retain_grad()  # densification reads meta["means2d"].grad
    images, alphas = rasterize_to_pixels(means2d, proj.conics, feats, proj.opacities, width, height, tile_size,
                                         offsets, flatten_ids, backgrounds=backgrounds, absgrad=absgrad)
    if render_mode in ("ED", "RGB+ED"):
        images = torch.cat([images[..., :-1], images[..., -1:] / alphas.clamp_min(1e-10)], -1)
    cam_ids, gauss_ids = ids if ids is not None else (None, None)
    meta = {"radii": proj.radii, "means2d": means2d, "depths": proj.depths, "conics": proj.conics,
            "opacities": proj.opacities, "tiles_per_gauss": tiles_per_gauss, "isect_ids": isect_ids,
            "flatten_ids": flatten_ids, "isect_offsets": offsets, "tile_width": tile_width,
            "tile_height": tile_height, "tile_size": tile_size, "width": width, "height": height, "n_cameras": C,
            "camera_ids": cam_ids, "gaussian_ids": gauss_ids}
    return images, alphas, meta


def _features(colors, means, centres, sh_degree, depths, render_mode, C):
    """What the blend accumulates per (camera, Gaussian), [C, N, D']."""
    feats = []
    if render_mode in ("RGB", "RGB+ED"):
        if sh_degree is None:
            feats.append(colors if colors.dim() == 3 else colors[None].expand(C, *colors.shape))
        else:
            # [N, K, 3] coefficients are shared by the cameras: the SH kernel reads them once per Gaussian
            feats.append(sh_colors(sh_degree, means, centres, colors))
    if render_mode != "RGB":
        feats.append(depths[..., None])
    return feats[0] if len(feats) == 1 else torch.cat(feats, -1)


def _centres(values: DeferredCheck, viewmats: torch.Tensor) -> torch.Tensor:  # [C, 3]
    """The cameras' centres for the SH directions: those the check kernel computed, unless the poses need a
    gradient through them (then torch's inverse, differentiable)."""
    if values.centres is not None and not (viewmats.requires_grad and torch.is_grad_enabled()):
        return values.centres
    return camera_centers(viewmats)


def _backgrounds(background, render_mode, C):
    """The blend's backgrounds [C, D'] or None: the colour channels' background, 0 behind depth channels."""
    if background is None or render_mode not in ("RGB", "RGB+ED"):
        return None  # depth channels have no background (gsplat's rule)
    bg = background.expand(C, -1) if background.dim() == 1 else background
    if render_mode != "RGB":
        bg = torch.cat([bg, bg.new_zeros(C, 1)], -1)
    return bg.contiguous()


def check_inputs(means, quats, scales, opacities, colors, viewmats, Ks, width, height, sh_degree, near, far,
                 tile_size, background, render_mode, camera_model, eps2d) -> tuple[int, int, int, DeferredCheck]:
    """Every argument of ``rasterize``; returns (C, N, D, values) with D the colour channels. ``values``: the
    checks for NaN and inf in the parameters and for their documented ranges, launched, to be read with the
    render's one host sync (``DeferredCheck.resolve``)."""
    C, N = check_projection_inputs(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                                   camera_model, camera_values=False)
    dev = means.device
    if render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode must be one of {', '.join(map(repr, RENDER_MODES))}, got {render_mode!r}")
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or not 1 <= tile_size <= 32:
        raise ValueError(f"tile_size must be an int in [1, 32], got {tile_size!r}")
    if not isinstance(colors, torch.Tensor):
        raise ValueError(f"colors must be a tensor, got {type(colors).__name__}")
    if sh_degree is None:
        if not ((colors.dim() == 2 and colors.shape[0] == N) or (colors.dim() == 3 and colors.shape[:2] == (C, N))):
            raise ValueError(f"colors must be [N, D] or [C, N, D] features (C={C}, N={N}) without sh_degree, got "
                             f"{list(colors.shape)} (SH coefficients [N, K, 3] need sh_degree)")
        D = colors.shape[-1]
        if D < 1:
            raise ValueError("colors must have at least one channel, got D=0")
    else:
        if isinstance(sh_degree, bool) or not isinstance(sh_degree, int) or not 0 <= sh_degree <= MAX_DEGREE:
            raise ValueError(f"sh_degree must be None or an int in [0, {MAX_DEGREE}], got {sh_degree!r}")
        K = (sh_degree + 1) ** 2
        lead = colors.shape[:-2] if colors.dim() >= 2 else None
        if not (lead in ((N,), (C, N)) and colors.shape[-1] == 3 and colors.shape[-2] >= K):
            raise ValueError(f"colors must be SH coefficients [N, K, 3] or [C, N, K, 3] with K >= {K} for "
                             f"sh_degree={sh_degree} (C={C}, N={N}), got {list(colors.shape)}")
        D = 3
    if colors.dtype != torch.float32:
        raise ValueError(f"colors must be torch.float32, got {colors.dtype}")
    if colors.device != dev:
        raise ValueError(f"colors must be on {dev} like means, got {colors.device}")
    if background is not None:
        if not isinstance(background, torch.Tensor):
            raise ValueError(f"background must be a tensor or None, got {type(background).__name__}")
        if tuple(background.shape) not in ((D,), (C, D)):
            raise ValueError(f"background must have shape [{D}] or [{C}, {D}] (colour channels), got "
                             f"{list(background.shape)}")
        if background.dtype != torch.float32 or background.device != dev:
            raise ValueError(f"background must be torch.float32 on {dev}, got {background.dtype} on "
                             f"{background.device}")
    named = [("means", means), ("quats", quats), ("scales", scales), ("opacities", opacities), ("colors", colors)]
    if background is not None:
        named.append(("background", background))
    return C, N, D, DeferredCheck(named, cameras=(viewmats, Ks), bounds=gaussian_bounds(scales, opacities))


def estimate_bytes(C: int, N: int, D: int, width: int, height: int, tile_size: int) -> int:
    """Bytes a forward and backward render allocates before the tile intersections (which come on top: at
    least one 12-byte pair for each Gaussian a camera sees, counted here as one per (camera, Gaussian))."""
    per_pair = 4 * (2 + 3 + 1 + 2 + 1 + D) * 2 + 12  # projection + colours, their gradients, one intersection
    per_pixel = 4 * (D + 1) * 2 + 8  # image + alpha, their gradients, the blend's saved T and last index
    tiles = C * -(-width // tile_size) * -(-height // tile_size) * 4
    return C * N * per_pair + C * width * height * per_pixel + tiles


def free_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CUDA: the driver's count plus what torch's caching allocator holds unused;
    CPU: MemAvailable), None where unknown."""
    if device.type == "cuda":
        # one read of the allocator's counters: torch.cuda.memory_reserved and memory_allocated each flatten
        # and sort all ~170 of them in Python (~0.1 ms a call)
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        cached = stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"] \
            if stats else 0
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type == "cpu" and os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def check_memory(C: int, N: int, D: int, width: int, height: int, tile_size: int, device: torch.device) -> None:
    need = estimate_bytes(C, N, D, width, height, tile_size)
    if device.type == "cuda" and need <= torch.cuda.mem_get_info(device)[0]:
        return  # the driver's free memory covers it alone: the allocator's counters are not needed
    free = free_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"rasterize of {N} Gaussians into {C} camera(s) at {width}x{height} needs at least "
                         f"{need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on {device} (render "
                         "fewer cameras or Gaussians per call, or a smaller image)")
