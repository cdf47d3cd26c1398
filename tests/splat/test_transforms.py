"""nerfstudio / Blender ``transforms.json`` scenes: the street's cameras written in both layouts (OpenGL
camera-to-world, relative image paths) read back to our world-to-camera OpenCV matrices and pixel intrinsics;
RGBA on white, images_N/, a point cloud from ply_file_path, errors; and a few training steps through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from warpforge.splat.scene import street_scene
from warpforge.splat.transforms import TransformsError, load_transforms, random_cube_points

W, H = 32, 24


@pytest.fixture(scope="module")
def street():
    s = street_scene(n=1200, width=W, height=H, n_ring=5, n_drive=5)
    return s, s.posed_images()


def _c2w_opengl(viewmat: torch.Tensor) -> list[list[float]]:
    c2w = torch.linalg.inv(viewmat.double()) @ torch.diag(torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64))
    return c2w.tolist()


def _png(path: Path, img: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).save(path)


def write_nerfstudio(root: Path, street, data, *, w_decl=W, h_decl=H, ply=False) -> Path:
    v = street.views
    frames = []
    for i, name in enumerate(v.names):
        _png(root / "images" / f"{name}.png", (data.images[i].numpy() * 255 + 0.5).astype(np.uint8))
        frames.append({"file_path": f"images/{name}.png", "transform_matrix": _c2w_opengl(v.viewmats[i])})
    k = v.Ks[0] * torch.tensor([[w_decl / W], [h_decl / H], [1.0]])  # intrinsics of the declared size
    meta = {"camera_model": "OPENCV", "fl_x": float(k[0, 0]), "fl_y": float(k[1, 1]), "cx": float(k[0, 2]),
            "cy": float(k[1, 2]), "w": w_decl, "h": h_decl, "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0,
            "frames": frames}
    if ply:
        import plyfile

        rec = np.zeros(len(street.points), dtype=[(c, "f4") for c in "xyz"] + [(c, "u1") for c in
                                                                               ("red", "green", "blue")])
        for j, c in enumerate("xyz"):
            rec[c] = street.points[:, j].numpy()
        rec["red"] = 255
        plyfile.PlyData([plyfile.PlyElement.describe(rec, "vertex")]).write(str(root / "sparse_pc.ply"))
        meta["ply_file_path"] = "sparse_pc.ply"
    (root / "transforms.json").write_text(json.dumps(meta))
    return root


def test_nerfstudio_poses_intrinsics_and_points(tmp_path, street):
    s, data = street
    root = write_nerfstudio(tmp_path / "ns", s, data, ply=True)
    got = load_transforms(root, test_every=4)
    names = [f"images/{n}.png" for n in s.views.names]
    assert got.views.names == sorted(names)
    order = [names.index(n) for n in got.views.names]
    torch.testing.assert_close(got.views.viewmats, s.views.viewmats[order], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.views.Ks, s.views.Ks[order], atol=1e-4, rtol=0)
    assert (got.views.width, got.views.height) == (W, H) and got.test == [0, 4, 8] and len(got.train) == 7
    assert got.points.shape == s.points.shape and torch.equal(got.points_rgb[:, 0], torch.ones(len(s.points)))
    assert torch.equal(got.background, torch.zeros(3))
    torch.testing.assert_close(got.batch([0], "cpu")[0], data.images[order[0]], atol=1 / 255, rtol=0)
    # the same file through a path to the json itself
    assert load_transforms(root / "transforms.json").views.names == got.views.names


def test_images_smaller_than_declared_rescale_intrinsics(tmp_path, street):
    """transforms.json declares 64x48 with 64x48 intrinsics, the images are 32x24: K is halved, no stretch."""
    s, data = street
    root = write_nerfstudio(tmp_path / "ns", s, data, w_decl=2 * W, h_decl=2 * H)
    got = load_transforms(root)
    assert (got.views.width, got.views.height) == (W, H)
    torch.testing.assert_close(got.views.Ks[0], s.views.Ks[0], atol=1e-4, rtol=0)
    # --downscale 2 reads images_2/ when it is there
    for name in s.views.names:
        _png(root / "images_2" / f"{name}.png", np.zeros((H // 2, W // 2, 3), np.uint8))
    half = load_transforms(root, downscale=2)
    assert (half.views.width, half.views.height) == (W // 2, H // 2) and int(half.images.max()) == 0
    torch.testing.assert_close(half.views.Ks[0, :2], s.views.Ks[0, :2] / 2, atol=1e-4, rtol=0)


def test_blender_layout_rgba_on_white(tmp_path, street):
    s, data = street
    root = tmp_path / "lego"
    fov = math.radians(70.0)  # street_scene's horizontal field of view
    for split, idx in (("train", range(0, 7)), ("test", range(7, 10))):
        frames = []
        for i in idx:
            rgba = np.zeros((H, W, 4), np.uint8)
            rgba[..., :3] = 200
            rgba[: H // 2, :, 3] = 255  # top half opaque grey, bottom transparent
            _png(root / split / f"r_{i}.png", rgba)
            frames.append({"file_path": f"./{split}/r_{i}", "rotation": 0.1,
                           "transform_matrix": _c2w_opengl(s.views.viewmats[i])})
        (root / f"transforms_{split}.json").write_text(json.dumps({"camera_angle_x": fov, "frames": frames}))
    got = load_transforms(root)
    assert len(got.train) == 7 and got.test == [7, 8, 9] and got.views.names[7] == "test/r_7.png"
    torch.testing.assert_close(got.views.Ks, s.views.Ks, atol=1e-3, rtol=0)
    torch.testing.assert_close(got.views.viewmats[:7], s.views.viewmats[:7], atol=1e-5, rtol=0)
    img = got.images[0].numpy()
    assert (img[: H // 2] == 200).all() and (img[H // 2:] == 255).all()  # transparent -> white
    assert torch.equal(got.background, torch.ones(3))
    # no point cloud: a random cube around where the cameras look
    assert got.points.shape == (100_000, 3)


def test_random_cube_matches_3dgs_blender_init():
    """Cameras on a sphere of radius 4 looking at the origin: a cube of half-size ~1.3 at the origin."""
    from warpforge.splat.scene import look_at

    g = torch.Generator().manual_seed(0)
    d = torch.nn.functional.normalize(torch.randn(20, 3, generator=g), dim=-1)
    eyes = 4.0 * d + torch.tensor([0.0, 0.0, 0.001])
    vm = look_at(eyes, torch.zeros(20, 3)).double().numpy()
    pts, rgb = random_cube_points(vm, 5000, seed=1)
    assert np.abs(pts).max() == pytest.approx(1.32, abs=0.02) and np.abs(pts.mean(0)).max() < 0.05
    assert (rgb == 0.5).all()


def test_errors_name_the_file(tmp_path, street):
    s, data = street
    root = write_nerfstudio(tmp_path / "ns", s, data)
    meta = json.loads((root / "transforms.json").read_text())
    for change, match in [({"k1": 0.1}, r"transforms.json: distortion \{'k1': 0.1\} is not supported"),
                          ({"camera_model": "OPENCV_FISHEYE"}, "camera_model OPENCV_FISHEYE is not a pinhole"),
                          ({"fl_x": None}, r"no focal length \(fl_x, or camera_angle_x\)"),
                          ({"frames": []}, "non-empty 'frames' list")]:
        (root / "transforms.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(TransformsError, match=match):
            load_transforms(root)
    bad = dict(meta, frames=[dict(meta["frames"][0], transform_matrix=[[1, 0], [0, 1]])])
    (root / "transforms.json").write_text(json.dumps(bad))
    with pytest.raises(TransformsError, match="frame 0 has no 4x4 transform_matrix|must be a finite, invertible"):
        load_transforms(root)
    (root / "transforms.json").write_text(json.dumps(dict(meta, frames=[{"file_path": "images/nope.png",
                                                                          "transform_matrix": np.eye(4).tolist()}])))
    with pytest.raises(TransformsError, match="nope.png: image missing"):
        load_transforms(root)
    (root / "transforms.json").write_text("{not json")
    with pytest.raises(TransformsError, match="transforms.json: not a readable JSON file"):
        load_transforms(root)


def test_train_cli_on_a_transforms_scene(tmp_path, street):
    from warpforge.cli import main
    from warpforge.splat.train import load_checkpoint

    s, data = street
    root = write_nerfstudio(tmp_path / "ns", s, data, ply=True)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["splat", "train", str(root), "--out", str(out), "--steps", "4", "--eval-every",
                                    "4", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, res.output
    ck = load_checkpoint(out / "ckpt" / "last.pt")
    assert ck["step"] == 4 and ck["views"]["names"][0] == "images/drive000.png"
    res = CliRunner().invoke(main, ["splat", "train", str(tmp_path), "--out", str(out), "--steps", "4"])
    assert res.exit_code == 2
    assert f"warpforge splat: {tmp_path}: neither a COLMAP model" in res.stderr


def test_colmap_images_resized_after_reconstruction(tmp_path):
    """A COLMAP camera of 40x30 whose images are 80x60: the images keep their size, K doubles (gsplat's rule),
    where the loader used to stretch them back to 40x30."""
    from tests.splat.test_colmap import write_images, write_text
    from warpforge.splat.colmap import load_colmap

    root = tmp_path / "scene"
    write_text(root / "sparse" / "0")
    pixels = write_images(root / "images", size=(80, 60))
    data = load_colmap(root)
    assert (data.views.width, data.views.height) == (80, 60)
    assert np.array_equal(data.images[1].numpy(), pixels["b.png"])  # not resampled
    np.testing.assert_allclose(data.views.Ks[1].numpy(), [[100, 0, 40], [0, 104, 30], [0, 0, 1]])
    quarter = load_colmap(root, downscale=4)  # 80x60 images / 4 = 20x15: K of the 40x30 camera halved
    assert (quarter.views.width, quarter.views.height) == (20, 15)
    np.testing.assert_allclose(quarter.views.Ks[1].numpy(), [[25, 0, 10], [0, 26, 7.5], [0, 0, 1]])
