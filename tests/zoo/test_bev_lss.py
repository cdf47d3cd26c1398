"""BEV-LSS's own parts: the camera geometry, the lift (depth x context) and the splat (index_add pooling)."""

from __future__ import annotations

import math

import pytest
import torch

from warpforge.zoo import bev_lss


def _small() -> bev_lss.LSSConfig:
    return bev_lss.LSSConfig(image_size=(32, 64), focal=50.0, principal=(32.0, 12.0), widths=(8, 16, 32, 32),
                             depth=(4.0, 24.0, 4.0), context=8, grid=(-20.0, 20.0, 2.5), bev_width=8, classes=3)


def test_camera_axes():
    # The front camera looks along ego +x, with its image right along ego -y and image down along -z.
    r = bev_lss.camera_to_ego(0.0)
    torch.testing.assert_close(r @ torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
                               torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(r @ torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
                               torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64))
    # A camera yawed +90 degrees looks left (+y).
    torch.testing.assert_close(bev_lss.camera_to_ego(90.0) @ torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
                               torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))


def test_frustum_points_follow_each_camera():
    c = bev_lss.LSSConfig()
    pts = bev_lss.frustum_points(c)                        # [N, D, h, w, 3]
    fh, fw = c.feature_size
    assert pts.shape == (6, len(c.depths), fh, fw, 3)
    for cam, (_, yaw, x, y, z) in enumerate(c.rig):
        # Points along the middle column's rays move away from the camera in its yaw direction.
        centre = pts[cam, :, :, fw // 2].mean(dim=1)       # [D, 3]
        direction = centre[-1, :2] - centre[0, :2]
        heading = math.degrees(math.atan2(direction[1], direction[0]))
        assert abs((heading - yaw + 180) % 360 - 180) < 5, f"camera {cam}: heading {heading:.1f}, yaw {yaw}"
        # Distance from the camera along each ray grows with the depth bin, as d * |K^-1 [u, v, 1]|.
        dist = (pts[cam, :, 0, 0] - torch.tensor([x, y, z], dtype=torch.float64)).norm(dim=-1)
        assert (dist.diff() > 0).all()


def test_bev_index_drops_points_outside_the_grid():
    c = bev_lss.LSSConfig()
    index = bev_lss.bev_index(c)
    cells = c.cells * c.cells
    assert index.shape == (c.cameras * len(c.depths) * c.feature_size[0] * c.feature_size[1],)
    assert index.min() >= 0 and index.max() <= cells
    assert (index < cells).float().mean() > 0.9  # the +-51.2 m grid holds nearly the whole 44 m frustum
    # Narrow the height range to a thin slab: most points fall outside and go to the dump cell.
    thin = bev_lss.bev_index(bev_lss.LSSConfig(height=(0.0, 0.1)))
    assert (thin == cells).float().mean() > 0.9


def test_lift_weights_context_by_a_depth_distribution():
    c = _small()
    model = bev_lss.build(c)
    images = torch.randn(2, c.cameras, 3, *c.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        points = model.lift(images)                        # [B, N*D*h*w, C]
        _, ctx = model.encoder(images.flatten(0, 1))       # [B*N, C, h, w]
    d = len(c.depths)
    fh, fw = c.feature_size
    per_depth = points.reshape(2, c.cameras, d, fh, fw, c.context)
    # Depth probabilities sum to one, so summing the lifted features over depth gives the context back.
    expected = ctx.reshape(2, c.cameras, c.context, fh, fw).permute(0, 1, 3, 4, 2)
    torch.testing.assert_close(per_depth.sum(dim=2), expected, rtol=1e-5, atol=1e-5)


def test_splat_sums_points_into_their_cells():
    c = _small()
    model = bev_lss.build(c)
    g = torch.Generator().manual_seed(1)
    points = torch.randn(2, model.index.numel(), c.context, generator=g)
    grid = model.splat(points)                            # [B, C, X, Y]
    # Reference: a dense one-hot matrix of point -> cell, dropping the out-of-grid cell.
    onehot = torch.nn.functional.one_hot(model.index, c.cells * c.cells + 1)[:, :-1].float()  # [P, X*Y]
    expected = torch.einsum("pq,bpc->bcq", onehot, points).reshape(2, c.context, c.cells, c.cells)
    torch.testing.assert_close(grid, expected, rtol=1e-5, atol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="image_size: expected multiples of stride=16"):
        bev_lss.LSSConfig(image_size=(120, 352))
    with pytest.raises(ValueError, match="widths: expected 4 stages"):
        bev_lss.LSSConfig(widths=(32, 64))
