"""Per-tile front-to-back alpha blending with early termination, forward and backward.

Triton: one program per (camera, tile); the tile's pixels spread over the program's threads (FWD_WARPS
warps forward, BWD_WARPS backward: 8 pixels a thread at one warp). The tile's sorted Gaussians are walked one
at a time: a Gaussian's parameters are scalar loads every thread makes (the same address across the warp),
unrolled UNROLL deep so their latency overlaps. A pixel keeps a Gaussian while its transmittance after it
stays above T_MIN; the tile stops once every pixel is done. Per pixel the final T and the index of the last
Gaussian that contributed are stored for the backward, which walks the tile back to front from its largest
last index, recovering each T before a Gaussian by dividing by (1 - alpha) as gsplat does. Most of a tile's
Gaussians reach none of its pixels (the tile test is conservative): one vote skips their reductions and
atomics, as gsplat's per-warp ballot does; the others' eight per-Gaussian sums are one joined reduction and
one atomic add. The interpreter runs the same code, with plain exp2 and division where the GPU takes the
fast forms (``_exp2``, ``_div``).
CPU: ``_blend_torch``, the same algorithm in torch over batches of tiles (forward and analytic backward);
``reference.rasterize_to_pixels_reference`` is the plain-autograd ground truth both are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from warpforge.kernels import INTERPRET, check_tensor_as, use_triton  # the import picks the interpreter first
from warpforge.splat import reference as ref
from warpforge.splat._blend_torch import blend_backward, blend_forward
from warpforge.splat.tiles import _load_gaussians

# Measured on an H100 (1M Gaussians, 1080p, 3.16M intersections), fwd / bwd ms: a chunked variant that
# evaluated CHUNK Gaussians as a [CHUNK, pixels] block with tl.cumprod took 2.21 / 8.95; one at a time at
# (UNROLL x warps) 1x1 1.43 / 3.75, 2x2 1.14-1.19 / 4.97, 4x1 1.70 / 5.56 (backward sums joined): the forward
# and backward take their own best.
FWD_UNROLL, FWD_WARPS = 2, 2
BWD_UNROLL, BWD_WARPS = 1, 1
MAX_TILE = 32  # the Triton kernels keep a tile's pixels in one program


@triton.jit
def _tile(offsets_ptr, n_isects, n_tiles, W, H, TW, TH, TILE: tl.constexpr, PB: tl.constexpr, D: tl.constexpr,
          DB: tl.constexpr):
    """The program's camera, tile pixels (x, y, flat index in [C*H*W]), which of them are in the image, its
    range [start, end) of the sorted intersections, and the colour channels (DB lanes, the first D live)."""
    pid = tl.program_id(0)
    cam = pid // (TH * TW)
    tile = pid % (TH * TW)
    p = tl.arange(0, PB)
    px = (tile % TW) * TILE + p % TILE
    py = (tile // TW) * TILE + p // TILE
    inside = (p < TILE * TILE) & (px < W) & (py < H)
    pix = (cam.to(tl.int64) * H + py) * W + px
    start = tl.load(offsets_ptr + pid)
    end = tl.load(offsets_ptr + pid + 1, mask=pid + 1 < n_tiles, other=n_isects)
    dcol = tl.arange(0, DB)
    dm = dcol < D
    return cam, px.to(tl.float32) + 0.5, py.to(tl.float32) + 0.5, pix, inside, start, end, dcol, dm


# GPU math for the per-(pixel, Gaussian) work, by offline sm_90 SASS counts of the forward loop: libdevice's
# exp2, which flush-to-zero makes a bare ex2.approx.ftz (tl.exp2 adds a denormal fix-up), and the approximate
# division (IEEE division's fix-ups cost ~10 instructions a pair). The interpreter has no libdevice: there the
# plain operations run (the same values up to rounding).
_GPU_MATH: tl.constexpr = tl.constexpr(not INTERPRET)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2(x):
    if _GPU_MATH:
        return libdevice.exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def _div(x, y):
    """x / y for y in [0.01, 1] (1 - alpha): the approximate division on the GPU (2 instructions against
    about 12 for IEEE division's range fix-ups; within 2 ulp)."""
    if _GPU_MATH:
        return libdevice.fast_dividef(x, y)
    else:
        return x / y


@triton.jit
def _gaussian_at(means_ptr, conics_ptr, colors_ptr, opac_ptr, ids_ptr, j, jm, fx, fy, dcol, dm, D: tl.constexpr):
    """Intersection j's Gaussian (lanes off ``jm`` read zeros): its index, conic, opacity, colour, offset from
    the pixels and p2, the exponent of its falloff there in log2 units (the forward and backward agree on it)."""
    g = tl.load(ids_ptr + j, mask=jm, other=0).to(tl.int64)
    gx, gy, ca, cb, cc, op = _load_gaussians(means_ptr, conics_ptr, opac_ptr, g, jm, 0.0)
    col = tl.load(colors_ptr + g * D + dcol, mask=dm & jm, other=0.0)
    dx = gx - fx
    dy = gy - fy
    p2 = ((-0.5 * LOG2E) * ca * dx + (-LOG2E) * cb * dy) * dx + (-0.5 * LOG2E) * cc * dy * dy
    return g, ca, cb, cc, op, col, dx, dy, p2


@triton.jit
def _blend_fwd_kernel(means_ptr, conics_ptr, colors_ptr, opac_ptr, bg_ptr, offsets_ptr, ids_ptr,
                      out_ptr, alpha_ptr, T_ptr, last_ptr,
                      n_isects, n_tiles, W, H, TW, TH,
                      D: tl.constexpr, DB: tl.constexpr, TILE: tl.constexpr, PB: tl.constexpr,
                      UNROLL: tl.constexpr, HAS_BG: tl.constexpr, ALPHA_MIN: tl.constexpr,
                      ALPHA_MAX: tl.constexpr, T_MIN: tl.constexpr):
    cam, fx, fy, pix, inside, start, end, dcol, dm = _tile(offsets_ptr, n_isects, n_tiles, W, H, TW, TH, TILE, PB,
                                                           D, DB)
    T = tl.full([PB], 1.0, tl.float32)
    done = inside == 0
    last = tl.full([PB], -1, tl.int32)
    acc = tl.zeros([PB, DB], tl.float32)
    n_live = tl.sum(inside.to(tl.int32), axis=0)
    i = start
    while (i < end) & (n_live > 0):
        for k in tl.static_range(UNROLL):
            j = i + k
            jm = j < end
            g, ca, cb, cc, op, col, dx, dy, p2 = _gaussian_at(means_ptr, conics_ptr, colors_ptr, opac_ptr, ids_ptr,
                                                              j, jm, fx, fy, dcol, dm, D)
            alpha = tl.minimum(op * _exp2(p2), ALPHA_MAX)
            alpha = tl.where((p2 <= 0) & (alpha >= ALPHA_MIN), alpha, 0.0)
            t_next = T * (1.0 - alpha)
            keep = (t_next > T_MIN) & (done == 0)
            w = tl.where(keep, alpha * T, 0.0)
            acc += w[:, None] * col[None, :]
            last = tl.where(keep & (alpha > 0), j, last)
            T = tl.where(keep, t_next, T)
            done = done | (t_next <= T_MIN)
        n_live = tl.sum((done == 0).to(tl.int32), axis=0)
        i += UNROLL
    if HAS_BG:
        bg = tl.load(bg_ptr + cam * D + dcol, mask=dm, other=0.0)
        acc += T[:, None] * bg[None, :]
    tl.store(out_ptr + pix[:, None] * D + dcol[None, :], acc, mask=inside[:, None] & dm[None, :])
    tl.store(alpha_ptr + pix, 1.0 - T, mask=inside)
    tl.store(T_ptr + pix, T, mask=inside)
    tl.store(last_ptr + pix, last, mask=inside)


@triton.jit
def _blend_bwd_kernel(means_ptr, conics_ptr, colors_ptr, opac_ptr, bg_ptr, offsets_ptr, ids_ptr,
                      T_ptr, last_ptr, v_out_ptr, v_alpha_ptr,
                      v_means_ptr, v_conics_ptr, v_colors_ptr, v_opac_ptr, v_abs_ptr,
                      n_isects, n_tiles, W, H, TW, TH,
                      D: tl.constexpr, DB: tl.constexpr, TILE: tl.constexpr, PB: tl.constexpr,
                      UNROLL: tl.constexpr, HAS_BG: tl.constexpr, ABSGRAD: tl.constexpr, ALPHA_GRAD: tl.constexpr,
                      ALPHA_MIN: tl.constexpr, ALPHA_MAX: tl.constexpr):
    # ALPHA_GRAD: the alphas took a gradient (v_alpha is read; without it, as if zero)
    cam, fx, fy, pix, inside, start, end, dcol, dm = _tile(offsets_ptr, n_isects, n_tiles, W, H, TW, TH, TILE, PB,
                                                           D, DB)
    T = tl.load(T_ptr + pix, mask=inside, other=1.0)  # T after the pixel's last Gaussian, then walking back
    last = tl.load(last_ptr + pix, mask=inside, other=-1)
    v_c = tl.load(v_out_ptr + pix[:, None] * D + dcol[None, :], mask=inside[:, None] & dm[None, :], other=0.0)
    v_a = tl.load(v_alpha_ptr + pix, mask=inside & ALPHA_GRAD, other=0.0)
    if HAS_BG:
        bg = tl.load(bg_ptr + cam * D + dcol, mask=dm, other=0.0)
        v_a = v_a - tl.sum(v_c * bg[None, :], axis=1)
    fin = T * v_a
    behind = tl.zeros([PB], tl.float32)  # sum over the Gaussians behind of w * (colour . v_c)
    j0 = tl.minimum(end, tl.max(last, axis=0) + 1) - 1
    while j0 >= start:
        for k in tl.static_range(UNROLL):
            j = j0 - k
            jm = j >= start
            g, ca, cb, cc, op, col, dx, dy, p2 = _gaussian_at(means_ptr, conics_ptr, colors_ptr, opac_ptr, ids_ptr,
                                                              j, jm, fx, fy, dcol, dm, D)
            vis = _exp2(p2)
            raw = op * vis
            alpha = tl.minimum(raw, ALPHA_MAX)
            valid = jm & (j <= last) & (p2 <= 0) & (alpha >= ALPHA_MIN)
            a = tl.where(valid, alpha, 0.0)
            ra = _div(1.0, 1.0 - a)
            T = T * ra  # T before this Gaussian
            w = a * T
            gdot = tl.sum(col[None, :] * v_c, axis=1)  # colour . v_c, per pixel
            v_alpha = (gdot * T - behind * ra + fin * ra)
            behind += w * gdot
            on = valid & (raw <= ALPHA_MAX)  # the clamp passes no gradient
            v_sigma = tl.where(on, -raw * v_alpha, 0.0)
            vx = v_sigma * (ca * dx + cb * dy)
            vy = v_sigma * (cb * dx + cc * dy)
            # Most of a tile's Gaussians reach none of its pixels (the tile test is conservative): one vote
            # skips their reductions and atomics, as gsplat's per-warp ballot does.
            if tl.max(valid.to(tl.int32), axis=0) > 0:
                tl.atomic_add(v_colors_ptr + g * D + dcol, tl.sum(w[:, None] * v_c, axis=0), mask=dm, sem="relaxed")
                # the eight per-Gaussian sums as one reduction: one cross-warp exchange, not eight
                f = tl.join(tl.join(tl.join(vx, vy), tl.join(0.5 * v_sigma * dx * dx, v_sigma * dx * dy)),
                            tl.join(tl.join(0.5 * v_sigma * dy * dy, tl.where(on, vis * v_alpha, 0.0)),
                                    tl.join(tl.abs(vx), tl.abs(vy))))  # [PB, 2, 2, 2]
                sums = tl.reshape(tl.sum(f, axis=0), [8])
                n = tl.arange(0, 8)
                field = 4 * (n % 2) + 2 * ((n // 2) % 2) + n // 4  # join order -> vx vy ca cb cc op |vx| |vy|
                ptr = tl.where(field < 2, v_means_ptr + 2 * g + field,
                               tl.where(field < 5, v_conics_ptr + 3 * g + (field - 2),
                                        tl.where(field == 5, v_opac_ptr + g, v_abs_ptr + 2 * g + (field - 6))))
                tl.atomic_add(ptr, sums, mask=(field < 6) | ABSGRAD, sem="relaxed")
        j0 -= UNROLL


def _meta(colors: torch.Tensor, tile_size: int, unroll: int, num_warps: int) -> dict:
    D = colors.shape[-1]
    # powers of two by bit_length: triton.next_power_of_2 (and triton.cdiv) cost ~4 us a host call
    return dict(D=D, DB=1 << (D - 1).bit_length(), TILE=tile_size, PB=1 << (tile_size * tile_size - 1).bit_length(),
                UNROLL=unroll, ALPHA_MIN=ref.ALPHA_MIN, ALPHA_MAX=ref.ALPHA_MAX, num_warps=num_warps)


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Uninitialized output buffer (the tests swap in NaN-filled ones: every element must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fwd_triton(means2d, conics, colors, opacities, backgrounds, width, height, tile_size, offsets, flatten_ids):
    C, th, tw = offsets.shape  # the layout's own leading dims ([C, N] or packed [nnz]) do not matter here
    D = colors.shape[-1]
    dev = means2d.device
    out = _alloc((C, height, width, D), torch.float32, dev)
    alphas = _alloc((C, height, width, 1), torch.float32, dev)
    T = _alloc((C, height, width), torch.float32, dev)
    last = _alloc((C, height, width), torch.int32, dev)
    n_tiles = C * th * tw
    _blend_fwd_kernel[(n_tiles,)](
        means2d, conics, colors, opacities, backgrounds if backgrounds is not None else out, offsets, flatten_ids,
        out, alphas, T, last, flatten_ids.numel(), n_tiles, width, height, tw, th,
        HAS_BG=backgrounds is not None, T_MIN=ref.T_MIN, **_meta(colors, tile_size, FWD_UNROLL, FWD_WARPS))
    return out, alphas, T, last


def _bwd_triton(means2d, conics, colors, opacities, backgrounds, width, height, tile_size, offsets, flatten_ids,
                T, last, v_out, v_alphas, absgrad):
    C, th, tw = offsets.shape  # the layout's own leading dims ([C, N] or packed [nnz]) do not matter here
    n_tiles = C * th * tw
    grads = [torch.zeros_like(v) for v in (means2d, conics, colors, opacities)]
    v_abs = torch.zeros_like(means2d) if absgrad else grads[0]
    _blend_bwd_kernel[(n_tiles,)](
        means2d, conics, colors, opacities, backgrounds if backgrounds is not None else v_out, offsets, flatten_ids,
        T, last, v_out, v_alphas if v_alphas is not None else v_out, *grads, v_abs, flatten_ids.numel(), n_tiles,
        width, height, tw, th, HAS_BG=backgrounds is not None, ABSGRAD=absgrad, ALPHA_GRAD=v_alphas is not None,
        **_meta(colors, tile_size, BWD_UNROLL, BWD_WARPS))
    return grads, (v_abs if absgrad else None)


def _dense(*tensors):
    return tuple(t.contiguous() if t is not None else None for t in tensors)


class _Blend(torch.autograd.Function):
    # Inputs arrive as the caller passed them (``absgrad`` is set on that means2d object, which the render
    # hands out as meta["means2d"]); the kernels get contiguous copies where they are not already.
    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, backgrounds, width, height, tile_size, offsets,
                flatten_ids, absgrad, triton_path):
        fwd = _fwd_triton if triton_path else blend_forward
        out, alphas, T, last = fwd(*_dense(means2d, conics, colors, opacities, backgrounds), width, height,
                                   tile_size, *_dense(offsets, flatten_ids))
        ctx.save_for_backward(means2d, conics, colors, opacities, backgrounds, offsets, flatten_ids, T, last)
        ctx.cfg = (width, height, tile_size, absgrad, triton_path)
        ctx.set_materialize_grads(False)  # unused alphas: None, not a [C, H, W, 1] fill of zeros
        return out, alphas

    @staticmethod
    def backward(ctx, v_out, v_alphas):
        means2d, conics, colors, opacities, backgrounds, offsets, flatten_ids, T, last = ctx.saved_tensors
        width, height, tile_size, absgrad, triton_path = ctx.cfg
        if v_out is None:
            v_out = T.new_zeros(*T.shape, colors.shape[-1])
        if v_alphas is None and not triton_path:
            v_alphas = T.new_zeros(*T.shape, 1)
        bwd = _bwd_triton if triton_path else blend_backward
        grads, v_abs = bwd(*_dense(means2d, conics, colors, opacities, backgrounds), width, height, tile_size,
                           *_dense(offsets, flatten_ids), T, last, v_out.contiguous(), *_dense(v_alphas), absgrad)
        if absgrad:
            means2d.absgrad = v_abs
        v_bg = None
        if backgrounds is not None and ctx.needs_input_grad[4]:
            v_bg = (v_out * T[..., None]).sum(dim=(1, 2))
        return (*grads, v_bg, None, None, None, None, None, None, None)


def rasterize_to_pixels(means2d: torch.Tensor,  # [C, N, 2], or packed [nnz, 2]
                        conics: torch.Tensor,  # [C, N, 3] / [nnz, 3]
                        colors: torch.Tensor,  # [C, N, D] / [nnz, D]
                        opacities: torch.Tensor,  # [C, N] / [nnz]
                        width: int, height: int, tile_size: int,
                        tile_offsets: torch.Tensor,  # [C, tile_height, tile_width] int32
                        flatten_ids: torch.Tensor,  # [M] int32, sorted by camera | tile | depth
                        *, backgrounds: torch.Tensor | None = None,  # [C, D]
                        absgrad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Blend each tile's Gaussians front to back: render_colors [C,H,W,D], render_alphas [C,H,W,1].

    Two layouts of the per-(camera, Gaussian) inputs, as gsplat's: dense [C, N, ...], flatten_ids indexing the
    flattened C * N; or packed [nnz, ...] (2-D colors), flatten_ids indexing the nnz rows. The blend reads them
    only through flatten_ids, and the camera of a tile from tile_offsets, so both run the same code.
    Differentiable in means2d, conics, colors, opacities and backgrounds. With ``absgrad`` the backward
    also sets ``means2d.absgrad`` (means2d's shape): the sum over pixels of |dL/dmeans2d| of each pixel's term
    (what gsplat's densification reads).
    """
    if not isinstance(colors, torch.Tensor) or colors.dim() not in (2, 3):
        raise ValueError("colors must be a [C, N, D] tensor (or [nnz, D], packed), got "
                         + (str(list(colors.shape)) if isinstance(colors, torch.Tensor) else type(colors).__name__))
    lead, D = tuple(colors.shape[:-1]), colors.shape[-1]
    if not isinstance(means2d, torch.Tensor):
        raise ValueError(f"means2d must be a tensor, got {type(means2d).__name__}")
    if not isinstance(tile_offsets, torch.Tensor) or tile_offsets.dim() != 3:
        raise ValueError("tile_offsets must be a [C, tile_height, tile_width] tensor, got "
                         + (str(list(tile_offsets.shape)) if isinstance(tile_offsets, torch.Tensor)
                            else type(tile_offsets).__name__))
    C = lead[0] if len(lead) == 2 else tile_offsets.shape[0]
    dev = means2d.device
    for name, v in (("width", width), ("height", height), ("tile_size", tile_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if D < 1:
        raise ValueError(f"colors must have at least one channel, got D={D}")
    th, tw = -(-height // tile_size), -(-width // tile_size)
    check_tensor_as(means2d, "means2d", (*lead, 2), torch.float32, dev)
    check_tensor_as(conics, "conics", (*lead, 3), torch.float32, dev, like="means2d")
    check_tensor_as(colors, "colors", (*lead, D), torch.float32, dev, like="means2d")
    check_tensor_as(opacities, "opacities", lead, torch.float32, dev, like="means2d")
    check_tensor_as(tile_offsets, "tile_offsets", (C, th, tw), torch.int32, dev, like="means2d")
    if not isinstance(flatten_ids, torch.Tensor) or flatten_ids.dim() != 1 or flatten_ids.dtype != torch.int32:
        raise ValueError("flatten_ids must be a 1-D int32 tensor")
    check_tensor_as(flatten_ids, "flatten_ids", (flatten_ids.numel(),), torch.int32, dev, like="means2d")
    if backgrounds is not None:
        check_tensor_as(backgrounds, "backgrounds", (C, D), torch.float32, dev, like="means2d")
    triton_path = use_triton(means2d)
    if triton_path and tile_size > MAX_TILE:
        raise ValueError(f"tile_size must be at most {MAX_TILE} for the Triton blend, got {tile_size}")
    return _Blend.apply(means2d, conics, colors, opacities, backgrounds, width, height, tile_size, tile_offsets,
                        flatten_ids, bool(absgrad), triton_path)
