"""Stage 1: project 3D Gaussians into each camera (EWA splatting with gsplat's low-pass filter)."""

from __future__ import annotations

import math

import torch

from warpforge.splat import reference as ref
from warpforge.splat.camera import Projection, camera_model_code, check_cameras

__all__ = ["Projection", "project"]


def project(means: torch.Tensor,  # [N, 3]
            quats: torch.Tensor,  # [N, 4] (w, x, y, z), normalized inside
            scales: torch.Tensor,  # [N, 3] linear
            opacities: torch.Tensor,  # [N] in [0, 1]
            viewmats: torch.Tensor,  # [C, 4, 4] world -> camera
            Ks: torch.Tensor,  # [C, 3, 3]
            width: int, height: int, *, near: float = 0.01, far: float = 1e10, eps2d: float = 0.3,
            camera_model: str = "pinhole") -> Projection:
    """means2d [C,N,2], conics [C,N,3], depths [C,N], radii [C,N,2] int32 (the opacity-aware box; 0 = culled),
    opacities [C,N]. Gradients flow to means, quats, scales and opacities (and through the torch path to
    viewmats and Ks)."""
    check_projection_inputs(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                            camera_model)
    return ref.project_reference(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                                 camera_model)


def check_projection_inputs(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                            camera_model) -> tuple[int, int]:
    """Shapes, dtypes, devices and settings of ``project``; returns (C, N)."""
    if not isinstance(means, torch.Tensor) or means.dim() != 2 or means.shape[-1] != 3:
        raise ValueError("means must be a [N, 3] tensor, got "
                         + (str(list(means.shape)) if isinstance(means, torch.Tensor) else type(means).__name__))
    N, dev = means.shape[0], means.device
    if means.dtype != torch.float32:
        raise ValueError(f"means must be torch.float32, got {means.dtype}")
    for name, t, shape in (("quats", quats, (N, 4)), ("scales", scales, (N, 3)), ("opacities", opacities, (N,))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (N={N} from means), got {list(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev} like means, got {t.device}")
    C = check_cameras(viewmats, Ks, dev)
    for name, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (isinstance(near, (int, float)) and math.isfinite(near) and near > 0):
        raise ValueError(f"near must be a finite number > 0, got {near!r}")
    if not (isinstance(far, (int, float)) and far > near):
        raise ValueError(f"far must be a number > near={near}, got {far!r}")
    if not (isinstance(eps2d, (int, float)) and math.isfinite(eps2d) and eps2d >= 0):
        raise ValueError(f"eps2d must be a finite number >= 0, got {eps2d!r}")
    camera_model_code(camera_model)
    return C, N
