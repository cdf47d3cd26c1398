"""Cameras as the splat pipeline takes them, gsplat's conventions, and what a camera sees of each Gaussian.

- ``viewmats`` [C, 4, 4]: world -> camera (OpenCV axes: x right, y down, z forward), rows ``[R | t]``.
- ``Ks`` [C, 3, 3]: pinhole intrinsics ``[[fx, 0, cx], [0, fy, cy], [0, 0, 1]]`` in pixels; pixel (i, j) covers
  [i, i + 1) x [j, j + 1), its centre at (i + 0.5, j + 0.5).
- ``camera_model``: "pinhole" (perspective) or "fisheye" (equidistant: a ray at angle theta from the optical
  axis lands at radius f * theta from the principal point, gsplat's ``fisheye_proj``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CAMERA_MODELS = ("pinhole", "fisheye")


class Projection(NamedTuple):
    """The projected Gaussians, one row per (camera, Gaussian). Culled ones have radii (0, 0) and zeros in
    means2d, conics and depths (and no gradient)."""

    means2d: torch.Tensor  # [C, N, 2] pixel coordinates of the projected centre
    conics: torch.Tensor  # [C, N, 3] (a, b, c) of the inverse 2D covariance (eps2d added first)
    depths: torch.Tensor  # [C, N] camera-space z
    radii: torch.Tensor  # [C, N, 2] int32 half-extents of the opacity-aware bound, (0, 0) = culled
    opacities: torch.Tensor  # [C, N] the opacity each camera blends with


def camera_model_code(camera_model: str) -> int:
    """0 for "pinhole", 1 for "fisheye" (the kernels' constexpr); anything else is a ValueError."""
    if camera_model not in CAMERA_MODELS:
        raise ValueError(f"camera_model must be one of {', '.join(map(repr, CAMERA_MODELS))}, got {camera_model!r}")
    return CAMERA_MODELS.index(camera_model)


def camera_centers(viewmats: torch.Tensor) -> torch.Tensor:  # [C, 4, 4] -> [C, 3]
    """World position of each camera (as gsplat: the translation of the inverse view matrix). ``inv_ex``: no host
    sync for the singularity check (``camera_problems`` reports a singular view matrix)."""
    return torch.linalg.inv_ex(viewmats)[0][:, :3, 3]


def view_inverse_column(viewmats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [C,4,4] -> [C,3], [C]
    """The camera centres (the inverse's translation column) and the determinants, by cofactors along the last
    row: the formula ``checks``' kernel evaluates, so the torch checks flag a singular view matrix (determinant 0,
    or a centre that is not finite) where the kernel does."""
    v = viewmats.detach()
    # the 3x3 minors of rows 0..2 leaving out column j, as row0 . (row1 x row2)
    a, b, c = v[:, :3, _MINOR_COLUMNS].unbind(1)  # [C, 4, 3] each
    cof = (a * torch.linalg.cross(b, c, dim=-1)).sum(-1) * v.new_tensor([-1.0, 1.0, -1.0, 1.0])
    det = (v[:, 3] * cof).sum(-1)
    return cof[:, :3] / det[:, None], det


_MINOR_COLUMNS = ((1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2))


def check_cameras(viewmats, Ks, device: torch.device, dtype: torch.dtype = torch.float32, *,
                  values: bool = True) -> int:
    """Validate [C,4,4] view matrices and [C,3,3] intrinsics (finite, positive focal lengths); returns C.
    ``values=False`` checks shapes, dtypes and devices only: the caller folds :func:`camera_problems` into
    its own single host sync."""
    for name, t, tail in (("viewmats", viewmats, (4, 4)), ("Ks", Ks, (3, 3))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape[1:]) != tail:
            raise ValueError(f"{name} must have shape [C, {tail[0]}, {tail[1]}], got {list(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like means, got {t.device}")
    if viewmats.shape[0] != Ks.shape[0]:
        raise ValueError(f"viewmats and Ks must have the same number of cameras, got {viewmats.shape[0]} "
                         f"and {Ks.shape[0]}")
    if viewmats.shape[0] == 0:
        raise ValueError("viewmats must hold at least one camera, got C=0")
    if values and bool(camera_problems(viewmats, Ks)):  # one host sync; the message is found only on failure
        raise_camera_problem(viewmats, Ks)
    return viewmats.shape[0]


def camera_problems(viewmats: torch.Tensor, Ks: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on the cameras' device, True when a value is non-finite, a focal length is not
    positive or a view matrix is singular (no host sync: the caller reads it with its other checks)."""
    f = torch.stack([Ks[:, 0, 0], Ks[:, 1, 1]], -1).detach()
    return (~torch.isfinite(viewmats.detach()).all()) | (~torch.isfinite(Ks.detach()).all()) | (f <= 0).any() \
        | _singular(viewmats).any()


def raise_camera_problem(viewmats: torch.Tensor, Ks: torch.Tensor) -> None:
    """ValueError naming the camera value :func:`camera_problems` flagged (returns if there is none)."""
    for name, t in (("viewmats", viewmats), ("Ks", Ks)):
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            raise ValueError(f"{name} has a non-finite value at index {_first(bad)}")
    f = torch.stack([Ks[:, 0, 0], Ks[:, 1, 1]], -1).detach()
    if bool((f <= 0).any()):
        c = int((f <= 0).any(-1).nonzero()[0, 0])
        raise ValueError(f"Ks[{c}] must have positive focal lengths fx, fy, got {f[c].tolist()}")
    singular = _singular(viewmats)
    if bool(singular.any()):
        raise ValueError(f"viewmats[{int(singular.nonzero()[0, 0])}] is singular (a world -> camera matrix must be "
                         "invertible)")


def _singular(viewmats: torch.Tensor) -> torch.Tensor:  # [C] bool
    """No camera centre: a zero determinant, or one so small that the centre overflows."""
    centres, det = view_inverse_column(viewmats)
    return (det == 0) | ~torch.isfinite(centres).all(-1)


def _first(mask: torch.Tensor) -> list[int]:
    """Index of the first True of a boolean tensor, as a list."""
    return mask.nonzero()[0].tolist()
