"""rasterize(packed=True), gsplat's packed layout: the same images and gradients as the dense layout, meta's
per-pair fields as the visible rows of the dense ones, and the camera groups of a large render."""

from __future__ import annotations

import pytest
import torch
from tests.splat.conftest import HEIGHT, WIDTH, leaves, make_scene

from warpforge.kernels.tolerance import rel_err
from warpforge.splat import packed as packed_mod
from warpforge.splat import rasterize

PARAMS = ("means", "quats", "scales", "opacities", "sh")
# ||packed - dense|| / ||dense||. Measured on the CPU path: 0 (the same sums in the same order); the bound leaves
# room for the Triton path's atomics. A wrong pair or weight is > 1e-2.
GRAD_TOL = 1e-6


def _render(s: dict, packed: bool, **kw):
    return rasterize(s["means"], s["quats"], s["scales"], s["opacities"], s["sh"], s["viewmats"], s["Ks"], WIDTH,
                     HEIGHT, packed=packed, **kw)


def _forward_backward(scene: dict, packed: bool, **kw):
    s = leaves(scene)
    img, alpha, meta = _render(s, packed, **kw)
    g = torch.Generator().manual_seed(1)
    w_img, w_alpha = torch.randn(img.shape, generator=g), torch.randn(alpha.shape, generator=g)
    ((img * w_img).sum() + (alpha * w_alpha).sum()).backward()
    return img.detach(), alpha.detach(), meta, {k: s[k].grad for k in PARAMS}


@pytest.mark.parametrize("kw", [
    dict(sh_degree=3),
    dict(sh_degree=1, render_mode="RGB+ED", background=torch.tensor([0.2, 0.5, 0.9]), rasterize_mode="antialiased"),
], ids=["sh3", "sh1-depth-background-antialiased"])
def test_packed_equals_dense(kw):
    scene = make_scene(96, 3, seed=2)
    dense = _forward_backward(scene, False, **kw)
    packed = _forward_backward(scene, True, **kw)
    # the same pairs blend in the same order: only the SH sums of gathered rows can round differently
    torch.testing.assert_close(packed[0], dense[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(packed[1], dense[1], atol=1e-6, rtol=0)
    for k in PARAMS:
        assert rel_err(packed[3][k], dense[3][k]) < GRAD_TOL, (k, rel_err(packed[3][k], dense[3][k]))


def test_meta_holds_the_visible_rows_of_the_dense_layout():
    scene = make_scene(96, 3, seed=2)
    _, _, d = _render(scene, False, sh_degree=3)
    _, _, p = _render(scene, True, sh_degree=3)
    visible = (d["radii"] > 0).all(-1)
    cam, gauss = visible.nonzero(as_tuple=True)
    assert 0 < cam.numel() < visible.numel()  # the scene culls some pairs: the packed list is shorter
    assert torch.equal(p["camera_ids"], cam) and torch.equal(p["gaussian_ids"], gauss)
    for key in ("radii", "means2d", "depths", "conics", "opacities", "tiles_per_gauss"):
        torch.testing.assert_close(p[key], d[key][cam, gauss], atol=0, rtol=0, msg=key)
    # the same intersections, sorted the same way; flatten_ids name the same pairs through their rows
    assert torch.equal(p["isect_ids"], d["isect_ids"]) and torch.equal(p["isect_offsets"], d["isect_offsets"])
    dense_index = cam * scene["means"].shape[0] + gauss
    assert torch.equal(dense_index[p["flatten_ids"].long()], d["flatten_ids"].long())
    assert d["camera_ids"] is None and d["gaussian_ids"] is None


def test_camera_groups_give_the_same_render(monkeypatch):
    """A large render projects its cameras in groups; one camera a group is the same render."""
    scene = make_scene(64, 3, seed=3)
    whole = _forward_backward(scene, True, sh_degree=2)
    monkeypatch.setattr(packed_mod, "PACK_PAIRS", 1)
    grouped = _forward_backward(scene, True, sh_degree=2)
    # the CPU projection batches its matrix products over the cameras of a call: a camera alone rounds a little
    # differently
    torch.testing.assert_close(grouped[0], whole[0], atol=1e-6, rtol=0)
    for k in PARAMS:  # those last-bit differences through the scene's near-degenerate Gaussians: ~2e-5 measured
        assert rel_err(grouped[3][k], whole[3][k]) < 1e-4, (k, rel_err(grouped[3][k], whole[3][k]))


def test_packed_with_features_and_nothing_visible():
    scene = make_scene(32, 2, seed=4)
    feats = torch.rand(2, 32, 5)  # [C, N, D] per-camera features
    args = [scene[k] for k in ("means", "quats", "scales", "opacities")]
    for colors in (feats, feats[0]):
        a = rasterize(*args, colors, scene["viewmats"], scene["Ks"], WIDTH, HEIGHT, packed=True)[0]
        b = rasterize(*args, colors, scene["viewmats"], scene["Ks"], WIDTH, HEIGHT)[0]
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    away = scene["viewmats"].clone()
    away[:, 2, 3] -= 100.0  # everything behind the cameras
    img, alpha, meta = rasterize(*args, feats, away, scene["Ks"], WIDTH, HEIGHT, packed=True,
                                 background=torch.ones(5))
    assert meta["gaussian_ids"].numel() == 0 and alpha.max() == 0 and bool((img == 1).all())
    with pytest.raises(ValueError, match="packed must be a bool"):
        rasterize(*args, feats, scene["viewmats"], scene["Ks"], WIDTH, HEIGHT, packed="yes")


def test_packed_equals_dense_on_the_kernels(triton_on_cpu):
    """The Triton launchers (interpreter) take the packed rows too."""
    scene = make_scene(24, 2, seed=5)
    dense = _forward_backward(scene, False, sh_degree=1)
    packed = _forward_backward(scene, True, sh_degree=1)
    torch.testing.assert_close(packed[0], dense[0], atol=1e-6, rtol=0)
    for k in PARAMS:
        assert rel_err(packed[3][k], dense[3][k]) < GRAD_TOL, (k, rel_err(packed[3][k], dense[3][k]))
