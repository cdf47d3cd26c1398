"""Random screen-space Gaussians (the inputs of tile intersection and blending) for the raster tests."""

from __future__ import annotations

import math

import torch


def splats_2d(C: int, N: int, width: int, height: int, *, D: int = 3, seed: int = 0, scale=(0.4, 9.0),
              pad: float = 12.0, culled: float = 0.1, tie_depths: bool = True, min_opacity: float = 0.005) -> dict:
    """Screen-space Gaussians as projection hands them over: means2d [C,N,2], conics [C,N,3] (inverse of a
    2D covariance that includes the 0.3 px^2 low-pass), opacities [C,N], depths [C,N], radii [C,N,2] int32
    (the opacity-aware box, (0, 0) for a random ``culled`` fraction), colors [C,N,D]."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    means2d = torch.stack([u(C, N) * (width + 2 * pad) - pad, u(C, N) * (height + 2 * pad) - pad], -1)
    lo, hi = math.log(scale[0]), math.log(scale[1])
    s = torch.exp(lo + (hi - lo) * u(C, N, 2))
    th = u(C, N) * math.pi
    cs, sn = torch.cos(th), torch.sin(th)
    cxx = cs * cs * s[..., 0] ** 2 + sn * sn * s[..., 1] ** 2 + 0.3
    cyy = sn * sn * s[..., 0] ** 2 + cs * cs * s[..., 1] ** 2 + 0.3
    cxy = cs * sn * (s[..., 0] ** 2 - s[..., 1] ** 2)
    det = cxx * cyy - cxy * cxy
    conics = torch.stack([cyy / det, -cxy / det, cxx / det], -1)
    opacities = min_opacity + (1.0 - min_opacity) * u(C, N) ** 0.5
    radii = opacity_aware_radii(conics, opacities)
    off = ((means2d[..., 0] + radii[..., 0] <= 0) | (means2d[..., 0] - radii[..., 0] >= width)
           | (means2d[..., 1] + radii[..., 1] <= 0) | (means2d[..., 1] - radii[..., 1] >= height))
    cull = off | (u(C, N) < culled) | (opacities < 1 / 255)
    radii[cull] = 0
    depths = 0.5 + 9.5 * u(C, N)
    if tie_depths and N >= 8:  # equal depths: the sort must keep such pairs in index order
        depths[:, N // 2: N // 2 + 4] = depths[:, N // 2: N // 2 + 1]
    colors = u(C, N, D)
    return dict(means2d=means2d, conics=conics, opacities=opacities, depths=depths, radii=radii, colors=colors)


def opacity_aware_radii(conics: torch.Tensor, opacities: torch.Tensor) -> torch.Tensor:
    """Half-extents [..., 2] int32 of the box of the ellipse where opacity * exp(power) = 1/255."""
    det = conics[..., 0] * conics[..., 2] - conics[..., 1] ** 2
    cxx, cyy = conics[..., 2] / det, conics[..., 0] / det
    extend = torch.sqrt(2.0 * torch.log(torch.clamp(opacities * 255.0, min=1.0)))
    return torch.stack([torch.ceil(extend * cxx.sqrt()), torch.ceil(extend * cyy.sqrt())], -1).int()
