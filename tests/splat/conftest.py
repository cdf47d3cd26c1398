"""Small random scenes for the splat tests, built to reach the pipeline's edge cases.

``make_scene`` places N Gaussians in front of C cameras looking at the origin, and mixes in:
- centres on tile borders (pixel x = 16 or y = 16 of camera 0, the default 16-pixel tiles);
- centres behind camera 0 and inside its near plane (culled there, visible to the others);
- tiny Gaussians (sub-pixel: the eps2d low-pass filter dominates) and huge ones (larger than the image);
- opacities below 1/255 (culled), quaternions of random norm (normalized inside), a degenerate scale (0).
Images are 40x24: with 16-pixel tiles the last tile column and row are partial.
"""

from __future__ import annotations

import math

import pytest
import torch

WIDTH, HEIGHT, TILE = 40, 24, 16
SCENE_KEYS = ("means", "quats", "scales", "opacities", "sh", "viewmats", "Ks")


def look_at(eye: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # [3], [3] -> [4, 4] world -> camera
    f = torch.nn.functional.normalize(target - eye, dim=0)
    r = torch.nn.functional.normalize(torch.linalg.cross(f, torch.tensor([0.0, 1.0, 0.0], dtype=f.dtype)), dim=0)
    d = torch.linalg.cross(f, r)
    R = torch.stack([r, d, f])  # rows: camera x (right), y (down), z (forward) in world coordinates
    m = torch.eye(4, dtype=f.dtype)
    m[:3, :3] = R
    m[:3, 3] = -R @ eye
    return m


def cameras(n: int, width: int = WIDTH, height: int = HEIGHT, dtype=torch.float32):
    """``n`` cameras on an arc around the origin at distance 4, slightly different intrinsics each."""
    views, Ks = [], []
    for i in range(n):
        ang = -0.5 + (1.0 * i / max(n - 1, 1) if n > 1 else 0.5)
        eye = torch.tensor([4.0 * math.sin(ang), 0.3 * i - 0.2, -4.0 * math.cos(ang)], dtype=torch.float64)
        views.append(look_at(eye, torch.zeros(3, dtype=torch.float64)))
        f = 0.8 * width * (1.0 + 0.1 * i)
        Ks.append(torch.tensor([[f, 0, width / 2 + 1.3 * i], [0, f * 1.02, height / 2 - 0.7 * i], [0, 0, 1]],
                               dtype=torch.float64))
    return torch.stack(views).to(dtype), torch.stack(Ks).to(dtype)


def make_scene(n: int = 64, n_cameras: int = 2, seed: int = 0, sh_degree: int = 3, width: int = WIDTH,
               height: int = HEIGHT, dtype=torch.float32) -> dict:
    """A dict of means [N,3], quats [N,4], scales [N,3], opacities [N], sh [N,K,3], viewmats [C,4,4], Ks [C,3,3]
    (float64 math, returned in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    viewmats, Ks = cameras(n_cameras, width, height, torch.float64)
    means = (u(n, 3) * 2 - 1) * torch.tensor([1.6, 1.0, 1.2], dtype=torch.float64)
    log_s = math.log(0.02) + (math.log(0.4) - math.log(0.02)) * u(n, 3)
    scales = torch.exp(log_s)
    quats = torch.randn(n, 4, generator=g, dtype=torch.float64) * (0.3 + 2 * u(n, 1))
    opacities = 0.05 + 0.9 * u(n)
    special = torch.randperm(n, generator=g)
    k = max(1, n // 16)
    cam_from_world = torch.linalg.inv(viewmats[0])

    def at_pixel(ids, px, py, depth):  # centres that project to (px, py) in camera 0 at camera-space depth
        K = Ks[0]
        x = (px - K[0, 2]) / K[0, 0] * depth
        y = (py - K[1, 2]) / K[1, 1] * depth
        p = torch.stack([x, y, depth, torch.ones_like(depth)], -1)
        means[ids] = (cam_from_world @ p.T).T[:, :3]

    groups = [special[i * k:(i + 1) * k] for i in range(8)]
    at_pixel(groups[0], torch.full((k,), float(TILE)), u(k) * height, 3 + 2 * u(k))  # on a tile column border
    at_pixel(groups[1], u(k) * width, torch.full((k,), float(TILE)), 3 + 2 * u(k))  # on a tile row border
    at_pixel(groups[2], u(k) * width, u(k) * height, -1 - u(k))  # behind camera 0
    at_pixel(groups[3], u(k) * width, u(k) * height, 0.004 * u(k))  # inside camera 0's near plane (0.01)
    scales[groups[4]] = 1e-3 * (1 + u(k, 3))  # tiny: smaller than a pixel
    scales[groups[5]] = 1.5 + u(k, 3)  # huge: larger than the image
    opacities[groups[6]] = 0.5 / 255 * u(k)  # below the 1/255 threshold: culled
    scales[groups[7][:1], 2] = 0.0  # a flat Gaussian (one zero scale)
    sh = 0.1 * torch.randn(n, (sh_degree + 1) ** 2, 3, generator=g, dtype=torch.float64)
    sh[:, 0] = 0.6 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    scene = {"means": means, "quats": quats, "scales": scales, "opacities": opacities, "sh": sh,
             "viewmats": viewmats, "Ks": Ks}
    return {key: v.to(dtype) for key, v in scene.items()}


def leaves(scene: dict, keys=("means", "quats", "scales", "opacities", "sh")) -> dict:
    """Copies of the scene's parameters that require grad (cameras stay constants)."""
    return {k: (v.detach().clone().requires_grad_() if k in keys else v) for k, v in scene.items()}


@pytest.fixture
def scene() -> dict:
    """64 Gaussians, 2 cameras, SH degree 3 (see the module docstring for what it mixes in)."""
    return make_scene()


@pytest.fixture
def scene3() -> dict:
    """129 Gaussians (odd, past a 128 block), 3 cameras, SH degree 3."""
    return make_scene(129, 3, seed=1)
