"""nerfstudio and Blender (NeRF-synthetic) scenes: a ``transforms.json`` beside the images.

Two layouts, one reader:

- nerfstudio (``ns-process-data``): FOLDER/transforms.json with intrinsics ``fl_x fl_y cx cy w h`` at the top
  (a frame may override any of them), frames ``{"file_path": "images/frame_00001.png", "transform_matrix": ...}``
  and optionally ``ply_file_path``, the SfM points to start the Gaussians from. Every ``test_every``-th image
  (sorted by name) is held out, as for COLMAP.
- Blender: FOLDER/transforms_train.json and transforms_test.json with ``camera_angle_x`` (the horizontal field of
  view in radians) and ``file_path`` without an extension (``./train/r_0`` -> ``train/r_0.png``); the test file's
  frames are the held-out cameras. RGBA images are composited on white, the background training then uses.

``transform_matrix`` is camera-to-world in OpenGL axes (x right, y up, z backwards); ours are world-to-camera in
OpenCV axes (x right, y down, z forward), so each one is flipped in y and z, then inverted. Paths are relative
to the json file. Images whose size differs from the ``w``/``h`` the file declares rescale the intrinsics by
the ratio (as the COLMAP loader does) rather than being stretched. Without a point cloud, the Gaussians start at
random points in a cube around where the cameras look (3DGS starts Blender scenes from a random cube of
+-1.3, which this rule reproduces for cameras at distance 4).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from warpforge.splat.scene import PosedImages, Views, one_image_size, camera_focus

OPENGL_TO_OPENCV = np.diag([1.0, -1.0, -1.0, 1.0])  # flips camera y and z: right-multiplied on camera-to-world
INTRINSIC_KEYS = ("fl_x", "fl_y", "cx", "cy", "w", "h", "camera_angle_x", "camera_angle_y", "camera_model",
                  "k1", "k2", "k3", "k4", "p1", "p2")
DISTORTION_KEYS = ("k1", "k2", "k3", "k4", "p1", "p2")
CUBE_FRACTION = 0.33  # half-size of the random-init cube, x the median camera distance to the focus


class TransformsError(ValueError):
    """A transforms.json scene that cannot be read, with the file and what was wrong."""


def find_transforms(path: str | Path) -> list[tuple[Path, bool]] | None:
    """The json files of a scene and whether each holds held-out cameras: [(transforms.json, False)] or
    [(transforms_train.json, False), (transforms_test.json, True)]; None when ``path`` is neither."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".json":
        return [(p, False)]
    if (p / "transforms.json").is_file():
        return [(p / "transforms.json", False)]
    if (p / "transforms_train.json").is_file():
        test = p / "transforms_test.json"
        return [(p / "transforms_train.json", False)] + ([(test, True)] if test.is_file() else [])
    return None


def _read_json(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TransformsError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("frames"), list) or not meta["frames"]:
        raise TransformsError(f"{path}: expected an object with a non-empty 'frames' list")
    return meta


def _image_path(json_path: Path, file_path: str, downscale: int) -> tuple[Path, int]:
    """The image file of a frame and the factor still to divide its size by: nerfstudio's ``images_N/`` beside
    ``images/`` when it exists (already downscaled), else the file itself. Blender paths lack the extension."""
    p = (json_path.parent / file_path).resolve()
    if not p.suffix:
        p = p.with_suffix(".png")
    if downscale > 1 and p.parent.name == "images":
        pre = p.parent.with_name(f"images_{downscale}") / p.name
        if pre.is_file():
            return pre, 1
    return p, downscale


def _load_image(path: Path, factor: int) -> tuple[np.ndarray, bool]:
    """[H, W, 3 or 4] uint8 (alpha kept), downscaled by ``factor``; and whether it had alpha."""
    try:
        from PIL import Image
    except ImportError:
        raise TransformsError("reading images needs Pillow: pip install 'warpforge[splat]'") from None
    if not path.is_file():
        raise TransformsError(f"{path}: image missing")
    try:
        with Image.open(path) as pil:
            alpha = pil.mode in ("RGBA", "LA", "PA") or "transparency" in pil.info
            pil = pil.convert("RGBA" if alpha else "RGB")
            if factor > 1:
                pil = pil.resize((pil.width // factor, pil.height // factor), Image.Resampling.BICUBIC)
            return np.asarray(pil, dtype=np.uint8), alpha
    except OSError as e:
        raise TransformsError(f"{path}: cannot read the image ({e})") from None


def _intrinsics(path: Path, meta: dict, frame: dict, width: int, height: int, downscale: int) -> list[list[float]]:
    """K of a frame for its image as loaded (width x height): the declared intrinsics, the frame's overriding the
    file's, scaled by loaded size / declared size (undeclared: the loaded size x ``downscale``)."""
    cam = {k: frame.get(k, meta.get(k)) for k in INTRINSIC_KEYS}
    model = cam["camera_model"] or "OPENCV"
    if model != "OPENCV":
        raise TransformsError(f"{path}: camera_model {model} is not a pinhole; undistort the images first")
    dist = {k: cam[k] for k in DISTORTION_KEYS if cam[k]}
    if dist:
        raise TransformsError(f"{path}: distortion {dist} is not supported; undistort the images first "
                              "(ns-process-data or colmap image_undistorter)")
    # the size the intrinsics refer to: declared, else the image's own at full resolution
    w0 = float(cam["w"] or width * downscale)
    h0 = float(cam["h"] or height * downscale)
    if cam["fl_x"] is not None:
        fx = float(cam["fl_x"])
        fy = float(cam["fl_y"] if cam["fl_y"] is not None else fx)
    elif cam["camera_angle_x"] is not None:
        fx = 0.5 * w0 / math.tan(0.5 * float(cam["camera_angle_x"]))
        fy = 0.5 * h0 / math.tan(0.5 * float(cam["camera_angle_y"])) if cam["camera_angle_y"] else fx
    else:
        raise TransformsError(f"{path}: no focal length (fl_x, or camera_angle_x)")
    cx = float(cam["cx"] if cam["cx"] is not None else w0 / 2)
    cy = float(cam["cy"] if cam["cy"] is not None else h0 / 2)
    if not (fx > 0 and fy > 0 and w0 > 0 and h0 > 0):
        raise TransformsError(f"{path}: focal lengths and size must be positive, got fl_x={fx} fl_y={fy} "
                              f"w={w0} h={h0}")
    sx, sy = width / w0, height / h0
    return [[fx * sx, 0.0, cx * sx], [0.0, fy * sy, cy * sy], [0.0, 0.0, 1.0]]


def _viewmat(path: Path, index: int, frame: dict) -> np.ndarray:
    """World -> camera (OpenCV axes) from an OpenGL camera-to-world ``transform_matrix``."""
    try:
        c2w = np.array(frame["transform_matrix"], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise TransformsError(f"{path}: frame {index} has no 4x4 transform_matrix") from None
    if c2w.shape == (3, 4):
        c2w = np.vstack([c2w, [0.0, 0.0, 0.0, 1.0]])
    if c2w.shape != (4, 4) or not np.isfinite(c2w).all() or abs(np.linalg.det(c2w[:3, :3])) < 1e-6:
        raise TransformsError(f"{path}: frame {index}: transform_matrix must be a finite, invertible 4x4")
    return np.linalg.inv(c2w @ OPENGL_TO_OPENCV)


def _ply_points(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(xyz [P, 3], rgb [P, 3] in [0, 1]) of a point-cloud PLY (nerfstudio's sparse_pc.ply)."""
    try:
        import plyfile
    except ImportError:
        raise TransformsError("reading ply_file_path needs plyfile: pip install 'warpforge[splat]'") from None
    try:
        v = plyfile.PlyData.read(str(path))["vertex"].data
        xyz = np.stack([v["x"], v["y"], v["z"]], 1).astype(np.float64)
    except Exception as e:  # noqa: BLE001 - plyfile raises several types for a malformed file
        raise TransformsError(f"{path}: not a readable point cloud ({e})") from None
    names = v.dtype.names
    rgb = (np.stack([v["red"], v["green"], v["blue"]], 1) / 255.0 if {"red", "green", "blue"} <= set(names)
           else np.full_like(xyz, 0.5))
    if len(xyz) == 0 or not np.isfinite(xyz).all():
        raise TransformsError(f"{path}: the point cloud is empty or has non-finite points")
    return xyz, rgb


def random_cube_points(viewmats: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uniform points (grey) in a cube centred where the cameras look (``scene.camera_focus``), half-size
    CUBE_FRACTION x the median camera distance to it."""
    focus, dist = camera_focus(torch.as_tensor(viewmats))
    half = CUBE_FRACTION * (dist or 1.0)
    rng = np.random.default_rng(seed)
    return focus.double().numpy() + rng.uniform(-half, half, (n, 3)), np.full((n, 3), 0.5)


def load_transforms(path: str | Path, *, downscale: int = 1, test_every: int = 8, init_points: int = 100_000,
                    seed: int = 0, device: torch.device | str = "cpu") -> PosedImages:
    """Posed images of a nerfstudio or Blender scene (``path``: the json file or its folder)."""
    if downscale < 1:
        raise ValueError(f"load_transforms: downscale must be >= 1, got {downscale}")
    if test_every < 2:
        raise ValueError(f"load_transforms: test_every must be >= 2, got {test_every}")
    files = find_transforms(path)
    if files is None:
        raise TransformsError(f"{path}: no transforms.json or transforms_train.json")
    frames = []  # (json path, meta, frame, held out)
    for jpath, held_out in files:
        meta = _read_json(jpath)
        frames += [(jpath, meta, f, held_out) for f in meta["frames"]]
    pixels, viewmats, ks, names, held, size, any_alpha = [], [], [], [], [], None, False
    for i, (jpath, meta, frame, held_out) in enumerate(frames):
        if not isinstance(frame, dict) or not isinstance(frame.get("file_path"), str):
            raise TransformsError(f"{jpath}: frame {i} has no file_path")
        img_path, factor = _image_path(jpath, frame["file_path"], downscale)
        arr, alpha = _load_image(img_path, factor)
        h, w = arr.shape[:2]
        size = one_image_size(size, w, h, img_path, TransformsError)
        any_alpha |= alpha
        pixels.append(arr)
        ks.append(_intrinsics(jpath, meta, frame, w, h, downscale))
        viewmats.append(_viewmat(jpath, i, frame))
        names.append(str(img_path.relative_to(jpath.parent.resolve())) if img_path.is_relative_to(
            jpath.parent.resolve()) else img_path.name)
        held.append(held_out)
    assert size is not None  # _read_json refuses an empty frames list, so the first frame set it
    # RGBA (Blender renders on transparency): composite on white, which is then the training background
    background = np.ones(3) if any_alpha else np.zeros(3)
    rgb = []
    for arr in pixels:
        if arr.shape[2] == 4:
            a = arr[..., 3:].astype(np.float32) / 255.0
            arr = np.clip(arr[..., :3] * a + 255.0 * background * (1 - a) + 0.5, 0, 255).astype(np.uint8)
        rgb.append(arr)
    order = sorted(range(len(frames)), key=lambda j: (held[j], names[j]))  # sorted by name, as COLMAP
    viewmats = np.array(viewmats)[order]
    views = Views(torch.tensor(viewmats, dtype=torch.float32), torch.tensor(np.array(ks)[order], dtype=torch.float32),
                  size[0], size[1], [names[j] for j in order]).to(device)
    c = len(order)
    if any(held):
        test = [k for k, j in enumerate(order) if held[j]]
    else:
        test = [k for k in range(c) if k % test_every == 0] if c > 1 else []
    train = [k for k in range(c) if k not in set(test)]
    meta0, json0 = frames[0][1], files[0][0]
    if meta0.get("ply_file_path"):
        xyz, prgb = _ply_points((json0.parent / meta0["ply_file_path"]).resolve())
    else:
        xyz, prgb = random_cube_points(viewmats, init_points, seed)
    name = json0.parent.resolve().name
    return PosedImages(views, torch.from_numpy(np.stack([rgb[j] for j in order])), train, test,
                       torch.tensor(xyz, dtype=torch.float32, device=device),
                       torch.tensor(prgb, dtype=torch.float32, device=device),
                       torch.tensor(background, dtype=torch.float32, device=device), name=name)
