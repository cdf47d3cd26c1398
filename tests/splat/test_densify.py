"""Densification on synthetic gradients: clone small, split large, prune transparent and huge, opacity
reset, gsplat's schedule, and optimizer moments that stay row-aligned with the parameters."""

from __future__ import annotations

import math

import pytest
import torch

from warpforge.splat.densify import (DensifyConfig, Densifier, duplicate, quat_to_rotmat, remove,
                                     reset_opacities, split_gaussians)
from warpforge.splat.optim import SelectiveAdam

LRS = {"means": 1e-3, "scales": 1e-3, "quats": 1e-3, "opacities": 1e-3, "sh0": 1e-3, "shN": 1e-3}
W, H = 64, 48


def make(n: int, *, scale: float = 0.001, opacity: float = 0.5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {"means": torch.randn(n, 3, generator=g), "scales": torch.full((n, 3), math.log(scale)),
              "quats": torch.randn(n, 4, generator=g), "opacities": torch.full((n,), math.log(opacity / (1 - opacity))),
              "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, 3, 3, generator=g)}
    params = {k: v.requires_grad_() for k, v in params.items()}
    opt = SelectiveAdam(params, LRS)
    for st in opt.state.values():  # distinct, recognisable moments per row
        for i, (name, t) in enumerate(st.items()):
            st[name] = torch.arange(n, dtype=torch.float32).view(-1, *([1] * (t.dim() - 1))).expand_as(t) + 1000 * i
    return params, opt


def grads_for(n: int, high: list[int], c: int = 1, value: float = 0.01) -> torch.Tensor:
    """means2d gradients [C, N, 2]: ``value`` (already per camera of a C-camera mean) on the ``high`` ones."""
    g = torch.full((c, n, 2), 1e-7)
    g[:, high, 0] = value / c
    return g


def visible(c: int, n: int) -> torch.Tensor:
    return torch.full((c, n, 2), 3, dtype=torch.int32)


def test_defaults_are_gsplats():
    c = DensifyConfig()
    assert (c.prune_opa, c.grow_grad2d, c.grow_scale3d, c.prune_scale3d) == (0.005, 0.0002, 0.01, 0.1)
    assert (c.refine_start_iter, c.refine_stop_iter, c.refine_every, c.reset_every) == (500, 15_000, 100, 3000)
    with pytest.raises(ValueError, match="grow_grad2d: must be > 0"):
        DensifyConfig(grow_grad2d=0)
    with pytest.raises(ValueError, match="refine_start_iter <= refine_stop_iter"):
        DensifyConfig(refine_start_iter=10, refine_stop_iter=5)


def test_accumulate_normalises_by_screen_and_cameras():
    d = Densifier(DensifyConfig(), scene_scale=1.0)
    g = torch.zeros(2, 3, 2)
    g[0, 0] = torch.tensor([0.01, 0.0])  # seen by camera 0 only
    g[:, 1] = torch.tensor([0.0, 0.02])  # seen by both
    radii = visible(2, 3)
    radii[1, 0] = 0  # camera 1 culled Gaussian 0
    radii[:, 2, 1] = 0  # a zero y radius is culled too (gsplat: all axes > 0)
    d.accumulate(0, g, radii, W, H)
    # x scaled by W/2 * C = 64, y by H/2 * C = 48
    assert d.grad2d.tolist() == pytest.approx([0.01 * 64, 2 * 0.02 * 48, 0.0])
    assert d.count.tolist() == [1.0, 2.0, 0.0]
    d.accumulate(1, g, radii, W, H)
    assert d.count.tolist() == [2.0, 4.0, 0.0]


def test_clone_small_split_large_keep_the_rest():
    n = 6
    params, opt = make(n)
    params["scales"].data[[1, 2, 4]] = math.log(0.5)  # large: above 0.01 * scene_scale (= 1)
    before = {k: v.detach().clone() for k, v in params.items()}
    d = Densifier(DensifyConfig(refine_start_iter=0, refine_every=10), scene_scale=1.0, seed=3)
    d.accumulate(10, grads_for(n, [0, 3, 2, 4]), visible(1, n), W, H)  # 0, 3 small+high; 2, 4 large+high
    out = d.step(10, params, opt)
    assert out == {"cloned": 2, "split": 2, "pruned": 0}
    # rows: kept [0, 1, 3, 5] (their order), the clones of 0 and 3 ... see the returned index in the ops
    assert params["means"].shape[0] == n + 2 + 2
    for k, v in params.items():
        assert v.requires_grad and opt.state[k]["exp_avg"].shape == v.shape == opt.state[k]["exp_avg_sq"].shape
    kept = [0, 1, 3, 5]  # not split, in order, then clones of 0 and 3, then two halves of 2 and 4
    assert torch.equal(params["means"][:4], before["means"][kept])
    assert torch.equal(params["means"][4:6], before["means"][[0, 3]])
    assert opt.state["means"]["exp_avg"][:4, 0].tolist() == [float(i) for i in kept]  # moments follow rows
    assert opt.state["means"]["exp_avg"][4:].abs().sum() == 0  # new rows start with zero moments
    halves = params["scales"][6:]
    assert torch.allclose(halves, torch.full_like(halves, math.log(0.5 / 1.6)))
    assert torch.equal(params["sh0"][6:], before["sh0"][[2, 4, 2, 4]])
    # split samples lie within a few sigma of their parent, one on each side on average
    off = params["means"][6:] - before["means"][[2, 4, 2, 4]]
    assert 0 < off.norm(dim=-1).max() < 0.5 * 5
    assert d.grad2d.shape == (10,) and d.grad2d.abs().sum() == 0 and d.count.sum() == 0  # stats reset


def test_split_samples_follow_the_rotation():
    params, opt = make(1)
    params["scales"].data[:] = torch.log(torch.tensor([[1.0, 1e-4, 1e-4]]))
    params["quats"].data[:] = torch.tensor([[math.cos(math.pi / 4), 0.0, 0.0, math.sin(math.pi / 4)]])  # 90 deg about z
    centre = params["means"].detach().clone()
    split_gaussians(params, opt, torch.tensor([True]), torch.Generator().manual_seed(0))
    off = params["means"].detach() - centre
    assert off.shape == (2, 3)
    assert off[:, 0].abs().max() < 1e-3 and off[:, 2].abs().max() < 1e-3  # the long axis now points along y
    assert off[:, 1].abs().max() > 1e-2
    r = quat_to_rotmat(torch.tensor([[0.5, 0.5, 0.5, 0.5]]) * 3)  # normalised inside
    assert torch.allclose(r[0] @ r[0].T, torch.eye(3), atol=1e-6)


def test_prune_transparent_and_after_reset_huge():
    n = 5
    params, opt = make(n)
    params["opacities"].data[1] = math.log(0.001 / 0.999)  # transparent
    params["scales"].data[3] = math.log(0.5)  # huge: above 0.1 * scene_scale
    cfg = DensifyConfig(refine_start_iter=0, refine_every=10, reset_every=30, grow_grad2d=1.0)
    d = Densifier(cfg, scene_scale=1.0)
    d.accumulate(10, grads_for(n, []), visible(1, n), W, H)
    assert d.step(10, params, opt)["pruned"] == 1  # step 10 < reset_every: the huge one stays
    assert params["means"].shape[0] == 4 and opt.state["quats"]["exp_avg_sq"].shape == (4, 4)
    d.accumulate(40, grads_for(4, []), visible(1, 4), W, H)
    assert d.step(40, params, opt)["pruned"] == 1  # past the first reset: huge pruned
    assert params["means"].shape[0] == 3
    assert opt.state["means"]["exp_avg"][:, 0].tolist() == [0.0, 2.0, 4.0]


def test_opacity_reset_and_schedule():
    n = 4
    params, opt = make(n, opacity=0.9)
    params["opacities"].data[0] = math.log(0.001 / 0.999)
    cfg = DensifyConfig(refine_start_iter=100, refine_stop_iter=1000, refine_every=50, reset_every=300,
                        grow_grad2d=1.0, prune_opa=0.0005)
    d = Densifier(cfg, scene_scale=1.0)
    for step in (0, 50, 100, 120):  # before/at refine_start_iter or off the refine grid: nothing happens
        d.accumulate(step, grads_for(n, []), visible(1, n), W, H)
        assert d.step(step, params, opt) == {}
    assert d.count.tolist() == [4.0] * 4  # statistics kept accumulating
    out = d.step(300, params, opt)
    assert out == {"cloned": 0, "split": 0, "pruned": 0, "reset": 3}
    cap = math.log(0.001 / 0.999)
    assert torch.allclose(params["opacities"], torch.full((n,), cap), atol=1e-5)
    assert opt.state["opacities"]["exp_avg"].abs().sum() == 0 and opt.state["means"]["exp_avg"].abs().sum() > 0
    assert d.step(1000, params, opt) == {}  # refine_stop_iter: no more edits, no more resets
    d.accumulate(1000, grads_for(n, [0]), visible(1, n), W, H)
    assert d.count.sum() == 0


def test_ranks_agree_when_statistics_are_reduced():
    """Two densifiers, each seeing half the cameras, decide as one seeing all (the multi-GPU contract)."""
    n, c = 8, 4
    g = torch.rand(c, n, 2, generator=torch.Generator().manual_seed(1)) * 2e-5
    g[:, [1, 5], :] *= 20
    radii = visible(c, n)
    radii[0, 2] = 0
    one_params, one_opt = make(n)
    one = Densifier(DensifyConfig(refine_start_iter=0, refine_every=5), 1.0, seed=7)
    one.accumulate(5, g, radii, W, H)
    ref = one.step(5, one_params, one_opt)
    shards = [Densifier(DensifyConfig(refine_start_iter=0, refine_every=5), 1.0, seed=7) for _ in range(2)]
    for r, s in enumerate(shards):
        # each rank's loss averages its own 2 cameras, so its per-camera gradients are 2x the 4-camera mean's
        s.accumulate(5, g[2 * r:2 * r + 2] * 2, radii[2 * r:2 * r + 2], W, H)

    snap = [{"grad2d": s.grad2d.clone(), "count": s.count.clone()} for s in shards]

    def reduce_with(me: int):  # what torch.distributed.all_reduce does for this rank, with 2 ranks
        def all_reduce(t: torch.Tensor, op: str) -> None:
            name = "grad2d" if t is shards[me].grad2d else "count"
            assert op == "sum" and (name == "count" or t is shards[me].grad2d)
            t.add_(snap[1 - me][name])
        return all_reduce

    assert ref["cloned"] + ref["split"] > 0
    for r, s in enumerate(shards):
        s.all_reduce = reduce_with(r)
        params, opt = make(n)
        assert s.step(5, params, opt) == ref
        for k in params:
            assert torch.allclose(params[k], one_params[k], atol=1e-6), (r, k)


def test_ops_keep_moments_aligned():
    params, opt = make(5)
    idx = duplicate(params, opt, torch.tensor([False, True, False, False, True]))
    assert idx.tolist() == [0, 1, 2, 3, 4, 1, 4]
    assert opt.state["sh0"]["exp_avg"][:, 0, 0].tolist() == [0, 1, 2, 3, 4, 0, 0]
    idx = remove(params, opt, torch.tensor([True, False, False, False, False, False, True]))
    assert idx.tolist() == [1, 2, 3, 4, 5]
    assert opt.state["sh0"]["exp_avg"][:, 0, 0].tolist() == [1, 2, 3, 4, 0]
    assert reset_opacities(params, opt, value=0.6) == 0  # all at 0.5 already
