"""Stage 2: view-dependent colour from spherical harmonics (degrees 0..3), gsplat's basis and constants."""

from __future__ import annotations

import torch

from warpforge.splat import reference as ref

MAX_DEGREE = 3


def spherical_harmonics(degree: int,
                        dirs: torch.Tensor,  # [..., 3] view directions (mean - camera centre), any length
                        coeffs: torch.Tensor,  # [..., K, 3], K >= (degree + 1)^2
                        ) -> torch.Tensor:  # [..., 3]
    """sum_k basis_k(dirs / |dirs|) * coeffs_k over the first (degree + 1)^2 coefficients. The render adds 0.5
    and clamps at 0 (as gsplat's rasterization()); this function does not. Differentiable in dirs and coeffs."""
    check_sh(degree, dirs, coeffs)
    return ref.sh_reference(degree, dirs, coeffs)


def check_sh(degree, dirs, coeffs) -> None:
    if isinstance(degree, bool) or not isinstance(degree, int) or not 0 <= degree <= MAX_DEGREE:
        raise ValueError(f"degree must be an int in [0, {MAX_DEGREE}], got {degree!r}")
    for name, t in (("dirs", dirs), ("coeffs", coeffs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if dirs.dim() < 1 or dirs.shape[-1] != 3:
        raise ValueError(f"dirs must have shape [..., 3], got {list(dirs.shape)}")
    n = (degree + 1) ** 2
    if coeffs.shape[:-2] != dirs.shape[:-1] or coeffs.dim() != dirs.dim() + 1 or coeffs.shape[-1] != 3 \
            or coeffs.shape[-2] < n:
        raise ValueError(f"coeffs must have shape {list(dirs.shape[:-1]) + ['K', 3]} with K >= {n} for degree "
                         f"{degree}, got {list(coeffs.shape)}")
    if coeffs.dtype != dirs.dtype:
        raise ValueError(f"coeffs must be {dirs.dtype} like dirs, got {coeffs.dtype}")
    if coeffs.device != dirs.device:
        raise ValueError(f"coeffs must be on {dirs.device} like dirs, got {coeffs.device}")
