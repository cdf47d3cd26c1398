"""`warpforge splat train|render` end to end on a tiny street: the files a run writes, resume, renders of
checkpoints and PLYs, one-line errors with exit status 2, and the HTML report in headless Chromium."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from warpforge.cli import main
from warpforge.splat.report import encode_png

TINY = ["--gaussians", "1200", "--size", "32x24", "--eval-every", "10", "--ckpt-every", "10", "--device", "cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("splat") / "street"
    res = CliRunner().invoke(main, ["splat", "train", "street", "--out", str(out), "--steps", "30", *TINY])
    assert res.exit_code == 0, res.output
    assert "held-out PSNR" in res.output and "wrote" in res.output
    # building the ground truth is said before and after (a 300k street takes minutes on a CPU)
    before, after = res.output.splitlines()[:2]
    assert before.startswith("building the street's ground truth: about 1,200 Gaussians, rendering its 96 cameras "
                             "at 32x24 on cpu"), res.output
    assert re.fullmatch(r"built the ground truth: [\d,]+ Gaussians, 96 images in \d+\.\d s", after), res.output
    return out


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def test_train_writes_checkpoint_ply_report(run):
    from warpforge.splat.ply import load_ply
    from warpforge.splat.train import load_checkpoint

    ck = load_checkpoint(run / "ckpt" / "last.pt")
    assert ck["step"] == 30 and len(ck["views"]["test"]) == 12 and ck["views"]["width"] == 32
    ply = load_ply(run / "point_cloud.ply")
    assert ply.n == ck["params"]["means"].shape[0] and ply.sh_degree == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["held_out_psnr"] > 10 and summary["steps_per_s"] > 0
    assert set(summary["stage_ms"]) == {"render", "loss", "backward", "optimizer", "densify"}
    html = (run / "report.html").read_text()
    # self-contained: no script, no stylesheet link, every src/href a data URI, no URL but the SVG namespace
    assert "<script" not in html and "<link" not in html
    assert all(v.startswith("data:") for v in re.findall(r'(?:src|href)="([^"]*)"', html))
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert html.count("data:image/png;base64,") == 2 * 8  # 8 held-out renders beside their ground truth
    for chart in ("loss", "psnr", "gaussians"):
        assert f'<svg id="{chart}"' in html
    assert '<table id="stages"' in html


def test_resume_continues_the_run(run, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(run, out)
    res = CliRunner().invoke(main, ["splat", "train", "street", "--out", str(out), "--steps", "40", "--resume",
                                    *TINY])
    assert res.exit_code == 0, res.output
    assert "resumed from" in res.output and "at step 30" in res.output
    from warpforge.splat.train import load_checkpoint

    ck = load_checkpoint(out / "ckpt" / "last.pt")
    assert ck["step"] == 40 and [e["step"] for e in ck["evals"]] == [0, 10, 20, 30, 40]


def test_train_on_a_colmap_folder(tmp_path):
    """The street exported as a COLMAP text model with PNG images trains through the same command."""
    import torch

    from warpforge.splat.scene import rotmat_to_quat, street_scene
    from warpforge.splat.train import load_checkpoint

    street = street_scene(n=1200, width=32, height=24, n_ring=6, n_drive=6)
    data = street.posed_images()
    root = tmp_path / "colmap"
    (root / "sparse" / "0").mkdir(parents=True)
    (root / "images").mkdir()
    v = street.views
    fx, fy, cx, cy = (float(x) for x in (v.Ks[0, 0, 0], v.Ks[0, 1, 1], v.Ks[0, 0, 2], v.Ks[0, 1, 2]))
    (root / "sparse" / "0" / "cameras.txt").write_text(f"1 PINHOLE 32 24 {fx} {fy} {cx} {cy}\n")
    q = rotmat_to_quat(v.viewmats[:, :3, :3].double().numpy())
    lines = []
    for i, name in enumerate(v.names):
        t = v.viewmats[i, :3, 3].tolist()
        lines += [f"{i + 1} {' '.join(map(repr, q[i].tolist()))} {' '.join(map(repr, t))} 1 {name}.png", ""]
        (root / "images" / f"{name}.png").write_bytes(encode_png(data.images[i].numpy()))
    (root / "sparse" / "0" / "images.txt").write_text("\n".join(lines) + "\n")
    pts = [f"{j + 1} {x} {y} {z} {int(r * 255)} {int(g * 255)} {int(b * 255)} 0.5"
           for j, ((x, y, z), (r, g, b)) in enumerate(zip(street.points.tolist(), street.points_rgb.tolist()))]
    (root / "sparse" / "0" / "points3D.txt").write_text("\n".join(pts) + "\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["splat", "train", str(root), "--out", str(out), "--steps", "20", "--eval-every",
                                    "10", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    ck = load_checkpoint(out / "ckpt" / "last.pt")
    assert ck["scene"] == "colmap" and ck["views"]["names"][0] == "drive000.png" and ck["views"]["test"] == [0, 8]
    order = [v.names.index(n.removesuffix(".png")) for n in ck["views"]["names"]]
    assert torch.allclose(ck["views"]["viewmats"], v.viewmats[order], atol=1e-5)  # poses survive the round trip
    assert torch.equal(ck["background"], torch.zeros(3))  # COLMAP scenes train on black, as gsplat's parser
    # the sky is baked into these images but a COLMAP scene renders on black: 20 steps only start to fit it
    losses = [r["loss"] for r in ck["history"]]
    assert len(ck["evals"]) == 3 and all(math.isfinite(e["psnr"]) for e in ck["evals"])
    assert len(losses) >= 3 and min(losses[1:]) < losses[0], losses


def test_render_checkpoint_and_ply(run, tmp_path):
    r = CliRunner()
    one = tmp_path / "v.png"
    res = r.invoke(main, ["splat", "render", str(run / "ckpt" / "last.pt"), "--camera", "test:0", "--out", str(one)])
    assert res.exit_code == 0, res.output
    img = _png(one)
    assert img.shape == (24, 32, 3) and img.std() > 5
    res = r.invoke(main, ["splat", "render", str(run / "ckpt" / "last.pt"), "--camera", "ring001", "--camera",
                          "26,0,32@0,0,2", "--size", "64x48", "--out", str(tmp_path / "many")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == ["camera1.png", "ring001.png"]
    assert _png(tmp_path / "many" / "ring001.png").shape == (48, 64, 3)
    imgs = []
    for bg in ("1,1,1", "0,0,0"):
        res = r.invoke(main, ["splat", "render", str(run / "point_cloud.ply"), "--camera", "0,-40,20@0,0,0", "--size",
                              "40x30", "--background", bg, "--out", str(tmp_path / "p.png")])
        assert res.exit_code == 0, res.output
        imgs.append(_png(tmp_path / "p.png").astype(int))
    assert imgs[0].shape == (30, 40, 3) and imgs[0].std() > 5
    assert (imgs[0] >= imgs[1]).all() and (imgs[0] > imgs[1]).any()  # the background shows through somewhere


@pytest.mark.parametrize("args, message", [
    (["train", "nowhere", "--out", "x"], "warpforge splat: nowhere: no such file or folder (SCENE is 'street'"),
    (["train", "street", "--size", "32by24"], "warpforge splat: --size: expected WIDTHxHEIGHT"),
    (["train", "street", "--steps", "0"], "warpforge splat: --steps: must be >= 1, got 0"),
    (["render", "missing.pt", "--camera", "test:0", "--out", "x.png"], "warpforge splat: missing.pt: no such file"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["splat", *args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_render_errors_name_the_camera(run, tmp_path):
    r = CliRunner()
    ck = str(run / "ckpt" / "last.pt")
    for cam, msg in [("test:99", "index must be in 0..11"), ("nosuch", "not a camera of the checkpoint"),
                     ("1,2@0,0,0", "--camera EYE: expected three numbers"), ("0,0,5@0,0,0", "straight along the up")]:
        res = r.invoke(main, ["splat", "render", ck, "--camera", cam, "--out", str(tmp_path / "x.png")])
        assert res.exit_code == 2 and msg in res.stderr, (cam, res.output)
    res = r.invoke(main, ["splat", "render", str(run / "point_cloud.ply"), "--camera", "test:0", "--out", "x.png"])
    assert res.exit_code == 2 and "a PLY has no cameras" in res.stderr
    res = r.invoke(main, ["splat", "train", "street", "--out", str(tmp_path / "fresh"), "--resume", *TINY])
    assert res.exit_code == 2 and "ckpt/last.pt: no checkpoint to --resume from" in res.stderr


def test_bad_files_fail_at_load_naming_the_file(run, tmp_path):
    """A PLY with NaN, or a checkpoint with inf, is refused when it is read: one line naming the file and the
    first bad Gaussian, in the one error form of `warpforge splat`."""
    import plyfile
    import torch

    v = plyfile.PlyData.read(str(run / "point_cloud.ply"))["vertex"].data.copy()
    v["scale_1"][3] = np.nan
    bad_ply = tmp_path / "nan.ply"
    plyfile.PlyData([plyfile.PlyElement.describe(v, "vertex")]).write(str(bad_ply))
    ck = torch.load(run / "ckpt" / "last.pt", weights_only=False)
    ck["params"]["opacities"][5] = float("inf")
    bad_ck = tmp_path / "inf.pt"
    torch.save(ck, bad_ck)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for src, msg in [(bad_ply, f"warpforge splat: {bad_ply}: vertex 3: scale_1 = nan is not finite"),
                     (bad_ck, f"warpforge splat: {bad_ck}: opacities[5] of Gaussian 5 is inf, not finite"),
                     (tmp_path / "junk.pt", "junk.pt: not a readable checkpoint")]:
        res = CliRunner().invoke(main, ["splat", "render", str(src), "--camera", "0,-40,20@0,0,0", "--out",
                                        str(tmp_path / "x.png")])
        assert res.exit_code == 2, res.output
        assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_camera_that_sees_nothing_warns(run, tmp_path):
    """Looking away from the scene still writes the PNG (the background) and exits 0, with a warning line."""
    out = tmp_path / "away.png"
    res = CliRunner().invoke(main, ["splat", "render", str(run / "point_cloud.ply"), "--camera",
                                    "0,0,500@0,1,600", "--size", "32x24", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"warpforge splat: {out}: warning: camera camera0 sees none of the" in res.stderr
    assert _png(out).max() == 0
    res = CliRunner().invoke(main, ["splat", "render", str(run / "point_cloud.ply"), "--camera", "0,-40,20@0,0,0",
                                    "--size", "32x24", "--out", str(out)])
    assert res.exit_code == 0 and "warning" not in res.stderr


def test_png_encoder():
    from PIL import Image
    import io

    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_png(img)))), img)
    f = np.linspace(0, 1, 12, dtype=np.float32).reshape(2, 2, 3)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encode_png(f)))), (f * 255 + 0.5).astype(np.uint8))
    with pytest.raises(ValueError, match=r"expected an \[H, W, 3\] image"):
        encode_png(np.zeros((4, 4)))


# ---- the report in headless Chromium (as tests/profile/test_profile_report.py checks the profiler's) ----------

def _chromium(exe: str, page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_report_renders_in_chromium(run, chromium, tmp_path):
    page = run / "report.html"
    dom = _chromium(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln]
    assert 'id="headline"' in dom.stdout and '<svg id="psnr"' in dom.stdout and dom.stdout.count("<image ") == 16
    assert dom.stdout.count('class="series"') >= 4
    shot = tmp_path / "splat-report.png"
    r = _chromium(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1300,1400")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000  # a rendered page, not a blank
