"""warpforge.splat: a differentiable 3D Gaussian Splatting rasterizer (Triton on CUDA, torch on CPU).

>>> from warpforge.splat import rasterize
>>> images, alphas, meta = rasterize(means, quats, scales, opacities, sh, viewmats, Ks, 1920, 1080, sh_degree=3)

``rasterize`` takes gsplat's ``rasterization()`` arguments and conventions; the stages it runs are public too
(``warpforge.splat.project.project``, whose name the submodule takes here, ``spherical_harmonics``,
``intersect_tiles``, ``tile_offsets``, ``rasterize_to_pixels``), and ``render_reference`` is the dense torch
render the tests hold it to. Names load on first use, so
``import warpforge.splat`` stays cheap (no torch, no Triton until a name is touched).
"""

from __future__ import annotations

from warpforge._lazy import lazy_exports

_LAZY = {
    "rasterize": "render",
    "Projection": "camera",
    "spherical_harmonics": "sh",
    "intersect_tiles": "tiles", "tile_offsets": "tiles",
    "rasterize_to_pixels": "blend",
    "render_reference": "reference",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
