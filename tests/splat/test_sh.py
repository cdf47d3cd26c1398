"""The SH kernels (Triton interpreter) against the torch reference: colours into NaN-poisoned buffers, gradients
of a random loss for dirs and coefficients, every degree, odd sizes, coefficients shared across cameras."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err
from warpforge.splat import reference as ref
from warpforge.splat import sh as sh_mod
from warpforge.splat.sh import spherical_harmonics

# fp32 polynomials up to degree 3 and a 16-term dot product, in another order than torch's
TOL = FP32_ELEMENTWISE_TOL[0] * 5


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(sh_mod, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                                    device=device))


def _run(fn, degree, dirs, coeffs, seed=0):
    d = dirs.clone().requires_grad_()
    c = coeffs.clone().requires_grad_()
    out = fn(degree, d, c)
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), d.grad, c.grad


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
@pytest.mark.parametrize("shape,shared,K", [((1,), False, 16), ((3, 67), True, 16), ((2, 65), False, 9),
                                            ((129,), False, 17)])
def test_triton_matches_reference(degree, shape, shared, K, triton_on_cpu, poisoned):
    K = max(K, (degree + 1) ** 2)  # training passes all 16 and raises the degree; K = (degree + 1)^2 is tight
    g = torch.Generator().manual_seed(degree * 100 + shape[-1])
    dirs = torch.randn(*shape, 3, generator=g) * 4
    coeffs = torch.randn(*(shape[1:] if shared else shape), K, 3, generator=g)
    got = _run(spherical_harmonics, degree, dirs, coeffs)
    want = _run(ref.sh_reference, degree, dirs, coeffs)
    assert got[0].shape == (*shape, 3)
    assert rel_err(got[0], want[0]) < TOL
    n = (degree + 1) ** 2
    assert rel_err(got[2], want[2]) < TOL
    assert (got[2][..., n:, :] == 0).all()  # unused coefficients get exact zeros
    if degree == 0:  # a constant basis: the direction gets no gradient (the reference builds none)
        assert want[1] is None and (got[1] == 0).all()
    else:
        assert rel_err(got[1], want[1]) < TOL


def test_shared_coefficients_sum_over_cameras(triton_on_cpu, poisoned):
    """Coefficients shared by C cameras get the sum of the C per-camera gradients (no atomics: one program
    loops over the cameras)."""
    g = torch.Generator().manual_seed(1)
    dirs = torch.randn(4, 33, 3, generator=g)
    coeffs = torch.randn(33, 16, 3, generator=g)
    _, _, shared = _run(spherical_harmonics, 3, dirs, coeffs)
    _, _, each = _run(spherical_harmonics, 3, dirs, coeffs[None].expand(4, -1, -1, -1).contiguous())
    torch.testing.assert_close(shared, each.sum(0), rtol=1e-5, atol=1e-6)


def test_degenerate_directions(triton_on_cpu, poisoned):
    """A zero direction (a camera at a Gaussian's centre) stays finite, as F.normalize's eps makes it."""
    dirs = torch.tensor([[0.0, 0.0, 0.0], [1e-20, 0.0, 0.0], [0.0, 3.0, 4.0]])
    coeffs = torch.randn(3, 16, 3, generator=torch.Generator().manual_seed(0))
    out, v_d, v_c = _run(spherical_harmonics, 3, dirs, coeffs)
    want = _run(ref.sh_reference, 3, dirs, coeffs)
    assert torch.isfinite(out).all() and torch.isfinite(v_c).all()
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_d[2], want[1][2], rtol=1e-5, atol=1e-6)


def test_launcher_validates_its_buffers():
    with pytest.raises(ValueError, match=r"dirs must be contiguous"):
        sh_mod.sh_fwd_triton(1, torch.zeros(3, 8).t(), torch.zeros(8, 4, 3), 1)
    with pytest.raises(ValueError, match=r"SH kernel arguments must be dirs \[CAMS \* N, 3\]"):
        sh_mod.sh_fwd_triton(1, torch.zeros(8, 3), torch.zeros(8, 4, 3), 2)
    with pytest.raises(ValueError, match=r"coeffs must be torch.float32, got torch.float16"):
        sh_mod.sh_fwd_triton(1, torch.zeros(8, 3), torch.zeros(8, 4, 3).half(), 1)
    with pytest.raises(ValueError, match=r"v_colors must be a contiguous float32 \[8, 3\] tensor"):
        sh_mod.sh_bwd_triton(1, torch.zeros(8, 3), torch.zeros(8, 4, 3), torch.zeros(8, 2), 1)


def _run_colors(fn, degree, means, centres, coeffs, seed=0):
    m, c, k = (t.clone().requires_grad_() for t in (means, centres, coeffs))
    out = fn(degree, m, c, k)
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out.detach(), m.grad, c.grad, k.grad


def _colors_reference(degree, means, centres, coeffs):
    return torch.clamp_min(ref.sh_reference(degree, means[None] - centres[:, None], coeffs) + 0.5, 0.0)


@pytest.mark.parametrize("degree", [0, 1, 3])
@pytest.mark.parametrize("C,N,per_camera", [(1, 1, False), (3, 67, False), (2, 33, True)])
def test_render_colours_match_reference(degree, C, N, per_camera, triton_on_cpu, poisoned):
    """``sh_colors``: the directions from the means and camera centres, + 0.5 and the clamp at 0 in the kernels,
    against the torch ops they replace; gradients to means, centres (pose refinement) and coefficients. The DC
    terms straddle -0.5, so the clamp cuts some colours (and their gradients) and passes others."""
    g = torch.Generator().manual_seed(degree * 10 + N)
    means = torch.randn(N, 3, generator=g) * 2
    centres = torch.randn(C, 3, generator=g) * 3 + torch.tensor([0.0, 0.0, -6.0])
    K = 16
    coeffs = 0.3 * torch.randn(*((C,) if per_camera else ()), N, K, 3, generator=g)
    coeffs[..., 0, :] = torch.randn(*coeffs.shape[:-2], 3, generator=g) * 2
    got = _run_colors(sh_mod.sh_colors, degree, means, centres, coeffs)
    want = _run_colors(_colors_reference, degree, means, centres, coeffs)
    assert got[0].shape == (C, N, 3)
    clamped = _colors_reference(degree, means, centres, coeffs) == 0
    if N > 1:
        assert clamped.any() and not clamped.all()  # the clamp is exercised both ways
    assert rel_err(got[0], want[0]) < TOL
    assert rel_err(got[3], want[3]) < TOL
    if degree == 0:  # a constant basis: the means and centres get no gradient (the reference builds none)
        assert want[1] is None and (got[1] == 0).all() and (got[2] == 0).all()
    else:
        assert rel_err(got[1], want[1]) < TOL
        assert rel_err(got[2], want[2]) < TOL


def test_render_launchers_validate_their_buffers():
    with pytest.raises(ValueError, match=r"SH render kernel arguments must be means \[N, 3\], centres \[C, 3\]"):
        sh_mod.sh_colors_fwd_triton(1, torch.zeros(8, 3), torch.zeros(2, 3), torch.zeros(7, 4, 3))
    with pytest.raises(ValueError, match=r"centres must be contiguous"):
        sh_mod.sh_colors_fwd_triton(1, torch.zeros(8, 3), torch.zeros(3, 2).t(), torch.zeros(8, 4, 3))
    with pytest.raises(ValueError, match=r"v_colors must be a contiguous float32 \[2, 8, 3\] tensor"):
        sh_mod.sh_colors_bwd_triton(1, torch.zeros(8, 3), torch.zeros(2, 3), torch.zeros(8, 4, 3),
                                    torch.zeros(8, 3))
