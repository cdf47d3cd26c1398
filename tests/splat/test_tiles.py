"""Tile intersection (exact ellipse/tile test), the key sort and tile offsets: the Triton kernels (through
the interpreter) against the torch path, and the torch path against brute force over pixels."""

from __future__ import annotations

import pytest
import torch

from tests.splat._splats2d import splats_2d
from warpforge.splat import reference as ref
from warpforge.splat import tiles


def _grid(W, H, ts):
    return -(-W // ts), -(-H // ts)


def _args(s):
    return s["means2d"], s["radii"], s["depths"], s["conics"], s["opacities"]


def _with_border_gaussians(s, ts):
    """Put a few Gaussians exactly on tile borders and corners, and one huge and one needle-thin."""
    s = {k: v.clone() for k, v in s.items()}
    m = s["means2d"]
    m[:, 0] = torch.tensor([ts, ts], dtype=torch.float32)
    m[:, 1] = torch.tensor([2 * ts, ts / 2])
    m[:, 2] = torch.tensor([ts - 0.5, ts + 0.5])
    m[:, 3] = torch.tensor([0.0, 0.0])
    for i in range(4):
        s["radii"][:, i] = torch.tensor([6, 6], dtype=torch.int32)
        s["conics"][:, i] = torch.tensor([0.5, 0.1, 0.4])
        s["opacities"][:, i] = 0.9
    # a needle at 45 degrees: covariance eigenvalues 400 and 0.3 px^2
    cxx = cyy = (400.0 + 0.3) / 2
    cxy = (400.0 - 0.3) / 2
    det = cxx * cyy - cxy * cxy
    s["conics"][:, 4] = torch.tensor([cyy / det, -cxy / det, cxx / det])
    s["opacities"][:, 4] = 0.95
    ext = (2 * torch.log(torch.tensor(0.95 * 255.0))).sqrt()
    s["radii"][:, 4] = torch.ceil(ext * torch.tensor([cxx, cyy]).sqrt()).int()
    m[:, 4] = torch.tensor([1.7 * ts, 1.3 * ts])
    return s


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs of the kernels start as garbage (-7), so an element the kernel skips shows."""
    monkeypatch.setattr(tiles, "_alloc", lambda shape, dtype, device: torch.full(
        shape if isinstance(shape, tuple) else (shape,), -7, dtype=dtype, device=device))


def _on(s, device):
    return {k: v.to(device) for k, v in s.items()}


def _pairs(keys, fids, tile_bits):
    return set(zip(fids.tolist(), ((keys >> 32) & ((1 << tile_bits) - 1)).tolist()))


@pytest.mark.parametrize("C,N,W,H,ts", [(2, 150, 45, 37, 16), (3, 60, 50, 17, 16), (1, 200, 33, 20, 8)])
def test_triton_intersections_equal_torch_path(C, N, W, H, ts, triton_on_cpu, device, poisoned):
    s = _with_border_gaussians(splats_2d(C, N, W, H, seed=C * N), ts)
    tw, th = _grid(W, H, ts)
    d = _on(s, device)
    got = [t.cpu() for t in tiles.intersect_tiles(*_args(d), ts, tw, th)]
    want = ref.intersect_tiles_reference(*_args(s), ts, tw, th)
    assert want[1].numel() > 4 * C
    unsorted = [t.cpu() for t in tiles.intersect_tiles(*_args(d), ts, tw, th, sort=False)]
    if device.type == "cpu":  # the interpreter repeats the torch path's float32 operations exactly
        for name, g, w in zip(("tiles_per_gauss", "isect_ids", "flatten_ids"), got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name
        for g, w in zip(unsorted, ref.intersect_tiles_reference(*_args(s), ts, tw, th, sort=False)):
            assert torch.equal(g, w)
    else:  # the GPU contracts to FMAs and takes fast sqrt/division: a tile at the ellipse's edge may differ
        tile_bits, _ = ref.isect_bits(C, tw, th)
        a, b = _pairs(*got[1:], tile_bits), _pairs(*want[1:], tile_bits)
        assert len(a ^ b) <= 0.01 * len(b), (len(a ^ b), len(b))
        assert torch.all(got[1][1:] >= got[1][:-1])
    # unsorted (emission order: Gaussian-major, rows top-down, tiles left-right) and sorted apart
    assert torch.all(unsorted[2][1:] >= unsorted[2][:-1])
    assert all(torch.equal(g, w) for g, w in zip(tiles.sort_intersections(*unsorted[1:]), got[1:]))
    offsets = tiles.tile_offsets(got[1].to(device), C, tw, th).cpu()
    assert torch.equal(offsets, ref.tile_offsets_reference(got[1], C, tw, th))


def test_keys_are_camera_tile_depth_sorted_and_ties_keep_index_order():
    C, N, W, H, ts = 3, 80, 40, 40, 16
    s = splats_2d(C, N, W, H, seed=3)
    tw, th = _grid(W, H, ts)
    tpg, keys, fids = tiles.intersect_tiles(*_args(s), ts, tw, th)
    tile_bits, _ = ref.isect_bits(C, tw, th)
    g = fids.long()
    assert torch.equal(keys >> (32 + tile_bits), g // N)
    assert torch.equal(keys & 0xFFFFFFFF, s["depths"].reshape(-1).view(torch.int32).long()[g] & 0xFFFFFFFF)
    tile = (keys >> 32) & ((1 << tile_bits) - 1)
    assert int(tile.max()) < tw * th
    assert torch.all(keys[1:] >= keys[:-1])
    ties = keys[1:] == keys[:-1]
    assert ties.any(), "the scene has equal depths in a tile"
    assert torch.all(g[1:][ties] > g[:-1][ties])
    assert torch.equal(torch.bincount(g, minlength=C * N), tpg.reshape(-1).long())
    # a (Gaussian, tile) pair appears once
    pair = g * (tw * th) + tile
    assert pair.unique().numel() == pair.numel()


def _tile_sets(s, W, H, ts):
    """Boolean [C*N, C*th*tw]-free sets: emitted pairs, candidate-box pairs and the pairs some pixel needs
    (alpha >= 1/255 by brute force over every pixel of the image), each as a [C*N, th*tw] mask."""
    C, N = s["depths"].shape
    tw, th = _grid(W, H, ts)
    _, keys, fids = tiles.intersect_tiles(*_args(s), ts, tw, th)
    tile_bits, _ = ref.isect_bits(C, tw, th)
    emitted = torch.zeros(C * N, th * tw, dtype=torch.bool)
    emitted[fids.long(), (keys >> 32) & ((1 << tile_bits) - 1)] = True
    _, _, _, (tx0, tx1, ty0, ty1) = ref.gaussian_tile_setup(s["means2d"], s["radii"], s["conics"], s["opacities"],
                                                           ts, tw, th)
    tyy, txx = torch.meshgrid(torch.arange(th), torch.arange(tw), indexing="ij")
    tyy, txx = tyy.reshape(-1).float(), txx.reshape(-1).float()
    valid = ((s["radii"] > 0).all(-1)).reshape(-1, 1)
    box = (valid & (txx >= tx0.reshape(-1, 1)) & (txx < tx1.reshape(-1, 1)) & (tyy >= ty0.reshape(-1, 1))
           & (tyy < ty1.reshape(-1, 1)))
    py, px = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    ptile = (py // ts * tw + px // ts).reshape(-1)
    dx = s["means2d"].reshape(-1, 1, 2)[..., 0] - (px.reshape(1, -1) + 0.5)
    dy = s["means2d"].reshape(-1, 1, 2)[..., 1] - (py.reshape(1, -1) + 0.5)
    a, b, c = (s["conics"].reshape(-1, 3)[:, k:k + 1] for k in range(3))
    sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
    alpha = s["opacities"].reshape(-1, 1) * torch.exp(-sigma)
    lit = (sigma >= 0) & (alpha >= ref.ALPHA_MIN) & valid  # [C*N, H*W]
    needed = torch.zeros(C * N, th * tw, dtype=torch.bool)
    gi, pi = lit.nonzero(as_tuple=True)
    needed[gi, ptile[pi]] = True
    return emitted, box, needed


@pytest.mark.parametrize("ts", [16, 8])
def test_tight_tiles_are_inside_the_box_and_cover_every_lit_pixel(ts):
    W, H = 61, 45
    s = _with_border_gaussians(splats_2d(2, 120, W, H, seed=7, scale=(0.5, 14.0)), ts)
    emitted, box, needed = _tile_sets(s, W, H, ts)
    assert not (emitted & ~box).any(), "a tile outside the radii box was emitted"
    missed = needed & ~emitted
    assert not missed.any(), f"{int(missed.sum())} tiles with a pixel at alpha >= 1/255 were dropped"
    # the exact test removes the box's corner tiles (measured 0.71 at 16 px, 0.66 at 8 px on this scene)
    assert emitted.sum() < 0.85 * box.sum()


def test_degenerate_conic_keeps_its_whole_box():
    s = splats_2d(1, 3, 40, 40, seed=1, culled=0.0)
    s["means2d"][0, 0] = torch.tensor([20.0, 20.0])
    s["conics"][0, 0] = torch.tensor([1.0, 1.0, 1.0])  # det 0: no ellipse
    s["radii"][0, 0] = torch.tensor([9, 9], dtype=torch.int32)
    s["opacities"][0, 0] = 0.8
    tpg, _, _ = tiles.intersect_tiles(*_args(s), 16, 3, 3)
    assert int(tpg[0, 0]) == 4  # (20 +- 9) / 16 spans tiles 0..1 in x and y


def test_offsets_bound_each_tile_and_empty_tiles_are_empty(triton_on_cpu, device, poisoned):
    C, W, H, ts = 2, 70, 50, 16
    s = splats_2d(C, 40, W, H, seed=5)
    s["means2d"] = s["means2d"] * 0.3  # everything in the top-left corner: most tiles stay empty
    tw, th = _grid(W, H, ts)
    _, keys, _ = tiles.intersect_tiles(*_args(_on(s, device)), ts, tw, th)
    offsets = tiles.tile_offsets(keys, C, tw, th).cpu()
    keys = keys.cpu()
    assert torch.equal(offsets, ref.tile_offsets_reference(keys, C, tw, th))
    tile_bits, _ = ref.isect_bits(C, tw, th)
    bounds = offsets.reshape(-1).tolist() + [keys.numel()]
    empty = 0
    for i in range(C * th * tw):
        seg = keys[bounds[i]:bounds[i + 1]] >> 32
        assert torch.all(seg == ((i // (th * tw)) << tile_bits | (i % (th * tw))))
        empty += int(seg.numel() == 0)
    assert empty > C * th * tw // 2


def test_no_visible_gaussian_gives_no_intersections(triton_on_cpu, device, poisoned):
    s = splats_2d(2, 30, 40, 30, seed=2)
    s["radii"].zero_()
    tpg, keys, fids = tiles.intersect_tiles(*_args(_on(s, device)), 16, 3, 2)
    assert keys.numel() == 0 and fids.numel() == 0 and int(tpg.abs().sum()) == 0
    assert torch.equal(tiles.tile_offsets(keys, 2, 3, 2).cpu(), torch.zeros(2, 2, 3, dtype=torch.int32))


def test_bad_input_names_the_argument():
    s = splats_2d(1, 10, 32, 32, seed=0)
    with pytest.raises(ValueError, match="radii must be torch.int32"):
        tiles.intersect_tiles(s["means2d"], s["radii"].float(), s["depths"], s["conics"], s["opacities"], 16, 2, 2)
    with pytest.raises(ValueError, match=r"depths must have shape \[1, 10\]"):
        tiles.intersect_tiles(s["means2d"], s["radii"], s["depths"][:, :5], s["conics"], s["opacities"], 16, 2, 2)
    with pytest.raises(ValueError, match="tile_size: expected an integer >= 1, got 0"):
        tiles.intersect_tiles(*_args(s), 0, 2, 2)
    with pytest.raises(ValueError, match="key bits"):
        tiles.intersect_tiles(*_args(s), 16, 2**16, 2**15)
    with pytest.raises(ValueError, match="isect_ids must be a 1-D int64"):
        tiles.tile_offsets(torch.zeros(3, dtype=torch.int32), 1, 2, 2)


def test_inputs_that_require_grad_build_no_graph():
    s = splats_2d(1, 40, 40, 30, seed=6)
    args = [v.requires_grad_() if v.is_floating_point() else v for v in _args(s)]
    tpg, keys, fids = tiles.intersect_tiles(*args, 16, 3, 2)
    assert not any(t.requires_grad for t in (tpg, keys, fids))
    assert torch.equal(keys, ref.intersect_tiles_reference(*(a.detach() for a in args), 16, 3, 2)[1])
