"""COLMAP loader: a small model written here in both of COLMAP's formats (by this test's own writer, which
follows COLMAP's documented layouts), read back, and turned into training data."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from warpforge.splat.colmap import ColmapError, load_colmap, read_model

# two cameras, three images, four points; image 3 sees nothing
CAMERAS = [(1, "PINHOLE", 1, 40, 30, [50.0, 52.0, 20.0, 15.0]), (2, "SIMPLE_PINHOLE", 0, 40, 30, [45.0, 19.5, 14.5])]
QS = [(1.0, 0.0, 0.0, 0.0), (0.9238795, 0.0, 0.3826834, 0.0), (0.7071068, 0.7071068, 0.0, 0.0)]
TS = [(0.0, 0.0, 4.0), (0.5, -0.2, 3.0), (1.0, 2.0, 3.0)]
IMAGES = [(1, QS[0], TS[0], 1, "b.png", [(10.5, 11.5, 7), (3.0, 4.0, -1)]),
          (5, QS[1], TS[1], 2, "a.png", [(1.0, 2.0, 8)]),
          (9, QS[2], TS[2], 1, "c.png", [])]
POINTS = [(7, (0.1, 0.2, 0.3), (255, 0, 10), 0.5, [(1, 0)]), (8, (-1.0, 2.0, 5.0), (1, 2, 3), 1.25, [(5, 0), (1, 1)]),
          (11, (3.0, 3.0, 3.0), (9, 9, 9), 0.0, []), (12, (0.0, -4.0, 1.0), (200, 100, 50), 2.0, [(9, 0)])]


def write_text(d: Path) -> None:
    d.mkdir(parents=True)
    with open(d / "cameras.txt", "w") as f:
        f.write("# Camera list with one line of data per camera:\n#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n")
        for cid, model, _, w, h, params in CAMERAS:
            f.write(f"{cid} {model} {w} {h} " + " ".join(repr(p) for p in params) + "\n")
    with open(d / "images.txt", "w") as f:
        f.write("# Image list with two lines of data per image:\n")
        for iid, q, t, cid, name, pts in IMAGES:
            f.write(f"{iid} {' '.join(map(repr, q))} {' '.join(map(repr, t))} {cid} {name}\n")
            f.write(" ".join(f"{x!r} {y!r} {p}" for x, y, p in pts) + "\n")
    with open(d / "points3D.txt", "w") as f:
        f.write("# 3D point list\n")
        for pid, xyz, rgb, err, track in POINTS:
            f.write(f"{pid} {' '.join(map(repr, xyz))} {' '.join(map(str, rgb))} {err!r} "
                    + " ".join(f"{i} {j}" for i, j in track) + "\n")


def write_binary(d: Path) -> None:
    d.mkdir(parents=True)
    with open(d / "cameras.bin", "wb") as f:
        f.write(struct.pack("<Q", len(CAMERAS)))
        for cid, _, mid, w, h, params in CAMERAS:
            f.write(struct.pack("<iiQQ", cid, mid, w, h) + struct.pack(f"<{len(params)}d", *params))
    with open(d / "images.bin", "wb") as f:
        f.write(struct.pack("<Q", len(IMAGES)))
        for iid, q, t, cid, name, pts in IMAGES:
            f.write(struct.pack("<i4d3di", iid, *q, *t, cid) + name.encode() + b"\0")
            f.write(struct.pack("<Q", len(pts)))
            for x, y, p in pts:
                f.write(struct.pack("<ddq", x, y, p))
    with open(d / "points3D.bin", "wb") as f:
        f.write(struct.pack("<Q", len(POINTS)))
        for pid, xyz, rgb, err, track in POINTS:
            f.write(struct.pack("<Q3d3BdQ", pid, *xyz, *rgb, err, len(track)))
            for i, j in track:
                f.write(struct.pack("<ii", i, j))


def write_images(d: Path, size=(40, 30)) -> dict[str, np.ndarray]:
    from PIL import Image

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for _, _, _, _, name, _ in IMAGES:
        arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(arr).save(d / name)
        out[name] = arr
    return out


@pytest.fixture(params=["text", "binary"])
def colmap_dir(tmp_path, request) -> Path:
    root = tmp_path / "scene"
    (write_text if request.param == "text" else write_binary)(root / "sparse" / "0")
    return root


def test_reads_every_record(colmap_dir):
    m = read_model(colmap_dir)
    assert sorted(m.cameras) == [1, 2]
    c1, c2 = m.cameras[1], m.cameras[2]
    assert (c1.model, c1.width, c1.height) == ("PINHOLE", 40, 30)
    assert c1.params.tolist() == [50.0, 52.0, 20.0, 15.0] and c1.pinhole() == (50.0, 52.0, 20.0, 15.0)
    assert c2.model == "SIMPLE_PINHOLE" and c2.pinhole() == (45.0, 45.0, 19.5, 14.5)
    assert sorted(m.images) == [1, 5, 9]
    im = m.images[1]
    assert im.name == "b.png" and im.camera_id == 1
    assert im.qvec.tolist() == list(QS[0]) and im.tvec.tolist() == [0, 0, 4]
    assert im.xys.tolist() == [[10.5, 11.5], [3.0, 4.0]] and im.point3d_ids.tolist() == [7, -1]
    assert m.images[9].xys.shape == (0, 2)
    assert m.point_ids.tolist() == [7, 8, 11, 12]
    np.testing.assert_array_equal(m.xyz, [p[1] for p in POINTS])
    assert m.rgb.dtype == np.uint8 and m.rgb.tolist() == [list(p[2]) for p in POINTS]
    assert m.errors.tolist() == [0.5, 1.25, 0.0, 2.0]
    assert [t.tolist() for t in m.tracks] == [[[1, 0]], [[5, 0], [1, 1]], [], [[9, 0]]]


def test_viewmat_is_world_to_camera(colmap_dir):
    m = read_model(colmap_dir)
    im = m.images[5]  # 45 degrees about y
    v = im.viewmat()
    a = np.pi / 4
    r = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
    np.testing.assert_allclose(v[:3, :3], r, atol=1e-6)
    np.testing.assert_allclose(v[:3, 3], TS[1])
    # a point the camera projects: world -> camera -> pixel with the PINHOLE/SIMPLE_PINHOLE parameters
    p = np.array([0.3, -0.1, 2.0, 1.0])
    cam = v @ p
    assert cam[2] > 0


def test_load_colmap_dataset(colmap_dir):
    pixels = write_images(colmap_dir / "images")
    data = load_colmap(colmap_dir, test_every=2)
    names = data.views.names
    assert names == ["a.png", "b.png", "c.png"]  # sorted by name, as gsplat's parser
    assert data.test == [0, 2] and data.train == [1]
    assert data.images.dtype == torch.uint8 and tuple(data.images.shape) == (3, 30, 40, 3)
    assert np.array_equal(data.images[1].numpy(), pixels["b.png"])
    np.testing.assert_allclose(data.views.Ks[0].numpy(), [[45, 0, 19.5], [0, 45, 14.5], [0, 0, 1]])
    np.testing.assert_allclose(data.views.Ks[1].numpy(), [[50, 0, 20], [0, 52, 15], [0, 0, 1]])
    assert data.points.shape == (4, 3) and float(data.points_rgb[0, 0]) == pytest.approx(1.0)
    b = data.batch([1], "cpu")
    assert b.dtype == torch.float32 and float(b.max()) <= 1.0
    np.testing.assert_allclose(b[0].numpy() * 255, pixels["b.png"], atol=1e-3)
    # downscale: half-size images and intrinsics
    half = load_colmap(colmap_dir, downscale=2)
    assert (half.views.width, half.views.height) == (20, 15)
    np.testing.assert_allclose(half.views.Ks[1].numpy(), [[25, 0, 10], [0, 26, 7.5], [0, 0, 1]])


def test_bad_folders_say_what_is_wrong(tmp_path):
    with pytest.raises(ColmapError, match="no COLMAP model"):
        read_model(tmp_path)
    d = tmp_path / "t"
    write_text(d)
    (d / "points3D.txt").unlink()
    with pytest.raises(ColmapError, match="missing points3D.txt"):
        read_model(d)
    b = tmp_path / "b"
    write_binary(b)
    (b / "images.bin").write_bytes((b / "images.bin").read_bytes()[:-5])
    with pytest.raises(ColmapError, match="truncated"):
        read_model(b)
    c = tmp_path / "c"
    write_text(c)
    (c / "cameras.txt").write_text("1 OPENCV 40 30 50 50 20 15 0.1 0 0 0\n2 PINHOLE 40 30 1 1 1\n")
    with pytest.raises(ColmapError, match="needs 4 parameters, got 3"):
        read_model(c)
    (c / "cameras.txt").write_text("1 OPENCV 40 30 50 50 20 15 0.1 0 0 0\n2 PINHOLE 40 30 1 1 1 1\n")
    write_images(c / "images")
    with pytest.raises(ColmapError, match="OPENCV with distortion.*image_undistorter"):
        load_colmap(c)
    (c / "cameras.txt").write_text("1 PINHOLE 40 30 50 50 20 15\n2 PINHOLE 40 30 50 50 20 15\n")
    (c / "images" / "b.png").write_bytes(b"not an image")
    with pytest.raises(ColmapError, match="b.png: cannot read the image"):
        load_colmap(c)
    (c / "cameras.txt").write_text("1 PINHOLE 40 30 50 50 20 15\n")
    with pytest.raises(ColmapError, match="refers to camera 2"):
        read_model(c)
