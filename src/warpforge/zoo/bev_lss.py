"""BEV-LSS: six cameras to a bird's-eye-view map, in the Lift-Splat-Shoot style (Philion & Fidler 2020).

One pass, in the order of the paper's name:

1. **Encode** each camera image with a small conv trunk to stride 16 and a 1x1 head that predicts,
   per feature pixel, a distribution over ``D`` depth bins and a ``C``-channel context vector.
2. **Lift**: the outer product depth x context gives ``C`` features at each of the ``D`` depths
   along every pixel's ray: ``N * D * h * w`` frustum points per sample.
3. **Splat**: every frustum point is summed into the BEV cell its 3-D position falls in (pillar
   pooling: heights collapse) with ``index_add`` over a precomputed cell index.
4. **Shoot**: a small BEV conv net turns the pooled grid into per-cell class logits.

The camera rig is fixed, so the frustum's cell index is computed once from the intrinsics and
extrinsics and kept as a buffer, as deployed LSS/BEVDet engines do (BEVPoolv2's precomputed
index); ``forward`` then has no data-dependent control flow and traces with ``torch.fx``.

The rig is nuScenes-like: six 352x128 cameras (the paper's input size: 1600x900 scaled by 0.22 and
cropped), focal 278.5 px (about 65 degrees across), mounted 1.5 m up at yaws 0, +-55, +-110 and 180
degrees; depth bins 4..44 m (41); a 128x128 grid of 0.8 m cells covering +-51.2 m around the ego,
heights -10..10 m. 1.5 M parameters, 4.4 GMACs per sample (six cameras).

Weights: seeded random (LSS weights are not installable offline), Kaiming convs with BatchNorm
statistics calibrated on one random sample, so activations keep the scale of a trained network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from warpforge.zoo._common import build_calibrated, random_images, random_spec
from warpforge.zoo.registry import ModelSpec

# (name, yaw in degrees, x, y, z of the camera in the ego frame: x forward, y left, z up; metres)
NUSCENES_RIG = (("front", 0.0, 1.70, 0.00, 1.5), ("front_left", 55.0, 1.55, 0.50, 1.5),
                ("front_right", -55.0, 1.55, -0.50, 1.5), ("back", 180.0, -1.00, 0.00, 1.5),
                ("back_left", 110.0, 1.05, 0.48, 1.5), ("back_right", -110.0, 1.05, -0.48, 1.5))


@dataclass(frozen=True)
class LSSConfig:
    image_size: tuple[int, int] = (128, 352)      # (H, W) of each camera image
    focal: float = 278.5                          # pixels
    principal: tuple[float, float] = (176.0, 51.0)  # (cx, cy) pixels
    rig: tuple = NUSCENES_RIG
    stride: int = 16                              # encoder output stride
    widths: tuple[int, ...] = (32, 64, 128, 256)  # encoder stages at strides 2, 4, 8, 16
    depth: tuple[float, float, float] = (4.0, 45.0, 1.0)  # bins: arange(start, stop, step), metres
    context: int = 64                             # C: channels lifted per depth bin
    grid: tuple[float, float, float] = (-51.2, 51.2, 0.8)  # x and y: min, max, cell size (metres)
    height: tuple[float, float] = (-10.0, 10.0)   # z range kept (metres)
    bev_width: int = 64
    classes: int = 4                              # e.g. vehicle, pedestrian, drivable area, lane divider

    def __post_init__(self):
        h, w = self.image_size
        if h % self.stride or w % self.stride:
            raise ValueError(f"image_size: expected multiples of stride={self.stride}, got {self.image_size}")
        if len(self.widths) != int(math.log2(self.stride)):
            raise ValueError(f"widths: expected {int(math.log2(self.stride))} stages for stride {self.stride}, "
                             f"got {len(self.widths)}")
        if self.cells % 2:
            raise ValueError(f"grid: expected an even number of cells per side (the BEV net halves it), "
                             f"got {self.cells}")

    @property
    def cameras(self) -> int:
        return len(self.rig)

    @property
    def depths(self) -> torch.Tensor:
        return torch.arange(*self.depth, dtype=torch.float64)

    @property
    def cells(self) -> int:
        lo, hi, res = self.grid
        return round((hi - lo) / res)

    @property
    def feature_size(self) -> tuple[int, int]:
        return self.image_size[0] // self.stride, self.image_size[1] // self.stride


def camera_to_ego(yaw_deg: float) -> torch.Tensor:
    """Rotation [3, 3] from camera axes (x right, y down, z forward) to ego axes (x forward, y left, z up)."""
    base = torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]], dtype=torch.float64)
    c, s = math.cos(math.radians(yaw_deg)), math.sin(math.radians(yaw_deg))
    yaw = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    return yaw @ base


def frustum_points(c: LSSConfig) -> torch.Tensor:
    """Ego-frame positions of every frustum point: [N, D, h, w, 3] (float64)."""
    fh, fw = c.feature_size
    v = (torch.arange(fh, dtype=torch.float64) + 0.5) * c.stride  # feature-pixel centres in image pixels
    u = (torch.arange(fw, dtype=torch.float64) + 0.5) * c.stride
    d = c.depths
    k_inv = torch.linalg.inv(torch.tensor([[c.focal, 0.0, c.principal[0]], [0.0, c.focal, c.principal[1]],
                                           [0.0, 0.0, 1.0]], dtype=torch.float64))
    pix = torch.stack(torch.meshgrid(u, v, indexing="xy") + (torch.ones(fh, fw, dtype=torch.float64),), -1)  # [h, w, 3]
    rays = pix @ k_inv.T                                       # [h, w, 3], camera frame, z = 1
    cam = d[:, None, None, None] * rays[None]                  # [D, h, w, 3]
    out = []
    for _, yaw, x, y, z in c.rig:
        out.append(cam @ camera_to_ego(yaw).T + torch.tensor([x, y, z], dtype=torch.float64))
    return torch.stack(out)


def bev_index(c: LSSConfig) -> torch.Tensor:
    """BEV cell (x_cell * cells + y_cell) of every frustum point, flattened as [N * D * h * w] (int64).

    Points outside the grid or the height range go to the extra cell ``cells**2``, dropped after pooling.
    """
    pts = frustum_points(c).reshape(-1, 3)
    lo, _, res = c.grid
    ix = torch.floor((pts[:, 0] - lo) / res).long()
    iy = torch.floor((pts[:, 1] - lo) / res).long()
    inside = (ix >= 0) & (ix < c.cells) & (iy >= 0) & (iy < c.cells)
    keep = inside & (pts[:, 2] >= c.height[0]) & (pts[:, 2] < c.height[1])
    return torch.where(keep, ix * c.cells + iy, torch.full_like(ix, c.cells * c.cells))


def conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class CameraEncoder(nn.Module):
    """images [M, 3, H, W] -> (depth probabilities [M, D, H/16, W/16], context [M, C, H/16, W/16])."""

    def __init__(self, c: LSSConfig):
        super().__init__()
        layers, cin = [], 3
        for i, w in enumerate(c.widths):  # one stride-2 conv per stage, a second conv from stride 8 on
            layers.append(conv_bn(cin, w, stride=2))
            if i >= 2:
                layers.append(conv_bn(w, w))
            cin = w
        self.trunk = nn.Sequential(*layers)
        self.depth_bins = len(c.depths)
        self.head = nn.Conv2d(cin, self.depth_bins + c.context, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.head(self.trunk(x))
        return x[:, :self.depth_bins].softmax(dim=1), x[:, self.depth_bins:]


class BevNet(nn.Module):
    """BEV features [B, C, X, Y] -> logits [B, classes, X, Y]: a two-scale conv net with a skip."""

    def __init__(self, cin: int, width: int, classes: int):
        super().__init__()
        self.full = conv_bn(cin, width)
        self.down = nn.Sequential(conv_bn(width, 2 * width, stride=2), conv_bn(2 * width, 2 * width))
        self.up = conv_bn(2 * width, width, kernel=1)
        self.out = nn.Sequential(conv_bn(width, width), nn.Conv2d(width, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.full(x)
        y = F.interpolate(self.up(self.down(skip)), scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.out(y + skip)


class BevLSS(nn.Module):
    """camera images [B, N, 3, H, W] -> BEV class logits [B, classes, cells, cells] (x forward, y left)."""

    def __init__(self, config: LSSConfig = LSSConfig()):
        super().__init__()
        c = self.config = config
        self.encoder = CameraEncoder(c)
        self.bev = BevNet(c.context, c.bev_width, c.classes)
        self.register_buffer("index", bev_index(c), persistent=False)
        self.cameras, self.context, self.cells = c.cameras, c.context, c.cells
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # The classifier has 4 outputs: fan-out scaling would make its logits ~10x too large.
        nn.init.kaiming_normal_(self.bev.out[-1].weight, nonlinearity="linear")

    def lift(self, images: torch.Tensor) -> torch.Tensor:
        """[B, N, 3, H, W] -> frustum features [B, N * D * h * w, C]."""
        depth, ctx = self.encoder(images.flatten(0, 1))           # [B*N, D, h, w], [B*N, C, h, w]
        volume = depth.unsqueeze(1) * ctx.unsqueeze(2)            # [B*N, C, D, h, w]
        volume = volume.reshape(images.shape[0], self.cameras, self.context, -1)  # [B, N, C, D*h*w]
        return volume.transpose(2, 3).reshape(images.shape[0], -1, self.context)

    def splat(self, points: torch.Tensor) -> torch.Tensor:
        """[B, P, C] -> BEV grid [B, C, cells, cells], summing points that share a cell."""
        cells = self.cells * self.cells
        grid = points.new_zeros(points.shape[0], cells + 1, self.context).index_add(1, self.index, points)
        grid = grid[:, :cells].reshape(points.shape[0], self.cells, self.cells, self.context)
        return grid.permute(0, 3, 1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.bev(self.splat(self.lift(images)))


def build(config: LSSConfig = LSSConfig(), seed: int = 0) -> BevLSS:
    """A seeded random BevLSS with BatchNorm statistics calibrated on one random sample, in eval mode."""
    return build_calibrated(lambda: BevLSS(config), random_images(1, config.cameras, 3, *config.image_size),
                            seed)


def spec(*, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool) -> ModelSpec:
    # pretrained: no LSS weights are reachable offline; the model is random either way.
    c = LSSConfig()
    return random_spec("bev_lss", "bev", build(c), random_images(batch, c.cameras, 3, *c.image_size), device,
                       dtype)
