"""The pure-torch references of projection, SH and the dense render: finite differences in float64, gsplat's
own torch code (gsplat 1.5.3's ``cuda/_torch_impl.py`` runs on CPU for projection and SH; its torch blend needs
CUDA), and the culling rules."""

from __future__ import annotations

import math

import pytest
import torch
from gsplat.cuda import _torch_impl as gs

from tests.splat.conftest import HEIGHT, WIDTH, cameras, make_scene
from warpforge.splat import reference as ref


def _tiny(dtype=torch.float64, n=4, sh_degree=1, seed=3):
    """n Gaussians well inside a 10x8 image of 2 cameras: finite differences stay clear of the thresholds."""
    g = torch.Generator().manual_seed(seed)
    viewmats, Ks = cameras(2, 10, 8, dtype)
    Ks = Ks.clone()
    Ks[:, :2, :2] *= 0.8  # 10 pixels see the middle of the scene
    means = (torch.rand(n, 3, generator=g, dtype=dtype) - 0.5) * 0.8
    quats = torch.randn(n, 4, generator=g, dtype=dtype)
    scales = 0.15 + 0.2 * torch.rand(n, 3, generator=g, dtype=dtype)
    opacities = 0.3 + 0.5 * torch.rand(n, generator=g, dtype=dtype)
    sh = 0.3 * torch.randn(n, (sh_degree + 1) ** 2, 3, generator=g, dtype=dtype)
    return means, quats, scales, opacities, sh, viewmats, Ks


@pytest.mark.parametrize("camera_model,render_mode", [("pinhole", "RGB+ED"), ("fisheye", "RGB")])
def test_render_reference_gradcheck(camera_model, render_mode):
    means, quats, scales, opacities, sh, viewmats, Ks = _tiny()
    bg = torch.tensor([0.2, -0.1, 0.4], dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (means, quats, scales, opacities, sh, bg)]

    def f(means, quats, scales, opacities, sh, bg):
        img, alpha, _ = ref.render_reference(means, quats, scales, opacities, sh, viewmats, Ks, 10, 8,
                                             sh_degree=1, background=bg, render_mode=render_mode,
                                             camera_model=camera_model)
        return img, alpha

    img, alpha = f(*inputs)
    assert float(alpha.detach().max()) > 0.5  # the Gaussians do cover pixels
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


def test_project_reference_gradcheck_fisheye_off_axis_and_on_axis():
    """The fisheye's derivatives, including a centre on the optical axis (x = y = 0)."""
    means, quats, scales, opacities, _, viewmats, Ks = _tiny(n=3)
    means = means.clone()
    cam0 = torch.linalg.inv(viewmats[0])
    means[0] = (cam0 @ torch.tensor([0.0, 0.0, 4.0, 1.0], dtype=torch.float64))[:3]  # on camera 0's axis

    def f(means, quats, scales):
        p = ref.project_reference(means, quats, scales, opacities, viewmats, Ks, 10, 8, camera_model="fisheye")
        return p.means2d, p.conics, p.depths

    inputs = [t.clone().requires_grad_() for t in (means, quats, scales)]
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize("camera_model", ["pinhole", "fisheye"])
def test_projection_matches_gsplat_torch(camera_model):
    s = make_scene(96, 3, seed=5)
    p = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                              HEIGHT, camera_model=camera_model)
    covars = gs._quat_scale_to_covar_preci(s["quats"], s["scales"], compute_preci=False)[0]
    g_radii, g_means2d, g_depths, g_conics, _ = gs._fully_fused_projection(
        s["means"], covars, s["viewmats"], s["Ks"], WIDTH, HEIGHT, eps2d=0.3, camera_model=camera_model)
    keep = (p.radii > 0).all(-1)
    # gsplat's torch code culls by depth, determinant and its 3.33-sigma box; ours adds the opacity rule
    assert not (keep & ~(g_radii > 0).all(-1)).any()
    assert keep.sum() > 100
    for ours, theirs in ((p.means2d, g_means2d), (p.conics, g_conics), (p.depths, g_depths)):
        torch.testing.assert_close(ours[keep], theirs[keep], rtol=2e-5, atol=1e-5)
    # radii: gsplat's CUDA rule, ceil(min(3.33, sqrt(2 ln(255 opacity))) * sqrt(Sigma2d_ii)); ours uses the tile
    # test's cutoff, 0.05% wider, so a radius may be one pixel larger, never smaller
    a, b, c = g_conics.unbind(-1)
    det = a * c - b * b
    var = torch.stack([c / det, a / det], -1)  # the blurred 2D covariance's diagonal
    ext = torch.clamp(torch.sqrt(2 * torch.log(s["opacities"] * 255)), max=3.33)[None, :, None]
    g_cuda = torch.ceil(ext * torch.sqrt(var)).int()
    diff = (p.radii - g_cuda)[keep]
    assert diff.min() >= 0 and diff.max() <= 1
    assert (diff == 0).float().mean() > 0.9
    # and a culled pair has zeros everywhere
    assert (p.means2d[~keep] == 0).all() and (p.conics[~keep] == 0).all() and (p.depths[~keep] == 0).all()


@pytest.mark.parametrize("camera_model", ["pinhole", "fisheye"])
def test_antialiased_compensation_matches_gsplat_torch(camera_model):
    """gsplat's torch projection with calc_compensations=True (what rasterization() multiplies the opacities by
    in its "antialiased" mode): our per-camera opacity / the opacity is its compensation on every kept pair."""
    s = make_scene(96, 3, seed=8)
    p = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                              HEIGHT, camera_model=camera_model, antialiased=True)
    covars = gs._quat_scale_to_covar_preci(s["quats"], s["scales"], compute_preci=False)[0]
    _, _, _, g_conics, g_comp = gs._fully_fused_projection(
        s["means"], covars, s["viewmats"], s["Ks"], WIDTH, HEIGHT, eps2d=0.3, calc_compensations=True,
        camera_model=camera_model)
    keep = (p.radii > 0).all(-1)
    assert keep.sum() > 100
    comp = p.opacities / s["opacities"][None]
    torch.testing.assert_close(comp[keep], g_comp[keep], rtol=2e-5, atol=1e-6)
    assert g_comp[keep].min() < 0.3  # small splats are dimmed strongly, ...
    # ... so fewer pairs pass the opacity test than in classic mode, and the boxes are never larger
    classic = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"],
                                    WIDTH, HEIGHT, camera_model=camera_model)
    assert keep.sum() < (classic.radii > 0).all(-1).sum()
    assert (p.radii[keep] <= classic.radii[keep]).all()
    torch.testing.assert_close(p.conics[keep], classic.conics[keep])  # the blur itself is the same


def test_antialiased_render_reference_gradcheck():
    means, quats, scales, opacities, sh, viewmats, Ks = _tiny(n=3)  # under a pixel: the compensation is 0.24 to 0.42
    inputs = [t.clone().requires_grad_() for t in (means, quats, scales, opacities)]

    def f(means, quats, scales, opacities):
        img, alpha, _ = ref.render_reference(means, quats, scales, opacities, sh, viewmats, Ks, 10, 8,
                                             sh_degree=1, rasterize_mode="antialiased")
        return img, alpha

    assert float(f(*inputs)[1].detach().max()) > 0.3
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


def test_culling_rules():
    s = make_scene(64, 2, seed=0)
    p = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                              HEIGHT)
    R, t = s["viewmats"][:, :3, :3], s["viewmats"][:, :3, 3]
    z = (torch.einsum("cij,nj->cni", R, s["means"]) + t[:, None])[..., 2]
    keep = (p.radii > 0).all(-1)
    assert not keep[z < 0.01].any()  # behind the camera or inside its near plane
    assert (z[0] < 0.01).sum() >= 8  # the scene does put Gaussians there
    assert not keep[:, s["opacities"] < 1 / 255].any()
    assert ((p.radii > 0).all(-1) == (p.radii > 0).any(-1)).all()  # never half culled
    far = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                                HEIGHT, far=4.0)
    assert not (far.radii > 0).all(-1)[z > 4.0].any() and (z > 4.0).any()
    # every kept box meets the image
    m, r = p.means2d[keep], p.radii[keep].float()
    assert ((m[:, 0] + r[:, 0] > 0) & (m[:, 0] - r[:, 0] < WIDTH) & (m[:, 1] + r[:, 1] > 0)
            & (m[:, 1] - r[:, 1] < HEIGHT)).all()


def test_radii_bound_the_alpha_ellipse():
    """Outside the radii box no pixel gets alpha >= 1/255 (sampled densely around each Gaussian)."""
    s = make_scene(64, 2, seed=2)
    p = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                              HEIGHT)
    keep = (p.radii > 0).all(-1)
    con, op, r = p.conics[keep], p.opacities[keep], p.radii[keep].float()
    u = torch.linspace(-1, 1, 201)
    for scale in (1.0, 1.05):  # on the box's border and just outside it
        dx = (u[None, :, None] * r[:, None, :1] * scale).expand(-1, -1, 201)
        dy = (u[None, None, :] * r[:, None, 1:] * scale).expand(-1, 201, -1)
        border = (dx.abs() >= r[:, None, :1] * 0.999) | (dy.abs() >= r[:, None, 1:] * 0.999)
        a, b, c = (con[:, j, None, None] for j in range(3))  # the conic's xx, xy, yy terms
        power = -0.5 * (a * dx * dx + c * dy * dy) - b * dx * dy
        alpha = op[:, None, None] * torch.exp(power)
        assert (alpha[border] < ref.ALPHA_MIN).all()


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_sh_matches_gsplat_torch(degree):
    g = torch.Generator().manual_seed(degree)
    dirs = torch.randn(7, 5, 3, generator=g) * 3
    coeffs = torch.randn(7, 5, 16, 3, generator=g)
    torch.testing.assert_close(ref.sh_reference(degree, dirs, coeffs), gs._spherical_harmonics(degree, dirs, coeffs),
                               rtol=1e-5, atol=1e-5)
    d = dirs.double().requires_grad_()
    c = coeffs.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda d, c: ref.sh_reference(degree, d, c), (d[:2, :2], c[:2, :2]))


def test_dense_render_rules():
    """One pixel, by hand: depth order, the 0.999 clamp, a Gaussian below 1/255 skipped, the stop before T would
    reach 1e-4, the background behind."""
    means2d = torch.tensor([[1.5, 1.5], [1.5, 1.5], [1.5, 1.5], [35.5, 1.5]], dtype=torch.float64)
    conics = torch.tensor([[0.01, 0.0, 0.01]] * 4, dtype=torch.float64)
    colors = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1], [5, 5, 5]], dtype=torch.float64)
    opacities = torch.tensor([0.8, 0.9999, 0.6, 0.9], dtype=torch.float64)
    depths = torch.tensor([2.0, 1.0, 3.0, 0.5], dtype=torch.float64)
    bg = torch.tensor([0.0, 0.0, 7.0], dtype=torch.float64)
    img, alpha = ref.blend_dense(means2d, conics, colors, opacities, depths, torch.ones(4, dtype=torch.bool), 3, 2,
                                 bg)
    # Gaussian 3 (nearest) is 34 px away: alpha 0.9 * exp(-5.78) = 0.0028 < 1/255, skipped. Then Gaussian 1
    # (opacity 0.9999, clamped to 0.999), Gaussian 0 (0.8): T = 0.001 * 0.2 = 2e-4 > 1e-4, kept; Gaussian 2
    # would leave 8e-5 <= 1e-4: the pixel stops before it.
    assert 0.9 * math.exp(-0.5 * 0.01 * 34 ** 2) < ref.ALPHA_MIN
    T = 0.001 * 0.2
    expect = torch.tensor([0.999, 0.001 * 0.8, 7.0 * T], dtype=torch.float64)
    torch.testing.assert_close(img[1, 1], expect)
    torch.testing.assert_close(alpha[1, 1], torch.tensor([1 - T], dtype=torch.float64))
    # one Gaussian, exact formula at an offset pixel (dx = -1, dy = 0.5), with the cross term
    c = torch.tensor([[0.3, 0.1, 0.2]], dtype=torch.float64)
    f64 = torch.float64
    img, alpha = ref.blend_dense(torch.tensor([[1.5, 0.0]], dtype=f64), c, torch.ones(1, 1, dtype=f64),
                                 torch.tensor([0.7], dtype=f64), torch.ones(1), torch.ones(1, dtype=torch.bool), 3, 1)
    dx, dy = 1.5 - 2.5, 0.0 - 0.5
    a = 0.7 * math.exp(-0.5 * (0.3 * dx * dx + 0.2 * dy * dy) - 0.1 * dx * dy)
    torch.testing.assert_close(img[0, 2, 0], torch.tensor(a, dtype=torch.float64))
