"""The public render against the dense reference: images, alphas and every gradient, on the CPU (torch) path and
through the Triton kernels (interpreter); render modes, features, backgrounds, meta, absgrad, the tight bound."""

from __future__ import annotations

import pytest
import torch

from tests.splat.conftest import HEIGHT, TILE, WIDTH, leaves, make_scene
from warpforge.kernels.tolerance import rel_err
from warpforge.splat import rasterize, render_reference
from warpforge.splat import reference as ref

PARAMS = ("means", "quats", "scales", "opacities", "sh")
# Both paths are float32 with different summation orders (per tile vs per image, cumprod vs a running product);
# a pixel whose transmittance lands within rounding of 1e-4 may stop one Gaussian apart. Measured: images
# ~1e-7, gradients up to ~1e-5 relative.
TOL = 1e-4


def _render(fn, s, *, bg=None, extra=(), keys=PARAMS, **kw):
    p = leaves(s, keys)
    extra_leaves = [t.detach().clone().requires_grad_() for t in extra]
    if bg is not None:
        bg = bg.detach().clone().requires_grad_()
    colors = extra_leaves[0] if extra_leaves else p["sh"]
    img, alpha, meta = fn(p["means"], p["quats"], p["scales"], p["opacities"], colors, s["viewmats"], s["Ks"],
                          WIDTH, HEIGHT, background=bg, **kw)
    if meta["means2d"].requires_grad:
        meta["means2d"].retain_grad()
    g = torch.Generator().manual_seed(7)
    loss = (img * torch.randn(img.shape, generator=g)).sum() + (alpha * torch.randn(alpha.shape, generator=g)).sum()
    loss.backward()
    grads = {k: p[k].grad for k in keys if p[k].grad is not None}
    grads.update({f"extra{i}": t.grad for i, t in enumerate(extra_leaves)})
    if bg is not None:
        grads["background"] = bg.grad
    grads["means2d"] = meta["means2d"].grad
    return img.detach(), alpha.detach(), grads, meta


def _compare(got, want, tol=TOL):
    img, alpha, grads, meta = got
    r_img, r_alpha, r_grads, r_meta = want
    assert rel_err(img, r_img) < tol, rel_err(img, r_img)
    assert rel_err(alpha, r_alpha) < tol
    assert set(grads) == set(r_grads)
    for k in grads:
        assert grads[k] is not None and r_grads[k] is not None, k
        assert float(r_grads[k].norm()) > 0, k  # the loss does reach every input
        assert rel_err(grads[k], r_grads[k]) < tol, (k, rel_err(grads[k], r_grads[k]))
    assert torch.equal(meta["radii"], r_meta["radii"])


@pytest.mark.parametrize("render_mode", ["RGB", "D", "ED", "RGB+ED"])
def test_matches_dense_reference_modes(scene3, render_mode):
    bg = torch.tensor([0.3, -0.2, 0.5]) if "RGB" in render_mode else None  # depth modes have no background
    kw = dict(sh_degree=3, render_mode=render_mode)
    got = _render(rasterize, scene3, bg=bg, **kw)
    want = _render(render_reference, scene3, bg=bg, **kw)
    assert got[0].shape == (3, HEIGHT, WIDTH, {"RGB": 3, "D": 1, "ED": 1, "RGB+ED": 4}[render_mode])
    _compare(got, want)


def test_matches_dense_reference_fisheye(scene):
    kw = dict(sh_degree=2, camera_model="fisheye")
    _compare(_render(rasterize, scene, **kw), _render(render_reference, scene, **kw))


@pytest.mark.parametrize("per_camera", [False, True])
def test_features_and_per_camera_backgrounds(scene, per_camera):
    g = torch.Generator().manual_seed(1)
    C, N = scene["viewmats"].shape[0], scene["means"].shape[0]
    feats = torch.rand((C, N, 5) if per_camera else (N, 5), generator=g)
    bg = torch.rand(C, 5, generator=g)
    got = _render(rasterize, scene, bg=bg, extra=(feats,))
    want = _render(render_reference, scene, bg=bg, extra=(feats,))
    assert got[0].shape == (C, HEIGHT, WIDTH, 5)
    _compare(got, want)


def test_cameras_are_independent(scene3):
    """Rendering 3 cameras at once equals rendering each alone."""
    s = scene3

    def render(viewmats, Ks):
        with torch.no_grad():
            return rasterize(s["means"], s["quats"], s["scales"], s["opacities"], s["sh"], viewmats, Ks, WIDTH,
                             HEIGHT, sh_degree=1)

    img, alpha, meta = render(s["viewmats"], s["Ks"])
    for c in range(3):
        i1, a1, m1 = render(s["viewmats"][c:c + 1], s["Ks"][c:c + 1])
        torch.testing.assert_close(i1[0], img[c], rtol=0, atol=1e-6)
        torch.testing.assert_close(a1[0], alpha[c], rtol=0, atol=1e-6)
        assert torch.equal(m1["radii"][0], meta["radii"][c])


def test_meta(scene3):
    img, alpha, grads, meta = _render(rasterize, scene3, sh_degree=3)
    C, N = 3, scene3["means"].shape[0]
    tw, th = -(-WIDTH // TILE), -(-HEIGHT // TILE)
    assert meta["radii"].shape == (C, N, 2) and meta["radii"].dtype == torch.int32
    for k, shape in (("means2d", (C, N, 2)), ("conics", (C, N, 3)), ("depths", (C, N)), ("opacities", (C, N)),
                     ("tiles_per_gauss", (C, N)), ("isect_offsets", (C, th, tw))):
        assert tuple(meta[k].shape) == shape, k
    M = meta["isect_ids"].numel()
    assert M == int(meta["tiles_per_gauss"].sum()) == meta["flatten_ids"].numel() > 0
    assert (meta["tile_width"], meta["tile_height"], meta["tile_size"]) == (tw, th, TILE)
    assert (meta["width"], meta["height"], meta["n_cameras"], meta["gaussian_ids"]) == (WIDTH, HEIGHT, C, None)
    # culled pairs get no tiles and no gradient
    culled = (meta["radii"] == 0).all(-1)
    assert culled.any() and (meta["tiles_per_gauss"][culled] == 0).all()
    assert (grads["means2d"][culled] == 0).all()


_ABSGRAD_REF: dict = {}


def _absgrad_reference(s, loss_weights, sh_degree):
    """Sum over pixels of |dL/dmeans2d| of each pixel's term: the dense blend with one copy of means2d per pixel."""
    p = ref.project_reference(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
                              HEIGHT)
    colors = ref.view_colors(s["sh"], s["means"], s["viewmats"], sh_degree)
    out = []
    for c in range(s["viewmats"].shape[0]):
        m = p.means2d[c].detach()[None].expand(WIDTH * HEIGHT, -1, -1).clone().requires_grad_()
        img, alpha = ref.blend_dense(m, p.conics[c].detach(), colors[c].detach(), p.opacities[c].detach(),
                                     p.depths[c].detach(), (p.radii[c] > 0).all(-1), WIDTH, HEIGHT)
        ((img * loss_weights[0][c]).sum() + (alpha * loss_weights[1][c]).sum()).backward()
        out.append(m.grad.abs().sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("triton", [False, True])
def test_absgrad(scene, triton, request):
    if triton:
        request.getfixturevalue("triton_on_cpu")  # every stage through its kernel (interpreter)
    p = leaves(scene)
    img, alpha, meta = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["sh"], scene["viewmats"],
                                 scene["Ks"], WIDTH, HEIGHT, sh_degree=2, absgrad=True)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(img.shape, generator=g), torch.randn(alpha.shape, generator=g))
    ((img * w[0]).sum() + (alpha * w[1]).sum()).backward()
    key = tuple(t.sum().item() for t in w)
    if key not in _ABSGRAD_REF:  # the same scene and weights for both paths: the reference runs once
        _ABSGRAD_REF[key] = _absgrad_reference(scene, w, 2)
    want = _ABSGRAD_REF[key]
    got = meta["means2d"].absgrad
    assert float(want.norm()) > 0
    assert rel_err(got, want) < TOL
    assert (got >= meta["means2d"].grad.abs() - 1e-6).all()  # |sum| <= sum of |.|


def test_no_grad_and_detached_inputs(scene):
    """Under no_grad (inference) nothing keeps a graph and meta["means2d"] has no grad to retain."""
    with torch.no_grad():
        img, alpha, meta = rasterize(scene["means"], scene["quats"], scene["scales"], scene["opacities"],
                                     scene["sh"], scene["viewmats"], scene["Ks"], WIDTH, HEIGHT, sh_degree=3)
    assert not img.requires_grad and not meta["means2d"].requires_grad
    want, _, _ = render_reference(scene["means"], scene["quats"], scene["scales"], scene["opacities"], scene["sh"],
                                  scene["viewmats"], scene["Ks"], WIDTH, HEIGHT, sh_degree=3)
    assert rel_err(img, want) < TOL


def test_tight_bound_keeps_every_pixel_of_the_3sigma_square():
    """Every (camera, Gaussian, pixel) that gsplat's 3-sigma square covers with alpha >= 1/255 lies in a tile the
    exact test emitted, and the render equals one that blends the whole square's tiles."""
    s = make_scene(160, 3, seed=11)
    img, alpha, meta = rasterize(s["means"], s["quats"], s["scales"], s["opacities"], s["sh"], s["viewmats"],
                                 s["Ks"], WIDTH, HEIGHT, sh_degree=1)
    C, N = 3, 160
    tw, th = meta["tile_width"], meta["tile_height"]
    tile_bits = (tw * th).bit_length()
    pairs = set(zip(((meta["isect_ids"] >> 32) & ((1 << tile_bits) - 1)).tolist(),
                    meta["flatten_ids"].tolist()))  # (tile, flattened Gaussian)
    m, con, op = meta["means2d"].detach(), meta["conics"].detach(), meta["opacities"].detach()
    a, b, c = con.unbind(-1)
    var_x, var_y = c / (a * c - b * b), a / (a * c - b * b)
    square = torch.stack([torch.ceil(3.0 * var_x.sqrt()), torch.ceil(3.0 * var_y.sqrt())], -1)
    ys, xs = torch.meshgrid(torch.arange(HEIGHT), torch.arange(WIDTH), indexing="ij")
    px, py = xs.reshape(-1) + 0.5, ys.reshape(-1) + 0.5
    visible = (meta["radii"] > 0).all(-1)
    checked = tight_drops = 0
    for cam in range(C):
        for g in visible[cam].nonzero()[:, 0].tolist():
            dx, dy = m[cam, g, 0] - px, m[cam, g, 1] - py
            inside = (dx.abs() <= square[cam, g, 0]) & (dy.abs() <= square[cam, g, 1])
            power = -0.5 * (a[cam, g] * dx * dx + c[cam, g] * dy * dy) - b[cam, g] * dx * dy
            shaded = inside & (op[cam, g] * torch.exp(power) >= ref.ALPHA_MIN)
            for pix in shaded.nonzero()[:, 0].tolist():
                tile = (pix // WIDTH // TILE) * tw + (pix % WIDTH) // TILE
                checked += 1
                tight_drops += (tile, cam * N + g) not in pairs
    assert checked > 1000 and tight_drops == 0
    # the square's tiles minus ours: work the tight test saved (the square holds more pairs)
    n_tiles = (torch.ceil((m + square) / TILE).clamp(max=torch.tensor([tw, th]))
               - torch.floor((m - square) / TILE).clamp(min=0)).clamp(min=0).prod(-1)
    sq_tiles = torch.where(visible, n_tiles, 0.0).sum()
    assert int(sq_tiles) > meta["isect_ids"].numel()


@pytest.mark.usefixtures("triton_on_cpu")
@pytest.mark.parametrize("render_mode,camera_model", [("RGB", "pinhole"), ("RGB+ED", "fisheye")])
def test_triton_pipeline_matches_dense_reference(render_mode, camera_model):
    """Every stage through its Triton kernel (interpreter): project, SH, intersection, sort, offsets, blend; the
    camera poses require grad too."""
    s = make_scene(67, 2, seed=4)
    kw = dict(sh_degree=3, render_mode=render_mode, camera_model=camera_model, keys=(*PARAMS, "viewmats"))
    got = _render(rasterize, s, bg=torch.tensor([0.1, 0.4, 0.2]), **kw)
    want = _render(render_reference, s, bg=torch.tensor([0.1, 0.4, 0.2]), **kw)
    _compare(got, want)


@pytest.mark.parametrize("triton", [False, True])
def test_antialiased_matches_dense_reference(triton, request):
    """rasterize_mode="antialiased" on the torch path and through every Triton kernel against the dense
    reference; and it is the classic render of Gaussians whose opacities are multiplied by the compensation."""
    if triton:
        request.getfixturevalue("triton_on_cpu")
    s = make_scene(67, 2, seed=6)
    kw = dict(sh_degree=3, rasterize_mode="antialiased")
    got = _render(rasterize, s, bg=torch.tensor([0.1, 0.4, 0.2]), **kw)
    _compare(got, _render(render_reference, s, bg=torch.tensor([0.1, 0.4, 0.2]), **kw))
    classic = _render(rasterize, s, bg=torch.tensor([0.1, 0.4, 0.2]), sh_degree=3)
    assert rel_err(got[0], classic[0]) > 1e-3  # the mode does change the image
    assert float(got[1].mean()) < float(classic[1].mean())  # compensation <= 1: less coverage, never more


def test_antialiased_mode_is_checked(scene):
    with pytest.raises(ValueError, match=r"rasterize_mode must be one of 'classic', 'antialiased', got 'mip'"):
        rasterize(*(scene[k] for k in ("means", "quats", "scales", "opacities", "sh", "viewmats", "Ks")), WIDTH,
                  HEIGHT, sh_degree=3, rasterize_mode="mip")


def test_public_names_and_a_cheap_import():
    import subprocess
    import sys

    import warpforge.splat as ws

    for name in ws.__all__:
        assert getattr(ws, name) is not None, name
    assert sorted(dir(ws)) == sorted(ws.__all__)
    code = "import sys, warpforge.splat; assert 'torch' not in sys.modules and 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.gpu
def test_gpu_render_matches_the_cpu_path():
    """On the H200: every stage's CUDA kernel against the torch path on the CPU at a size the interpreter cannot
    run (2 cameras, 20k Gaussians, 320x240, SH degree 3), images and every gradient, both camera models."""
    s = make_scene(20_000, 2, seed=21, width=320, height=240)
    for camera_model in ("pinhole", "fisheye"):
        out = {}
        for dev in ("cpu", "cuda"):
            p = {k: v.to(dev) for k, v in leaves(s).items()}
            for k in PARAMS:
                p[k] = p[k].detach().requires_grad_()
            img, alpha, meta = rasterize(p["means"], p["quats"], p["scales"], p["opacities"], p["sh"],
                                         p["viewmats"], p["Ks"], 320, 240, sh_degree=3, camera_model=camera_model,
                                         absgrad=True)
            g = torch.Generator().manual_seed(0)
            w = torch.randn(img.shape, generator=g).to(dev)
            (img * w).sum().backward()
            out[dev] = [img.detach().cpu(), alpha.detach().cpu(), meta["means2d"].absgrad.cpu()] + \
                [p[k].grad.cpu() for k in PARAMS]
        # the GPU blend takes fast exp2 and division, and its atomics sum in another order: the bar
        # against gsplat (images within 1e-3 on average, gradients cosine > 0.999) applied to our own two paths
        assert (out["cuda"][0] - out["cpu"][0]).abs().mean() < 1e-3
        for a, b in zip(out["cuda"][1:], out["cpu"][1:]):
            assert torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0) > 0.999
