"""The packed layout (``rasterize(..., packed=True)``, gsplat's packed mode): only the visible (camera, Gaussian)
pairs, as one flat list with their camera and Gaussian indices, instead of the dense [C, N] layout.

    per group of cameras: project (dense within the group) -> colours -> keep the pairs with radii > 0
    -> the same tile intersection and blend, reading rows of the flat list

What it saves: every per-pair tensor the later stages hold is [nnz] instead of [C, N]: the projected values
(means2d, conics, depths, radii, opacities: 36 B a pair), the colours (4 B a channel), tiles per Gaussian, and the
blend's gradient buffers of all of them. The dense tensors exist for one group of cameras at a time
(``PACK_PAIRS`` pairs), so a render of many cameras that each see part of the scene needs memory in proportion
to what they see (the street's drive-through cameras see 42% of the pairs, its aerial ring 78%). The ids cost
16 B a visible pair; the Gaussians' own gradients stay [N]. With autograd, what the projection and the SH keep
for their backward stays dense per group (on CUDA the radii and the view directions, 20 B a pair; on the CPU
path autograd's intermediates), so the saving is largest in a render without gradients.

Images equal the dense layout's: the same pairs reach the same stages in the same order (a pair's row in the
flat list grows with its dense index c * N + g, and the key sort is stable); on the CPU path, with one camera
group, images and gradients are bit-identical. The cost: a host sync per camera group (the count of visible
pairs), the row gathers, and per group a projection launch that recomputes each Gaussian's world covariance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from warpforge.splat.camera import Projection
from warpforge.splat.project import project_checked
from warpforge.splat.reference import isect_bits
from warpforge.splat.tiles import _check_bits, intersect_tiles, sort_intersections

PACK_PAIRS = 1 << 22  # (camera, Gaussian) pairs projected densely at a time: ~150 MB of projection outputs


class Packed(NamedTuple):
    """A projection in the packed layout: ``proj``'s fields are [nnz, ...] (means2d [nnz, 2], conics [nnz, 3],
    depths [nnz], radii [nnz, 2] int32, opacities [nnz]), row i the pair (camera_ids[i], gaussian_ids[i])."""

    proj: Projection
    features: torch.Tensor | None  # [nnz, D] what the blend accumulates, when asked for
    camera_ids: torch.Tensor  # [nnz] int64, non-decreasing
    gaussian_ids: torch.Tensor  # [nnz] int64, increasing within a camera


def project_packed(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d, camera_model,
                   antialiased: bool = False, *,
                   features: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None) -> Packed:
    """``project_checked`` for the packed layout: cameras in groups of about ``PACK_PAIRS`` pairs.

    ``features(c0, c1, depths)``: the per-pair features of cameras c0..c1-1, [c1 - c0, N, D] from the group's
    depths [c1 - c0, N]; their visible rows become ``Packed.features``. Colours are made per group in the dense
    layout because SH coefficients are shared by the cameras: gathered into rows instead they would cost
    (K * 3 * 4 B, 192 B at degree 3) each visible pair, more than all the rest of a pair."""
    C, N = viewmats.shape[0], means.shape[0]
    step = max(1, PACK_PAIRS // max(N, 1))
    parts, feats, cams, gauss = [], [], [], []
    for c0 in range(0, C, step):
        c1 = min(c0 + step, C)
        p = project_checked(means, quats, scales, opacities, viewmats[c0:c1], Ks[c0:c1], width, height, near, far,
                            eps2d, camera_model, antialiased)
        c, g = (p.radii > 0).all(-1).nonzero(as_tuple=True)  # row-major: camera, then Gaussian, ascending
        parts.append(Projection(*(v[c, g] for v in p)))
        if features is not None:
            feats.append(features(c0, c1, p.depths)[c, g])
        cams.append(c + c0)
        gauss.append(g)
    cat = (lambda vs: vs[0]) if len(parts) == 1 else torch.cat
    return Packed(Projection(*(cat(vs) for vs in zip(*parts))), cat(feats) if feats else None, cat(cams),
                  cat(gauss))


def intersect_tiles_packed(packed: Packed, n_cameras: int, tile_size: int, tile_width: int, tile_height: int):
    """``intersect_tiles`` on the packed rows: tiles_per_gauss [nnz] int32, isect_ids [M] int64 (camera | tile |
    depth), flatten_ids [M] int32 (rows of the packed list).

    The rows go through the dense kernels as one camera of nnz Gaussians (the tile test reads only the pair's
    own values); each key then gets its row's camera in the bits above the tile, and the one stable sort runs."""
    tile_bits = _check_bits(n_cameras, tile_width, tile_height)
    assert tile_bits == isect_bits(1, tile_width, tile_height)[0]  # the tile field does not depend on C
    p = packed.proj
    counts, keys, ids = intersect_tiles(p.means2d[None], p.radii[None], p.depths[None], p.conics[None],
                                        p.opacities[None], tile_size, tile_width, tile_height, sort=False)
    keys = keys | (packed.camera_ids[ids.long()] << (tile_bits + 32))
    return (counts[0], *sort_intersections(keys, ids))
