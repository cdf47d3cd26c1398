"""COLMAP sparse models (text or binary) and the posed-image datasets built on them.

Reads ``cameras``, ``images`` and ``points3D`` in either of COLMAP's two formats (the layouts COLMAP's own
``read_write_model`` documents), then ``load_colmap`` turns a folder with ``images/`` and ``sparse/0/`` into
the ``PosedImages`` training takes. Training needs pinhole cameras: undistort other models first with
``colmap image_undistorter`` (gsplat's parser does the same with OpenCV).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from warpforge.splat.scene import PosedImages, Views, one_image_size

# model id -> (name, number of parameters)
CAMERA_MODELS = {
    0: ("SIMPLE_PINHOLE", 3), 1: ("PINHOLE", 4), 2: ("SIMPLE_RADIAL", 4), 3: ("RADIAL", 5), 4: ("OPENCV", 8),
    5: ("OPENCV_FISHEYE", 8), 6: ("FULL_OPENCV", 12), 7: ("FOV", 5), 8: ("SIMPLE_RADIAL_FISHEYE", 4),
    9: ("RADIAL_FISHEYE", 5), 10: ("THIN_PRISM_FISHEYE", 12), 11: ("RAD_TAN_THIN_PRISM_FISHEYE", 16),
}
MODEL_IDS = {name: (i, n) for i, (name, n) in CAMERA_MODELS.items()}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")


class ColmapError(ValueError):
    """A COLMAP folder that cannot be read, with the file and what was wrong."""


@dataclass
class Camera:
    id: int
    model: str
    width: int
    height: int
    params: np.ndarray  # the model's parameters, COLMAP order (PINHOLE: fx, fy, cx, cy)

    def pinhole(self) -> tuple[float, float, float, float]:
        """(fx, fy, cx, cy); raises for a model with non-zero distortion."""
        p = self.params
        if self.model == "SIMPLE_PINHOLE":
            return p[0], p[0], p[1], p[2]
        if self.model == "PINHOLE":
            return p[0], p[1], p[2], p[3]
        if self.model in ("SIMPLE_RADIAL", "RADIAL") and not np.any(p[3:]):
            return p[0], p[0], p[1], p[2]
        if self.model in ("OPENCV", "FULL_OPENCV") and not np.any(p[4:]):
            return p[0], p[1], p[2], p[3]
        raise ColmapError(f"camera {self.id}: model {self.model} with distortion {p[3:].tolist()} is not a pinhole; "
                          "undistort the images first (colmap image_undistorter)")


@dataclass
class Image:
    id: int
    qvec: np.ndarray  # [4] world -> camera rotation (w, x, y, z)
    tvec: np.ndarray  # [3] world -> camera translation
    camera_id: int
    name: str
    xys: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # [K, 2] keypoints
    point3d_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [K], -1: none

    def viewmat(self) -> np.ndarray:  # [4, 4] world -> camera
        w, x, y, z = self.qvec / np.linalg.norm(self.qvec)
        r = np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                      [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                      [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])
        m = np.eye(4)
        m[:3, :3], m[:3, 3] = r, self.tvec
        return m


@dataclass
class Model:
    """A COLMAP sparse reconstruction."""

    cameras: dict[int, Camera]
    images: dict[int, Image]
    point_ids: np.ndarray  # [P] int64
    xyz: np.ndarray  # [P, 3] float64
    rgb: np.ndarray  # [P, 3] uint8
    errors: np.ndarray  # [P] reprojection error
    tracks: list[np.ndarray]  # per point: [T, 2] (image_id, point2d_idx)


# ---- text --------------------------------------------------------------------------------------------

def _lines(path: Path) -> list[tuple[int, str]]:
    return [(i + 1, ln.strip()) for i, ln in enumerate(path.read_text().splitlines())
            if ln.strip() and not ln.lstrip().startswith("#")]


def _read_text(folder: Path) -> Model:
    cams: dict[int, Camera] = {}
    path = folder / "cameras.txt"
    for no, ln in _lines(path):
        try:
            f = ln.split()
            cams[int(f[0])] = _camera(int(f[0]), f[1], int(f[2]), int(f[3]), [float(x) for x in f[4:]], path)
        except (ValueError, IndexError) as e:
            raise ColmapError(f"{path}:{no}: cannot parse camera line {ln!r} ({e})") from None
    images: dict[int, Image] = {}
    path = folder / "images.txt"
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    # Two lines per image; the second (keypoints) may be empty, so blank lines count here.
    while lines and not lines[-1].strip():
        lines.pop()
    first = 0
    while first < len(lines) and not lines[first].strip():
        first += 1
    for i in range(first, len(lines), 2):
        f = lines[i].split()
        try:
            img = Image(int(f[0]), np.array(f[1:5], dtype=np.float64), np.array(f[5:8], dtype=np.float64),
                        int(f[8]), " ".join(f[9:]))
            pts = lines[i + 1].split() if i + 1 < len(lines) else []
            arr = np.array(pts, dtype=np.float64).reshape(-1, 3)
        except (ValueError, IndexError) as e:
            raise ColmapError(f"{path}: cannot parse the image record {lines[i]!r} ({e})") from None
        if not img.name:
            raise ColmapError(f"{path}: image {img.id} has no file name")
        img.xys, img.point3d_ids = arr[:, :2], arr[:, 2].astype(np.int64)
        images[img.id] = img
    path = folder / "points3D.txt"
    ids, xyz, rgb, err, tracks = [], [], [], [], []
    for no, ln in _lines(path):
        f = ln.split()
        try:
            ids.append(int(f[0]))
            xyz.append([float(x) for x in f[1:4]])
            rgb.append([int(x) for x in f[4:7]])
            err.append(float(f[7]))
            tracks.append(np.array(f[8:], dtype=np.int64).reshape(-1, 2))
        except (ValueError, IndexError) as e:
            raise ColmapError(f"{path}:{no}: cannot parse point line ({e})") from None
    return _model(cams, images, ids, xyz, rgb, err, tracks)


# ---- binary ------------------------------------------------------------------------------------------

class _Reader:
    def __init__(self, path: Path) -> None:
        self.path, self.data, self.pos = path, path.read_bytes(), 0

    def read(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ColmapError(f"{self.path}: truncated at byte {self.pos} (needed {size} more)")
        out = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return out

    def array(self, dtype: str, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.pos + size > len(self.data):
            raise ColmapError(f"{self.path}: truncated at byte {self.pos} (needed {size} more)")
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
        self.pos += size
        return out

    def cstring(self) -> str:
        end = self.data.find(b"\0", self.pos)
        if end < 0:
            raise ColmapError(f"{self.path}: unterminated image name at byte {self.pos}")
        s = self.data[self.pos:end].decode("utf-8")
        self.pos = end + 1
        return s


def _read_binary(folder: Path) -> Model:
    r = _Reader(folder / "cameras.bin")
    cams: dict[int, Camera] = {}
    for _ in range(r.read("Q")[0]):
        cid, mid, w, h = r.read("iiQQ")
        if mid not in CAMERA_MODELS:
            raise ColmapError(f"{r.path}: camera {cid} has unknown model id {mid}")
        name, n = CAMERA_MODELS[mid]
        cams[cid] = _camera(cid, name, w, h, list(r.read(f"{n}d")), r.path)
    r = _Reader(folder / "images.bin")
    images: dict[int, Image] = {}
    for _ in range(r.read("Q")[0]):
        iid, qw, qx, qy, qz, tx, ty, tz, cid = r.read("i7di")
        name = r.cstring()
        k = r.read("Q")[0]
        rec = r.array("<f8,<f8,<i8", k)  # x, y, point3D_id per keypoint
        images[iid] = Image(iid, np.array([qw, qx, qy, qz]), np.array([tx, ty, tz]), cid, name,
                            np.stack([rec["f0"], rec["f1"]], 1), rec["f2"].astype(np.int64))
    r = _Reader(folder / "points3D.bin")
    ids, xyz, rgb, err, tracks = [], [], [], [], []
    for _ in range(r.read("Q")[0]):
        pid, x, y, z, cr, cg, cb, e, t = r.read("Q3d3BdQ")
        ids.append(pid)
        xyz.append((x, y, z))
        rgb.append((cr, cg, cb))
        err.append(e)
        tracks.append(r.array("<i4", 2 * t).reshape(-1, 2).astype(np.int64))
    return _model(cams, images, ids, xyz, rgb, err, tracks)


def _camera(cid: int, model: str, w: int, h: int, params: list[float], path: Path) -> Camera:
    if model not in MODEL_IDS:
        raise ColmapError(f"{path}: camera {cid} has unknown model {model!r}")
    want = MODEL_IDS[model][1]
    if len(params) != want:
        raise ColmapError(f"{path}: camera {cid} ({model}) needs {want} parameters, got {len(params)}")
    if w <= 0 or h <= 0:
        raise ColmapError(f"{path}: camera {cid} has image size {w}x{h}")
    return Camera(cid, model, int(w), int(h), np.array(params, dtype=np.float64))


def _model(cams, images, ids, xyz, rgb, err, tracks) -> Model:
    for img in images.values():
        if img.camera_id not in cams:
            raise ColmapError(f"image {img.id} ({img.name}) refers to camera {img.camera_id}, which is not defined")
    return Model(cams, images, np.array(ids, dtype=np.int64), np.array(xyz, dtype=np.float64).reshape(-1, 3),
                 np.array(rgb, dtype=np.uint8).reshape(-1, 3), np.array(err, dtype=np.float64), tracks)


def find_sparse(folder: str | Path) -> Path:
    """The folder holding the model files: FOLDER/sparse/0, FOLDER/sparse or FOLDER itself."""
    root = Path(folder)
    for cand in (root / "sparse" / "0", root / "sparse", root):
        if any((cand / f"cameras.{ext}").is_file() for ext in ("bin", "txt")):
            return cand
    raise ColmapError(f"{root}: no COLMAP model (cameras.bin or cameras.txt in sparse/0, sparse or the folder)")


def read_model(folder: str | Path) -> Model:
    """Read a COLMAP sparse model; binary when ``cameras.bin`` is there, else text."""
    sparse = find_sparse(folder)
    binary = (sparse / "cameras.bin").is_file()
    ext = "bin" if binary else "txt"
    missing = [f"{n}.{ext}" for n in ("cameras", "images", "points3D") if not (sparse / f"{n}.{ext}").is_file()]
    if missing:
        raise ColmapError(f"{sparse}: missing {', '.join(missing)}")
    return _read_binary(sparse) if binary else _read_text(sparse)


# ---- the training dataset ---------------------------------------------------------------------------------

def load_colmap(folder: str | Path, *, downscale: int = 1, test_every: int = 8,
                device: torch.device | str = "cpu") -> PosedImages:
    """Posed images from FOLDER/images (or images_<downscale> when present) and the sparse model.

    Images are sorted by name; every ``test_every``-th is held out (gsplat's split). Pixels stay uint8 on
    the host until a step needs them. All images must share one size after ``downscale``. An image whose size
    differs from its camera's (images resized after reconstruction) keeps its size; the intrinsics are scaled by
    image size / camera size in x and y, as gsplat's parser does (it measures the first image only).
    """
    if downscale < 1:
        raise ValueError(f"load_colmap: downscale must be >= 1, got {downscale}")
    if test_every < 2:
        raise ValueError(f"load_colmap: test_every must be >= 2, got {test_every}")
    root = Path(folder)
    model = read_model(root)
    if not model.images:
        raise ColmapError(f"{root}: the model has no registered images")
    pre = root / f"images_{downscale}"
    img_dir, factor = (pre, 1) if downscale > 1 and pre.is_dir() else (root / "images", downscale)
    if not img_dir.is_dir():
        raise ColmapError(f"{root}: no images/ folder next to the sparse model")
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise ColmapError("reading COLMAP images needs Pillow: pip install 'warpforge[splat]'") from None
    entries = sorted(model.images.values(), key=lambda im: im.name)
    pixels, viewmats, ks, size = [], [], [], None
    for im in entries:
        path = img_dir / im.name
        if not path.is_file():
            raise ColmapError(f"{path}: image {im.id} of the model is missing")
        cam = model.cameras[im.camera_id]
        try:
            with PILImage.open(path) as pil:
                pil = pil.convert("RGB")
                if factor > 1:  # images/ at full size: downscale here (images_N/ is already)
                    pil = pil.resize((pil.width // factor, pil.height // factor), PILImage.Resampling.BICUBIC)
                arr = np.asarray(pil, dtype=np.uint8)
        except OSError as e:  # Pillow's UnidentifiedImageError and truncated files are OSErrors
            raise ColmapError(f"{path}: cannot read the image ({e})") from None
        h, w = arr.shape[:2]
        size = one_image_size(size, w, h, path, ColmapError)
        fx, fy, cx, cy = cam.pinhole()
        sx, sy = w / cam.width, h / cam.height
        ks.append([[fx * sx, 0.0, cx * sx], [0.0, fy * sy, cy * sy], [0.0, 0.0, 1.0]])
        viewmats.append(im.viewmat())
        pixels.append(arr)
    assert size is not None  # the model has images (checked above), and the first one set it
    views = Views(torch.tensor(np.array(viewmats), dtype=torch.float32), torch.tensor(ks, dtype=torch.float32),
                  size[0], size[1], [im.name for im in entries]).to(device)
    c = len(entries)
    test = [i for i in range(c) if i % test_every == 0] if c > 1 else []
    train = [i for i in range(c) if i not in set(test)]
    if len(model.xyz) == 0:
        raise ColmapError(f"{root}: the model has no 3D points to start the Gaussians from")
    return PosedImages(views, torch.from_numpy(np.stack(pixels)), train, test,
                       torch.tensor(model.xyz, dtype=torch.float32, device=device),
                       torch.tensor(model.rgb, dtype=torch.float32, device=device) / 255.0,
                       torch.zeros(3, device=device), name=root.name)
