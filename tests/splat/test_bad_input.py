"""Bad input to ``rasterize`` (and the stage functions it validates with): one-line ValueErrors that name the
argument, what was expected and what was given; never a wrong image or a crash."""

from __future__ import annotations

import pytest
import torch

from tests.splat.conftest import HEIGHT, WIDTH, make_scene
from warpforge.splat import checks, rasterize, render
from warpforge.splat.project import project
from warpforge.splat.sh import spherical_harmonics

ARGS = ("means", "quats", "scales", "opacities", "sh", "viewmats", "Ks")


@pytest.fixture
def s():
    return make_scene(20, 2, seed=0, sh_degree=2)


def _call(s, width=WIDTH, height=HEIGHT, **kw):
    kw.setdefault("sh_degree", 2)
    return rasterize(*(s[k] for k in ARGS), width, height, **kw)


def _raises(match: str, fn, *args, **kw):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name,index,value", [("means", (5, 1), float("nan")), ("quats", (0, 3), float("inf")),
                                              ("scales", (19, 0), float("-inf")), ("opacities", (7,), float("nan")),
                                              ("sh", (3, 2, 1), float("nan"))])
def test_non_finite_parameters_name_the_tensor_and_index(s, name, index, value):
    s[name] = s[name].clone()
    s[name][index] = value
    label = "colors" if name == "sh" else name
    msg = _raises(f"{label} has a non-finite value", _call, s)
    assert str(list(index)) in msg


@pytest.mark.parametrize("name,index,value,match", [
    ("scales", (4, 2), -0.5,
     r"scales must be >= 0.0 \(linear scales, exp of the log-scales\), got -0.5 at index \[4, 2\]"),
    ("opacities", (9,), 1.5, r"opacities must be in \[0.0, 1.0\] \(after the sigmoid\), got 1.5 at index \[9\]"),
    ("opacities", (0,), -2.0, r"opacities must be in \[0.0, 1.0\] \(after the sigmoid\), got -2.0 at index \[0\]"),
])
def test_out_of_range_scales_and_opacities(s, name, index, value, match):
    """The documented ranges: log-scales or logits passed where linear scales and opacities belong are refused
    (a negative scale would otherwise render as its absolute value, an opacity > 1 as 0.999)."""
    s[name] = s[name].clone()
    s[name][index] = value
    _raises(match, _call, s)
    _raises(match, project, s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"], WIDTH,
            HEIGHT)
    s[name][index] = 0.0  # the edges of the ranges are fine
    _call(s)


def test_non_finite_background_and_cameras(s):
    _raises(r"background has a non-finite value \(nan\) at index \[1\]", _call, s,
            background=torch.tensor([0.0, float("nan"), 0.0]))
    vm = s["viewmats"].clone()
    vm[1, 0, 3] = float("inf")
    _raises(r"viewmats has a non-finite value at index \[1, 0, 3\]", _call, dict(s, viewmats=vm))


@pytest.mark.parametrize("name,bad,match", [
    ("quats", lambda t: t[:, :3], r"quats must have shape \[20, 4\].*got \[20, 3\]"),
    ("scales", lambda t: t[:-1], r"scales must have shape \[20, 3\].*got \[19, 3\]"),
    ("opacities", lambda t: t[:, None], r"opacities must have shape \[20\].*got \[20, 1\]"),
    ("means", lambda t: t[:, :2], r"means must be a \[N, 3\] tensor, got \[20, 2\]"),
    ("means", lambda t: t.double(), r"means must be torch.float32, got torch.float64"),
    ("scales", lambda t: t.half(), r"scales must be torch.float32, got torch.float16"),
    ("sh", lambda t: t[:, :4], r"colors must be SH coefficients .* K >= 9 for sh_degree=2 .* got \[20, 4, 3\]"),
    ("sh", lambda t: t.double(), r"colors must be torch.float32"),
    ("viewmats", lambda t: t[:, :3], r"viewmats must have shape \[C, 4, 4\], got \[2, 3, 4\]"),
    ("Ks", lambda t: t[:1], r"viewmats and Ks must have the same number of cameras, got 2 and 1"),
    ("viewmats", lambda t: t[:0], r"viewmats and Ks must have the same number of cameras, got 0 and 2"),
    ("Ks", lambda t: t * torch.tensor([[0.0, 1, 1], [1, 1, 1], [1, 1, 1]]), r"Ks\[0\] must have positive focal"),
])
def test_mismatched_shapes_and_dtypes(s, name, bad, match):
    _raises(match, _call, dict(s, **{name: bad(s[name])}))


def test_devices_must_match(s):
    meta = s["means"].to("meta")
    _raises(r"quats must be on meta like means, got cpu", _call, dict(s, means=meta))


def test_colour_layouts(s):
    _raises(r"colors must be \[N, D\] or \[C, N, D\] features .* \(SH coefficients \[N, K, 3\] need sh_degree\)",
            _call, s, sh_degree=None)
    _raises(r"colors must be \[N, D\] or \[C, N, D\] features", _call, dict(s, sh=torch.zeros(3, 20, 4)),
            sh_degree=None)
    _raises(r"sh_degree must be None or an int in \[0, 3\], got 4", _call, s, sh_degree=4)
    _raises(r"background must have shape \[3\] or \[2, 3\]", _call, s, background=torch.zeros(4))
    _raises(r"background must have shape \[5\] or \[2, 5\]", _call, dict(s, sh=torch.zeros(20, 5)), sh_degree=None,
            background=torch.zeros(3, 5))


@pytest.mark.parametrize("kw,match", [
    (dict(width=0), r"width must be an int >= 1, got 0"),
    (dict(height=0), r"height must be an int >= 1, got 0"),
    (dict(width=40.0), r"width must be an int >= 1, got 40.0"),
    (dict(tile_size=0), r"tile_size must be an int in \[1, 32\], got 0"),
    (dict(tile_size=64), r"tile_size must be an int in \[1, 32\], got 64"),
    (dict(render_mode="RGBD"), r"render_mode must be one of 'RGB', 'D', 'ED', 'RGB\+ED', got 'RGBD'"),
    (dict(camera_model="ortho"), r"camera_model must be one of 'pinhole', 'fisheye', got 'ortho'"),
    (dict(near=0.0), r"near must be a finite number > 0, got 0.0"),
    (dict(far=0.005), r"far must be a number > near=0.01, got 0.005"),
    (dict(eps2d=-1.0), r"eps2d must be a finite number >= 0, got -1.0"),
])
def test_bad_settings(s, kw, match):
    _raises(match, _call, s, **kw)


def test_memory_estimate_before_allocating(s, monkeypatch):
    """More work than memory: refused with the estimate, before anything big is allocated."""
    monkeypatch.setattr(render, "free_bytes", lambda device: 2**20)
    msg = _raises(r"rasterize of 20 Gaussians into 2 camera\(s\) at 4000x3000 needs at least [\d.]+ GiB, more than "
                  r"the 0.00 GiB free on cpu", _call, s, width=4000, height=3000)
    assert "fewer cameras" in msg
    # and against this machine's real free memory: 2 cameras of 1M x 1M pixels cannot fit
    monkeypatch.undo()
    _raises(r"needs at least \d+\.\d+ GiB, more than the", _call, s, width=1_000_000, height=1_000_000)


def test_cuda_memory_check_asks_the_allocator_only_when_the_driver_falls_short(monkeypatch):
    """The check's CUDA side with the CUDA calls stubbed (no GPU needed): the driver's free memory alone when it
    covers the estimate (one cheap call a render), else plus what torch's allocator holds unused."""
    need = {C: render.estimate_bytes(C, 5_000_000, 3, 1920, 1080, 16) for C in (1, 3, 8)}
    driver, cached = (need[1] + need[3]) // 2, need[3]  # covers 1 camera alone, 3 with the cache, not 8
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (calls.append("driver") or (driver, 80 * 2**30)))
    stats = {"reserved_bytes": {"all": {"current": cached + 2**30}}, "allocated_bytes": {"all": {"current": 2**30}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: calls.append("stats") or stats)
    cuda = torch.device("cuda", 0)
    render.check_memory(1, 5_000_000, 3, 1920, 1080, 16, cuda)
    assert calls == ["driver"]
    calls.clear()
    render.check_memory(3, 5_000_000, 3, 1920, 1080, 16, cuda)
    assert calls == ["driver", "stats", "driver"]
    with pytest.raises(ValueError, match=rf"needs at least [\d.]+ GiB, more than the {(driver + cached) / 2**30:.2f} "
                                         r"GiB free on cuda:0"):
        render.check_memory(8, 5_000_000, 3, 1920, 1080, 16, cuda)


def test_unnormalized_quaternions_are_normalized(s):
    a, _, ma = _call(s)
    b, _, mb = _call(dict(s, quats=s["quats"] * 7.5))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(ma["radii"], mb["radii"])


def test_stage_functions_validate_too(s):
    _raises(r"opacities must have shape \[20\]", project, s["means"], s["quats"], s["scales"], s["opacities"][:3],
            s["viewmats"], s["Ks"], WIDTH, HEIGHT)
    _raises(r"degree must be an int in \[0, 3\], got 5", spherical_harmonics, 5, torch.zeros(4, 3),
            torch.zeros(4, 16, 3))
    _raises(r"coeffs must have shape \[4, 'K', 3\] \(or \['K', 3\], shared\) with K >= 16", spherical_harmonics, 3,
            torch.zeros(4, 3), torch.zeros(4, 9, 3))


def test_nothing_visible_renders_the_background(s):
    """All Gaussians behind every camera: culled, no intersections, the image is the background."""
    far_behind = dict(s, means=s["means"] * 0 + torch.tensor([0.0, 0.0, 0.0]) - 50 * s["viewmats"][0, 2, :3])
    bg = torch.tensor([0.2, 0.4, 0.6])
    img, alpha, meta = _call(far_behind, background=bg)
    assert (meta["radii"][0] == 0).all() and meta["isect_ids"].numel() >= 0
    assert torch.equal(img[0], bg.expand(HEIGHT, WIDTH, 3)) and (alpha[0] == 0).all()


def test_huge_finite_values_are_not_mistaken_for_inf():
    """The NaN/inf check sums each tensor first; a sum that overflows on finite values must not raise."""
    huge = [("means", torch.full((4, 3), 3e38)), ("quats", torch.ones(4, 4))]
    checks.check_finite(huge)
    deferred = checks.DeferredCheck(huge)
    assert not bool(deferred.ok)  # the flag is up (the sum overflowed) ...
    deferred.resolve(False)  # ... and finding nothing to name, resolving it raises nothing
    q = torch.ones(4, 4)
    q[2, 1] = float("inf")
    for check in (checks.check_finite, lambda named: checks.DeferredCheck(named).resolve()):
        with pytest.raises(ValueError, match=r"quats has a non-finite value \(inf\) at index \[2, 1\]"):
            check([("means", torch.full((4, 3), 3e38)), ("quats", q)])


def test_zero_gaussians_render_the_background(s):
    empty = dict(s, means=s["means"][:0], quats=s["quats"][:0], scales=s["scales"][:0],
                 opacities=s["opacities"][:0], sh=s["sh"][:0])
    bg = torch.tensor([0.2, 0.4, 0.6])
    img, alpha, meta = _call(empty, background=bg)
    assert torch.equal(img, bg.expand(2, HEIGHT, WIDTH, 3)) and (alpha == 0).all()
    assert meta["radii"].shape == (2, 0, 2) and meta["isect_ids"].numel() == 0


def test_singular_view_matrix_is_named(s):
    vm = s["viewmats"].clone()
    vm[1, 2] = 0.0  # a zero row: not invertible, so the camera has no centre
    _raises(r"viewmats\[1\] is singular", _call, dict(s, viewmats=vm))


@pytest.mark.parametrize("name,index,value,match", [
    ("means", (5, 1), float("nan"), r"means has a non-finite value \(nan\) at index \[5, 1\]"),
    ("sh", (3, 2, 1), float("inf"), r"colors has a non-finite value \(inf\) at index \[3, 2, 1\]"),
    ("opacities", (7,), 1.5, r"opacities must be in \[0.0, 1.0\]"),
])
def test_kernel_path_reads_the_checks_with_the_intersection_count(s, name, index, value, match, triton_on_cpu):
    """On the kernels the value checks are read in the render's one host sync (with the intersection count):
    the same one-line errors, raised before anything is sized from the count."""
    t = s[name].clone()
    t[index] = value
    _raises(match, _call, dict(s, **{name: t}))
    _call(s)  # and a clean scene still renders after a refused one
