"""Outputs of a trained scene: the .splat file web viewers load (byte layout, antimatter15's order and rounding)
and camera paths rendered to MP4 (orbit and through the training cameras), through the CLI on a tiny street."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from warpforge.cli import main
from warpforge.splat.export import RECORD, load_splat, save_splat
from warpforge.splat.scene import SH_C0, Splats, street_scene
from warpforge.splat.video import orbit_path, train_path


def _splats(n: int = 50, seed: int = 0) -> Splats:
    g = torch.Generator().manual_seed(seed)
    return Splats(means=torch.randn(n, 3, generator=g), scales=torch.randn(n, 3, generator=g) - 3,
                  quats=torch.randn(n, 4, generator=g) * 3, opacities=torch.randn(n, generator=g) * 3,
                  sh0=torch.randn(n, 1, 3, generator=g) * 2, shN=torch.randn(n, 3, 3, generator=g))


def test_splat_bytes_follow_the_converter(tmp_path):
    """32 bytes per Gaussian: position, linear scale, RGBA (DC colour, sigmoid opacity, x255 clipped and
    truncated), quaternion x128+128; sorted by exp(sum of log-scales) x opacity, largest first."""
    s = _splats()
    path = save_splat(s, tmp_path / "a.splat")
    data = path.read_bytes()
    assert len(data) == 32 * s.n and RECORD.itemsize == 32
    rec = load_splat(path)
    key = torch.exp(s.scales.double().sum(1)) * torch.sigmoid(s.opacities.double())
    order = torch.argsort(-key, stable=True)
    assert np.array_equal(rec["position"], s.means[order].numpy())
    np.testing.assert_allclose(rec["scale"], torch.exp(s.scales[order]).numpy(), rtol=1e-6)
    # the first record, by hand from the raw bytes (little-endian float32 x 6, then 8 bytes)
    i = int(order[0])
    head = np.frombuffer(data[:24], dtype="<f4")
    assert head[:3].tolist() == s.means[i].tolist()
    rgb = np.clip((0.5 + SH_C0 * s.sh0[i, 0].double().numpy()) * 255, 0, 255).astype(np.uint8)
    alpha = np.uint8(min(255.0, 255 * (1 / (1 + math.exp(-float(s.opacities[i]))))))
    assert list(data[24:28]) == [*rgb.tolist(), int(alpha)]
    q = s.quats[i].double().numpy()
    assert list(data[28:32]) == np.clip(q / np.linalg.norm(q) * 128 + 128, 0, 255).astype(np.uint8).tolist()
    assert (rec["color"] == 255).any() and (rec["color"] == 0).any()  # the sample reaches both clips
    # keys sorted non-increasing
    k = np.prod(rec["scale"].astype(np.float64), 1) * (rec["color"][:, 3] + 0.5) / 255
    assert (np.diff(np.prod(rec["scale"].astype(np.float64), 1)[:5]) != 0).any() and k[0] >= k[-1]


def test_splat_refuses_non_finite(tmp_path):
    s = _splats(5)
    s.means[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"x.splat: a Gaussian .* non-finite position or scale"):
        save_splat(s, tmp_path / "x.splat")
    (tmp_path / "bad.splat").write_bytes(b"\0" * 33)
    with pytest.raises(ValueError, match="not a whole number of 32-byte"):
        load_splat(tmp_path / "bad.splat")


def test_orbit_and_train_paths():
    street = street_scene(n=600, width=32, height=24, n_ring=8, n_drive=0)
    v = street.views
    # the ring looks at (0, 0, 2) from radius 26, height 32: the orbit recovers that circle
    orbit = orbit_path(street.splats, v, 12, 48, 32)
    c = orbit.centers()
    assert len(orbit) == 12 and orbit.width == 48
    torch.testing.assert_close(c[:, :2].norm(dim=-1), torch.full((12,), 26.0), atol=0.05, rtol=0)
    torch.testing.assert_close(c[:, 2], torch.full((12,), 32.0), atol=0.05, rtol=0)
    fwd = torch.nn.functional.normalize(torch.tensor([0.0, 0.0, 2.0]) - c, dim=-1)
    torch.testing.assert_close(orbit.viewmats[:, 2, :3], fwd, atol=1e-3, rtol=0)  # looking at the centre
    assert (orbit.viewmats[:, 1, 2] < 0).all()  # image down is world down: z is up
    # through the training cameras: the ends are the first and last, the middle between its neighbours
    train = [1, 2, 3, 5]
    tp = train_path(v, train, 7, 32, 24)
    torch.testing.assert_close(tp.viewmats[0], v.viewmats[1], atol=1e-4, rtol=0)
    torch.testing.assert_close(tp.viewmats[-1], v.viewmats[5], atol=1e-4, rtol=0)
    torch.testing.assert_close(tp.viewmats[2], v.viewmats[2], atol=1e-4, rtol=0)  # frame 2 of 6 is camera 1 of 3
    torch.testing.assert_close(tp.centers()[3], 0.5 * (v.centers()[2] + v.centers()[3]), atol=1e-3, rtol=0)
    r = tp.viewmats[:, :3, :3]
    torch.testing.assert_close(r @ r.transpose(1, 2), torch.eye(3).expand(7, 3, 3), atol=1e-5, rtol=0)
    # no cameras (a PLY): around the Gaussians, z up
    o = orbit_path(street.splats, None, 4, 32, 24)
    assert (o.centers()[:, 2] > street.splats.means[:, 2].median()).all()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("splat") / "street"
    res = CliRunner().invoke(main, ["splat", "train", "street", "--out", str(out), "--steps", "5", "--gaussians",
                                    "1200", "--size", "32x24", "--eval-every", "5", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, res.output
    return out


def test_export_cli(trained, tmp_path):
    from warpforge.splat.ply import load_ply

    r = CliRunner()
    res = r.invoke(main, ["splat", "export", str(trained / "ckpt" / "last.pt"), "--out", str(tmp_path / "s.splat")])
    assert res.exit_code == 0, res.output
    n = load_ply(trained / "point_cloud.ply").n
    assert f"wrote {n:,} Gaussians to" in res.output and (tmp_path / "s.splat").stat().st_size == 32 * n
    res = r.invoke(main, ["splat", "export", str(trained / "point_cloud.ply"), "--format", "splat", "--out",
                          str(tmp_path / "p.bin")])
    assert res.exit_code == 0 and (tmp_path / "p.bin").read_bytes() == (tmp_path / "s.splat").read_bytes()
    res = r.invoke(main, ["splat", "export", str(trained / "ckpt" / "last.pt"), "--out", str(tmp_path / "c.ply")])
    assert res.exit_code == 0 and load_ply(tmp_path / "c.ply").n == n
    res = r.invoke(main, ["splat", "export", str(tmp_path / "none.pt"), "--out", str(tmp_path / "x.splat")])
    assert res.exit_code == 2 and f"warpforge splat: {tmp_path / 'none.pt'}: no such file" in res.stderr


def test_video_cli(trained, tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="pip install 'warpforge[splat]' brings it")
    r = CliRunner()
    ck = str(trained / "ckpt" / "last.pt")
    for path, frames in (("orbit", 6), ("train", 5)):
        out = tmp_path / f"{path}.mp4"
        res = r.invoke(main, ["splat", "video", ck, "--out", str(out), "--path", path, "--frames", str(frames),
                              "--size", "32x24", "--device", "cpu"])
        assert res.exit_code == 0, res.output
        assert f"{frames} frames at 32x24" in res.output
        assert out.read_bytes()[4:8] == b"ftyp"  # an MP4 container
        reader = imageio_ffmpeg.read_frames(str(out))
        meta = reader.__next__()
        got = [np.frombuffer(f, np.uint8) for f in reader]
        assert meta["size"] == (32, 24) and len(got) == frames
        assert max(float(f.std()) for f in got) > 5  # the street, not a blank
    for args, msg in ((["--size", "33x24"], "--size: H.264 (yuv420p) needs an even width and height"),
                      (["--frames", "1"], "--frames: at least 2")):
        res = r.invoke(main, ["splat", "video", ck, "--out", str(tmp_path / "x.mp4"), *args])
        assert res.exit_code == 2 and f"warpforge splat: {msg}" in res.stderr, res.output
    res = r.invoke(main, ["splat", "video", str(trained / "point_cloud.ply"), "--out", str(tmp_path / "x.mp4"),
                          "--path", "train"])
    assert res.exit_code == 2 and "a PLY has no training cameras" in res.stderr
