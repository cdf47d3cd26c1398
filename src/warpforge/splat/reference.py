"""Pure-torch references for every stage of the Gaussian-splatting pipeline, written for clarity.

On CPU tensors the public splat functions run these (as ``warpforge.kernels`` dispatches); the tests
compare each Triton kernel with the reference of its stage, and the whole tiled pipeline with
``render_reference``, which blends every Gaussian at every pixel with no tiles at all.
"""

from __future__ import annotations

import torch

# ---- projection, spherical harmonics, dense whole-pipeline render -----------------------------------


# ---- tile intersection, key sort, per-tile blending ------------------------------------------------
#
# A pixel's colour is the front-to-back blend of the Gaussians of its tile, gsplat's rules:
#   alpha = min(ALPHA_MAX, opacity * exp(power)), power = -0.5*(a*dx^2 + c*dy^2) - b*dx*dy, (dx, dy) =
#   mean - pixel centre (x + 0.5, y + 0.5); a Gaussian with power > 0 or alpha < ALPHA_MIN is skipped; a
#   pixel stops before the first Gaussian that would take its transmittance T to T_MIN or below.

ALPHA_MIN = 1.0 / 255.0  # dimmer contributions are skipped (gsplat's ALPHA_THRESHOLD)
ALPHA_MAX = 0.99  # the clamp SPLAT_API agreed on (gsplat 1.5.3's kernels clamp at 0.999)
T_MIN = 1e-4  # transmittance at which a pixel is done
# Mahalanobis margin of the exact ellipse/tile test: covers the float rounding of the blend's power, so
# the test never drops a tile where some pixel reaches ALPHA_MIN (it widens the ellipse by 0.05%).
CUTOFF_REL, CUTOFF_ABS = 1e-3, 1e-3
# Below this det/(a*c) a conic is too close to degenerate for the row formula: its whole box is kept.
MIN_DET_RATIO = 1e-6


def isect_bits(n_cameras: int, tile_width: int, tile_height: int) -> tuple[int, int]:
    """(tile_bits, camera_bits) of the intersection key camera | tile | depth (gsplat's widths)."""
    return (tile_width * tile_height).bit_length(), max(n_cameras, 1).bit_length()


def alpha_cutoff(opacities: torch.Tensor) -> torch.Tensor:
    """q = a*dx^2 + 2b*dx*dy + c*dy^2 below which opacity*exp(-q/2) >= ALPHA_MIN, widened by the margin."""
    t = 2.0 * torch.log(torch.clamp(opacities * 255.0, min=1e-30))
    return t * (1.0 + CUTOFF_REL) + CUTOFF_ABS


def candidate_box(means2d: torch.Tensor, radii: torch.Tensor, tile_size: int, tile_width: int,
                  tile_height: int) -> tuple[torch.Tensor, ...]:
    """Tile box [tx0, tx1) x [ty0, ty1) (float) of each Gaussian's pixel box mean +- radii, as gsplat's
    isect_tiles computes it: the candidates the exact test picks from."""
    ts = float(tile_size)
    rx, ry = radii[..., 0].float() / ts, radii[..., 1].float() / ts
    tx, ty = means2d[..., 0] / ts, means2d[..., 1] / ts
    tx0 = torch.clamp(torch.floor(tx - rx), 0.0, float(tile_width))
    tx1 = torch.clamp(torch.ceil(tx + rx), 0.0, float(tile_width))
    ty0 = torch.clamp(torch.floor(ty - ry), 0.0, float(tile_height))
    ty1 = torch.clamp(torch.ceil(ty + ry), 0.0, float(tile_height))
    return tx0, tx1, ty0, ty1


def row_tile_span(x, y, a, b, c, t, row0, tile_size: int, tx0, tx1, exact):
    """Tile columns [c0, c1) (float) of one tile row where the ellipse a*dx^2 + 2b*dx*dy + c*dy^2 <= t around
    (x, y) covers a pixel centre; row0 is the row's first pixel row. The ellipse's slice through the row's
    pixel-centre band is convex, so its x-extent is one interval: the right end is largest at the band's
    point nearest the ellipse's rightmost point (dy = -b*xmax/c), the left end mirrored. Where ``exact`` is
    False (degenerate conic) the row keeps the whole candidate range. The Triton kernels repeat these float32
    operations in the same order, so both paths choose the same tiles."""
    ts = float(tile_size)
    det = a * c - b * b
    ymax = torch.sqrt(t * a / det)  # the ellipse's half-extents in y and x
    xmax = torch.sqrt(t * c / det)
    ye = b * xmax / c
    r0 = torch.maximum(row0, torch.ceil(y - ymax - 0.5))  # pixel rows with a centre inside the y-extent
    r1 = torch.minimum(row0 + (ts - 1.0), torch.floor(y + ymax - 0.5))
    dy0 = r0 + 0.5 - y
    dy1 = r1 + 0.5 - y
    dyr = torch.minimum(torch.maximum(-ye, dy0), dy1)
    dyl = torch.minimum(torch.maximum(ye, dy0), dy1)
    xr = x + (torch.sqrt(torch.clamp(a * t - det * dyr * dyr, min=0.0)) - b * dyr) / a
    xl = x - (torch.sqrt(torch.clamp(a * t - det * dyl * dyl, min=0.0)) + b * dyl) / a
    c0 = torch.maximum(torch.floor(torch.ceil(xl - 0.5) / ts), tx0)
    c1 = torch.minimum(torch.floor(torch.floor(xr - 0.5) / ts) + 1.0, tx1)
    c1 = torch.where(r0 <= r1, c1, c0)
    return torch.where(exact, c0, tx0), torch.where(exact, c1, tx1)


def gaussian_tile_setup(means2d, radii, conics, opacities, tile_size, tile_width, tile_height):
    """Per Gaussian: (valid, exact, cutoff t, candidate box) for the intersection."""
    a, b, c = conics[..., 0], conics[..., 1], conics[..., 2]
    t = alpha_cutoff(opacities)
    valid = (radii[..., 0] > 0) & (radii[..., 1] > 0) & (t > 0)
    det = a * c - b * b
    exact = (a > 0) & (c > 0) & (det > MIN_DET_RATIO * (a * c))
    return valid, exact, t, candidate_box(means2d, radii, tile_size, tile_width, tile_height)


def intersect_tiles_reference(means2d, radii, depths, conics, opacities, tile_size: int, tile_width: int,
                              tile_height: int, sort: bool = True):
    """Reference of ``tiles.intersect_tiles``: every (Gaussian, tile) pair that passes the exact test,
    emitted Gaussian-major and row-major, then (``sort``) stably sorted by the key camera | tile | depth.
    Returns tiles_per_gauss [C,N] int32, isect_ids [M] int64, flatten_ids [M] int32."""
    C, N = depths.shape
    dev = means2d.device
    flat = lambda v: v.reshape(C * N)  # noqa: E731
    valid, exact, t, (tx0, tx1, ty0, ty1) = gaussian_tile_setup(means2d, radii, conics, opacities, tile_size,
                                                                tile_width, tile_height)
    n_rows = torch.where(flat(valid), flat(ty1 - ty0), 0.0).long()
    gid = torch.repeat_interleave(torch.arange(C * N, device=dev), n_rows)  # one entry per (Gaussian, tile row)
    first = torch.cumsum(n_rows, 0) - n_rows
    row = flat(ty0)[gid] + (torch.arange(gid.numel(), device=dev) - first[gid]).float()
    x, y = flat(means2d[..., 0])[gid], flat(means2d[..., 1])[gid]
    a, b, c = (flat(conics[..., k])[gid] for k in range(3))
    c0, c1 = row_tile_span(x, y, a, b, c, flat(t)[gid], row * tile_size, tile_size, flat(tx0)[gid],
                           flat(tx1)[gid], flat(exact)[gid])
    n_cols = torch.clamp(c1 - c0, min=0.0).long()
    tiles_per_gauss = torch.zeros(C * N, dtype=torch.long, device=dev).index_add_(0, gid, n_cols)
    rid = torch.repeat_interleave(torch.arange(gid.numel(), device=dev), n_cols)  # one entry per intersection
    first = torch.cumsum(n_cols, 0) - n_cols
    col = c0.long()[rid] + torch.arange(rid.numel(), device=dev) - first[rid]
    tile = row.long()[rid] * tile_width + col
    g = gid[rid]
    tile_bits, _ = isect_bits(C, tile_width, tile_height)
    depth_bits = flat(depths).contiguous().view(torch.int32).long() & 0xFFFFFFFF
    keys = ((g // N) << (32 + tile_bits)) | (tile << 32) | depth_bits[g]
    if not sort:
        return tiles_per_gauss.int().view(C, N), keys, g.int()
    isect_ids, order = torch.sort(keys, stable=True)
    return tiles_per_gauss.int().view(C, N), isect_ids, g[order].int()


def tile_offsets_reference(isect_ids: torch.Tensor, n_cameras: int, tile_width: int,
                           tile_height: int) -> torch.Tensor:
    """Reference of ``tiles.tile_offsets``: index of each tile's first intersection (lower bound of its
    camera|tile key), [C, tile_height, tile_width] int32."""
    tile_bits, _ = isect_bits(n_cameras, tile_width, tile_height)
    cams = torch.arange(n_cameras, device=isect_ids.device)[:, None] << tile_bits
    targets = (cams | torch.arange(tile_width * tile_height, device=isect_ids.device)[None, :]).reshape(-1)
    offsets = torch.searchsorted((isect_ids >> 32).contiguous(), targets)
    return offsets.int().view(n_cameras, tile_height, tile_width)


def blend_tile(px: torch.Tensor,  # [P] pixel centres x
               py: torch.Tensor,  # [P]
               means2d: torch.Tensor,  # [K, 2] the tile's Gaussians, front to back
               conics: torch.Tensor,  # [K, 3]
               colors: torch.Tensor,  # [K, D]
               opacities: torch.Tensor,  # [K]
               chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Front-to-back blend of one tile's pixels: (colour [P, D], final transmittance [P]), differentiable.

    Which Gaussians a pixel keeps (skips, early termination) is decided without gradient, as in the
    kernels; the blend of the kept ones is plain autograd (an exclusive cumprod of 1 - alpha). With
    ``chunk`` the Gaussians go ``chunk`` at a time and the tile stops once every pixel is done."""
    P, K, D = px.shape[0], means2d.shape[0], colors.shape[-1]
    out = px.new_zeros(P, D)
    T = px.new_ones(P)
    done = torch.zeros(P, dtype=torch.bool, device=px.device)
    step = chunk or max(K, 1)
    for s in range(0, K, step):
        if s and bool(done.all()):
            break
        e = min(s + step, K)
        dx = means2d[..., s:e, 0] - px[:, None]  # [P, k] (means2d may be [P, K, 2]: one copy per pixel)
        dy = means2d[..., s:e, 1] - py[:, None]
        a, b, c = conics[s:e, 0], conics[s:e, 1], conics[s:e, 2]
        sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
        alpha = torch.clamp(opacities[s:e] * torch.exp(-sigma), max=ALPHA_MAX)
        alpha = torch.where((sigma >= 0) & (alpha >= ALPHA_MIN), alpha, torch.zeros_like(alpha))
        with torch.no_grad():
            t_incl = T[:, None] * torch.cumprod(1.0 - alpha, dim=1)
            keep = (t_incl > T_MIN) & ~done[:, None]
            done = done | (t_incl <= T_MIN).any(dim=1)
        alpha = torch.where(keep, alpha, torch.zeros_like(alpha))
        one_minus = 1.0 - alpha
        t_excl = T[:, None] * torch.cumprod(torch.cat([one_minus.new_ones(P, 1), one_minus[:, :-1]], 1), dim=1)
        out = out + (alpha * t_excl) @ colors[s:e]
        T = t_excl[:, -1] * one_minus[:, -1]
    return out, T


def tile_pixels(tile_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel offsets (x, y) within a tile, row-major, [tile_size^2] each."""
    p = torch.arange(tile_size * tile_size, device=device)
    return (p % tile_size).float(), (p // tile_size).float()


def rasterize_to_pixels_reference(means2d, conics, colors, opacities, width: int, height: int, tile_size: int,
                                  tile_offsets, flatten_ids, backgrounds=None, chunk: int | None = None):
    """Reference of ``blend.rasterize_to_pixels`` (a loop over tiles of ``blend_tile``), differentiable by
    autograd. Returns render_colors [C,H,W,D], render_alphas [C,H,W,1]."""
    C, N, D = colors.shape
    th, tw = tile_offsets.shape[1:]
    M = flatten_ids.numel()
    offs = tile_offsets.reshape(-1).tolist() + [M]
    ox, oy = tile_pixels(tile_size, means2d.device)
    flat = [means2d.reshape(C * N, 2), conics.reshape(C * N, 3), colors.reshape(C * N, D),
            opacities.reshape(C * N)]
    outs, Ts = [], []
    for i in range(C * th * tw):
        ty, tx = divmod(i % (th * tw), tw)
        px, py = ox + (tx * tile_size + 0.5), oy + (ty * tile_size + 0.5)
        ids = flatten_ids[offs[i]:offs[i + 1]].long()
        out, T = blend_tile(px, py, *(v[ids] for v in flat), chunk=chunk)
        outs.append(out)
        Ts.append(T)
    return assemble_tiles(torch.stack(outs), torch.stack(Ts), C, th, tw, tile_size, width, height, backgrounds)


def tiles_to_image(v: torch.Tensor, C: int, th: int, tw: int, tile_size: int, width: int,
                   height: int) -> torch.Tensor:
    """Per-tile values [C*th*tw, P, k] (camera-major tiles, row-major pixels) to images [C, H, W, k]."""
    k = v.shape[-1]
    img = v.reshape(C, th, tw, tile_size, tile_size, k).permute(0, 1, 3, 2, 4, 5)
    return img.reshape(C, th * tile_size, tw * tile_size, k)[:, :height, :width]


def assemble_tiles(out, T, C, th, tw, tile_size, width, height, backgrounds):
    """Per-tile results (out [C*th*tw, P, D], T [C*th*tw, P]) to (colours [C,H,W,D], alphas [C,H,W,1]),
    the background blended in behind."""
    img = tiles_to_image(out, C, th, tw, tile_size, width, height)
    T = tiles_to_image(T[..., None], C, th, tw, tile_size, width, height)
    if backgrounds is not None:
        img = img + T * backgrounds[:, None, None, :]
    return img, 1.0 - T
