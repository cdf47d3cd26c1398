"""Tile intersection with the opacity-aware exact ellipse/tile test, the one key sort, per-tile offsets.

A Gaussian's candidate tiles are those of its pixel box ``mean +- radii`` (what gsplat's ``isect_tiles``
emits). Of those, a tile is kept only if the ellipse ``opacity * exp(power) >= 1/255`` covers one of its
pixel centres: per tile row the ellipse's slice through the row's pixel band is one x-interval, computed in
closed form (``reference.row_tile_span``), so the test costs O(rows) per Gaussian, not O(tiles). Tiles at
the box's corners, which a tilted or elongated ellipse misses, are never emitted, and every later stage
(sort, blend, backward) does less work for it.

Triton path: a counting kernel (tiles per Gaussian) -> cumsum -> an emit kernel writing each Gaussian's
keys and ids at its offset, Gaussian-major and row-major -> one stable ``torch.sort`` of the int64 keys
camera | tile | depth -> a binary-search kernel for the tile offsets. The torch path (CPU) emits the same
pairs in the same order and sorts them the same way, so both return identical arrays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge._validate import check_int
from warpforge.kernels import use_triton  # importing the package chooses the interpreter before any @jit
from warpforge.splat import reference as ref
from warpforge.splat.checks import DeferredCheck

BLOCK_GAUSS = 128  # Gaussians per program of the count and emit kernels
BLOCK_TILES = 256  # tiles per program of the offsets kernel


@triton.jit
def _load_gaussians(means_ptr, conics_ptr, opac_ptr, g, mask, DIAG_OTHER: tl.constexpr):
    """Gaussians g's 2D centre, conic (a, b, c) and opacity; masked lanes read 0 but for the conic's diagonal,
    which reads ``DIAG_OTHER`` (shared by the tile intersection and the blend kernels)."""
    x = tl.load(means_ptr + 2 * g, mask=mask, other=0.0)
    y = tl.load(means_ptr + 2 * g + 1, mask=mask, other=0.0)
    a = tl.load(conics_ptr + 3 * g, mask=mask, other=DIAG_OTHER)
    b = tl.load(conics_ptr + 3 * g + 1, mask=mask, other=0.0)
    c = tl.load(conics_ptr + 3 * g + 2, mask=mask, other=DIAG_OTHER)
    op = tl.load(opac_ptr + g, mask=mask, other=0.0)
    return x, y, a, b, c, op


@triton.jit
def _setup(means_ptr, radii_ptr, conics_ptr, opac_ptr, total, TILE: tl.constexpr, TW, TH,
           CUT_REL: tl.constexpr, CUT_ABS: tl.constexpr, MIN_DET: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block of Gaussians (one lane each of the flattened [C*N]) and its mask; load them and
    return their centre, conic, cutoff, candidate box and test mode (``reference.gaussian_tile_setup``, same
    float32 operations)."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = g < total
    x, y, a, b, c, op = _load_gaussians(means_ptr, conics_ptr, opac_ptr, g, mask, 1.0)
    rx = tl.load(radii_ptr + 2 * g, mask=mask, other=0)
    ry = tl.load(radii_ptr + 2 * g + 1, mask=mask, other=0)
    t = 2.0 * tl.log(tl.maximum(op * 255.0, 1e-30))  # opacity 0: -138, never -inf
    t = t * (1.0 + CUT_REL) + CUT_ABS
    valid = mask & (rx > 0) & (ry > 0) & (t > 0)
    det = a * c - b * b
    exact = (a > 0) & (c > 0) & (det > MIN_DET * (a * c))
    ts = TILE * 1.0
    tx, ty = x / ts, y / ts
    trx, try_ = rx.to(tl.float32) / ts, ry.to(tl.float32) / ts
    tx0 = tl.minimum(tl.maximum(tl.floor(tx - trx), 0.0), TW * 1.0)
    tx1 = tl.minimum(tl.maximum(tl.ceil(tx + trx), 0.0), TW * 1.0)
    ty0 = tl.minimum(tl.maximum(tl.floor(ty - try_), 0.0), TH * 1.0)
    ty1 = tl.minimum(tl.maximum(tl.ceil(ty + try_), 0.0), TH * 1.0)
    n_rows = tl.where(valid, (ty1 - ty0).to(tl.int32), 0)
    # lanes that take the box (or no tiles at all) get a harmless ellipse: no NaN flows into the int casts
    exact = exact & valid
    a, c = tl.where(exact, a, 1.0), tl.where(exact, c, 1.0)
    b, det, t = tl.where(exact, b, 0.0), tl.where(exact, det, 1.0), tl.where(exact, t, 1.0)
    return g, mask, x, y, a, b, c, det, t, exact, tx0, tx1, ty0, n_rows


@triton.jit
def _row_span(x, y, a, b, c, det, t, row0, TILE: tl.constexpr, tx0, tx1, exact):
    """``reference.row_tile_span``: tile columns [c0, c1) of one tile row, as int32."""
    ts = TILE * 1.0
    ymax = tl.sqrt(t * a / det)
    xmax = tl.sqrt(t * c / det)
    ye = b * xmax / c
    r0 = tl.maximum(row0, tl.ceil(y - ymax - 0.5))
    r1 = tl.minimum(row0 + (ts - 1.0), tl.floor(y + ymax - 0.5))
    dy0 = r0 + 0.5 - y
    dy1 = r1 + 0.5 - y
    dyr = tl.minimum(tl.maximum(-ye, dy0), dy1)
    dyl = tl.minimum(tl.maximum(ye, dy0), dy1)
    xr = x + (tl.sqrt(tl.maximum(a * t - det * dyr * dyr, 0.0)) - b * dyr) / a
    xl = x - (tl.sqrt(tl.maximum(a * t - det * dyl * dyl, 0.0)) + b * dyl) / a
    c0 = tl.maximum(tl.floor(tl.ceil(xl - 0.5) / ts), tx0)
    c1 = tl.minimum(tl.floor(tl.floor(xr - 0.5) / ts) + 1.0, tx1)
    c1 = tl.where(r0 <= r1, c1, c0)
    c0 = tl.where(exact, c0, tx0)
    c1 = tl.where(exact, c1, tx1)
    return c0.to(tl.int32), tl.maximum(c1, c0).to(tl.int32)


@triton.jit
def _isect_count_kernel(means_ptr, radii_ptr, conics_ptr, opac_ptr, counts_ptr, total, TW, TH,
                        TILE: tl.constexpr, CUT_REL: tl.constexpr, CUT_ABS: tl.constexpr, MIN_DET: tl.constexpr,
                        BLOCK: tl.constexpr):
    # one lane per Gaussian of the flattened [C*N]; counts [C*N] int32
    g, mask, x, y, a, b, c, det, t, exact, tx0, tx1, ty0, n_rows = _setup(
        means_ptr, radii_ptr, conics_ptr, opac_ptr, total, TILE, TW, TH, CUT_REL, CUT_ABS, MIN_DET, BLOCK)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(0, tl.max(n_rows, axis=0)):
        c0, c1 = _row_span(x, y, a, b, c, det, t, (ty0 + r) * TILE, TILE, tx0, tx1, exact)
        count += tl.where(r < n_rows, c1 - c0, 0)
    tl.store(counts_ptr + g, count, mask=mask)


@triton.jit
def _isect_emit_kernel(means_ptr, radii_ptr, conics_ptr, opac_ptr, depths_ptr, counts_ptr, cum_ptr,
                       keys_ptr, ids_ptr, total, N, TW, TH, TILE_BITS,
                       TILE: tl.constexpr, CUT_REL: tl.constexpr, CUT_ABS: tl.constexpr, MIN_DET: tl.constexpr,
                       BLOCK: tl.constexpr):
    # writes Gaussian g's keys and ids at [cum[g] - counts[g], cum[g]), rows top to bottom, tiles left to right
    g, mask, x, y, a, b, c, det, t, exact, tx0, tx1, ty0, n_rows = _setup(
        means_ptr, radii_ptr, conics_ptr, opac_ptr, total, TILE, TW, TH, CUT_REL, CUT_ABS, MIN_DET, BLOCK)
    cur = tl.load(cum_ptr + g, mask=mask, other=0) - tl.load(counts_ptr + g, mask=mask, other=0).to(tl.int64)
    depth = tl.load(depths_ptr + g, mask=mask, other=0.0)
    depth_bits = depth.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    cam_key = (g // N).to(tl.int64) << (TILE_BITS + 32)
    for r in range(0, tl.max(n_rows, axis=0)):
        row = ty0 + r
        c0, c1 = _row_span(x, y, a, b, c, det, t, row * TILE, TILE, tx0, tx1, exact)
        n_cols = tl.where(r < n_rows, c1 - c0, 0)
        first_tile = row.to(tl.int32) * TW + c0
        for j in range(0, tl.max(n_cols, axis=0)):
            ok = j < n_cols
            key = cam_key | ((first_tile + j).to(tl.int64) << 32) | depth_bits
            tl.store(keys_ptr + cur + j, key, mask=ok)
            tl.store(ids_ptr + cur + j, g, mask=ok)
        cur += n_cols


@triton.jit
def _tile_offsets_kernel(keys_ptr, out_ptr, M, n_iters, total, TILES_PER_CAM, TILE_BITS, BLOCK: tl.constexpr):
    # out[cam, tile] = lower bound of (cam << TILE_BITS | tile) in keys >> 32 (binary search, n_iters steps)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    target = ((i // TILES_PER_CAM).to(tl.int64) << TILE_BITS) | (i % TILES_PER_CAM)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + M
    for _ in range(n_iters):
        active = lo < hi
        mid = (lo + hi) // 2
        key = tl.load(keys_ptr + mid, mask=mask & active, other=0) >> 32
        right = key < target
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    tl.store(out_ptr + i, lo.to(tl.int32), mask=mask)


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Uninitialized output buffer (the tests swap in poisoned ones: every element must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(name: str, t, shape: tuple, dtype: torch.dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like means2d, got {t.device}")


def _check_bits(n_cameras: int, tile_width: int, tile_height: int) -> int:
    tile_bits, cam_bits = ref.isect_bits(n_cameras, tile_width, tile_height)
    if tile_bits + cam_bits > 31:  # the key stays a positive int64
        raise ValueError(f"{n_cameras} cameras x {tile_width}x{tile_height} tiles need {tile_bits + cam_bits} "
                         "key bits above the depth; at most 31 fit (use fewer cameras per call or larger tiles)")
    return tile_bits


def intersect_tiles(means2d: torch.Tensor,  # [C, N, 2]
                    radii: torch.Tensor,  # [C, N, 2] int32, (0, 0) = culled
                    depths: torch.Tensor,  # [C, N]
                    conics: torch.Tensor,  # [C, N, 3]
                    opacities: torch.Tensor,  # [C, N]
                    tile_size: int, tile_width: int, tile_height: int, *, sort: bool = True,
                    deferred: DeferredCheck | None = None):
    """The (Gaussian, tile) pairs to blend, sorted by camera | tile | depth.

    Returns tiles_per_gauss [C, N] int32, isect_ids [M] int64 (camera << (32 + tile_bits) | tile_id << 32 |
    depth's float32 bits, tile_id = ty * tile_width + tx), flatten_ids [M] int32 (index into the flattened
    [C * N] Gaussians). Pairs of equal key keep the order of their flattened index. ``sort=False`` returns
    the pairs as emitted (Gaussian-major; ``sort_intersections`` sorts them), for timing the two apart.
    ``deferred``: the caller's input checks, read in the same host sync as the intersection count (their
    ValueError is raised before anything is sized from the count).
    """
    if not isinstance(means2d, torch.Tensor) or means2d.dim() != 3 or means2d.shape[-1] != 2:
        raise ValueError(f"means2d must be a [C, N, 2] tensor, got "
                         f"{list(means2d.shape) if isinstance(means2d, torch.Tensor) else type(means2d).__name__}")
    C, N, _ = means2d.shape
    dev = means2d.device
    _check("means2d", means2d, (C, N, 2), torch.float32, dev)
    _check("radii", radii, (C, N, 2), torch.int32, dev)
    _check("depths", depths, (C, N), torch.float32, dev)
    _check("conics", conics, (C, N, 3), torch.float32, dev)
    _check("opacities", opacities, (C, N), torch.float32, dev)
    check_int("tile_size", tile_size, 1)
    check_int("tile_width", tile_width, 1)
    check_int("tile_height", tile_height, 1)
    tile_bits = _check_bits(C, tile_width, tile_height)
    if not use_triton(means2d):
        if deferred is not None:
            deferred.resolve()
        with torch.no_grad():  # integer outputs: no graph through the (differentiable) inputs
            return ref.intersect_tiles_reference(means2d.detach(), radii, depths.detach(), conics.detach(),
                                                 opacities.detach(), tile_size, tile_width, tile_height, sort=sort)
    total = C * N
    if total >= 2**31:
        raise ValueError(f"C * N must be below 2^31 (flatten_ids are int32), got {total}")
    means2d, radii, depths, conics, opacities = (t.detach().contiguous()
                                                 for t in (means2d, radii, depths, conics, opacities))
    counts = _alloc(total, torch.int32, dev)
    consts = dict(TILE=tile_size, CUT_REL=ref.CUTOFF_REL, CUT_ABS=ref.CUTOFF_ABS, MIN_DET=ref.MIN_DET_RATIO,
                  BLOCK=BLOCK_GAUSS)
    grid = (-(-total // BLOCK_GAUSS),)
    if total:
        _isect_count_kernel[grid](means2d, radii, conics, opacities, counts, total, tile_width, tile_height,
                                  **consts)
    cum = torch.cumsum(counts, 0, dtype=torch.int64)
    if not total:
        M = 0
        if deferred is not None:
            deferred.resolve()
    elif deferred is not None:  # the one host sync: the size of the intersection arrays and the input checks
        M, bad = torch.cat([cum[-1:], deferred.flag]).tolist()
        deferred.resolve(bad == 0)
    else:
        M = int(cum[-1])  # the one host sync: the size of the intersection arrays
    if M >= 2**31:
        raise ValueError(f"{M} tile intersections: at most 2^31 - 1 fit the int32 tile offsets "
                         "(render fewer cameras or Gaussians per call)")
    keys = _alloc(M, torch.int64, dev)
    ids = _alloc(M, torch.int32, dev)
    if M:
        _isect_emit_kernel[grid](means2d, radii, conics, opacities, depths, counts, cum, keys, ids, total, N,
                                 tile_width, tile_height, tile_bits, **consts)
    del cum
    if not sort:
        return counts.view(C, N), keys, ids
    return (counts.view(C, N), *sort_intersections(keys, ids))


def sort_intersections(isect_ids: torch.Tensor,  # [M] int64 keys, camera | tile | depth
                       flatten_ids: torch.Tensor,  # [M] int32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One stable sort of the keys, ids carried along: equal keys keep their emission order."""
    keys, order = torch.sort(isect_ids, stable=True)
    return keys, flatten_ids[order]


def tile_offsets(isect_ids: torch.Tensor,  # [M] int64, sorted
                 n_cameras: int, tile_width: int, tile_height: int) -> torch.Tensor:
    """Index of each tile's first intersection, [C, tile_height, tile_width] int32. A tile's range ends at
    the next tile's offset (the next in memory order), or at M for the last tile."""
    if not isinstance(isect_ids, torch.Tensor) or isect_ids.dim() != 1 or isect_ids.dtype != torch.int64:
        raise ValueError("isect_ids must be a 1-D int64 tensor, got "
                         + (f"{list(isect_ids.shape)} {isect_ids.dtype}" if isinstance(isect_ids, torch.Tensor)
                            else type(isect_ids).__name__))
    check_int("n_cameras", n_cameras, 1)
    check_int("tile_width", tile_width, 1)
    check_int("tile_height", tile_height, 1)
    tile_bits = _check_bits(n_cameras, tile_width, tile_height)
    if not use_triton(isect_ids):
        return ref.tile_offsets_reference(isect_ids, n_cameras, tile_width, tile_height)
    M = isect_ids.numel()
    total = n_cameras * tile_width * tile_height
    out = _alloc(total, torch.int32, isect_ids.device)
    _tile_offsets_kernel[(-(-total // BLOCK_TILES),)](
        isect_ids.contiguous(), out, M, max(M, 1).bit_length(), total, tile_width * tile_height, tile_bits,
        BLOCK=BLOCK_TILES)
    return out.view(n_cameras, tile_height, tile_width)
