"""PLY export/import in the Inria 3DGS layout: exact round trip, the property order and channel-major f_rest
that viewers expect, files written by other tools (ASCII, extra properties), and clear errors."""

from __future__ import annotations

import numpy as np
import plyfile
import pytest
import torch

from warpforge.splat.ply import load_ply, property_names, save_ply
from warpforge.splat.scene import Splats


def random_splats(n: int, degree: int, seed: int = 0) -> Splats:
    g = torch.Generator().manual_seed(seed)
    k = (degree + 1) ** 2
    return Splats(means=torch.randn(n, 3, generator=g) * 5, scales=torch.randn(n, 3, generator=g) - 3,
                  quats=torch.randn(n, 4, generator=g), opacities=torch.randn(n, generator=g) * 2,
                  sh0=torch.randn(n, 1, 3, generator=g), shN=torch.randn(n, k - 1, 3, generator=g) * 0.1)


@pytest.mark.parametrize("degree", [0, 1, 3])
def test_round_trip_is_exact(tmp_path, degree):
    s = random_splats(37, degree, seed=degree)
    path = save_ply(s, tmp_path / "sub" / "point_cloud.ply")
    back = load_ply(path)
    assert back.sh_degree == degree and back.n == 37
    for name in Splats.NAMES:
        assert torch.equal(getattr(back, name), getattr(s, name)), name


def test_inria_layout(tmp_path):
    s = random_splats(3, 3)
    s.shN[1] = torch.arange(45, dtype=torch.float32).reshape(15, 3)  # coefficient k, channel c -> 3k + c
    path = save_ply(s, tmp_path / "a.ply")
    ply = plyfile.PlyData.read(str(path))
    assert not ply.text and ply.byte_order == "<"
    v = ply["vertex"]
    names = [p.name for p in v.properties]
    assert names[:9] == ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    assert names[9:54] == [f"f_rest_{i}" for i in range(45)]
    assert names[54:] == ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    assert names == property_names(3) and all(p.val_dtype in ("f4", "float32") for p in v.properties)
    # channel-major: all 15 red coefficients first, then green, then blue
    row = v.data[1]
    assert [float(row[f"f_rest_{i}"]) for i in range(45)] == [float(3 * k + c) for c in range(3) for k in range(15)]
    assert float(row["opacity"]) == pytest.approx(float(s.opacities[1]))  # stored as the logit
    assert float(row["scale_2"]) == pytest.approx(float(s.scales[1, 2]))  # stored as the log
    assert float(row["rot_0"]) == pytest.approx(float(s.quats[1, 0]))  # w first
    assert float(row["nx"]) == 0.0


def test_reads_ascii_and_extra_properties(tmp_path):
    n = 4
    names = property_names(1) + ["red"]  # some tools add colour bytes; they are ignored
    rec = np.zeros(n, dtype=[(k, "f4") for k in names[:-1]] + [("red", "u1")])
    for i, k in enumerate(names[:-1]):
        rec[k] = np.arange(n) + 0.25 * i
    path = tmp_path / "ascii.ply"
    plyfile.PlyData([plyfile.PlyElement.describe(rec, "vertex")], text=True).write(str(path))
    s = load_ply(path)
    assert s.sh_degree == 1 and s.n == n
    assert s.means[2].tolist() == [2.0, 2.25, 2.5]
    assert s.shN[3, 0].tolist() == [3 + 0.25 * 9, 3 + 0.25 * 12, 3 + 0.25 * 15]  # f_rest_0, f_rest_3, f_rest_6


def test_errors(tmp_path):
    s = random_splats(5, 0)
    s.scales[3, 1] = float("nan")
    with pytest.raises(ValueError, match="Gaussian 3 has a non-finite parameter"):
        save_ply(s, tmp_path / "bad.ply")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_ply(tmp_path / "missing.ply")
    (tmp_path / "junk.ply").write_bytes(b"not a ply at all")
    with pytest.raises(ValueError, match="not a readable PLY"):
        load_ply(tmp_path / "junk.ply")
    with pytest.raises(FileNotFoundError, match=r"missing.ply: no such file"):
        load_ply(tmp_path / "missing.ply")
    rec = np.zeros(2, dtype=[("x", "f4"), ("y", "f4"), ("z", "f4")])
    plyfile.PlyData([plyfile.PlyElement.describe(rec, "vertex")]).write(str(tmp_path / "points.ply"))
    with pytest.raises(ValueError, match="not a 3DGS splat file: missing f_dc_0"):
        load_ply(tmp_path / "points.ply")


@pytest.mark.parametrize("prop,row,value,what", [("x", 4, np.nan, "nan is not finite"),
                                                 ("f_rest_2", 1, -np.inf, "-inf is not finite"),
                                                 ("scale_1", 2, 95.0, "95.0 is a log-scale whose exp overflows")])
def test_bad_values_are_refused_at_load(tmp_path, prop, row, value, what):
    """NaN, inf or an overflowing log-scale fail at load, naming the file, the first bad vertex and the property,
    rather than at the first render. A negative log-scale or logit is an ordinary Gaussian and loads."""
    s = random_splats(6, 1)
    s.scales[0] = -9.0  # scale 1.2e-4: tiny, valid
    s.opacities[0] = -30.0  # opacity ~1e-13: transparent, valid
    path = save_ply(s, tmp_path / "ok.ply")
    assert load_ply(path).n == 6
    ply = plyfile.PlyData.read(str(path))
    v = ply["vertex"].data.copy()
    v[prop][row] = value
    v["y"][5] = np.nan  # a later bad vertex: the first one is named, the count covers both
    bad = tmp_path / "bad.ply"
    plyfile.PlyData([plyfile.PlyElement.describe(v, "vertex")]).write(str(bad))
    with pytest.raises(ValueError) as e:
        load_ply(bad)
    tail = " float32" if "log" in what else ""
    assert str(e.value) == f"{bad}: vertex {row}: {prop} = {what}{tail} (2 bad vertices in all)"
