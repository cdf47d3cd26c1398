"""The compact ``.splat`` format web viewers load (antimatter15's splat viewer and those that read its files).

32 bytes per Gaussian, little-endian, no header:

    position  3 x float32   the mean
    scale     3 x float32   linear (exp of the log-scales)
    color     4 x uint8     RGB = (0.5 + SH_C0 * sh0) * 255, A = sigmoid(opacity) * 255, clipped to 0..255 and
                            truncated (as antimatter15's convert.py)
    rotation  4 x uint8     the normalized quaternion (w, x, y, z) * 128 + 128, clipped to 0..255

Gaussians are sorted by exp(sum of log-scales) * opacity, largest first (the converter's order: a viewer that
streams the file draws the big opaque ones first). Only the DC colour survives; higher SH bands are dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from warpforge.splat.scene import SH_C0, Splats

RECORD = np.dtype([("position", "<f4", 3), ("scale", "<f4", 3), ("color", "u1", 4), ("rotation", "u1", 4)])
assert RECORD.itemsize == 32


def splat_records(splats: Splats) -> np.ndarray:
    """[N] RECORD rows of ``splats`` in the .splat order."""
    s = splats.detach().to("cpu")
    log_scales = s.scales.double().numpy()
    opacity = torch.sigmoid(s.opacities.double()).numpy()
    # size * opacity, in float64 so near-ties order the same on every machine; stable for exact ties
    order = np.argsort(-(np.exp(log_scales.sum(1)) * opacity), kind="stable")
    rgb = 0.5 + SH_C0 * s.sh0[:, 0].double().numpy()
    color = np.concatenate([rgb, opacity[:, None]], 1) * 255.0
    q = s.quats.double().numpy()
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
    rec = np.empty(s.n, dtype=RECORD)
    rec["position"] = s.means.numpy()
    rec["scale"] = np.exp(log_scales)
    rec["color"] = np.clip(color, 0, 255).astype(np.uint8)
    rec["rotation"] = np.clip(q * 128.0 + 128.0, 0, 255).astype(np.uint8)
    return rec[order]


def save_splat(splats: Splats, path: str | Path) -> Path:
    """Write ``splats`` as a .splat file; returns the path."""
    path = Path(path)
    rec = splat_records(splats)
    if not (np.isfinite(rec["position"]).all() and np.isfinite(rec["scale"]).all()):
        row = int(np.argwhere(~(np.isfinite(rec["position"]).all(1) & np.isfinite(rec["scale"]).all(1)))[0, 0])
        raise ValueError(f"{path}: a Gaussian (row {row} of the sorted file) has a non-finite position or scale; "
                         "refusing to write a corrupt file")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rec.tobytes())
    return path


def load_splat(path: str | Path) -> np.ndarray:
    """The RECORD rows of a .splat file (for checking what was written; there is no way back to SH)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) % RECORD.itemsize:
        raise ValueError(f"{path}: {len(data)} bytes is not a whole number of 32-byte .splat records")
    return np.frombuffer(data, dtype=RECORD)
