"""Camera paths and MP4 video of a trained scene.

Two paths, each a ``Views`` of N frames:

- ``orbit_path``: a circle around where the scene is, looking at its centre. With training cameras the centre is
  where their axes meet (``scene.camera_focus``), "up" is opposite their mean image-down axis, and the radius and
  height are the median of the farther half of the cameras; without cameras (a PLY) it circles the Gaussians'
  median at twice their spread, 30 degrees above them, world z up (as ``warpforge splat render`` takes
  EYE@TARGET).
- ``train_path``: through the training cameras in their order, positions interpolated linearly and rotations
  by slerp, so the video retraces the capture.

``write_mp4`` encodes RGB frames with the ffmpeg that the ``imageio-ffmpeg`` wheel ships (H.264, yuv420p: even
width and height).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from warpforge.splat.scene import Splats, Views, camera_focus, rotmat_to_quat

PATHS = ("orbit", "train")


def _look(eyes: Tensor, target: Tensor, up: Tensor) -> Tensor:  # [F, 3], [3], [3] -> [F, 4, 4] world -> camera
    fwd = torch.nn.functional.normalize(target[None] - eyes, dim=-1)
    right = torch.nn.functional.normalize(torch.cross(fwd, up.expand_as(fwd), dim=-1), dim=-1)
    down = torch.cross(fwd, right, dim=-1)
    rot = torch.stack([right, down, fwd], 1)
    m = torch.eye(4, dtype=eyes.dtype).repeat(eyes.shape[0], 1, 1)
    m[:, :3, :3] = rot
    m[:, :3, 3] = -(rot @ eyes[..., None])[..., 0]
    return m


def _intrinsics(width: int, height: int, fov_x: float) -> Tensor:  # radians -> [3, 3], square pixels
    f = 0.5 * width / math.tan(0.5 * fov_x)
    return torch.tensor([[f, 0.0, width / 2.0], [0.0, f, height / 2.0], [0.0, 0.0, 1.0]])


class Orbit(NamedTuple):
    """A circle around the scene: its centre, up axis, radius, height above the centre, horizontal fov."""

    center: Tensor  # [3] float64
    up: Tensor  # [3] float64, unit
    radius: float
    lift: float
    fov_deg: float

    def eyes(self, angles: Tensor) -> Tensor:  # [F] radians -> [F, 3] float64
        # two axes of the circle's plane, perpendicular to up
        a = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
        if abs(float(a @ self.up)) > 0.9:
            a = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
        e1 = torch.nn.functional.normalize(a - (a @ self.up) * self.up, dim=0)
        e2 = torch.cross(self.up, e1, dim=0)
        ring = torch.cos(angles)[:, None] * e1 + torch.sin(angles)[:, None] * e2
        return self.center + self.radius * ring + self.lift * self.up


def orbit_around(splats: Splats, views: Views | None, fov_deg: float | None = None) -> Orbit:
    """The orbit of the module docstring: from the training cameras when there are any, else the Gaussians."""
    if views is not None and len(views):
        vm = views.viewmats.double()
        center, _ = camera_focus(vm)
        center = center.double()
        up = torch.nn.functional.normalize(-vm[:, 1, :3].mean(0), dim=0)  # row 1: camera y (down) in the world
        rel = views.centers().double() - center
        far = rel.norm(dim=-1) >= rel.norm(dim=-1).median()  # the farther half: an orbit that sees the scene
        rel = rel[far]  # rather than passing through it when close-ups are mixed in (the street's drive)
        height_up = rel @ up
        radius = float((rel - height_up[:, None] * up).norm(dim=-1).median())
        lift = float(height_up.median())
        own = math.degrees(2 * math.atan(0.5 * views.width / float(views.Ks[0, 0, 0])))
        fov = fov_deg if fov_deg is not None else own
    else:
        m = splats.means.detach().double()
        center = m.median(0).values
        up = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
        spread = float(torch.quantile((m - center)[:, :2].norm(dim=-1), 0.8)) if len(m) else 1.0
        radius = 2.0 * max(spread, 1e-3)
        lift = radius * math.tan(math.radians(30.0))
        fov = fov_deg if fov_deg is not None else 60.0
    return Orbit(center, up, radius, lift, fov)


def orbit_path(splats: Splats, views: Views | None, frames: int, width: int, height: int,
               fov_deg: float | None = None) -> Views:
    """``frames`` cameras on a circle around the scene (see the module docstring), one turn, evenly spaced."""
    orbit = orbit_around(splats, views, fov_deg)
    eyes = orbit.eyes(torch.arange(frames, dtype=torch.float64) / frames * 2 * math.pi)
    ks = _intrinsics(width, height, math.radians(orbit.fov_deg)).expand(frames, 3, 3).clone()
    return Views(_look(eyes, orbit.center, orbit.up).float(), ks, width, height,
                 [f"orbit{i:04d}" for i in range(frames)])


def _slerp(q0: np.ndarray, q1: np.ndarray, t: float) -> np.ndarray:
    d = float(q0 @ q1)
    if d < 0:  # the shorter way round
        q1, d = -q1, -d
    if d > 0.9995:
        q = q0 + t * (q1 - q0)
    else:
        th = math.acos(d)
        q = (math.sin((1 - t) * th) * q0 + math.sin(t * th) * q1) / math.sin(th)
    return q / np.linalg.norm(q)


def _quat_to_rotmat(q: np.ndarray) -> np.ndarray:
    w, x, y, z = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def train_path(views: Views, train: list[int], frames: int, width: int, height: int) -> Views:
    """``frames`` cameras through the training cameras in order: centres interpolated linearly, rotations by
    slerp, intrinsics linearly (rescaled to width x height). The first and last frames are the first and last
    training cameras."""
    idx = list(train)
    vm = views.viewmats[idx].double().numpy()
    rots = vm[:, :3, :3]
    quats = rotmat_to_quat(rots)
    centers = views.centers()[idx].double().numpy()
    ks = views.Ks[idx].double().numpy().copy()
    ks[:, 0] *= width / views.width
    ks[:, 1] *= height / views.height
    mats, kk = [], []
    for f in range(frames):
        u = f * (len(idx) - 1) / max(frames - 1, 1)
        i = min(int(u), len(idx) - 2) if len(idx) > 1 else 0
        t = u - i if len(idx) > 1 else 0.0
        j = min(i + 1, len(idx) - 1)
        r = _quat_to_rotmat(_slerp(quats[i], quats[j], t))
        c = (1 - t) * centers[i] + t * centers[j]
        m = np.eye(4)
        m[:3, :3], m[:3, 3] = r, -r @ c
        mats.append(m)
        kk.append((1 - t) * ks[i] + t * ks[j])
    return Views(torch.tensor(np.array(mats), dtype=torch.float32), torch.tensor(np.array(kk), dtype=torch.float32),
                 width, height, [f"train{i:04d}" for i in range(frames)])


def write_mp4(frames: Iterable[np.ndarray], path: str | Path, width: int, height: int, fps: int = 30) -> Path:
    """Encode [H, W, 3] uint8 frames as H.264 MP4 with imageio-ffmpeg's bundled ffmpeg."""
    try:
        import imageio_ffmpeg
    except ImportError:
        raise ImportError("MP4 output needs imageio-ffmpeg (it ships ffmpeg): pip install 'warpforge[splat]'") \
            from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=fps, codec="libx264",
                                         pix_fmt_in="rgb24", pix_fmt_out="yuv420p", macro_block_size=2,
                                         ffmpeg_log_level="error", output_params=["-movflags", "+faststart"])
    writer.send(None)  # start ffmpeg
    try:
        for frame in frames:
            writer.send(np.ascontiguousarray(frame, dtype=np.uint8))
    finally:
        writer.close()
    return path
