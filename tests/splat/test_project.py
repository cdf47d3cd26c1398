"""The projection kernels (Triton interpreter) against the torch reference: outputs into NaN-poisoned buffers,
gradients of a random loss against autograd of the reference, odd N, several cameras, both camera models,
Gaussians behind the camera and degenerate scales."""

from __future__ import annotations

import pytest
import torch

from tests.splat.conftest import HEIGHT, WIDTH, cameras, leaves, make_scene
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err
from warpforge.splat import project as project_mod
from warpforge.splat import reference as ref
from warpforge.splat.project import project

GAUSS = ("means", "quats", "scales", "opacities")
# fp32 elementwise math in a different order from torch's batched matmuls; the backward chains ~10 products
# and divisions by det (conics ~ 1/det^2): measured ~1e-6, bounded at 1e-5
TOL = 1e-5


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer starts as NaN (int32: a sentinel), so a kernel that skips an element is caught."""
    def alloc(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -7
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(project_mod, "_alloc", alloc)


def _run(s, triton: bool, camera_model="pinhole", seed=0, fields=("means2d", "conics", "depths", "opacities"),
         **kw):
    p = leaves(s, GAUSS)
    args = [p[k] for k in (*GAUSS, "viewmats", "Ks")]
    if triton:
        out = project(*args, WIDTH, HEIGHT, camera_model=camera_model, **kw)
    else:
        out = ref.project_reference(*args, WIDTH, HEIGHT, camera_model=camera_model, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = sum((getattr(out, f) * torch.randn(getattr(out, f).shape, generator=g)).sum() for f in fields)
    loss.backward()
    return out, {k: p[k].grad for k in GAUSS}


@pytest.mark.parametrize("n,n_cameras", [(1, 1), (7, 2), (129, 3)])
@pytest.mark.parametrize("camera_model", ["pinhole", "fisheye"])
def test_triton_matches_reference(n, n_cameras, camera_model, triton_on_cpu, poisoned):
    s = make_scene(n, n_cameras, seed=n)
    got, g_got = _run(s, True, camera_model)
    want, g_want = _run(s, False, camera_model)
    assert torch.equal(got.radii, want.radii)
    for f in ("means2d", "conics", "depths", "opacities"):
        assert rel_err(getattr(got, f), getattr(want, f)) < FP32_ELEMENTWISE_TOL[0] * 10, f
    for k in GAUSS:
        if float(g_want[k].norm()) == 0:
            assert float(g_got[k].abs().max()) == 0, k
        else:
            assert rel_err(g_got[k], g_want[k]) < TOL, (k, rel_err(g_got[k], g_want[k]))
    if n >= 7:
        assert (got.radii > 0).any() and (got.radii == 0).any()  # the scene has both kinds


@pytest.mark.parametrize("antialiased", [False, True])
def test_outputs_without_a_gradient(antialiased, triton_on_cpu, poisoned):
    """A loss that reads only the centres and conics (an RGB render's depths, or with antialiasing also the
    opacities, take no gradient): the backward gets None for those outputs, reads no zeros, and matches."""
    s = make_scene(67, 2, seed=5)
    fields = ("means2d", "conics")
    _, g_got = _run(s, True, fields=fields, antialiased=antialiased)
    _, g_want = _run(s, False, fields=fields, antialiased=antialiased)
    for k in ("means", "quats", "scales"):
        assert rel_err(g_got[k], g_want[k]) < TOL, (k, rel_err(g_got[k], g_want[k]))


@pytest.mark.parametrize("camera_model", ["pinhole", "fisheye"])
def test_antialiased_triton_matches_reference(camera_model, triton_on_cpu, poisoned):
    """The compensation sqrt(det(Sigma2d) / det(Sigma2d + eps2d I)) in the kernels: per-camera opacities, the
    radii and culling that use them, and the gradient through the determinants (tiny and huge Gaussians of the
    scene sit at both ends of the factor)."""
    s = make_scene(129, 3, seed=11)
    got, g_got = _run(s, True, camera_model, antialiased=True)
    want, g_want = _run(s, False, camera_model, antialiased=True)
    assert torch.equal(got.radii, want.radii)
    keep = (want.radii > 0).all(-1)
    comp = want.opacities[keep] / s["opacities"][None].expand_as(keep)[keep]
    assert comp.min() < 0.5 and comp.max() > 0.99 and comp.max() <= 1  # the scene spans the factor's range
    assert (want.opacities[~keep] == 0).all()
    for f in ("means2d", "conics", "depths", "opacities"):
        assert rel_err(getattr(got, f), getattr(want, f)) < FP32_ELEMENTWISE_TOL[0] * 10, f
    for k in GAUSS:
        assert rel_err(g_got[k], g_want[k]) < TOL, (k, rel_err(g_got[k], g_want[k]))
    classic, _ = _run(s, True, camera_model)
    assert ((got.radii <= classic.radii) | (classic.radii == 0)).all()  # a fainter splat, a box no larger


@pytest.mark.parametrize("camera_model", ["pinhole", "fisheye"])
def test_viewmat_gradients(camera_model, triton_on_cpu, poisoned):
    """Camera poses that require grad get the reference's gradient (summed over a block, then atomically)."""
    s = make_scene(150, 3, seed=12)
    out = {}
    for name, fn in (("triton", project), ("ref", ref.project_reference)):
        vm = s["viewmats"].clone().requires_grad_()
        p = fn(s["means"], s["quats"], s["scales"], s["opacities"], vm, s["Ks"], WIDTH, HEIGHT,
               camera_model=camera_model)
        g = torch.Generator().manual_seed(1)
        sum((t * torch.randn(t.shape, generator=g)).sum() for t in (p.means2d, p.conics, p.depths)).backward()
        out[name] = vm.grad
    assert float(out["ref"][:, :3].norm()) > 0 and (out["triton"][:, 3] == 0).all()
    assert rel_err(out["triton"], out["ref"]) < TOL


def test_culled_gaussians_get_zeros_and_no_gradient(triton_on_cpu, poisoned):
    """Behind the camera, inside the near plane, transparent, off-screen: radii 0, zero outputs, zero grads."""
    viewmats, Ks = cameras(1)
    R, t = viewmats[0, :3, :3], viewmats[0, :3, 3]
    cam_pts = torch.tensor([[0.0, 0.0, -2.0], [0.1, 0.0, 0.005], [0.0, 0.0, 3.0], [50.0, 0.0, 3.0], [0.2, 0.1, 3.0]])
    means = (cam_pts - t) @ R  # world points with these camera-space positions (R orthonormal)
    s = {"means": means, "quats": torch.randn(5, 4), "scales": torch.full((5, 3), 0.05),
         "opacities": torch.tensor([0.9, 0.9, 0.5 / 255, 0.9, 0.9]), "viewmats": viewmats, "Ks": Ks}
    out, grads = _run(s, True)
    assert out.radii[0, :4].eq(0).all() and out.radii[0, 4].gt(0).all()
    assert (out.means2d[0, :4] == 0).all() and (out.conics[0, :4] == 0).all() and (out.depths[0, :4] == 0).all()
    for k in ("means", "quats", "scales"):
        assert (grads[k][:4] == 0).all() and grads[k][4].abs().sum() > 0, k


def test_degenerate_and_extreme_scales(triton_on_cpu, poisoned):
    """Zero scales (the blur alone), needles, and huge Gaussians close to the camera."""
    s = make_scene(33, 2, seed=9)
    scales = s["scales"].clone()
    scales[:4] = 0.0
    scales[4:8, :2] = 1e-6
    scales[8:12] = 50.0
    s["scales"] = scales
    for model in ("pinhole", "fisheye"):
        got, g_got = _run(s, True, model)
        want, g_want = _run(s, False, model)
        assert torch.equal(got.radii, want.radii)
        assert rel_err(got.conics, want.conics) < 1e-5 and rel_err(got.means2d, want.means2d) < 1e-6
        for k in ("means", "quats", "scales"):
            assert torch.isfinite(g_got[k]).all() and rel_err(g_got[k], g_want[k]) < TOL, k


def test_settings_reach_the_kernel(triton_on_cpu):
    """near, far and eps2d change the kernel's output as they change the reference's."""
    s = make_scene(64, 2, seed=4)
    for kw in (dict(near=3.5), dict(far=4.0), dict(eps2d=0.0), dict(eps2d=2.0)):
        got, _ = _run(s, True, **kw)
        want, _ = _run(s, False, **kw)
        base, _ = _run(s, False)
        assert torch.equal(got.radii, want.radii), kw
        assert rel_err(got.conics, want.conics) < 1e-5, kw
        assert not torch.equal(want.radii, base.radii), kw  # the setting did matter


def test_atan2_matches_torch(triton_on_cpu):
    """The kernels' own atan2 (libdevice's is not in the interpreter) over every octant."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(y_ptr, x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(o_ptr + i, project_mod._atan2(tl.load(y_ptr + i, mask=m), tl.load(x_ptr + i, mask=m)), mask=m)

    g = torch.Generator().manual_seed(0)
    y = torch.cat([torch.rand(999, generator=g) * 10.0 ** torch.randint(-6, 4, (999,), generator=g),
                   torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0])])
    x = torch.cat([torch.randn(999, generator=g) * 10.0 ** torch.randint(-6, 4, (999,), generator=g),
                   torch.tensor([0.0, -1.0, 0.0, 1.0, -2.0])])
    out = torch.full_like(y, float("nan"))
    k[(triton.cdiv(y.numel(), 256),)](y, x, out, y.numel(), BLOCK=256)
    assert (out - torch.atan2(y, x)).abs().max() < 5e-7


def test_launcher_validates_its_buffers():
    s = make_scene(8, 1)
    args = [s[k].contiguous() for k in (*GAUSS, "viewmats", "Ks")]
    with pytest.raises(ValueError, match=r"quats must be contiguous"):
        project_mod.project_fwd_triton(args[0], args[1].t().contiguous().t(), *args[2:], WIDTH, HEIGHT, 0.01,
                                       1e10, 0.3, 0)
    with pytest.raises(ValueError, match=r"radii must be torch.int32, got torch.int64"):
        project_mod.project_bwd_triton(args[0], args[1], args[2], args[4], args[5], torch.zeros(1, 8, 2).long(),
                                       torch.zeros(1, 8, 2), torch.zeros(1, 8, 3), torch.zeros(1, 8), WIDTH, HEIGHT,
                                       0.01, 1e10, 0.3, 0)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot check: the projection, SH and input-check kernels compile for the H200
    (offline ptxas) without spills, within the register budgets their launch shapes were chosen for."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.splat._sm90_core"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 16 and all(r["spill_bytes"] == 0 for r in res.values()), res
    assert all(r["regs"] <= 128 for r in res.values()), res  # >= 4 blocks of 4 warps a SM
