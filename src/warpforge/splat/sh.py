"""Stage 2: view-dependent colour from spherical harmonics (degrees 0..3), gsplat's basis and constants.

Triton: one program per block of coefficient rows (Gaussians). A row's coefficients [K, 3] are loaded
once, as three [BLOCK, KB] tiles, and reused for every direction that shares them: with coefficients shared
across cameras (``coeffs`` [N, K, 3] against ``dirs`` [C, N, 3], what the render passes) the program loops
over the C cameras, and in the backward it sums the coefficient gradient over them in registers before one
store (no atomics). The basis and its gradient are built as [BLOCK, KB] tiles, so a colour channel is one
row reduction. CPU: ``reference.sh_reference`` (autograd).

The render's colours (``sh_colors``) run the same kernels in their RENDER mode: each direction is the Gaussian's
mean minus the camera centre, computed in registers from the means [N, 3] and centres [C, 3], and the colour
leaves as max(colour + 0.5, 0); the backward recomputes the colour for the clamp's mask and sums the means'
gradient over the cameras in registers. Four torch ops a forward (the directions, + 0.5, the clamp, the centres'
inverse) and their backward ops are gone, as is the [C, N, 3] directions tensor autograd kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels import use_triton  # importing the package chooses the interpreter before any @jit
from warpforge.splat import reference as ref

MAX_DEGREE = 3
# Coefficient rows per program. Offline sm_90 compiles (ptxas, K = 16, 4 warps): forward 64 rows 40-48
# registers; backward 64 rows 192-204 registers, 32 rows 92-95 (no spills either way), so the backward takes
# 32 rows for the occupancy; the render backward (directions from the means, the clamp's mask recomputed)
# 32 rows 119-123. Chosen by register count; not yet timed on a GPU.
BLOCK = 64
BWD_BLOCK = 32
NUM_WARPS = 4

C0: tl.constexpr = tl.constexpr(ref.SH_C0)
C1: tl.constexpr = tl.constexpr(ref.SH_C1)
# the degree-2 and degree-3 constants, one module-level constexpr each (the kernels read them as globals)
C20, C21, C22, C23, C24 = (tl.constexpr(c) for c in ref.SH_C2)
C30, C31, C32, C33, C34, C35, C36 = (tl.constexpr(c) for c in ref.SH_C3)


@triton.jit
def _put(tile, col, k: tl.constexpr, v):
    """Column k of a [BLOCK, KB] tile set to the [BLOCK] vector v."""
    return tl.where(col == k, v[:, None], tile)


@triton.jit
def _unit_dir(dirs_ptr, centres_ptr, cam, row, mask, mx, my, mz, RENDER: tl.constexpr):
    """The unit view direction of a block's rows, its length and 1 / max(length, eps). RENDER: mean - the
    camera's centre (means already loaded); else the row of dirs."""
    if RENDER:
        dx = mx - tl.load(centres_ptr + 3 * cam)
        dy = my - tl.load(centres_ptr + 3 * cam + 1)
        dz = mz - tl.load(centres_ptr + 3 * cam + 2)
    else:
        dx = tl.load(dirs_ptr + 3 * row, mask=mask, other=1.0)
        dy = tl.load(dirs_ptr + 3 * row + 1, mask=mask, other=0.0)
        dz = tl.load(dirs_ptr + 3 * row + 2, mask=mask, other=0.0)
    norm = tl.sqrt(dx * dx + dy * dy + dz * dz)
    inv = 1.0 / tl.maximum(norm, 1e-12)  # F.normalize's eps
    return dx * inv, dy * inv, dz * inv, norm, inv


@triton.jit
def _load_means(means_ptr, n, mask, RENDER: tl.constexpr):
    """RENDER: the block's means (the directions' origins); else placeholders nothing reads."""
    if RENDER:
        return (tl.load(means_ptr + 3 * n, mask=mask, other=1.0), tl.load(means_ptr + 3 * n + 1, mask=mask, other=0.0),
                tl.load(means_ptr + 3 * n + 2, mask=mask, other=0.0))
    else:
        zero = tl.zeros(n.shape, tl.float32)
        return zero, zero, zero


@triton.jit
def _basis(x, y, z, col, DEGREE: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr):
    """``reference.sh_basis`` as a [BLOCK, KB] tile (columns past (DEGREE + 1)^2 are 0). Products keep a tensor
    on the left: the interpreter mishandles a constexpr-times-tensor passed as an argument."""
    t = tl.zeros([BLOCK, KB], tl.float32)
    t = _put(t, col, 0, tl.zeros_like(x) + C0)
    if DEGREE >= 1:
        t = _put(t, col, 1, y * -C1)
        t = _put(t, col, 2, z * C1)
        t = _put(t, col, 3, x * -C1)
    if DEGREE >= 2:
        xx, yy, zz = x * x, y * y, z * z
        t = _put(t, col, 4, x * y * C20)
        t = _put(t, col, 5, y * z * C21)
        t = _put(t, col, 6, (2.0 * zz - xx - yy) * C22)
        t = _put(t, col, 7, x * z * C23)
        t = _put(t, col, 8, (xx - yy) * C24)
    if DEGREE >= 3:
        t = _put(t, col, 9, y * (3.0 * xx - yy) * C30)
        t = _put(t, col, 10, x * y * z * C31)
        t = _put(t, col, 11, y * (4.0 * zz - xx - yy) * C32)
        t = _put(t, col, 12, z * (2.0 * zz - 3.0 * xx - 3.0 * yy) * C33)
        t = _put(t, col, 13, x * (4.0 * zz - xx - yy) * C34)
        t = _put(t, col, 14, z * (xx - yy) * C35)
        t = _put(t, col, 15, x * (xx - 3.0 * yy) * C36)
    return t


@triton.jit
def _basis_grad(x, y, z, col, DEGREE: tl.constexpr, BLOCK: tl.constexpr, KB: tl.constexpr):
    """d basis / d(x, y, z) at the unit direction: three [BLOCK, KB] tiles."""
    gx = tl.zeros([BLOCK, KB], tl.float32)
    gy = tl.zeros([BLOCK, KB], tl.float32)
    gz = tl.zeros([BLOCK, KB], tl.float32)
    zero = tl.zeros_like(x)
    if DEGREE >= 1:
        gy = _put(gy, col, 1, zero - C1)
        gz = _put(gz, col, 2, zero + C1)
        gx = _put(gx, col, 3, zero - C1)
    if DEGREE >= 2:
        xx, yy, zz = x * x, y * y, z * z
        gx = _put(gx, col, 4, y * C20)
        gy = _put(gy, col, 4, x * C20)
        gy = _put(gy, col, 5, z * C21)
        gz = _put(gz, col, 5, y * C21)
        gx = _put(gx, col, 6, x * (-2.0 * C22))
        gy = _put(gy, col, 6, y * (-2.0 * C22))
        gz = _put(gz, col, 6, z * (4.0 * C22))
        gx = _put(gx, col, 7, z * C23)
        gz = _put(gz, col, 7, x * C23)
        gx = _put(gx, col, 8, x * (2.0 * C24))
        gy = _put(gy, col, 8, y * (-2.0 * C24))
    if DEGREE >= 3:
        gx = _put(gx, col, 9, x * y * (6.0 * C30))
        gy = _put(gy, col, 9, (3.0 * xx - 3.0 * yy) * C30)
        gx = _put(gx, col, 10, y * z * C31)
        gy = _put(gy, col, 10, x * z * C31)
        gz = _put(gz, col, 10, x * y * C31)
        gx = _put(gx, col, 11, x * y * (-2.0 * C32))
        gy = _put(gy, col, 11, (4.0 * zz - xx - 3.0 * yy) * C32)
        gz = _put(gz, col, 11, y * z * (8.0 * C32))
        gx = _put(gx, col, 12, x * z * (-6.0 * C33))
        gy = _put(gy, col, 12, y * z * (-6.0 * C33))
        gz = _put(gz, col, 12, (6.0 * zz - 3.0 * xx - 3.0 * yy) * C33)
        gx = _put(gx, col, 13, (4.0 * zz - 3.0 * xx - yy) * C34)
        gy = _put(gy, col, 13, x * y * (-2.0 * C34))
        gz = _put(gz, col, 13, x * z * (8.0 * C34))
        gx = _put(gx, col, 14, x * z * (2.0 * C35))
        gy = _put(gy, col, 14, y * z * (-2.0 * C35))
        gz = _put(gz, col, 14, (xx - yy) * C35)
        gx = _put(gx, col, 15, (3.0 * xx - 3.0 * yy) * C36)
        gy = _put(gy, col, 15, x * y * (-6.0 * C36))
    return gx, gy, gz


@triton.jit
def _load_coeffs(coeffs_ptr, row, col, mask, K):
    """A block's coefficients [BLOCK, KB] per channel (columns past K read as 0)."""
    m = mask[:, None] & (col < K)
    base = coeffs_ptr + (row.to(tl.int64)[:, None] * K + col) * 3
    return (tl.load(base, mask=m, other=0.0), tl.load(base + 1, mask=m, other=0.0),
            tl.load(base + 2, mask=m, other=0.0))


@triton.jit
def _block(N, BLOCK: tl.constexpr, KB: tl.constexpr):
    """The program's block of Gaussians n (and which are < N), the coefficient columns [1, KB], and N as int64
    per lane (row cam * N + n of the per-camera layouts, without int32 overflow)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return n, n < N, tl.arange(0, KB)[None, :], tl.zeros([BLOCK], tl.int64) + N


@triton.jit
def _view(dirs_ptr, centres_ptr, cam, n, n64, col, mask, mx, my, mz, RENDER: tl.constexpr, DEGREE: tl.constexpr,
          BLOCK: tl.constexpr, KB: tl.constexpr):
    """Camera cam's row of the block, its unit view direction (``_unit_dir``) and the SH basis there."""
    row = cam * n64 + n
    x, y, z, norm, inv = _unit_dir(dirs_ptr, centres_ptr, cam, row, mask, mx, my, mz, RENDER)
    return row, x, y, z, norm, inv, _basis(x, y, z, col, DEGREE, BLOCK, KB)


@triton.jit
def _sh_fwd_kernel(dirs_ptr, centres_ptr, coeffs_ptr, out_ptr, N, CAMS, K,
                   RENDER: tl.constexpr, COEF_SHARED: tl.constexpr, DEGREE: tl.constexpr, KB: tl.constexpr,
                   BLOCK: tl.constexpr):
    # out [CAMS * N, 3], row cam * N + n. Directions: dirs [CAMS * N, 3]; RENDER: means [N, 3] (at dirs_ptr)
    # minus centres [CAMS, 3], and the colour + 0.5 clamped at 0 (gsplat's rasterization()). Coefficients: row n
    # of [N, K, 3] for every camera (COEF_SHARED), else row cam * N + n of [CAMS * N, K, 3].
    n, mask, col, n64 = _block(N, BLOCK, KB)
    if COEF_SHARED:
        c_r, c_g, c_b = _load_coeffs(coeffs_ptr, n, col, mask, K)
    mx, my, mz = _load_means(dirs_ptr, n, mask, RENDER)
    for cam in range(CAMS):
        row, x, y, z, _norm, _inv, b = _view(dirs_ptr, centres_ptr, cam, n, n64, col, mask, mx, my, mz, RENDER,
                                             DEGREE, BLOCK, KB)
        if not COEF_SHARED:
            c_r, c_g, c_b = _load_coeffs(coeffs_ptr, row, col, mask, K)
        r = tl.sum(b * c_r, axis=1)
        g = tl.sum(b * c_g, axis=1)
        bl = tl.sum(b * c_b, axis=1)
        if RENDER:
            r, g, bl = tl.maximum(r + 0.5, 0.0), tl.maximum(g + 0.5, 0.0), tl.maximum(bl + 0.5, 0.0)
        tl.store(out_ptr + 3 * row, r, mask=mask)
        tl.store(out_ptr + 3 * row + 1, g, mask=mask)
        tl.store(out_ptr + 3 * row + 2, bl, mask=mask)


@triton.jit
def _sh_bwd_kernel(dirs_ptr, centres_ptr, coeffs_ptr, v_out_ptr, v_dirs_ptr, v_centres_ptr, v_coeffs_ptr, N, CAMS,
                   K, RENDER: tl.constexpr, COEF_SHARED: tl.constexpr, CENTRE_GRAD: tl.constexpr,
                   DEGREE: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr):
    # The forward's layouts. v_dirs [CAMS * N, 3]; RENDER: v_means [N, 3] (at v_dirs_ptr), summed over the
    # cameras in registers, and with CENTRE_GRAD v_centres [CAMS, 3] (atomics into zeros). v_coeffs: [N, K, 3]
    # summed over the cameras in registers (COEF_SHARED), else per row.
    n, mask, col, n64 = _block(N, BLOCK, KB)
    if COEF_SHARED:
        c_r, c_g, c_b = _load_coeffs(coeffs_ptr, n, col, mask, K)
        acc_r = tl.zeros([BLOCK, KB], tl.float32)
        acc_g = tl.zeros([BLOCK, KB], tl.float32)
        acc_b = tl.zeros([BLOCK, KB], tl.float32)
    mx, my, mz = _load_means(dirs_ptr, n, mask, RENDER)
    vm_x = tl.zeros([BLOCK], tl.float32)
    vm_y = tl.zeros([BLOCK], tl.float32)
    vm_z = tl.zeros([BLOCK], tl.float32)
    for cam in range(CAMS):
        row, x, y, z, norm, inv, b = _view(dirs_ptr, centres_ptr, cam, n, n64, col, mask, mx, my, mz, RENDER,
                                           DEGREE, BLOCK, KB)
        if not COEF_SHARED:
            c_r, c_g, c_b = _load_coeffs(coeffs_ptr, row, col, mask, K)
        m_r, m_g, m_b = mask, mask, mask
        if RENDER:  # the clamp at 0 passes the gradient where colour + 0.5 >= 0 (torch's clamp_min)
            m_r = mask & (tl.sum(b * c_r, axis=1) + 0.5 >= 0.0)
            m_g = mask & (tl.sum(b * c_g, axis=1) + 0.5 >= 0.0)
            m_b = mask & (tl.sum(b * c_b, axis=1) + 0.5 >= 0.0)
        v_r = tl.load(v_out_ptr + 3 * row, mask=m_r, other=0.0)
        v_g = tl.load(v_out_ptr + 3 * row + 1, mask=m_g, other=0.0)
        v_b = tl.load(v_out_ptr + 3 * row + 2, mask=m_b, other=0.0)
        if COEF_SHARED:
            acc_r += b * v_r[:, None]
            acc_g += b * v_g[:, None]
            acc_b += b * v_b[:, None]
        else:
            m = mask[:, None] & (col < K)
            base = v_coeffs_ptr + (row[:, None] * K + col) * 3
            tl.store(base, b * v_r[:, None], mask=m)
            tl.store(base + 1, b * v_g[:, None], mask=m)
            tl.store(base + 2, b * v_b[:, None], mask=m)
        if DEGREE >= 1:  # degree 0 is constant: no direction gradient
            gk = c_r * v_r[:, None] + c_g * v_g[:, None] + c_b * v_b[:, None]  # dL/d basis_k
            gx, gy, gz = _basis_grad(x, y, z, col, DEGREE, BLOCK, KB)
            ux = tl.sum(gk * gx, axis=1)
            uy = tl.sum(gk * gy, axis=1)
            uz = tl.sum(gk * gz, axis=1)
            dot = tl.where(norm > 1e-12, ux * x + uy * y + uz * z, 0.0)  # through u = d / max(|d|, eps)
            vx, vy, vz = (ux - x * dot) * inv, (uy - y * dot) * inv, (uz - z * dot) * inv
        else:
            vx = tl.zeros([BLOCK], tl.float32)
            vy = tl.zeros([BLOCK], tl.float32)
            vz = tl.zeros([BLOCK], tl.float32)
        if RENDER:  # d = mean - centre
            vm_x += vx
            vm_y += vy
            vm_z += vz
            if CENTRE_GRAD:
                tl.atomic_add(v_centres_ptr + 3 * cam, -tl.sum(tl.where(mask, vx, 0.0), axis=0), sem="relaxed")
                tl.atomic_add(v_centres_ptr + 3 * cam + 1, -tl.sum(tl.where(mask, vy, 0.0), axis=0), sem="relaxed")
                tl.atomic_add(v_centres_ptr + 3 * cam + 2, -tl.sum(tl.where(mask, vz, 0.0), axis=0), sem="relaxed")
        else:
            tl.store(v_dirs_ptr + 3 * row, vx, mask=mask)
            tl.store(v_dirs_ptr + 3 * row + 1, vy, mask=mask)
            tl.store(v_dirs_ptr + 3 * row + 2, vz, mask=mask)
    if RENDER:
        tl.store(v_dirs_ptr + 3 * n, vm_x, mask=mask)
        tl.store(v_dirs_ptr + 3 * n + 1, vm_y, mask=mask)
        tl.store(v_dirs_ptr + 3 * n + 2, vm_z, mask=mask)
    if COEF_SHARED:
        m = mask[:, None] & (col < K)
        base = v_coeffs_ptr + (n.to(tl.int64)[:, None] * K + col) * 3
        tl.store(base, acc_r, mask=m)
        tl.store(base + 1, acc_g, mask=m)
        tl.store(base + 2, acc_b, mask=m)


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Uninitialized output buffer (the tests swap in NaN-filled ones: every element must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_dense(named, device: torch.device, like: str) -> None:
    """What the kernels index by hand: float32, contiguous, on ``device`` (that of ``like``)."""
    for name, t in named:
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel indexes it densely)")
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like {like}, got {t.device}")


def _check_kernel_args(dirs, coeffs, cams: int) -> None:
    """The kernels index dirs [CAMS * N, 3] and coeffs [N, K, 3] densely, float32, one device."""
    if coeffs.dim() != 3 or coeffs.shape[-1] != 3 or dirs.dim() != 2 or dirs.shape != (cams * coeffs.shape[0], 3):
        raise ValueError(f"SH kernel arguments must be dirs [CAMS * N, 3] and coeffs [N, K, 3] with CAMS={cams}, "
                         f"got {list(dirs.shape)} and {list(coeffs.shape)}")
    _check_dense((("dirs", dirs), ("coeffs", coeffs)), dirs.device, "dirs")


def _meta(degree: int, K: int, block: int) -> dict:
    return dict(DEGREE=degree, KB=max(16, 1 << (K - 1).bit_length()), BLOCK=block, num_warps=NUM_WARPS)


def sh_fwd_triton(degree: int, dirs: torch.Tensor, coeffs: torch.Tensor, cams: int) -> torch.Tensor:
    """Forward launcher: colours [CAMS * N, 3]."""
    _check_kernel_args(dirs, coeffs, cams)
    N, K = coeffs.shape[:2]
    out = _alloc((cams * N, 3), torch.float32, dirs.device)
    if N:
        _sh_fwd_kernel[(-(-N // BLOCK),)](dirs, dirs, coeffs, out, N, cams, K, RENDER=False, COEF_SHARED=True,
                                                 **_meta(degree, K, BLOCK))
    return out


def sh_bwd_triton(degree: int, dirs: torch.Tensor, coeffs: torch.Tensor, v_out: torch.Tensor,
                  cams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward launcher: (v_dirs [CAMS * N, 3], v_coeffs [N, K, 3])."""
    _check_kernel_args(dirs, coeffs, cams)
    if v_out.shape != dirs.shape or not v_out.is_contiguous() or v_out.dtype != torch.float32:
        raise ValueError(f"v_colors must be a contiguous float32 {list(dirs.shape)} tensor, got "
                         f"{list(v_out.shape)} {v_out.dtype}")
    N, K = coeffs.shape[:2]
    v_dirs = _alloc(dirs.shape, torch.float32, dirs.device)
    v_coeffs = _alloc(coeffs.shape, torch.float32, dirs.device)
    if N:
        _sh_bwd_kernel[(-(-N // BWD_BLOCK),)](dirs, dirs, coeffs, v_out, v_dirs, v_dirs, v_coeffs, N, cams, K,
                                                     RENDER=False, COEF_SHARED=True, CENTRE_GRAD=False,
                                                     **_meta(degree, K, BWD_BLOCK))
    return v_dirs, v_coeffs


def _check_render_args(means, centres, coeffs) -> None:
    """The render kernels index means [N, 3], centres [C, 3] and coeffs [N, K, 3] or [C, N, K, 3] densely."""
    N, C = means.shape[0], centres.shape[0]
    if (means.shape != (N, 3) or centres.shape != (C, 3) or coeffs.shape[-1] != 3
            or tuple(coeffs.shape[:-2]) not in ((N,), (C, N))):
        raise ValueError(f"SH render kernel arguments must be means [N, 3], centres [C, 3] and coeffs [N, K, 3] or "
                         f"[C, N, K, 3], got {list(means.shape)}, {list(centres.shape)} and {list(coeffs.shape)}")
    _check_dense((("means", means), ("centres", centres), ("coeffs", coeffs)), means.device, "means")


def sh_colors_fwd_triton(degree: int, means: torch.Tensor, centres: torch.Tensor,
                         coeffs: torch.Tensor) -> torch.Tensor:
    """Render forward launcher: colours [C, N, 3], SH along mean - centre, + 0.5, clamped at 0."""
    _check_render_args(means, centres, coeffs)
    N, C, K = means.shape[0], centres.shape[0], coeffs.shape[-2]
    out = _alloc((C, N, 3), torch.float32, means.device)
    if N:
        _sh_fwd_kernel[(-(-N // BLOCK),)](means, centres, coeffs, out, N, C, K, RENDER=True,
                                                 COEF_SHARED=coeffs.dim() == 3, **_meta(degree, K, BLOCK))
    return out


def sh_colors_bwd_triton(degree: int, means: torch.Tensor, centres: torch.Tensor, coeffs: torch.Tensor,
                         v_out: torch.Tensor, centre_grad: bool = False):
    """Render backward launcher: (v_means [N, 3], v_centres [C, 3] or None, v_coeffs like coeffs)."""
    _check_render_args(means, centres, coeffs)
    N, C, K = means.shape[0], centres.shape[0], coeffs.shape[-2]
    if v_out.shape != (C, N, 3) or not v_out.is_contiguous() or v_out.dtype != torch.float32:
        raise ValueError(f"v_colors must be a contiguous float32 {[C, N, 3]} tensor, got {list(v_out.shape)} "
                         f"{v_out.dtype}")
    v_means = _alloc((N, 3), torch.float32, means.device)
    v_coeffs = _alloc(coeffs.shape, torch.float32, means.device)
    v_centres = torch.zeros((C, 3), dtype=torch.float32, device=means.device) if centre_grad else None  # atomics
    if N:
        _sh_bwd_kernel[(-(-N // BWD_BLOCK),)](
            means, centres, coeffs, v_out, v_means, v_centres if centre_grad else v_means, v_coeffs, N, C, K,
            RENDER=True, COEF_SHARED=coeffs.dim() == 3, CENTRE_GRAD=centre_grad, **_meta(degree, K, BWD_BLOCK))
    return v_means, v_centres, v_coeffs


class _SH(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dirs, coeffs, degree, cams):  # dirs [CAMS * N, 3], coeffs [N, K, 3]
        dirs, coeffs = dirs.detach().contiguous(), coeffs.detach().contiguous()
        ctx.save_for_backward(dirs, coeffs)
        ctx.cfg = (degree, cams)
        return sh_fwd_triton(degree, dirs, coeffs, cams)

    @staticmethod
    def backward(ctx, v_out):
        dirs, coeffs = ctx.saved_tensors
        degree, cams = ctx.cfg
        v_dirs, v_coeffs = sh_bwd_triton(degree, dirs, coeffs, v_out.contiguous(), cams)
        return v_dirs, v_coeffs, None, None


class _SHColors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means, centres, coeffs, degree):
        means, centres, coeffs = (t.detach().contiguous() for t in (means, centres, coeffs))
        ctx.save_for_backward(means, centres, coeffs)
        ctx.degree = degree
        return sh_colors_fwd_triton(degree, means, centres, coeffs)

    @staticmethod
    def backward(ctx, v_out):
        means, centres, coeffs = ctx.saved_tensors
        v_means, v_centres, v_coeffs = sh_colors_bwd_triton(ctx.degree, means, centres, coeffs, v_out.contiguous(),
                                                            centre_grad=ctx.needs_input_grad[1])
        return v_means, v_centres, v_coeffs, None


def sh_colors(degree: int,
              means: torch.Tensor,  # [N, 3]
              centres: torch.Tensor,  # [C, 3] camera centres in world space
              coeffs: torch.Tensor,  # [N, K, 3] shared by the cameras, or [C, N, K, 3]; K >= (degree + 1)^2
              ) -> torch.Tensor:  # [C, N, 3]
    """The render's colours (gsplat's rasterization()): SH evaluated along mean - camera centre, plus 0.5,
    clamped at 0. On the kernels one launch forward and one backward: the directions, the offset and the clamp
    are computed in the SH kernels, never stored. Differentiable in means, centres and coeffs. The caller
    (``rasterize``) has validated the shapes."""
    if not use_triton(means):
        dirs = means[None] - centres[:, None]
        return torch.clamp_min(ref.sh_reference(degree, dirs, coeffs) + 0.5, 0.0)
    return _SHColors.apply(means, centres, coeffs, degree)


def spherical_harmonics(degree: int,
                        dirs: torch.Tensor,  # [..., 3] view directions (mean - camera centre), any length
                        coeffs: torch.Tensor,  # [..., K, 3] with K >= (degree + 1)^2; or [N, K, 3] shared
                        ) -> torch.Tensor:  # [..., 3]
    """sum_k basis_k(dirs / |dirs|) * coeffs_k over the first (degree + 1)^2 coefficients.

    ``coeffs`` has the batch shape of ``dirs``, or that shape without its first dimension: one set of
    coefficients shared by every camera (dirs [C, N, 3], coeffs [N, K, 3]), which the kernels read once per
    Gaussian. The render adds 0.5 and clamps at 0 (as gsplat's rasterization()); this function does not.
    Differentiable in dirs and coeffs."""
    shared = check_sh(degree, dirs, coeffs)
    if not use_triton(dirs):
        return ref.sh_reference(degree, dirs, coeffs)
    K = coeffs.shape[-2]
    cams = dirs.shape[0] if shared else 1
    out = _SH.apply(dirs.reshape(-1, 3), coeffs.reshape(-1, K, 3), degree, cams)
    return out.view(dirs.shape)


def check_sh(degree, dirs, coeffs) -> bool:
    """Validate the arguments of ``spherical_harmonics``; True when coeffs are shared across dirs' first dim."""
    if isinstance(degree, bool) or not isinstance(degree, int) or not 0 <= degree <= MAX_DEGREE:
        raise ValueError(f"degree must be an int in [0, {MAX_DEGREE}], got {degree!r}")
    for name, t in (("dirs", dirs), ("coeffs", coeffs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if dirs.dim() < 1 or dirs.shape[-1] != 3:
        raise ValueError(f"dirs must have shape [..., 3], got {list(dirs.shape)}")
    n = (degree + 1) ** 2
    batch = list(dirs.shape[:-1])
    lead = list(coeffs.shape[:-2]) if coeffs.dim() >= 2 else None
    if lead not in (batch, batch[1:]) or coeffs.shape[-1] != 3 or coeffs.shape[-2] < n:
        raise ValueError(f"coeffs must have shape {batch + ['K', 3]} (or {batch[1:] + ['K', 3]}, shared) with "
                         f"K >= {n} for degree {degree}, got {list(coeffs.shape)}")
    for name, t in (("dirs", dirs), ("coeffs", coeffs)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {t.dtype}")
    if coeffs.device != dirs.device:
        raise ValueError(f"coeffs must be on {dirs.device} like dirs, got {coeffs.device}")
    return lead != batch
