"""PLY export and import in the Inria 3DGS layout, the one common splat viewers read.

One ``vertex`` element, binary little-endian float32 properties in this order: ``x y z``, ``nx ny nz``
(zeros), ``f_dc_0..2`` (the DC SH band), ``f_rest_0..3(K-1)-1`` (higher bands, all red coefficients,
then green, then blue: the Inria code stores the [N, 3, K-1] transpose), ``opacity`` (logit),
``scale_0..2`` (log) and ``rot_0..3`` (quaternion w, x, y, z). Written and read with ``plyfile``.

Because scales are logs and opacities logits, every finite value is a valid Gaussian (a negative log-scale is
a scale below 1); what a file can get wrong is NaN, inf, or a log-scale whose exp overflows float32. ``load_ply``
refuses those at load, naming the file, the vertex and the property, instead of failing later at render.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from warpforge.splat.scene import MAX_LOG_SCALE, Splats


def _plyfile():
    try:
        import plyfile
    except ImportError:
        raise ImportError("PLY export/import needs plyfile: pip install 'warpforge[splat]'") from None
    return plyfile


def property_names(sh_degree: int) -> list[str]:
    """The vertex properties of a splat PLY with SH up to ``sh_degree``, in file order."""
    rest = 3 * ((sh_degree + 1) ** 2 - 1)
    return (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"] + [f"f_rest_{i}" for i in range(rest)]
            + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])


def save_ply(splats: Splats, path: str | Path) -> Path:
    """Write ``splats`` as an Inria-layout PLY; returns the path."""
    plyfile = _plyfile()
    s = splats.detach().to("cpu")
    n = s.n
    cols = [s.means, torch.zeros(n, 3), s.sh0.reshape(n, 3), s.shN.transpose(1, 2).reshape(n, -1),
            s.opacities[:, None], s.scales, s.quats]
    data = torch.cat(cols, dim=1).float().numpy()
    names = property_names(s.sh_degree)
    path = Path(path)
    assert data.shape[1] == len(names)
    if not np.isfinite(data).all():
        row = int(np.argwhere(~np.isfinite(data))[0, 0])
        raise ValueError(f"{path}: Gaussian {row} has a non-finite parameter; refusing to write a corrupt file")
    rec = np.empty(n, dtype=[(name, "<f4") for name in names])
    for i, name in enumerate(names):
        rec[name] = data[:, i]
    path.parent.mkdir(parents=True, exist_ok=True)
    plyfile.PlyData([plyfile.PlyElement.describe(rec, "vertex")], text=False, byte_order="<").write(str(path))
    return path


def load_ply(path: str | Path, device: torch.device | str = "cpu") -> Splats:
    """Read an Inria-layout splat PLY (any SH degree 0..3, binary or ASCII)."""
    plyfile = _plyfile()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        ply = plyfile.PlyData.read(str(path))
    except Exception as e:  # plyfile raises several types for a malformed header or body
        raise ValueError(f"{path}: not a readable PLY file ({e})") from None
    if "vertex" not in ply:
        raise ValueError(f"{path}: no 'vertex' element")
    v = ply["vertex"].data
    have = set(v.dtype.names)
    n_rest = sum(1 for name in have if name.startswith("f_rest_"))
    k = n_rest // 3 + 1
    if n_rest % 3 or math.isqrt(k) ** 2 != k or k > 16:
        raise ValueError(f"{path}: {n_rest} f_rest properties; expected 3*((d+1)^2-1) for an SH "
                         "degree d in 0..3")
    need = property_names(math.isqrt(k) - 1)
    missing = [name for name in need if name not in have and not name.startswith("n")]
    if missing:
        raise ValueError(f"{path}: not a 3DGS splat file: missing {', '.join(missing[:6])}")

    def cols(names: list[str]) -> torch.Tensor:
        return torch.from_numpy(np.stack([np.asarray(v[name], dtype=np.float32) for name in names], axis=1))

    check_values(path, v, [name for name in need if name in have])
    n = len(v)
    rest = cols([f"f_rest_{i}" for i in range(n_rest)]) if n_rest else torch.zeros(n, 0)
    splats = Splats(means=cols(["x", "y", "z"]), scales=cols(["scale_0", "scale_1", "scale_2"]),
                    quats=cols(["rot_0", "rot_1", "rot_2", "rot_3"]), opacities=cols(["opacity"])[:, 0],
                    sh0=cols(["f_dc_0", "f_dc_1", "f_dc_2"])[:, None, :],
                    shN=rest.reshape(n, 3, k - 1).transpose(1, 2).contiguous())
    return splats.to(device)


def check_values(path: Path, vertices: np.ndarray, names: list[str]) -> None:
    """ValueError naming the first vertex (in file order) with a NaN or inf property, or a log-scale whose exp
    overflows float32, and that property: one line, so a bad file fails at load rather than at render."""
    data = np.stack([np.asarray(vertices[name], dtype=np.float32) for name in names], axis=1)  # [n, P]
    scale_cols = [i for i, name in enumerate(names) if name.startswith("scale_")]
    bad = ~np.isfinite(data)
    bad[:, scale_cols] |= data[:, scale_cols] > MAX_LOG_SCALE
    if not bad.any():
        return
    row, col = (int(i) for i in np.argwhere(bad)[0])
    value = float(data[row, col])
    what = "is not finite" if not np.isfinite(value) else "is a log-scale whose exp overflows float32"
    raise ValueError(f"{path}: vertex {row}: {names[col]} = {value} {what} ({int(bad.any(1).sum())} bad vertices "
                     "in all)")
