"""Per-tile blending: the Triton kernels (interpreter) and the CPU path against autograd of the reference,
absgrad against a brute force with one copy of the means per pixel, and the whole tiled stage against a
dense per-pixel blend and a sequential per-pixel loop of gsplat's rules."""

from __future__ import annotations

import math

import pytest
import torch

from tests.splat._splats2d import opacity_aware_radii, splats_2d
from warpforge.splat import blend
from warpforge.splat import reference as ref

PARAMS = ("means2d", "conics", "colors", "opacities")
# (C, N, W, H, tile_size, D, background): odd sizes leave partial tiles; ts 8 gives many small tiles
CASES = [(2, 120, 45, 37, 16, 3, True), (1, 150, 33, 19, 8, 1, False), (3, 60, 40, 17, 16, 4, True),
         (1, 90, 21, 30, 16, 5, False)]


def _scene(C, N, W, H, ts, D, seed, tweak=None, **kw):
    s = splats_2d(C, N, W, H, D=D, seed=seed, **kw)
    if tweak is not None:
        tweak(s)
    tw, th = -(-W // ts), -(-H // ts)
    args = (s["means2d"], s["radii"], s["depths"], s["conics"], s["opacities"], ts, tw, th)
    _, keys, fids = ref.intersect_tiles_reference(*args)
    s["offsets"] = ref.tile_offsets_reference(keys, C, tw, th)
    s["flatten_ids"] = fids
    g = torch.Generator().manual_seed(seed + 1)
    s["bg"] = torch.rand(C, D, generator=g)
    s["v_out"] = torch.randn(C, H, W, D, generator=g)
    s["v_alpha"] = torch.randn(C, H, W, 1, generator=g)
    return s


def _run(fn, s, W, H, ts, bg, device="cpu", **kw):
    """Render with fn on ``device``, backprop a random linear loss; returns (colours, alphas, grads, absgrad)
    on the CPU."""
    d = {k: v.to(device) for k, v in s.items()}
    leaves = [d[k].clone().requires_grad_() for k in PARAMS]
    bgl = d["bg"].clone().requires_grad_() if bg else None
    out, alpha = fn(*leaves, W, H, ts, d["offsets"], d["flatten_ids"], backgrounds=bgl, **kw)
    ((out * d["v_out"]).sum() + (alpha * d["v_alpha"]).sum()).backward()
    grads = [v.grad for v in leaves] + ([bgl.grad] if bg else [])
    absgrad = getattr(leaves[0], "absgrad", None)
    return (out.detach().cpu(), alpha.detach().cpu(), [g.cpu() for g in grads],
            absgrad.cpu() if absgrad is not None else None)


def _reference(s, W, H, ts, bg):
    return _run(ref.rasterize_to_pixels_reference, s, W, H, ts, bg)


def _brute_absgrad(s, W, H, bg):
    """Sum over pixels of |dL/dmeans2d| of each pixel's own term: every pixel blends the camera's visible
    Gaussians (depth order, no tiles) through its own copy of the means, so autograd keeps them apart.
    Also returns the dense images, the tiled render's ground truth."""
    C, N, D = s["colors"].shape
    py, px = torch.meshgrid(torch.arange(H).float() + 0.5, torch.arange(W).float() + 0.5, indexing="ij")
    px, py = px.reshape(-1), py.reshape(-1)
    absgrad = torch.zeros(C, N, 2)
    imgs = torch.zeros(C, H, W, D)
    for c in range(C):
        vis = ((s["radii"][c] > 0).all(-1)).nonzero()[:, 0]
        ids = vis[torch.sort(s["depths"][c, vis], stable=True).indices]
        means = s["means2d"][c, ids][None].expand(H * W, -1, -1).clone().requires_grad_()
        out, T = ref.blend_tile(px, py, means, s["conics"][c, ids], s["colors"][c, ids], s["opacities"][c, ids])
        if bg:
            out = out + T[:, None] * s["bg"][c]
        loss = (out * s["v_out"][c].reshape(-1, D)).sum() + ((1 - T) * s["v_alpha"][c].reshape(-1)).sum()
        (g,) = torch.autograd.grad(loss, means)
        absgrad[c, ids] = g.abs().sum(0)
        imgs[c] = out.detach().reshape(H, W, D)
    return absgrad, imgs


# On the GPU the kernels take exp2 and division in their fast forms and contract to FMAs: a few pixels whose
# alpha or T sits within rounding of a threshold may blend one Gaussian more or less than the reference.
IMAGE_TOL, GRAD_TOL = (1e-4, 1e-3) if torch.cuda.is_available() else (1e-5, 2e-4)


def _close(got, want, rel=GRAD_TOL):
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale)


def _device(path, request):
    """The Triton path runs where the kernel tests run (the GPU when present, else the interpreter)."""
    if path != "triton":
        return "cpu"
    request.getfixturevalue("triton_on_cpu")
    return request.getfixturevalue("device")


@pytest.fixture
def poisoned(monkeypatch):
    """Kernel outputs start as NaN (or -7 for integers): an element the kernel never writes shows."""
    monkeypatch.setattr(blend, "_alloc", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))


def _check_against_reference(s, W, H, ts, bg, got):
    out, alpha, grads, absgrad = got
    r_out, r_alpha, r_grads, _ = _reference(s, W, H, ts, bg)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    _close(out, r_out, IMAGE_TOL)
    _close(alpha, r_alpha, IMAGE_TOL)
    for name, g, r in zip(PARAMS + ("backgrounds",), grads, r_grads):
        assert g is not None and torch.isfinite(g).all(), name
        _close(g, r), name
    brute, dense = _brute_absgrad(s, W, H, bg)
    _close(absgrad, brute)
    _close(out, dense, IMAGE_TOL)  # tiles + tight culling + sort + offsets == every Gaussian at every pixel


@pytest.mark.parametrize("case", CASES)
def test_triton_blend_matches_reference(case, triton_on_cpu, device, poisoned):
    C, N, W, H, ts, D, bg = case
    s = _scene(C, N, W, H, ts, D, seed=N + D)
    _check_against_reference(s, W, H, ts, bg, _run(blend.rasterize_to_pixels, s, W, H, ts, bg, device,
                                                   absgrad=True))


@pytest.mark.parametrize("case", CASES)
def test_cpu_path_matches_reference(case):
    C, N, W, H, ts, D, bg = case
    s = _scene(C, N, W, H, ts, D, seed=N + D)
    _check_against_reference(s, W, H, ts, bg, _run(blend.rasterize_to_pixels, s, W, H, ts, bg, absgrad=True))


@pytest.mark.parametrize("path", ["triton", "cpu"])
@pytest.mark.parametrize("unused", ["alpha", "out"])
def test_an_output_without_a_gradient(path, unused, request, poisoned):
    """A loss of the colours alone (the common case: the alphas take no gradient) or of the alphas alone: the
    backward gets None for the other output, fills no zeros for it, and matches a zero upstream gradient."""
    C, N, W, H, ts, D, bg = CASES[0]
    s = _scene(C, N, W, H, ts, D, seed=3)
    d = {k: v.to(_device(path, request)) for k, v in s.items()}
    leaves = [d[k].clone().requires_grad_() for k in PARAMS]
    out, alpha = blend.rasterize_to_pixels(*leaves, W, H, ts, d["offsets"], d["flatten_ids"], backgrounds=d["bg"])
    ((alpha * d["v_alpha"]).sum() if unused == "out" else (out * d["v_out"]).sum()).backward()
    s[f"v_{unused}"] = torch.zeros_like(s[f"v_{unused}"])
    _, _, r_grads, _ = _reference(s, W, H, ts, True)
    for name, g, r in zip(PARAMS, [v.grad.cpu() for v in leaves], r_grads):
        _close(g, r), name


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_dense_opaque_scene_terminates_early(path, request):
    """Many large opaque Gaussians: pixels saturate, so early termination, the last-index bookkeeping and
    the backward's T recovery by division all run (several chunks per tile, tile-wide early exit)."""
    dev = _device(path, request)
    C, N, W, H, ts, D = 1, 160, 35, 20, 16, 3
    s = _scene(C, N, W, H, ts, D, seed=11, scale=(2.0, 10.0), culled=0.0, min_opacity=0.6)
    got = _run(blend.rasterize_to_pixels, s, W, H, ts, True, dev, absgrad=True)
    T = 1 - got[1]
    assert float((T <= 2 * ref.T_MIN).float().mean()) > 0.5, "most pixels should saturate"
    assert got[2][0].abs().sum() > 0
    _check_against_reference(s, W, H, ts, True, got)


def _sequential(s, W, H):
    """gsplat's per-pixel loop, literally, in float64 Python: the rules the blend must follow."""
    C, N, D = s["colors"].shape
    out = torch.zeros(C, H, W, D, dtype=torch.float64)
    alphas = torch.zeros(C, H, W, 1, dtype=torch.float64)
    m, con, col, op = (s[k].double().tolist() for k in PARAMS)
    for c in range(C):
        order = sorted((i for i in range(N) if s["radii"][c, i].min() > 0), key=lambda i: (s["depths"][c, i], i))
        for y in range(H):
            for x in range(W):
                T, acc = 1.0, [0.0] * D
                for i in order:
                    dx, dy = m[c][i][0] - (x + 0.5), m[c][i][1] - (y + 0.5)
                    a, b, cc = con[c][i]
                    sigma = 0.5 * (a * dx * dx + cc * dy * dy) + b * dx * dy
                    alpha = min(ref.ALPHA_MAX, op[c][i] * math.exp(-sigma))
                    if sigma < 0 or alpha < ref.ALPHA_MIN:
                        continue
                    if T * (1 - alpha) <= ref.T_MIN:
                        break
                    for d in range(D):
                        acc[d] += col[c][i][d] * alpha * T
                    T *= 1 - alpha
                out[c, y, x] = torch.tensor(acc)
                alphas[c, y, x, 0] = 1 - T
    return out.float(), alphas.float()


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_follows_gsplats_per_pixel_rules(path, request):
    dev = _device(path, request)
    C, N, W, H, ts, D = 1, 50, 19, 13, 8, 2

    def tweak(s):  # three Gaussians clamped to ALPHA_MAX at their centres, which sit on pixel centres
        s["opacities"][0, :3] = 0.999
        s["means2d"][0, :3] = torch.tensor([[4.5, 4.5], [10.5, 6.5], [15.5, 9.5]])
        s["radii"] = opacity_aware_radii(s["conics"], s["opacities"])

    s = _scene(C, N, W, H, ts, D, seed=4, tweak=tweak, scale=(1.0, 6.0), culled=0.0)
    out, alpha, _, _ = _run(blend.rasterize_to_pixels, s, W, H, ts, False, dev)
    want_out, want_alpha = _sequential(s, W, H)
    _close(out, want_out, IMAGE_TOL)
    _close(alpha, want_alpha, IMAGE_TOL)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_no_gaussians_renders_the_background(path, request):
    dev = _device(path, request)
    C, N, W, H, ts, D = 2, 20, 23, 17, 16, 3
    s = _scene(C, N, W, H, ts, D, seed=9)
    s["flatten_ids"] = s["flatten_ids"][:0]
    s["offsets"] = torch.zeros_like(s["offsets"])
    out, alpha, grads, absgrad = _run(blend.rasterize_to_pixels, s, W, H, ts, True, dev, absgrad=True)
    assert torch.equal(out, s["bg"][:, None, None, :].expand(C, H, W, D))
    assert torch.equal(alpha, torch.zeros(C, H, W, 1))
    assert all(int(g.count_nonzero()) == 0 for g in grads[:4]) and int(absgrad.count_nonzero()) == 0
    _close(grads[4], s["v_out"].sum(dim=(1, 2)))


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_absgrad_lands_on_the_means2d_passed_in(path, request):
    """A non-contiguous means2d (a view, as a caller may hand over) gets its gradient and .absgrad itself."""
    dev = _device(path, request)
    C, N, W, H, ts, D = 1, 40, 24, 20, 16, 3
    s = _scene(C, N, W, H, ts, D, seed=8)
    d = {k: v.to(dev) for k, v in s.items()}
    store = d["means2d"].transpose(1, 2).contiguous().requires_grad_()  # [C, 2, N]
    means2d = store.transpose(1, 2)  # [C, N, 2], not contiguous
    means2d.retain_grad()
    out, alpha = blend.rasterize_to_pixels(means2d, d["conics"], d["colors"], d["opacities"], W, H, ts,
                                           d["offsets"], d["flatten_ids"], absgrad=True)
    ((out * d["v_out"]).sum() + (alpha * d["v_alpha"]).sum()).backward()
    assert not means2d.is_contiguous() and means2d.absgrad.shape == (C, N, 2)
    brute, _ = _brute_absgrad(s, W, H, False)
    _close(means2d.absgrad.cpu(), brute)
    _close(store.grad.transpose(1, 2), means2d.grad)
    assert means2d.grad.abs().sum() > 0


def test_bad_input_names_the_argument():
    C, N, W, H, ts, D = 1, 10, 20, 20, 16, 3
    s = _scene(C, N, W, H, ts, D, seed=1)
    args = [s[k] for k in PARAMS]
    with pytest.raises(ValueError, match=r"tile_offsets must have shape \[1, 2, 2\]"):
        blend.rasterize_to_pixels(*args, W, H, ts, s["offsets"][:, :1], s["flatten_ids"])
    with pytest.raises(ValueError, match="flatten_ids must be a 1-D int32"):
        blend.rasterize_to_pixels(*args, W, H, ts, s["offsets"], s["flatten_ids"].long())
    with pytest.raises(ValueError, match=r"backgrounds must have shape \[1, 3\]"):
        blend.rasterize_to_pixels(*args, W, H, ts, s["offsets"], s["flatten_ids"], backgrounds=torch.zeros(3))
    with pytest.raises(ValueError, match="opacities must have dtype torch.float32"):
        blend.rasterize_to_pixels(*args[:3], args[3].double(), W, H, ts, s["offsets"], s["flatten_ids"])
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        blend.rasterize_to_pixels(*args, 0, H, ts, s["offsets"], s["flatten_ids"])


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot check: the kernels compile for the H200 and fit their registers."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "tests.splat._sm90_splat"], capture_output=True, text=True,
                          env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 7
    assert all(r["spill_bytes"] == 0 for r in res.values()), res
    assert all(res[f"blend_fwd D{d}"]["regs"] <= 168 for d in (3, 4)), res  # >= 3 blocks of 4 warps a SM


@pytest.mark.gpu
def test_gpu_kernels_match_the_cpu_path_on_a_larger_scene():
    """On the H200: intersection, sort, offsets and blend (forward, backward, absgrad) on CUDA against the
    torch path on the CPU, at a size the interpreter cannot run (2 cameras, 20k Gaussians, 320x240)."""
    from warpforge.splat import tiles

    C, N, W, H, ts, D = 2, 20_000, 320, 240, 16, 3
    s = splats_2d(C, N, W, H, D=D, seed=21, scale=(0.5, 8.0))
    g = torch.Generator().manual_seed(22)
    v_out, v_alpha = torch.randn(C, H, W, D, generator=g), torch.randn(C, H, W, 1, generator=g)
    tw, th = -(-W // ts), -(-H // ts)
    outs = {}
    for dev in ("cuda", "cpu"):
        d = {k: v.to(dev) for k, v in s.items()}
        _, keys, fids = tiles.intersect_tiles(d["means2d"], d["radii"], d["depths"], d["conics"], d["opacities"],
                                              ts, tw, th)
        offsets = tiles.tile_offsets(keys, C, tw, th)
        leaves = [d[k].clone().requires_grad_() for k in PARAMS]
        out, alpha = blend.rasterize_to_pixels(*leaves, W, H, ts, offsets, fids, absgrad=True)
        ((out * v_out.to(dev)).sum() + (alpha * v_alpha.to(dev)).sum()).backward()
        outs[dev] = [out.detach().cpu(), alpha.detach().cpu(), *(v.grad.cpu() for v in leaves),
                     leaves[0].absgrad.cpu(), keys.numel()]
    gpu, cpu = outs["cuda"], outs["cpu"]
    assert abs(gpu[-1] - cpu[-1]) <= 0.01 * cpu[-1]
    assert (gpu[0] - cpu[0]).abs().mean() < 1e-5 and (gpu[1] - cpu[1]).abs().mean() < 1e-5
    for name, a, b in zip(PARAMS + ("absgrad",), gpu[2:-1], cpu[2:-1]):
        cos = float((a.double() * b.double()).sum() / (a.double().norm() * b.double().norm()))
        assert cos > 0.9999, (name, cos)
