"""The input-check kernel (Triton interpreter) against the torch checks it replaces on CUDA: the same flag for
every kind of bad value, in every checked tensor, at block edges and past the camera block; exact where the
torch sums overflow; and the camera centres it hands to the SH stage."""

from __future__ import annotations

import pytest
import torch

from tests.splat.conftest import make_scene
from warpforge.splat import checks
from warpforge.splat.camera import camera_centers

NAMES = ("means", "quats", "scales", "opacities", "sh")


def _named(s, background=None):
    named = [(("colors" if k == "sh" else k), s[k]) for k in NAMES]
    if background is not None:
        named.append(("background", background))
    return named


def _both(s, background=None):
    """(kernel flag, torch flag): True where a check failed."""
    named, cams = _named(s, background), (s["viewmats"], s["Ks"])
    bounds = checks.gaussian_bounds(s["scales"], s["opacities"])
    flag, _ = checks.check_flag_triton(named, cams, bounds)
    return bool(flag[0] != 0), not bool(checks.input_flag(named, cams, bounds))


def _scene():
    # 700 Gaussians of SH degree 3: the colours (33600 values) span 17 blocks of the kernel, the means 2
    s = make_scene(700, 19, seed=3)
    return {k: v.clone() for k, v in s.items()}


BAD = [("means", (0, 0), float("nan")), ("means", (682, 2), float("inf")),  # 682 * 3 + 2 = 2048: a block's first
       ("quats", (511, 3), float("-inf")), ("scales", (699, 2), float("nan")), ("scales", (5, 1), -1e-3),
       ("opacities", (699,), 1.0001), ("opacities", (0,), -0.5), ("sh", (699, 15, 2), float("nan")),
       ("sh", (42, 10, 1), float("inf")), ("viewmats", (18, 1, 3), float("nan")), ("Ks", (17, 0, 2), float("inf")),
       ("Ks", (16, 1, 1), 0.0), ("Ks", (0, 0, 0), -5.0)]


@pytest.mark.parametrize("name,index,value", BAD)
def test_kernel_flags_what_the_torch_checks_flag(name, index, value):
    s = _scene()
    assert _both(s) == (False, False)
    s[name][index] = value
    assert _both(s) == (True, True)


def test_background_slot_and_singular_cameras():
    s = _scene()
    bg = torch.tensor([0.1, 0.2, 0.3])
    assert _both(s, bg) == (False, False)
    assert _both(s, torch.tensor([0.1, float("nan"), 0.3])) == (True, True)
    for c, row in ((18, 2), (16, 0), (0, 3)):  # a zero row: no inverse (the last row: det 0 as well)
        t = _scene()
        t["viewmats"][c, row] = 0.0
        assert _both(t) == (True, True), (c, row)


def test_huge_finite_values_pass_the_kernel():
    """The kernel tests each element, so finite values whose sum overflows raise no flag (the torch sums do,
    and find nothing to name)."""
    s = _scene()
    s["means"][:] = 3e38
    kernel, torch_sums = _both(s)
    assert torch_sums and not kernel


def test_centres_are_the_inverse_translation():
    s = _scene()
    flag, centres = checks.check_flag_triton(_named(s), (s["viewmats"], s["Ks"]))
    assert int(flag[0]) == 0
    torch.testing.assert_close(centres, camera_centers(s["viewmats"]), rtol=1e-5, atol=1e-5)
    # a general (non-rigid) matrix with a projective last row: still the 4x4 inverse's column
    v = s["viewmats"].clone()
    v[:, 3] = torch.tensor([0.01, -0.02, 0.03, 1.1])
    v[:, :3, :3] *= torch.tensor([1.5, 0.7, 2.0])
    _, centres = checks.check_flag_triton(_named(s), (v, s["Ks"]))
    torch.testing.assert_close(centres, camera_centers(v), rtol=1e-4, atol=1e-5)


def test_slots_and_bounds_are_validated():
    t = torch.zeros(3)
    with pytest.raises(ValueError, match=r"the check kernel takes 1 to 6 tensors, got 7"):
        checks.check_flag_triton([(str(i), t) for i in range(7)])
    with pytest.raises(ValueError, match=r"bounds \['scales'\] name no checked tensor"):
        checks.check_flag_triton([("means", t)], bounds=[("scales", t, 0.0, None, "")])


def test_no_tensor_elements_still_checks_the_cameras():
    s = _scene()
    empty = [(k, v[:0]) for k, v in _named(s)]
    vm = s["viewmats"].clone()
    flag, centres = checks.check_flag_triton(empty, (vm, s["Ks"]))
    assert int(flag[0]) == 0 and centres.shape == (19, 3)
    vm[3, 0, 0] = float("nan")
    assert int(checks.check_flag_triton(empty, (vm, s["Ks"]))[0][0]) == 1
