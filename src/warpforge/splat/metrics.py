"""Image metrics for splat training: PSNR and SSIM (the loss uses SSIM too).

SSIM is Wang et al. 2004 with the standard 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03 and a
data range of 1. ``padding="valid"`` averages the SSIM map over the window positions that lie fully inside
the image (the published definition, and what gsplat's training loss uses); ``"same"`` zero-pads the
borders as the original 3DGS code does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

WINDOW = 11
SIGMA = 1.5
C1 = 0.01**2
C2 = 0.03**2


def psnr(image: Tensor,  # [..., H, W, C] in [0, 1]
         target: Tensor,  # [..., H, W, C]
         ) -> Tensor:
    """Peak signal-to-noise ratio in dB for a data range of 1, per leading index (a scalar for one image).

    Identical images give +inf (the mean squared error is zero).
    """
    _check_pair(image, target, min_dim=3)
    mse = ((image.float() - target.float()) ** 2).flatten(-3).mean(-1)
    return -10.0 * torch.log10(mse)


def gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> Tensor:
    """The normalised 1D Gaussian of SSIM's separable window, [size]."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2.0
    g = torch.exp(-(x**2) / (2.0 * sigma**2))
    return (g / g.sum()).float()


def ssim_map(image: Tensor,  # [B, H, W, C]
             target: Tensor,  # [B, H, W, C]
             padding: str = "valid",
             ) -> Tensor:  # [B, C, H', W']
    """The local SSIM at every window position (differentiable in both inputs)."""
    if padding not in ("valid", "same"):
        raise ValueError(f"ssim: padding must be 'valid' or 'same', got {padding!r}")
    _check_pair(image, target, min_dim=4)
    if image.dim() != 4:
        raise ValueError(f"ssim_map: expected [B, H, W, C] images, got shape {tuple(image.shape)}")
    b, h, w, c = image.shape
    if padding == "valid" and (h < WINDOW or w < WINDOW):
        raise ValueError(f"ssim: images must be at least {WINDOW}x{WINDOW} for padding='valid', got {h}x{w}")
    x = image.permute(0, 3, 1, 2).float()
    y = target.permute(0, 3, 1, 2).float()
    g = gaussian_window().to(x.device)
    pad = WINDOW // 2 if padding == "same" else 0

    def blur(t: Tensor) -> Tensor:  # separable Gaussian filter per channel
        t = F.conv2d(t, g.view(1, 1, 1, -1).expand(c, 1, 1, WINDOW), padding=(0, pad), groups=c)
        return F.conv2d(t, g.view(1, 1, -1, 1).expand(c, 1, WINDOW, 1), padding=(pad, 0), groups=c)

    mu_x, mu_y = blur(x), blur(y)
    sxx = blur(x * x) - mu_x**2
    syy = blur(y * y) - mu_y**2
    sxy = blur(x * y) - mu_x * mu_y
    num = (2 * mu_x * mu_y + C1) * (2 * sxy + C2)
    den = (mu_x**2 + mu_y**2 + C1) * (sxx + syy + C2)
    return num / den


def ssim(image: Tensor,  # [..., H, W, C] in [0, 1]
         target: Tensor,  # [..., H, W, C]
         padding: str = "valid",
         ) -> Tensor:
    """Mean SSIM per leading index (a scalar for one [H, W, C] image)."""
    lead = image.shape[:-3]
    x = image.reshape(-1, *image.shape[-3:]) if image.dim() != 3 else image[None]
    y = target.reshape(-1, *target.shape[-3:]) if target.dim() != 3 else target[None]
    if image.shape != target.shape:
        _check_pair(image, target, min_dim=3)
    m = ssim_map(x, y, padding).flatten(1).mean(1)
    return m.reshape(lead) if lead else m[0]


def _check_pair(a: Tensor, b: Tensor, min_dim: int) -> None:
    if a.shape != b.shape:
        raise ValueError(f"image and target shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dim() < min_dim:
        raise ValueError(f"expected images of at least {min_dim} dims ([..., H, W, C]), got {tuple(a.shape)}")
    if a.device != b.device:
        raise ValueError(f"image and target on different devices: {a.device} vs {b.device}")


def mse_to_psnr(mse: float) -> float:
    """PSNR in dB of a mean squared error (data range 1)."""
    return math.inf if mse <= 0 else -10.0 * math.log10(mse)
