"""Pure-torch references for every stage of the Gaussian-splatting pipeline, written for clarity.

On CPU tensors the public splat functions run these (as ``warpforge.kernels`` dispatches); the tests
compare each Triton kernel with the reference of its stage, and the whole tiled pipeline with
``render_reference``, which blends every Gaussian at every pixel with no tiles at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warpforge.splat.camera import Projection, camera_centers

# ---- projection, spherical harmonics, dense whole-pipeline render -----------------------------------
#
# A Gaussian is a mean, a rotation (quaternion w, x, y, z, normalized here), per-axis scales and an opacity;
# its world covariance is R S S^T R^T. Projection (EWA splatting, as gsplat): the camera-space covariance
# W Sigma W^T goes through the camera model's Jacobian J at the centre, Sigma2d = J W Sigma W^T J^T, and eps2d
# is added on the diagonal (gsplat's low-pass filter: every splat covers about a pixel). The conic is
# Sigma2d^-1; the blend's alpha is opacity * exp(-q / 2), q = d^T conic d, so alpha >= ALPHA_MIN on the
# ellipse q <= 2 ln(255 opacity): its axis-aligned box, half-extents sqrt(t * Sigma2d_xx) and
# sqrt(t * Sigma2d_yy), is the Gaussian's radii (gsplat's opacity-aware bound; the same widened cutoff as
# the tile test, so the box always holds the tiles the test keeps).

FISHEYE_EPS = 1e-7  # gsplat's fisheye_proj keeps the ray's length off 0 by this much
CLAMP_FOV = 0.3  # the pinhole Jacobian is taken at the centre clamped to 1.3x the half field of view
MAX_RADIUS = float(2**30)  # radii are int32; larger half-extents (far past any image) are clamped
SH_C0 = 0.28209479177387814  # real spherical harmonics, gsplat's (and the Inria rasterizer's) constants
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154, -0.4570457994644658,
         1.445305721320277, -0.5900435899266435)
RENDER_MODES = ("RGB", "D", "ED", "RGB+ED")
RASTERIZE_MODES = ("classic", "antialiased")


def quat_to_rotmat(quats: torch.Tensor) -> torch.Tensor:  # [..., 4] (w, x, y, z), any norm -> [..., 3, 3]
    w, x, y, z = F.normalize(quats, dim=-1).unbind(-1)
    R = torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                     2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                     2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1)
    return R.reshape(*quats.shape[:-1], 3, 3)


def covariance_3d(quats: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # [N, 4], [N, 3] -> [N, 3, 3]
    M = quat_to_rotmat(quats) * scales[..., None, :]  # R S
    return M @ M.transpose(-1, -2)


def pinhole_projection(p: torch.Tensor,  # [C, N, 3] camera-space points, z > 0
                       Ks: torch.Tensor, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Projected points [C, N, 2] and the projection's Jacobian [C, N, 2, 3]. As gsplat, the Jacobian is taken
    at the point clamped to 1.3x the field of view, so a Gaussian far outside the image keeps a sane footprint."""
    x, y, z = p.unbind(-1)
    fx, fy, cx, cy = Ks[:, 0, 0, None], Ks[:, 1, 1, None], Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    means2d = torch.stack([fx * x / z + cx, fy * y / z + cy], -1)
    tan_x, tan_y = 0.5 * width / fx, 0.5 * height / fy
    u = torch.clamp(x / z, min=-(cx / fx + CLAMP_FOV * tan_x), max=(width - cx) / fx + CLAMP_FOV * tan_x)
    v = torch.clamp(y / z, min=-(cy / fy + CLAMP_FOV * tan_y), max=(height - cy) / fy + CLAMP_FOV * tan_y)
    zero = torch.zeros_like(z)
    J = torch.stack([fx / z, zero, -fx * u / z, zero, fy / z, -fy * v / z], -1)
    return means2d, J.reshape(*z.shape, 2, 3)


def fisheye_projection(p: torch.Tensor,  # [C, N, 3]
                       Ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Equidistant fisheye (gsplat's ``fisheye_proj``): a ray at angle theta from the axis lands at radius
    f * theta. Projected points [C, N, 2] and the Jacobian [C, N, 2, 3]."""
    x, y, z = p.unbind(-1)
    fx, fy, cx, cy = Ks[:, 0, 0, None], Ks[:, 1, 1, None], Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    eps = FISHEYE_EPS
    r = torch.sqrt(torch.clamp(x * x + y * y, min=1e-30)) + eps  # (the clamp keeps sqrt's gradient finite at 0)
    theta = torch.atan2(r, z + eps)
    means2d = torch.stack([fx * x * theta / r + cx, fy * y * theta / r + cy], -1)
    x2, y2, xy = x * x + eps, y * y, x * y
    s = x2 + y2
    inv = 1.0 / (s + z * z)
    b = torch.atan2(r, z) / r / s
    a = z * inv / s
    J = torch.stack([fx * (x2 * a + y2 * b), fx * xy * (a - b), -fx * x * inv,
                     fy * xy * (a - b), fy * (y2 * a + x2 * b), -fy * y * inv], -1)
    return means2d, J.reshape(*z.shape, 2, 3)


def project_reference(means: torch.Tensor,  # [N, 3]
                      quats: torch.Tensor,  # [N, 4]
                      scales: torch.Tensor,  # [N, 3]
                      opacities: torch.Tensor,  # [N]
                      viewmats: torch.Tensor,  # [C, 4, 4]
                      Ks: torch.Tensor,  # [C, 3, 3]
                      width: int, height: int, near: float = 0.01, far: float = 1e10, eps2d: float = 0.3,
                      camera_model: str = "pinhole", antialiased: bool = False) -> Projection:
    """Reference of ``project.project``, differentiable by autograd. Culled (camera, Gaussian) pairs (centre
    nearer than ``near`` or beyond ``far``, opacity below ALPHA_MIN, a non-positive determinant, a box that
    misses the image) get radii 0, zeros elsewhere and no gradient. ``antialiased`` (gsplat's "antialiased"
    rasterize_mode, Mip-Splatting's 2D filter): the blur eps2d widens the splat without adding to its integral,
    so each camera's opacity is multiplied by sqrt(det(Sigma2d) / det(Sigma2d + eps2d I)) before the culling and
    the radii; culled pairs then get opacity 0."""
    C, N = viewmats.shape[0], means.shape[0]
    R, t = viewmats[:, :3, :3], viewmats[:, :3, 3]
    p = torch.einsum("cij,nj->cni", R, means) + t[:, None, :]  # [C, N, 3] camera-space centres
    cov = R[:, None] @ covariance_3d(quats, scales)[None] @ R.transpose(-1, -2)[:, None]  # [C, N, 3, 3]
    z = p[..., 2]
    in_range = (z >= near) & (z <= far)
    # culled centres get a stand-in in front of the camera: no inf or NaN reaches anyone's gradient
    p_safe = torch.where(in_range[..., None], p, p.new_tensor([0.0, 0.0, 1.0]))
    if camera_model == "pinhole":
        means2d, J = pinhole_projection(p_safe, Ks, width, height)
    elif camera_model == "fisheye":
        means2d, J = fisheye_projection(p_safe, Ks)
    else:
        raise ValueError(f"camera_model must be 'pinhole' or 'fisheye', got {camera_model!r}")
    cov2d = J @ cov @ J.transpose(-1, -2)
    a, b, c = cov2d[..., 0, 0] + eps2d, cov2d[..., 0, 1], cov2d[..., 1, 1] + eps2d
    det = a * c - b * b
    ok = in_range & (det > 0)
    det = torch.where(ok, det, torch.ones_like(det))
    conics = torch.stack([c / det, -b / det, a / det], -1)
    opac = opacities[None].expand(C, N)
    if antialiased:
        ratio = (cov2d[..., 0, 0] * cov2d[..., 1, 1] - b * b) / det
        pos = ok & (ratio > 0)  # sqrt's gradient is infinite at 0: where the ratio is not positive, comp is 0
        comp = torch.where(pos, torch.sqrt(torch.where(pos, ratio, torch.ones_like(ratio))), torch.zeros_like(ratio))
        opac = opac * comp
    with torch.no_grad():
        cut = torch.clamp(alpha_cutoff(opac), min=0.0)  # q at which alpha falls to ALPHA_MIN
        rx = torch.ceil(torch.sqrt(cut * a))
        ry = torch.ceil(torch.sqrt(cut * c))
        mx, my = means2d[..., 0], means2d[..., 1]
        on_screen = (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        keep = ok & (opac >= ALPHA_MIN) & on_screen
        radii = torch.where(keep[..., None], torch.stack([rx, ry], -1).clamp(max=MAX_RADIUS), 0.0).int()
    zero = lambda v: torch.where(keep.view(*keep.shape, *[1] * (v.dim() - 2)), v, torch.zeros_like(v))  # noqa: E731
    return Projection(zero(means2d), zero(conics), zero(z), radii, zero(opac) if antialiased else opac)


def sh_basis(degree: int, d: torch.Tensor) -> torch.Tensor:  # unit dirs [..., 3] -> [..., (degree + 1)^2]
    """Real spherical harmonics up to ``degree`` (0..3) at unit directions, gsplat's order and signs."""
    x, y, z = d.unbind(-1)
    out = [torch.full_like(x, SH_C0)]
    if degree >= 1:
        out += [-SH_C1 * y, SH_C1 * z, -SH_C1 * x]
    if degree >= 2:
        xx, yy, zz = x * x, y * y, z * z
        out += [SH_C2[0] * x * y, SH_C2[1] * y * z, SH_C2[2] * (2 * zz - xx - yy), SH_C2[3] * x * z,
                SH_C2[4] * (xx - yy)]
    if degree >= 3:
        out += [SH_C3[0] * y * (3 * xx - yy), SH_C3[1] * x * y * z, SH_C3[2] * y * (4 * zz - xx - yy),
                SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy), SH_C3[4] * x * (4 * zz - xx - yy),
                SH_C3[5] * z * (xx - yy), SH_C3[6] * x * (xx - 3 * yy)]
    return torch.stack(out, -1)


def sh_reference(degree: int, dirs: torch.Tensor,  # [..., 3] view directions, any length
                 coeffs: torch.Tensor,  # [..., K, 3], K >= (degree + 1)^2
                 ) -> torch.Tensor:  # [..., 3]
    """Reference of ``sh.spherical_harmonics``: colour = sum_k basis_k(dir / |dir|) * coeffs_k."""
    n = (degree + 1) ** 2
    return (sh_basis(degree, F.normalize(dirs, dim=-1))[..., None] * coeffs[..., :n, :]).sum(-2)


def view_colors(colors: torch.Tensor, means: torch.Tensor, viewmats: torch.Tensor,
                sh_degree: int | None) -> torch.Tensor:  # [C, N, D]
    """Per-camera colours: features ([N, D] or [C, N, D]) as given, or SH ([N, K, 3] or [C, N, K, 3]) evaluated
    along mean - camera centre, plus 0.5, clamped at 0 (gsplat's rasterization())."""
    C = viewmats.shape[0]
    if sh_degree is None:
        return colors if colors.dim() == 3 else colors[None].expand(C, *colors.shape)
    coeffs = colors if colors.dim() == 4 else colors[None].expand(C, *colors.shape)
    dirs = means[None] - camera_centers(viewmats)[:, None]
    return torch.clamp_min(sh_reference(sh_degree, dirs, coeffs) + 0.5, 0.0)


def blend_dense(means2d: torch.Tensor,  # [N, 2], or [P, N, 2]: one copy per pixel (for per-pixel gradients)
                conics: torch.Tensor,  # [N, 3]
                colors: torch.Tensor,  # [N, D]
                opacities: torch.Tensor,  # [N]
                depths: torch.Tensor,  # [N]
                visible: torch.Tensor,  # [N] bool
                width: int, height: int,
                background: torch.Tensor | None = None,  # [D]
                ) -> tuple[torch.Tensor, torch.Tensor]:  # [H, W, D], [H, W, 1]
    """One camera, every visible Gaussian at every pixel, nearest first, one Gaussian at a time: gsplat's
    per-pixel loop with the whole image as the vector. A pixel skips a Gaussian where power > 0 or
    alpha < ALPHA_MIN and stops before the first one that would take its transmittance to T_MIN or below;
    those choices carry no gradient, the blend of the rest is plain autograd."""
    order = torch.nonzero(visible).squeeze(1)
    order = order[torch.argsort(depths[order], stable=True)]
    dev, D = colors.device, colors.shape[-1]
    py, px = torch.meshgrid(torch.arange(height, device=dev), torch.arange(width, device=dev), indexing="ij")
    px = px.reshape(-1).to(colors.dtype) + 0.5
    py = py.reshape(-1).to(colors.dtype) + 0.5
    out = colors.new_zeros(px.shape[0], D)
    T = colors.new_ones(px.shape[0])
    done = torch.zeros(px.shape[0], dtype=torch.bool, device=dev)
    for i in order.tolist():
        dx = means2d[..., i, 0] - px
        dy = means2d[..., i, 1] - py
        a, b, c = conics[i].unbind(-1)
        power = -0.5 * (a * dx * dx + c * dy * dy) - b * dx * dy
        alpha = torch.clamp(opacities[i] * torch.exp(power), max=ALPHA_MAX)
        with torch.no_grad():
            skip = (power > 0) | (alpha < ALPHA_MIN) | done
            stop = ~skip & (T * (1.0 - alpha) <= T_MIN)
            done = done | stop
        alpha = torch.where(skip | stop, torch.zeros_like(alpha), alpha)
        out = out + (alpha * T)[:, None] * colors[i]
        T = T * (1.0 - alpha)
        if bool(done.all()):
            break
    if background is not None:
        out = out + T[:, None] * background
    return out.reshape(height, width, D), (1.0 - T).reshape(height, width, 1)


def render_reference(means, quats, scales, opacities, colors, viewmats, Ks, width: int, height: int, *,
                     sh_degree: int | None = None, near: float = 0.01, far: float = 1e10, tile_size: int = 16,
                     background: torch.Tensor | None = None, render_mode: str = "RGB",
                     camera_model: str = "pinhole", absgrad: bool = False, eps2d: float = 0.3,
                     rasterize_mode: str = "classic"):
    """The whole pipeline with no tiles (``render.rasterize``'s signature and outputs): project, colours,
    then every visible Gaussian blended at every pixel of each camera, nearest first (``blend_dense``).
    Differentiable by autograd in every float input; ``tile_size`` and ``absgrad`` are accepted and unused.
    Modes: "RGB" the colours, "D" accumulated depth, "ED" expected depth (D / alpha), "RGB+ED" both. The
    background ([D] or [C, D]) is behind the colour channels; depth channels have none (gsplat's rule)."""
    if render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode must be one of {RENDER_MODES}, got {render_mode!r}")
    C = viewmats.shape[0]
    if rasterize_mode not in RASTERIZE_MODES:
        raise ValueError(f"rasterize_mode must be one of {RASTERIZE_MODES}, got {rasterize_mode!r}")
    proj = project_reference(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                             camera_model, rasterize_mode == "antialiased")
    feats, bg = [], None
    if render_mode in ("RGB", "RGB+ED"):
        feats.append(view_colors(colors, means, viewmats, sh_degree))
        if background is not None:
            bg = background.expand(C, -1) if background.dim() == 1 else background
    if render_mode != "RGB":
        feats.append(proj.depths[..., None])
        if bg is not None:
            bg = torch.cat([bg, bg.new_zeros(C, 1)], -1)
    feats = torch.cat(feats, -1)
    visible = (proj.radii > 0).all(-1)
    renders = [blend_dense(proj.means2d[i], proj.conics[i], feats[i], proj.opacities[i], proj.depths[i],
                           visible[i], width, height, None if bg is None else bg[i]) for i in range(C)]
    images = torch.stack([r[0] for r in renders])
    alphas = torch.stack([r[1] for r in renders])
    if render_mode in ("ED", "RGB+ED"):
        images = torch.cat([images[..., :-1], images[..., -1:] / alphas.clamp_min(1e-10)], -1)
    meta = {"radii": proj.radii, "means2d": proj.means2d, "depths": proj.depths, "conics": proj.conics,
            "opacities": proj.opacities, "colors": feats, "width": width, "height": height, "n_cameras": C,
            "camera_ids": None, "gaussian_ids": None}
    return images, alphas, meta


# ---- tile intersection, key sort, per-tile blending ------------------------------------------------
#
# A pixel's colour is the front-to-back blend of the Gaussians of its tile, gsplat's rules:
#   alpha = min(ALPHA_MAX, opacity * exp(power)), power = -0.5*(a*dx^2 + c*dy^2) - b*dx*dy, (dx, dy) =
#   mean - pixel centre (x + 0.5, y + 0.5); a Gaussian with power > 0 or alpha < ALPHA_MIN is skipped; a
#   pixel stops before the first Gaussian that would take its transmittance T to T_MIN or below.

ALPHA_MIN = 1.0 / 255.0  # dimmer contributions are skipped (gsplat's ALPHA_THRESHOLD)
ALPHA_MAX = 0.999  # the clamp gsplat 1.5.3's kernels use (the Inria rasterizer's is 0.99)
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
        means_t, conics_t, colors_t, opacities_t = (v[ids] for v in flat)  # the tile's Gaussians
        out, T = blend_tile(px, py, means_t, conics_t, colors_t, opacities_t, chunk=chunk)
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
