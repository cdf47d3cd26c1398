"""Training: PSNR/SSIM against hand-computed cases, the selective Adam step, initialisation, the camera
order of data-parallel ranks, exact resume from a checkpoint, and held-out PSNR rising on a tiny street."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from warpforge.splat.densify import DensifyConfig
from warpforge.splat.metrics import C1, C2, psnr, ssim
from warpforge.splat.optim import SelectiveAdam
from warpforge.splat.scene import SH_C0, street_scene
from warpforge.splat.train import TrainConfig, Trainer, init_splats, knn_mean_distance

# ---- metrics ---------------------------------------------------------------------------------------------


def test_psnr_hand_computed():
    a = torch.full((2, 8, 9, 3), 0.5)
    b = a.clone()
    b[0] += 0.1  # mse 0.01 -> 20 dB
    b[1, :4] -= 0.2  # half the pixels off by 0.2: mse 0.02 -> 16.99 dB
    assert psnr(b, a).tolist() == pytest.approx([20.0, -10 * math.log10(0.02)], abs=1e-4)
    assert psnr(a[0], a[0]) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(a, a[:1])


def _window_variance() -> float:
    """sum_u g(u) u^2 for SSIM's normalised 11-tap Gaussian (sigma 1.5): the local variance of a unit ramp."""
    u = np.arange(-5, 6, dtype=np.float64)
    g = np.exp(-(u**2) / (2 * 1.5**2))
    g /= g.sum()
    return float((g * u * u).sum())


def _ramp(h: int = 20, w: int = 32, start: float = 0.1, slope: float = 0.02) -> torch.Tensor:
    return (start + slope * torch.arange(w, dtype=torch.float32)).expand(h, w)[..., None].expand(h, w, 3).clone()


def test_ssim_hand_computed():
    x = torch.rand(15, 17, 3, generator=torch.Generator().manual_seed(0))
    assert float(ssim(x, x)) == pytest.approx(1.0, abs=1e-5)
    # constant images: no variance, SSIM is the luminance term alone
    a, b = torch.full((12, 14, 3), 0.3), torch.full((12, 14, 3), 0.7)
    # rel 2e-4: fp32 E[x^2] - E[x]^2 leaves ~5e-8 of variance where there is none, against C2 = 9e-4
    assert float(ssim(a, b)) == pytest.approx((2 * 0.3 * 0.7 + C1) / (0.3**2 + 0.7**2 + C1), rel=2e-4)
    # a ramp and the ramp shifted by c: same structure, luminance term per window centre m = the ramp there
    r, c, s, v = _ramp(), 0.15, 0.02, _window_variance()
    m = 0.1 + s * np.arange(5, 32 - 5)  # valid window centres
    want = np.mean((2 * m * (m + c) + C1) / (m**2 + (m + c) ** 2 + C1))
    assert float(ssim(r, r + c)) == pytest.approx(want, rel=1e-4)
    # a ramp against its negative: the structure term is (C2 - 2 s^2 V) / (C2 + 2 s^2 V)
    lum = (2 * m * (1 - m) + C1) / (m**2 + (1 - m) ** 2 + C1)
    want = np.mean(lum * (C2 - 2 * s * s * v) / (C2 + 2 * s * s * v))
    assert float(ssim(r, 1 - r)) == pytest.approx(want, rel=1e-3)


def test_ssim_matches_scikit_image():
    metrics = pytest.importorskip("skimage.metrics")
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 24, 31, 3, generator=g)
    y = (x + 0.2 * torch.randn(2, 24, 31, 3, generator=g)).clamp(0, 1)
    ours = ssim(x, y)
    for i in range(2):
        ref = metrics.structural_similarity(x[i].numpy(), y[i].numpy(), channel_axis=2, gaussian_weights=True,
                                            sigma=1.5, use_sample_covariance=False, data_range=1.0)
        assert float(ours[i]) == pytest.approx(ref, abs=1e-4)
    assert ssim(x, y, padding="same").shape == (2,)
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(x[:, :8], y[:, :8])
    with pytest.raises(ValueError, match="padding must be"):
        ssim(x, y, padding="full")


# ---- optimizer and initialisation ----------------------------------------------------------------------------

def test_selective_adam_updates_only_visible_rows():
    p = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    opt = SelectiveAdam({"x": p}, {"x": 0.1}, betas=(0.9, 0.99), eps=1e-8)
    g1 = torch.tensor([[0.5, -1.0], [2.0, 2.0], [1.0, 1.0]])
    p.grad = g1.clone()
    opt.step(torch.tensor([True, False, True]))
    m, v = 0.1 * g1, 0.01 * g1 * g1  # no bias correction (gsplat's SelectiveAdam)
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]) - 0.1 * m / (v.sqrt() + 1e-8)
    want[1] = torch.tensor([3.0, 4.0])
    assert torch.allclose(p, want)
    assert opt.state["x"]["exp_avg"][1].abs().sum() == 0 and opt.state["x"]["exp_avg_sq"][1].abs().sum() == 0
    # second step with everything visible: row 1 starts its moments now, rows 0 and 2 continue theirs
    g2 = torch.tensor([[1.0, 1.0], [1.0, -1.0], [0.0, 0.0]])
    p.grad = g2.clone()
    before = p.detach().clone()
    opt.step(None)
    m2, v2 = 0.9 * m + 0.1 * g2, 0.99 * v + 0.01 * g2 * g2
    m2[1], v2[1] = 0.1 * g2[1], 0.01 * g2[1] ** 2
    assert torch.allclose(p, before - 0.1 * m2 / (v2.sqrt() + 1e-8), atol=1e-6)
    with pytest.raises(ValueError, match="no learning rate for"):
        SelectiveAdam({"x": p, "y": p}, {"x": 0.1})


def test_knn_and_init_follow_gsplat():
    g = torch.Generator().manual_seed(0)
    pts = torch.rand(300, 3, generator=g)
    d = torch.cdist(pts, pts).square()
    brute = d.topk(4, largest=False).values[:, 1:].mean(-1).sqrt()
    assert torch.allclose(knn_mean_distance(pts, chunk=64), brute, atol=1e-6)
    cfg = TrainConfig(sh_degree=2)
    s = init_splats(pts, torch.full((300, 3), 0.75), cfg, torch.Generator().manual_seed(0))
    assert torch.allclose(torch.sigmoid(s.opacities), torch.full((300,), 0.1))
    assert torch.allclose(s.scales.exp(), brute[:, None].expand(300, 3), atol=1e-6)
    assert torch.allclose(s.sh0 * SH_C0 + 0.5, torch.full((300, 1, 3), 0.75))
    assert s.shN.shape == (300, 8, 3) and s.shN.abs().sum() == 0 and s.sh_degree == 2


def test_config_validates():
    with pytest.raises(ValueError, match="sh_degree: must be in 0..3"):
        TrainConfig(sh_degree=4)
    with pytest.raises(ValueError, match="batch: must be >= 1"):
        TrainConfig(batch=0)
    with pytest.raises(ValueError, match="ssim_lambda"):
        TrainConfig(ssim_lambda=1.5)
    assert TrainConfig(densify={"refine_every": 7}).densify.refine_every == 7


# ---- training ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """The tiny street: ~3.5k ground-truth Gaussians, 64x48 images, 28 training and 4 held-out cameras."""
    return street_scene(n=3000, width=64, height=48, n_ring=16, n_drive=16, init_fraction=0.3).posed_images()


def small_config(steps: int, **kw) -> TrainConfig:
    kw.setdefault("densify", DensifyConfig(refine_start_iter=50, refine_every=50, refine_stop_iter=10_000,
                                           reset_every=10_000))
    return TrainConfig(steps=steps, sh_degree=1, sh_degree_interval=100, eval_every=1000, **kw)


class _Rank:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.all_reduce_ = None


def test_ranks_split_one_global_camera_order(tiny):
    one = Trainer(tiny, small_config(10, batch=2))
    ranks = [Trainer(tiny, small_config(10, batch=1), world=_Rank(r, 2)) for r in range(2)]
    for _ in range(20):  # more than one epoch of the 28 training cameras
        both = one.next_cameras()
        assert both == ranks[0].next_cameras() + ranks[1].next_cameras()
        assert set(both) <= set(tiny.train)


def test_resume_restores_everything(tiny, tmp_path):
    cfg = small_config(40, densify=DensifyConfig(refine_start_iter=5, refine_every=6, reset_every=17,
                                                 refine_stop_iter=40, grow_grad2d=5e-5))
    a = Trainer(tiny, cfg)
    for _ in range(15):
        a.train_step()
    path = a.save(tmp_path / "ckpt" / "last.pt")
    rows = [a.train_step() for _ in range(12)]  # refinements at 18 and 24, an opacity reset at 17
    assert any("reset" in r for r in rows) and any("split" in r or "cloned" in r for r in rows)
    b = Trainer(tiny, cfg)
    b.resume(path)
    assert b.step == 15
    rows_b = [b.train_step() for _ in range(12)]
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows]
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.opt.state[k][m], b.opt.state[k][m]), (k, m)
    assert torch.equal(a.densifier.grad2d, b.densifier.grad2d) and a.order == b.order


def test_held_out_psnr_rises(tiny):
    """200 steps from a noisy 30% sample of the surface points: held-out PSNR must pass 19 dB.

    It starts near 15.3 dB and reached 20.6 dB here (19.5-21.0 over two other scene and training seeds)."""
    t = Trainer(tiny, small_config(200))
    start = t.evaluate()["psnr"]
    end = t.fit()["psnr"]
    assert start < 18.0
    assert end > 19.0 and end > start + 3.0, (start, end)
    assert t.history[-1]["step"] == 199 and len(t.evals) == 2 and t.evals[-1]["held_out"]
    assert t.n != tiny.points.shape[0]  # densification ran (refinements at 100 and 150)
    assert all(v >= 0 for v in t.stage_ms.values()) and t.stage_steps == 200


# ---- the training benchmark (suite splat_train) on CPU ------------------------------------------------------

def test_training_suite_runs_both_loops(monkeypatch):
    """The suite's logic on the tiny setup: ours for real; the gsplat loop's plumbing (same init, camera order,
    Adam per parameter, the strategy's hooks in gsplat's order) with our rasterizer standing in for gsplat's,
    which needs CUDA."""
    import sys
    import types

    from warpforge.bench.suites import splat_train as st
    from warpforge.splat import rasterize

    calls = []

    class Strategy:  # records the DefaultStrategy protocol as the loop drives it
        def check_sanity(self, params, opts):
            assert set(params) == set(opts)

        def initialize_state(self, scene_scale):
            calls.append(("init", scene_scale))
            return {}

        def step_pre_backward(self, params, opts, state, step, info):
            info["means2d"].retain_grad()
            calls.append(("pre", step))

        def step_post_backward(self, params, opts, state, step, info, packed):
            assert info["means2d"].grad is not None and not packed
            calls.append(("post", step))

    def rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width, height, *, sh_degree, packed,
                      backgrounds):
        return rasterize(means, quats, scales, opacities, colors, viewmats, Ks, width, height, sh_degree=sh_degree,
                         background=backgrounds)

    monkeypatch.setitem(sys.modules, "gsplat", types.SimpleNamespace(DefaultStrategy=Strategy,
                                                                    rasterization=rasterization))
    monkeypatch.setattr(st._GsplatLoop, "needs_cuda", False)
    cases = {c.params["row"]: c for c in st._cases(quick=True)}
    assert set(cases) == {"iteration", "converge"}
    dev = torch.device("cpu")
    ours = cases["iteration"].ours(dev, 1)[0]
    peer = cases["iteration"].peers[st.GSPLAT](dev, 1)[0]
    assert ours.ms > 0 and peer.ms > 0 and ours.ran == peer.ran == {"steps": [2, 6]}
    assert [c for c in calls if c[0] != "init"] == [(k, s) for s in range(6) for k in ("pre", "post")]
    assert calls[0][0] == "init" and calls[0][1] > 0
    assert cases["iteration"].check(ours.output, None)["ok"]
    conv = cases["converge"].ours(dev, 1)[0]
    c = cases["converge"].check(conv.output, None)
    assert conv.extra["curve"][0]["step"] == 4 and c["ok"] == conv.extra["reached_bar"]
    assert conv.ran == ({"to_psnr_db": 15.0} if c["ok"] else {"stopped_at_step": 12, "below_db": 15.0})
