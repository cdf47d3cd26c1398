"""Scenes: Gaussians (``Splats``), cameras (``Views``), posed images, and the built-in street scene.

``Splats`` keeps gsplat's parameter names and encodings (log scales, logit opacities, SH split into the DC
band ``sh0`` and the rest ``shN``), so a user's gsplat checkpoint maps onto it field by field. A COLMAP
folder loads through ``colmap.py``; ``street_scene`` builds the procedural one (see its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SH_C0 = 0.28209479177387814  # the degree-0 SH basis constant: colour = SH_C0 * sh0 + 0.5
MAX_LOG_SCALE = math.log(float(np.finfo(np.float32).max))  # exp of a larger log-scale is inf in float32


def rgb_to_sh(rgb: Tensor) -> Tensor:
    """The DC coefficient that renders as ``rgb`` (before the +0.5 the renderer adds)."""
    return (rgb - 0.5) / SH_C0


def sh_to_rgb(sh0: Tensor) -> Tensor:
    return sh0 * SH_C0 + 0.5


@dataclass
class Splats:
    """A set of N 3D Gaussians in gsplat's parameterisation (the tensors an optimizer updates)."""

    means: Tensor  # [N, 3] world positions
    scales: Tensor  # [N, 3] log of the per-axis standard deviations
    quats: Tensor  # [N, 4] rotations (w, x, y, z), not necessarily normalised
    opacities: Tensor  # [N] logit of the opacity
    sh0: Tensor  # [N, 1, 3] DC spherical-harmonic band
    shN: Tensor  # [N, K-1, 3] higher bands, K = (sh_degree + 1)^2

    NAMES = ("means", "scales", "quats", "opacities", "sh0", "shN")

    def __post_init__(self) -> None:
        n = self.means.shape[0]
        want = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3)}
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"Splats.{name}: expected shape {list(shape)}, got {list(got)}")
        k = self.shN.shape[1] + 1 if self.shN.dim() == 3 else -1
        if self.shN.dim() != 3 or self.shN.shape[0] != n or self.shN.shape[2] != 3 or math.isqrt(k) ** 2 != k:
            raise ValueError(f"Splats.shN: expected shape [{n}, (d+1)^2-1, 3] for an SH degree d, "
                             f"got {list(self.shN.shape)}")

    @property
    def n(self) -> int:
        return self.means.shape[0]

    @property
    def sh_degree(self) -> int:
        return math.isqrt(self.shN.shape[1] + 1) - 1

    def as_dict(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Tensor]) -> Splats:
        missing = [k for k in cls.NAMES if k not in d]
        if missing:
            raise ValueError(f"Splats: missing tensors {missing} (have {sorted(d)})")
        return cls(**{k: d[k] for k in cls.NAMES})

    def to(self, device: torch.device | str) -> Splats:
        return Splats(**{k: v.to(device) for k, v in self.as_dict().items()})

    def detach(self) -> Splats:
        return Splats(**{k: v.detach() for k, v in self.as_dict().items()})

    def colors(self, sh_degree: int | None = None) -> Tensor:  # [N, K, 3]
        """SH coefficients up to ``sh_degree`` (default: all), the ``colors`` argument of ``rasterize``."""
        k = (self.sh_degree if sh_degree is None else sh_degree) + 1
        return torch.cat([self.sh0, self.shN[:, : k * k - 1]], dim=1)

    def check_values(self, where: str | Path) -> None:
        """ValueError ``<where>: <tensor> of Gaussian i is ...`` for NaN, inf, or a log-scale whose exp overflows
        float32 (the raw parameters may be anything else: scales are logs, opacities logits)."""
        for name, t in self.as_dict().items():
            bad = ~torch.isfinite(t.detach())
            if name == "scales":
                bad |= t.detach() > MAX_LOG_SCALE
            if bool(bad.any()):
                idx = bad.nonzero()[0].tolist()
                value = float(t[tuple(idx)])
                what = "not finite" if not math.isfinite(value) else "a log-scale whose exp overflows float32"
                raise ValueError(f"{where}: {name}{idx} of Gaussian {idx[0]} is {value}, {what}")

    def activated(self) -> tuple[Tensor, Tensor, Tensor]:
        """(quats, scales, opacities) as ``rasterize`` takes them: linear scales, sigmoid opacities."""
        return self.quats, torch.exp(self.scales), torch.sigmoid(self.opacities)


@dataclass
class Views:
    """C pinhole cameras sharing one image size (OpenCV convention: x right, y down, z forward)."""

    viewmats: Tensor  # [C, 4, 4] world -> camera
    Ks: Tensor  # [C, 3, 3]
    width: int
    height: int
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.viewmats.shape[0]
        if self.viewmats.shape != (c, 4, 4) or self.Ks.shape != (c, 3, 3):
            raise ValueError(f"Views: viewmats [C,4,4] and Ks [C,3,3] expected, got {list(self.viewmats.shape)} "
                             f"and {list(self.Ks.shape)}")
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"Views: image size must be positive, got {self.width}x{self.height}")
        if not self.names:
            self.names = [f"view{i:04d}" for i in range(c)]
        if len(self.names) != c:
            raise ValueError(f"Views: {c} cameras but {len(self.names)} names")

    def __len__(self) -> int:
        return self.viewmats.shape[0]

    def subset(self, idx: list[int] | Tensor) -> Views:
        idx = [int(i) for i in idx]
        return Views(self.viewmats[idx], self.Ks[idx], self.width, self.height, [self.names[i] for i in idx])

    def to(self, device: torch.device | str) -> Views:
        return Views(self.viewmats.to(device), self.Ks.to(device), self.width, self.height, list(self.names))

    def centers(self) -> Tensor:  # [C, 3] camera positions in the world
        r, t = self.viewmats[:, :3, :3], self.viewmats[:, :3, 3]
        return -(r.transpose(1, 2) @ t[..., None])[..., 0]


@dataclass
class PosedImages:
    """Training data: cameras, their images, the train/held-out split and an initial point cloud."""

    views: Views
    images: Tensor  # [C, H, W, 3] float in [0, 1], or uint8 (kept on the host, converted per step)
    train: list[int]
    test: list[int]
    points: Tensor  # [P, 3] initial Gaussian centres (SfM points, or a sample of the procedural surfaces)
    points_rgb: Tensor  # [P, 3] their colours in [0, 1]
    background: Tensor  # [3] the colour behind everything (the images' background)
    name: str = "scene"

    def __post_init__(self) -> None:
        c = len(self.views)
        want = (c, self.views.height, self.views.width, 3)
        if tuple(self.images.shape) != want:
            raise ValueError(f"PosedImages.images: expected {list(want)}, got {list(self.images.shape)}")
        if self.images.dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"PosedImages.images: expected uint8 or float32, got {self.images.dtype}")
        if not self.train:
            raise ValueError("PosedImages: no training cameras")
        bad = [i for i in (*self.train, *self.test) if not 0 <= i < c]
        if bad:
            raise ValueError(f"PosedImages: camera index {bad[0]} out of range for {c} cameras")
        if self.points.dim() != 2 or self.points.shape[1] != 3 or self.points.shape[0] == 0:
            raise ValueError(f"PosedImages.points: expected a non-empty [P, 3], got {list(self.points.shape)}")
        if self.points_rgb.shape != self.points.shape:
            raise ValueError(f"PosedImages.points_rgb: expected {list(self.points.shape)}, "
                             f"got {list(self.points_rgb.shape)}")

    def batch(self, idx: list[int], device: torch.device | str) -> Tensor:  # [B, H, W, 3] float32 in [0, 1]
        img = self.images[idx].to(device, non_blocking=True)
        return img.float() / 255.0 if img.dtype == torch.uint8 else img

    @property
    def scene_scale(self) -> float:
        """gsplat's scene scale: 1.1 x the largest distance of a camera centre from their mean."""
        c = self.views.centers()
        return 1.1 * float((c - c.mean(0)).norm(dim=-1).max().clamp_min(1e-6))


def one_image_size(size: tuple[int, int] | None, width: int, height: int, where: object,
                   error: type[Exception]) -> tuple[int, int]:
    """The dataset's image size while its images are read: the first image's (``size`` None until then), which
    each later one must match, as training takes one image size; a mismatch raises ``error`` naming ``where``."""
    if size is not None and size != (width, height):
        raise error(f"{where}: size {width}x{height} differs from the first image's {size[0]}x{size[1]}; "
                    "training needs one image size")
    return width, height


# ---- cameras --------------------------------------------------------------------------------------------

def look_at(eyes: Tensor,  # [C, 3]
            targets: Tensor,  # [C, 3]
            up: tuple[float, float, float] = (0.0, 0.0, 1.0),
            ) -> Tensor:  # [C, 4, 4] world -> camera
    """World-to-camera matrices of cameras at ``eyes`` looking at ``targets`` (z up in the world)."""
    eyes, targets = eyes.double(), targets.double()
    fwd = torch.nn.functional.normalize(targets - eyes, dim=-1)
    u = torch.tensor(up, dtype=torch.float64).expand_as(fwd)
    right = torch.cross(fwd, u, dim=-1)
    if bool((right.norm(dim=-1) < 1e-9).any()):
        raise ValueError("look_at: a camera looks straight along the up axis; its roll is undefined")
    right = torch.nn.functional.normalize(right, dim=-1)
    down = torch.cross(fwd, right, dim=-1)
    rot = torch.stack([right, down, fwd], dim=1)  # rows: camera axes in world coordinates
    m = torch.eye(4, dtype=torch.float64).repeat(eyes.shape[0], 1, 1)
    m[:, :3, :3] = rot
    m[:, :3, 3] = -(rot @ eyes[..., None])[..., 0]
    return m.float()


def intrinsics(width: int, height: int, fov_x_deg: float, n: int = 1) -> Tensor:  # [n, 3, 3]
    """Pinhole intrinsics with square pixels, the principal point at the image centre."""
    if not 1.0 <= fov_x_deg < 179.0:
        raise ValueError(f"intrinsics: fov_x_deg must be in [1, 179), got {fov_x_deg}")
    f = 0.5 * width / math.tan(math.radians(fov_x_deg) / 2)
    k = torch.tensor([[f, 0.0, width / 2.0], [0.0, f, height / 2.0], [0.0, 0.0, 1.0]])
    return k.expand(n, 3, 3).clone()


def camera_focus(viewmats: Tensor) -> tuple[Tensor, float]:  # [C, 4, 4] -> [3], distance
    """Where the cameras look: the point nearest every optical axis (least squares), and the median camera
    distance to it. Cameras whose axes are (nearly) parallel, which meet nowhere, give their mean centre."""
    c2w = torch.linalg.inv(viewmats.double())
    centers, axes = c2w[:, :3, 3], c2w[:, :3, 2]  # OpenCV: z is the viewing direction
    proj = torch.eye(3, dtype=torch.float64)[None] - axes[:, :, None] * axes[:, None, :]  # I - d d^T
    a, b = proj.sum(0), torch.einsum("cij,cj->i", proj, centers)
    focus = torch.linalg.solve(a, b) if float(torch.linalg.cond(a)) < 1e6 else centers.mean(0)
    return focus.float(), float((centers - focus).norm(dim=-1).median())


# ---- rendering a set of splats ---------------------------------------------------------------------------

def render(splats: Splats, viewmats: Tensor, Ks: Tensor, width: int, height: int, *, sh_degree: int | None = None,
           background: Tensor | None = None, absgrad: bool = False, **kwargs) -> tuple[Tensor, Tensor, dict]:
    """``rasterize`` on a ``Splats``: activations applied, SH up to ``sh_degree``. Images [C, H, W, 3]."""
    from warpforge.splat.render import rasterize

    deg = splats.sh_degree if sh_degree is None else min(sh_degree, splats.sh_degree)
    quats, scales, opacities = splats.activated()
    return rasterize(splats.means, quats, scales, opacities, splats.colors(deg), viewmats, Ks, width, height,
                     sh_degree=deg, background=background, absgrad=absgrad, **kwargs)


@torch.no_grad()
def render_views(splats: Splats, views: Views, *, background: Tensor | None = None, sh_degree: int | None = None,
                 chunk: int = 8) -> Tensor:  # [C, H, W, 3]
    """Render every camera of ``views``, ``chunk`` cameras per call (bounds the memory of one call)."""
    out = []
    for i in range(0, len(views), chunk):
        v = views.subset(list(range(i, min(i + chunk, len(views)))))
        img, _, _ = render(splats, v.viewmats, v.Ks, views.width, views.height, sh_degree=sh_degree,
                           background=background)
        out.append(img.clamp(0, 1))
    return torch.cat(out)


def rotmat_to_quat(r: np.ndarray) -> np.ndarray:  # [N, 3, 3] -> [N, 4] (w, x, y, z)
    """Unit quaternions of rotation matrices (Shepperd's method: the largest diagonal term picks the branch)."""
    r = np.asarray(r, dtype=np.float64)
    tr = np.trace(r, axis1=1, axis2=2)
    diag = np.stack([tr, r[:, 0, 0], r[:, 1, 1], r[:, 2, 2]], axis=1)
    pick = diag.argmax(1)
    q = np.empty((r.shape[0], 4))
    for case in range(4):
        m = pick == case
        if not m.any():
            continue
        a = r[m]
        if case == 0:
            s = np.sqrt(1.0 + tr[m]) * 2
            q[m] = np.stack([0.25 * s, (a[:, 2, 1] - a[:, 1, 2]) / s, (a[:, 0, 2] - a[:, 2, 0]) / s,
                             (a[:, 1, 0] - a[:, 0, 1]) / s], 1)
        else:
            i = case - 1
            j, k = (i + 1) % 3, (i + 2) % 3
            s = np.sqrt(1.0 + a[:, i, i] - a[:, j, j] - a[:, k, k]) * 2
            v = np.empty((a.shape[0], 4))
            v[:, 0] = (a[:, k, j] - a[:, j, k]) / s
            v[:, 1 + i] = 0.25 * s
            v[:, 1 + j] = (a[:, j, i] + a[:, i, j]) / s
            v[:, 1 + k] = (a[:, k, i] + a[:, i, k]) / s
            q[m] = v
    return q * np.where(q[:, :1] < 0, -1.0, 1.0)


# ---- the procedural street -------------------------------------------------------------------------------

SKY = (0.62, 0.74, 0.88)
FACADES = ((0.76, 0.60, 0.45), (0.86, 0.82, 0.72), (0.55, 0.60, 0.66), (0.70, 0.44, 0.38), (0.90, 0.89, 0.86),
           (0.60, 0.65, 0.50))
PAINTS = ((0.75, 0.10, 0.10), (0.10, 0.25, 0.70), (0.92, 0.92, 0.92), (0.10, 0.10, 0.12), (0.70, 0.72, 0.75),
          (0.90, 0.75, 0.10))
GLASS = (0.22, 0.27, 0.35)


@dataclass
class StreetConfig:
    """The procedural street: size of the ground truth, its cameras and their split."""

    n: int = 300_000  # ground-truth Gaussians (the exact count varies by a few percent with the layout)
    width: int = 960
    height: int = 540
    n_ring: int = 48  # aerial orbit around the block
    n_drive: int = 48  # along the road at eye height, both directions
    test_every: int = 8  # every 8th camera is held out (gsplat's convention)
    init_fraction: float = 0.1  # initial points, as a fraction of n: surface samples as SfM would triangulate
    fov_deg: float = 70.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 200:
            raise ValueError(f"StreetConfig.n: at least 200 Gaussians, got {self.n}")
        if self.width < 16 or self.height < 16:
            raise ValueError(f"StreetConfig: images of at least 16x16, got {self.width}x{self.height}")
        if self.n_ring < 0 or self.n_drive < 0 or self.n_ring + self.n_drive < 2:
            raise ValueError(f"StreetConfig: at least 2 cameras, got n_ring={self.n_ring} n_drive={self.n_drive}")
        if self.test_every < 2:
            raise ValueError(f"StreetConfig.test_every: at least 2, got {self.test_every}")
        if not 0.0 < self.init_fraction <= 1.0:
            raise ValueError(f"StreetConfig.init_fraction: in (0, 1], got {self.init_fraction}")


@dataclass
class StreetScene:
    """Ground-truth Gaussians and cameras of the procedural street (images are rendered on demand)."""

    config: StreetConfig
    splats: Splats  # the ground truth, SH degree 1
    views: Views
    train: list[int]
    test: list[int]
    points: Tensor  # [P, 3] initial points for training
    points_rgb: Tensor  # [P, 3]
    background: Tensor  # [3] sky

    def posed_images(self, device: torch.device | str = "cpu") -> PosedImages:
        """Render every camera of the ground truth: the images training fits."""
        images = render_views(self.splats.to(device), self.views.to(device), background=self.background.to(device))
        return PosedImages(self.views.to(device), images, list(self.train), list(self.test),
                           self.points.to(device), self.points_rgb.to(device), self.background.to(device),
                           name=f"street(n={self.splats.n})")


class _Builder:
    """Collects surface patches (jittered grids of flat Gaussians) and their colours."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.patches: list[tuple[float, float, Callable[[int], None]]] = []  # (area, weight, sampler(count))
        self.parts: list[tuple[np.ndarray, ...]] = []

    def rect(self, origin, u, v, lu: float, lv: float, weight: float, color, gloss: float = 0.0) -> None:
        """A rectangle origin + a*u + b*v, a in [0, lu], b in [0, lv]; its normal is u x v."""
        o, u, v = (np.asarray(x, dtype=np.float64) for x in (origin, u, v))
        n = np.cross(u, v)

        def sample(count: int) -> None:
            nu = max(1, round(math.sqrt(count * lu / lv)))
            nv = max(1, round(count / nu))
            a = (np.arange(nu)[:, None] + self.rng.uniform(0.15, 0.85, (nu, nv))) / nu * lu
            b = (np.arange(nv)[None, :] + self.rng.uniform(0.15, 0.85, (nu, nv))) / nv * lv
            a, b = a.ravel(), b.ravel()
            pos = o + a[:, None] * u + b[:, None] * v
            frame = np.repeat(np.stack([u, v, n], axis=1)[None], len(a), 0)
            self._add(pos, frame, lu / nu, lv / nv, color(a, b, pos) if callable(color) else color, gloss)

        self.patches.append((lu * lv, weight, sample))

    def cylinder(self, cx: float, cy: float, r: float, z0: float, z1: float, weight: float, color) -> None:
        def sample(count: int) -> None:
            nt = max(3, round(math.sqrt(count * 2 * math.pi * r / (z1 - z0))))
            nh = max(1, round(count / nt))
            t = (np.arange(nt)[:, None] + self.rng.uniform(0.15, 0.85, (nt, nh))) / nt * 2 * math.pi
            h = z0 + (np.arange(nh)[None, :] + self.rng.uniform(0.15, 0.85, (nt, nh))) / nh * (z1 - z0)
            t, h = t.ravel(), h.ravel()
            radial = np.stack([np.cos(t), np.sin(t), np.zeros_like(t)], 1)
            tangent = np.stack([-np.sin(t), np.cos(t), np.zeros_like(t)], 1)
            up = np.broadcast_to([0.0, 0.0, 1.0], radial.shape)
            pos = np.array([cx, cy, 0.0]) + r * radial + h[:, None] * up
            self._add(pos, np.stack([tangent, up, radial], axis=2), 2 * math.pi * r / nt, (z1 - z0) / nh, color, 0.0)

        self.patches.append((2 * math.pi * r * (z1 - z0), weight, sample))

    def box(self, lo, hi, weight: float, color, faces: str = "xXyYZ", gloss: float = 0.0) -> None:
        """Faces of an axis-aligned box: x/X (min/max x), y/Y, z/Z; normals point outwards.

        ``color``: one colour (or colour function of ``rect``) for every face, or a dict face -> colour.
        """
        (x0, y0, z0), (x1, y1, z1) = lo, hi
        dx, dy, dz = x1 - x0, y1 - y0, z1 - z0
        spec = {"x": ((x0, y1, z0), (0, -1, 0), (0, 0, 1), dy, dz), "X": ((x1, y0, z0), (0, 1, 0), (0, 0, 1), dy, dz),
                "y": ((x0, y0, z0), (1, 0, 0), (0, 0, 1), dx, dz), "Y": ((x1, y1, z0), (-1, 0, 0), (0, 0, 1), dx, dz),
                "z": ((x0, y1, z0), (1, 0, 0), (0, -1, 0), dx, dy), "Z": ((x0, y0, z1), (1, 0, 0), (0, 1, 0), dx, dy)}
        for f in faces:
            o, u, v, lu, lv = spec[f]
            self.rect(o, u, v, lu, lv, weight, color[f] if isinstance(color, dict) else color, gloss)

    def _add(self, pos, frame, su: float, sv: float, color, gloss: float) -> None:
        k = len(pos)
        rgb = np.broadcast_to(np.asarray(color, dtype=np.float64), (k, 3))
        rgb = np.clip(rgb + self.rng.normal(0.0, 0.02, (k, 3)), 0.0, 1.0)  # per-Gaussian grain: texture to learn
        thin = 0.08 * min(su, sv)
        scales = np.broadcast_to([0.6 * su, 0.6 * sv, thin], (k, 3))
        self.parts.append((pos, frame, scales, rgb, np.full(k, gloss)))

    def build(self, n: int) -> tuple[np.ndarray, ...]:
        total = sum(a * w for a, w, _ in self.patches)
        for area, weight, sample in self.patches:
            sample(max(4, round(n * area * weight / total)))
        return tuple(np.concatenate(x) for x in zip(*self.parts))


def _street_layout(b: _Builder, rng: np.random.Generator) -> None:
    length, road, walk, depth = 60.0, 4.0, 2.5, 8.0
    x0, x1 = -length / 2, length / 2

    def asphalt(a, bb, p):
        x, y = p[:, 0], p[:, 1]
        white = ((np.abs(y) < 0.12) & (np.mod(x, 6.0) < 3.0)) | ((np.abs(y) > road - 0.35) & (np.abs(y) < road - 0.2))
        white |= (x > 8.0) & (x < 11.0) & (np.mod(y + road, 1.2) < 0.6)  # a crosswalk
        base = np.array([0.24, 0.24, 0.25]) + rng.normal(0, 0.03, (len(x), 1))
        return np.where(white[:, None], np.array([0.92, 0.92, 0.86]), base)

    def paving(a, bb, p):
        seam = (np.mod(p[:, 0], 1.5) < 0.08)[:, None]
        return np.where(seam, np.array([0.45, 0.45, 0.46]), np.array([0.66, 0.65, 0.62]))

    b.rect((x0, -road, 0.0), (1, 0, 0), (0, 1, 0), length, 2 * road, 1.0, asphalt)
    for side in (-1, 1):
        y_curb, y_front = side * road, side * (road + walk)
        lo_y = min(y_curb, y_front)
        b.box((x0, lo_y, 0.0), (x1, lo_y + walk, 0.15), 0.8, {"Z": paving, "y": (0.55,) * 3, "Y": (0.55,) * 3},
              faces="Z" + ("Y" if side < 0 else "y"))
        # buildings: blocks of random width and height, windows on the street side
        x = x0
        while x < x1 - 1.0:
            w = min(float(rng.uniform(7.0, 13.0)), x1 - x)
            h = float(rng.uniform(7.0, 16.0))
            base = np.array(FACADES[int(rng.integers(len(FACADES)))])
            y_in, y_out = y_front, y_front + side * depth
            lo, hi = (x, min(y_in, y_out), 0.0), (x + w, max(y_in, y_out), h)
            front = "y" if side > 0 else "Y"

            def facade(a, bb, p, base=base):
                z = p[:, 2]
                win = (np.mod(a, 2.2) > 0.6) & (np.mod(a, 2.2) < 1.6) & (np.mod(z, 3.0) > 1.0) & (z > 3.0)
                win &= np.mod(z, 3.0) < 2.3
                shop = (z > 0.5) & (z < 2.6) & (np.mod(a, 4.0) > 0.4) & (np.mod(a, 4.0) < 3.4)
                return np.where((win | shop)[:, None], np.array(GLASS), base)

            b.box(lo, hi, 1.2, facade, faces=front)
            b.box(lo, hi, 0.4, (0.34, 0.32, 0.31), faces="Z")
            b.box(lo, hi, 0.35, tuple(0.8 * base), faces="xX" + ("Y" if side > 0 else "y"))
            x += w
        # poles with a lamp head over the road
        for px in np.arange(x0 + 5.0, x1, 10.0):
            py = side * (road + 0.4)
            b.cylinder(float(px), py, 0.08, 0.15, 6.0, 3.0, (0.30, 0.30, 0.33))
            b.box((px - 0.3, py - 0.5 if side > 0 else py, 5.9), (px + 0.3, py if side > 0 else py + 0.5, 6.1),
                  3.0, (1.0, 0.93, 0.65), faces="xXyYzZ")
    # parked cars along both curbs
    xs = []
    slots = np.arange(x0 + 6.0, x1 - 6.0, 9.0)  # parking places along each curb, a car in about 70% of them
    for side in (-1, 1):
        for cx in slots + rng.uniform(-1.5, 1.5, len(slots)):
            if rng.uniform() < 0.3:
                continue
            xs.append((float(cx), side * 3.0))
    for cx, cy in xs:
        paint = PAINTS[int(rng.integers(len(PAINTS)))]
        b.box((cx - 2.1, cy - 0.9, 0.3), (cx + 2.1, cy + 0.9, 1.0), 3.0, paint, faces="xXyYZ", gloss=0.3)
        b.box((cx - 1.2, cy - 0.8, 1.0), (cx + 0.9, cy + 0.8, 1.5), 3.0,
              {"x": GLASS, "X": GLASS, "y": GLASS, "Y": GLASS, "Z": paint}, faces="xXyYZ", gloss=0.3)
        for wx in (cx - 1.3, cx + 1.3):
            for wy, d in ((cy - 0.91, (0, 0, 1)), (cy + 0.91, (0, 0, 1))):
                b.rect((wx - 0.32, wy, 0.02), (1, 0, 0), d, 0.64, 0.6, 3.0, (0.05, 0.05, 0.05))


def street_scene(config: StreetConfig | None = None, **overrides) -> StreetScene:
    """The procedural street, deterministic from ``config.seed``.

    A 60 m road with lane markings and a crosswalk, raised sidewalks, two rows of box buildings with windows,
    lamp poles and parked cars (glossy: SH degree 1), all as flat Gaussians on the surfaces. Cameras: an aerial
    ring around the block and a drive-through along both lanes at eye height; every ``test_every``-th camera
    is held out. ``street_scene(n=3000, width=64, height=48)`` is the tiny version tests train on.
    """
    cfg = config or StreetConfig(**overrides)
    if config is not None and overrides:
        raise ValueError("street_scene: pass a StreetConfig or keyword overrides, not both")
    rng = np.random.default_rng(cfg.seed)
    b = _Builder(rng)
    _street_layout(b, rng)
    pos, frame, scales, rgb, gloss = b.build(cfg.n)
    n = len(pos)
    shn = np.zeros((n, 3, 3))
    shn[:, 1, :] = -gloss[:, None]  # brighter seen from above: a soft sky reflection on paint and glass
    splats = Splats(means=torch.from_numpy(pos).float(), scales=torch.from_numpy(np.log(scales)).float(),
                    quats=torch.from_numpy(rotmat_to_quat(frame)).float(),
                    opacities=torch.full((n,), math.log(0.96 / 0.04)),
                    sh0=rgb_to_sh(torch.from_numpy(rgb).float())[:, None, :], shN=torch.from_numpy(shn).float())
    # cameras: aerial ring, then the drive (forward on one lane, back on the other), yaw swaying to see facades
    t = torch.arange(cfg.n_ring, dtype=torch.float64) / max(cfg.n_ring, 1) * 2 * math.pi
    ring_eye = torch.stack([26.0 * torch.cos(t), 26.0 * torch.sin(t), torch.full_like(t, 32.0)], 1)
    ring_at = torch.tensor([0.0, 0.0, 2.0]).double().expand_as(ring_eye)
    k = torch.arange(cfg.n_drive, dtype=torch.float64)
    back = k >= (cfg.n_drive + 1) // 2
    s = torch.where(back, k - (cfg.n_drive + 1) // 2, k) / max((cfg.n_drive + 1) // 2 - 1, 1)
    dirn = torch.where(back, -1.0, 1.0).double()
    drive_eye = torch.stack([dirn * (-28.0 + 40.0 * s), -1.0 * dirn, torch.full_like(s, 1.6)], 1)  # 18 m+ ahead
    yaw = 0.3 * torch.sin(k * 1.7)
    ahead = torch.stack([10.0 * dirn * torch.cos(yaw), 10.0 * torch.sin(yaw), torch.full_like(s, 0.5)], 1)
    drive_at = drive_eye + ahead
    eyes, ats = torch.cat([ring_eye, drive_eye]), torch.cat([ring_at, drive_at])
    c = eyes.shape[0]
    names = [f"ring{i:03d}" for i in range(cfg.n_ring)] + [f"drive{i:03d}" for i in range(cfg.n_drive)]
    views = Views(look_at(eyes, ats), intrinsics(cfg.width, cfg.height, cfg.fov_deg, c), cfg.width, cfg.height, names)
    test = [i for i in range(c) if i % cfg.test_every == 0]
    train = [i for i in range(c) if i % cfg.test_every != 0]
    # initial points: a random subset of the surface samples with positional and colour noise
    p = max(16, round(cfg.init_fraction * n))
    pick = rng.choice(n, size=min(p, n), replace=False)
    points = pos[pick] + rng.normal(0.0, 0.05, (len(pick), 3))
    points_rgb = np.clip(rgb[pick] + rng.normal(0.0, 0.05, (len(pick), 3)), 0.0, 1.0)
    return StreetScene(cfg, splats, views, train, test, torch.from_numpy(points).float(),
                       torch.from_numpy(points_rgb).float(), torch.tensor(SKY))
