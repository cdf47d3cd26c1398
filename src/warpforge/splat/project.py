"""Stage 1: project 3D Gaussians into each camera (EWA splatting with gsplat's low-pass filter).

Triton forward: one program per block of BLOCK Gaussians. It builds each Gaussian's world covariance
R S S^T R^T once, then loops over the cameras: camera-space centre and covariance, the camera model's
projection and Jacobian (pinhole or equidistant fisheye, a constexpr), the 2D covariance plus eps2d, its
inverse (the conic), the opacity-aware radii and the culling tests (``reference.project_reference`` is the same
math in torch). Outputs are [C, N, ...]; a culled pair writes zeros.

Triton backward: the same programs and camera loop, recomputing the forward per camera (cheaper than saving
it); each program sums its Gaussians' gradients over the cameras in registers and stores them once, so no
atomics and a deterministic result. Chain: conic -> 2D covariance -> (camera covariance, Jacobian) -> world
covariance -> (R S) -> quaternion (through its normalization) and scales; the centre collects the projected
centre's, the Jacobian's and the depth's gradients.

CPU: ``reference.project_reference`` (autograd).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from warpforge.kernels import use_triton  # importing the package chooses the interpreter before any @jit
from warpforge.splat import reference as ref
from warpforge.splat.camera import Projection, camera_model_code, check_cameras
from warpforge.splat.checks import check_finite, gaussian_bounds

__all__ = ["Projection", "project"]

# Gaussians per program, 4 warps. Offline sm_90 compiles (ptxas): forward 48 registers, backward 80 (pinhole) and
# 87 (fisheye), no spills (tests/splat/_sm90_core.py).
BLOCK = 128
NUM_WARPS = 4
PI: tl.constexpr = tl.constexpr(math.pi)


# ---- shared math -------------------------------------------------------------------------------------------

@triton.jit
def _load_gaussian(quats_ptr, scales_ptr, g, mask):
    """Unit quaternion (w, x, y, z), R, and M = R S of a block of Gaussians (``reference.covariance_3d``)."""
    qw = tl.load(quats_ptr + 4 * g, mask=mask, other=1.0)
    qx = tl.load(quats_ptr + 4 * g + 1, mask=mask, other=0.0)
    qy = tl.load(quats_ptr + 4 * g + 2, mask=mask, other=0.0)
    qz = tl.load(quats_ptr + 4 * g + 3, mask=mask, other=0.0)
    qn = tl.sqrt(qw * qw + qx * qx + qy * qy + qz * qz)
    inv = 1.0 / tl.maximum(qn, 1e-12)  # F.normalize's eps
    w, x, y, z = qw * inv, qx * inv, qy * inv, qz * inv
    r00 = 1.0 - 2.0 * (y * y + z * z)
    r01 = 2.0 * (x * y - w * z)
    r02 = 2.0 * (x * z + w * y)
    r10 = 2.0 * (x * y + w * z)
    r11 = 1.0 - 2.0 * (x * x + z * z)
    r12 = 2.0 * (y * z - w * x)
    r20 = 2.0 * (x * z - w * y)
    r21 = 2.0 * (y * z + w * x)
    r22 = 1.0 - 2.0 * (x * x + y * y)
    sx = tl.load(scales_ptr + 3 * g, mask=mask, other=0.0)
    sy = tl.load(scales_ptr + 3 * g + 1, mask=mask, other=0.0)
    sz = tl.load(scales_ptr + 3 * g + 2, mask=mask, other=0.0)
    return (w, x, y, z, qn, r00, r01, r02, r10, r11, r12, r20, r21, r22, sx, sy, sz,
            r00 * sx, r01 * sy, r02 * sz, r10 * sx, r11 * sy, r12 * sz, r20 * sx, r21 * sy, r22 * sz)


@triton.jit
def _mul_t(a00, a01, a02, a10, a11, a12, a20, a21, a22, b00, b01, b02, b10, b11, b12, b20, b21, b22):
    """A B^T: the 9 entries, row by row (entry ij is row i of A dotted with row j of B)."""
    t00 = a00 * b00 + a01 * b01 + a02 * b02
    t01 = a00 * b10 + a01 * b11 + a02 * b12
    t02 = a00 * b20 + a01 * b21 + a02 * b22
    t10 = a10 * b00 + a11 * b01 + a12 * b02
    t11 = a10 * b10 + a11 * b11 + a12 * b12
    t12 = a10 * b20 + a11 * b21 + a12 * b22
    t20 = a20 * b00 + a21 * b01 + a22 * b02
    t21 = a20 * b10 + a21 * b11 + a22 * b12
    t22 = a20 * b20 + a21 * b21 + a22 * b22
    return t00, t01, t02, t10, t11, t12, t20, t21, t22


@triton.jit
def _gram(m00, m01, m02, m10, m11, m12, m20, m21, m22):
    """M M^T (the world covariance of M = R S): 6 entries, 00, 01, 02, 11, 12, 22 (the lower three of
    ``_mul_t`` are unused, so the compiler drops them)."""
    s00, s01, s02, _s10, s11, s12, _s20, _s21, s22 = _mul_t(m00, m01, m02, m10, m11, m12, m20, m21, m22,
                                                             m00, m01, m02, m10, m11, m12, m20, m21, m22)
    return s00, s01, s02, s11, s12, s22


@triton.jit
def _mul_sym(a00, a01, a02, a10, a11, a12, a20, a21, a22, s00, s01, s02, s11, s12, s22):
    """A S for symmetric S (6 entries: 00, 01, 02, 11, 12, 22): the 9 entries, row by row (A S^T, as S = S^T)."""
    return _mul_t(a00, a01, a02, a10, a11, a12, a20, a21, a22, s00, s01, s02, s01, s11, s12, s02, s12, s22)


@triton.jit
def _sandwich(a00, a01, a02, a10, a11, a12, a20, a21, a22, s00, s01, s02, s11, s12, s22):
    """A S A^T for symmetric S (6 entries in, 6 out: 00, 01, 02, 11, 12, 22)."""
    t00, t01, t02, t10, t11, t12, t20, t21, t22 = _mul_sym(a00, a01, a02, a10, a11, a12, a20, a21, a22,
                                                           s00, s01, s02, s11, s12, s22)
    return (t00 * a00 + t01 * a01 + t02 * a02, t00 * a10 + t01 * a11 + t02 * a12, t00 * a20 + t01 * a21 + t02 * a22,
            t10 * a10 + t11 * a11 + t12 * a12, t10 * a20 + t11 * a21 + t12 * a22, t20 * a20 + t21 * a21 + t22 * a22)


@triton.jit
def _load_camera(view_ptr, K_ptr, c):
    v = view_ptr + 16 * c
    k = K_ptr + 9 * c
    return (tl.load(v), tl.load(v + 1), tl.load(v + 2), tl.load(v + 3), tl.load(v + 4), tl.load(v + 5),
            tl.load(v + 6), tl.load(v + 7), tl.load(v + 8), tl.load(v + 9), tl.load(v + 10), tl.load(v + 11),
            tl.load(k), tl.load(k + 4), tl.load(k + 2), tl.load(k + 5))


@triton.jit
def _atan2(y, x):
    """atan2(y, x) for y >= 0, in [0, pi] (libdevice has atan2, the interpreter does not: one code for both).
    Octant reduction to t in [0, 1], then t > tan(pi/8) folds to (t - 1) / (t + 1); the odd Taylor series to
    u^15 on |u| <= tan(pi/8) is within 2e-8 of atan."""
    ax = tl.abs(x)
    hi = tl.maximum(y, ax)
    lo = tl.minimum(y, ax)
    t = lo / tl.maximum(hi, 1e-30)
    big = t > 0.41421356237309503
    u = tl.where(big, (t - 1.0) / (t + 1.0), t)
    s = u * u
    p = -1.0 / 15.0  # atan(u) = u (1 - s/3 + s^2/5 - ... - s^7/15), Horner in s = u^2
    p = p * s + 1.0 / 13.0
    p = p * s - 1.0 / 11.0
    p = p * s + 1.0 / 9.0
    p = p * s - 1.0 / 7.0
    p = p * s + 1.0 / 5.0
    p = p * s - 1.0 / 3.0
    a = u * (p * s + 1.0)
    a = tl.where(big, 0.7853981633974483 + a, a)
    a = tl.where(y > ax, 0.5 * PI - a, a)
    return tl.where(x < 0, PI - a, a)


@triton.jit
def _pinhole(x, y, z, fx, fy, cx, cy, W, H, CLAMP: tl.constexpr):
    """``reference.pinhole_projection``: centre and Jacobian (taken at the centre clamped to the widened FOV)."""
    rz = 1.0 / z
    m0 = fx * x * rz + cx
    m1 = fy * y * rz + cy
    tan_x = 0.5 * W / fx
    tan_y = 0.5 * H / fy
    u = tl.minimum(tl.maximum(x * rz, -(cx / fx + CLAMP * tan_x)), (W - cx) / fx + CLAMP * tan_x)
    v = tl.minimum(tl.maximum(y * rz, -(cy / fy + CLAMP * tan_y)), (H - cy) / fy + CLAMP * tan_y)
    zero = tl.zeros_like(z)
    return m0, m1, fx * rz, zero, -fx * u * rz, zero, fy * rz, -fy * v * rz


@triton.jit
def _pinhole_vjp(x, y, z, fx, fy, cx, cy, W, H, v_m0, v_m1, vj00, vj02, vj11, vj12, CLAMP: tl.constexpr):
    """Gradient of (centre, Jacobian) of ``_pinhole`` with respect to the camera-space point."""
    rz = 1.0 / z
    tan_x = 0.5 * W / fx
    tan_y = 0.5 * H / fy
    ux = x * rz
    uy = y * rz
    lo_x, hi_x = -(cx / fx + CLAMP * tan_x), (W - cx) / fx + CLAMP * tan_x
    lo_y, hi_y = -(cy / fy + CLAMP * tan_y), (H - cy) / fy + CLAMP * tan_y
    u = tl.minimum(tl.maximum(ux, lo_x), hi_x)
    v = tl.minimum(tl.maximum(uy, lo_y), hi_y)
    in_x = ((ux >= lo_x) & (ux <= hi_x)).to(tl.float32)  # the clamp passes gradient inside its range
    in_y = ((uy >= lo_y) & (uy <= hi_y)).to(tl.float32)
    rz2 = rz * rz
    v_x = v_m0 * fx * rz - vj02 * fx * in_x * rz2
    v_y = v_m1 * fy * rz - vj12 * fy * in_y * rz2
    v_z = (-(v_m0 * fx * x + v_m1 * fy * y) * rz2 - (vj00 * fx + vj11 * fy) * rz2
           + vj02 * fx * (u * rz2 + in_x * x * rz2 * rz) + vj12 * fy * (v * rz2 + in_y * y * rz2 * rz))
    return v_x, v_y, v_z


@triton.jit
def _fisheye(x, y, z, fx, fy, cx, cy, EPS: tl.constexpr):
    """``reference.fisheye_projection``: equidistant centre and Jacobian (gsplat's formulas)."""
    r = tl.sqrt(tl.maximum(x * x + y * y, 1e-30)) + EPS
    theta = _atan2(r, z + EPS)
    m0 = fx * x * theta / r + cx
    m1 = fy * y * theta / r + cy
    x2 = x * x + EPS
    y2 = y * y
    xy = x * y
    s = x2 + y2
    inv = 1.0 / (s + z * z)
    b = _atan2(r, z) / r / s
    a = z * inv / s
    return (m0, m1, fx * (x2 * a + y2 * b), fx * xy * (a - b), -fx * x * inv,
            fy * xy * (a - b), fy * (y2 * a + x2 * b), -fy * y * inv)


@triton.jit
def _fisheye_vjp(x, y, z, fx, fy, v_m0, v_m1, vj00, vj01, vj02, vj10, vj11, vj12, EPS: tl.constexpr):
    """Gradient of (centre, Jacobian) of ``_fisheye`` with respect to the camera-space point (reverse mode
    through its intermediates, last first)."""
    rr = x * x + y * y
    r0 = tl.sqrt(tl.maximum(rr, 1e-30))
    r = r0 + EPS
    zp = z + EPS
    theta = _atan2(r, zp)
    x2 = x * x + EPS
    y2 = y * y
    xy = x * y
    s = x2 + y2
    inv = 1.0 / (s + z * z)
    th2 = _atan2(r, z)
    b = th2 / r / s
    a = z * inv / s
    # the Jacobian's entries
    v_a = fx * x2 * vj00 + fx * xy * vj01 + fy * xy * vj10 + fy * y2 * vj11
    v_b = fx * y2 * vj00 - fx * xy * vj01 - fy * xy * vj10 + fy * x2 * vj11
    v_x2 = fx * a * vj00 + fy * b * vj11
    v_y2 = fx * b * vj00 + fy * a * vj11
    v_xy = (a - b) * (fx * vj01 + fy * vj10)
    v_inv = -fx * x * vj02 - fy * y * vj12
    v_x = -fx * inv * vj02
    v_y = -fy * inv * vj12
    # a = z * inv / s; b = th2 / r / s
    v_z = v_a * inv / s
    v_inv += v_a * z / s
    v_s = -v_a * a / s - v_b * b / s
    v_th2 = v_b / (r * s)
    v_r = -v_b * b / r
    # inv = 1 / (s + z^2)
    v_d = -v_inv * inv * inv
    v_s += v_d
    v_z += 2.0 * z * v_d
    # th2 = atan2(r, z)
    den2 = r * r + z * z
    v_r += v_th2 * z / den2
    v_z -= v_th2 * r / den2
    v_x2 += v_s
    v_y2 += v_s
    # the centre: m = f * (x, y) * theta / r + c, theta = atan2(r, z + eps)
    k = v_m0 * fx * x + v_m1 * fy * y
    v_x += v_m0 * fx * theta / r
    v_y += v_m1 * fy * theta / r
    v_theta = k / r
    v_r -= k * theta / (r * r)
    den = r * r + zp * zp
    v_r += v_theta * zp / den
    v_z -= v_theta * r / den
    v_x += 2.0 * x * v_x2 + y * v_xy
    v_y += 2.0 * y * v_y2 + x * v_xy
    v_rr = tl.where(rr >= 1e-30, v_r / (2.0 * r0), 0.0)  # r = sqrt(max(rr, 1e-30)) + eps
    return v_x + 2.0 * x * v_rr, v_y + 2.0 * y * v_rr, v_z


@triton.jit
def _camera_gaussian(view_ptr, K_ptr, cam, mx, my, mz, m00, m01, m02, m10, m11, m12, m20, m21, m22,
                     W, H, near, far, eps2d, CAMERA: tl.constexpr, CLAMP: tl.constexpr, EPS: tl.constexpr):
    """Camera ``cam``'s view of a block of Gaussians (both kernels' per-camera start): the camera's rotation and
    intrinsics, then the safe camera-space point, projected centre, Jacobian, camera covariance, Sigma_c J^T
    columns, the blurred 2D covariance (a, b, c), whether depth and determinant allow it, and the determinant
    before the blur (for the antialiased compensation)."""
    r00, r01, r02, t0, r10, r11, r12, t1, r20, r21, r22, t2, fx, fy, cx, cy = _load_camera(view_ptr, K_ptr, cam)
    px = r00 * mx + r01 * my + r02 * mz + t0
    py = r10 * mx + r11 * my + r12 * mz + t1
    pz = r20 * mx + r21 * my + r22 * mz + t2
    in_range = (pz >= near) & (pz <= far)
    x = tl.where(in_range, px, 0.0)  # culled centres get a harmless stand-in (as the reference)
    y = tl.where(in_range, py, 0.0)
    z = tl.where(in_range, pz, 1.0)
    if CAMERA == 0:
        c0, c1, j00, j01, j02, j10, j11, j12 = _pinhole(x, y, z, fx, fy, cx, cy, W, H, CLAMP)
    else:
        c0, c1, j00, j01, j02, j10, j11, j12 = _fisheye(x, y, z, fx, fy, cx, cy, EPS)
    # world covariance M M^T, then R_view (.) R_view^T
    s00, s01, s02, s11, s12, s22 = _gram(m00, m01, m02, m10, m11, m12, m20, m21, m22)
    k00, k01, k02, k11, k12, k22 = _sandwich(r00, r01, r02, r10, r11, r12, r20, r21, r22, s00, s01, s02, s11, s12, s22)
    u0 = k00 * j00 + k01 * j01 + k02 * j02  # Sigma_c J0^T
    u1 = k01 * j00 + k11 * j01 + k12 * j02
    u2 = k02 * j00 + k12 * j01 + k22 * j02
    w0 = k00 * j10 + k01 * j11 + k02 * j12  # Sigma_c J1^T
    w1 = k01 * j10 + k11 * j11 + k12 * j12
    w2 = k02 * j10 + k12 * j11 + k22 * j12
    a_raw = j00 * u0 + j01 * u1 + j02 * u2
    b = j00 * w0 + j01 * w1 + j02 * w2
    c_raw = j10 * w0 + j11 * w1 + j12 * w2
    a = a_raw + eps2d
    c = c_raw + eps2d
    det = a * c - b * b
    ok = in_range & (det > 0)
    return (r00, r01, r02, r10, r11, r12, r20, r21, r22, fx, fy, cx, cy,
            x, y, z, pz, c0, c1, j00, j01, j02, j10, j11, j12, k00, k01, k02, k11, k12, k22,
            u0, u1, u2, w0, w1, w2, a, b, c, tl.where(ok, det, 1.0), ok, a_raw * c_raw - b * b)


# ---- forward -----------------------------------------------------------------------------------------------

@triton.jit
def _project_fwd_kernel(means_ptr, quats_ptr, scales_ptr, opac_ptr, view_ptr, K_ptr,
                        means2d_ptr, conics_ptr, depths_ptr, radii_ptr, comp_ptr,
                        N, C, W, H, near, far, eps2d,
                        CAMERA: tl.constexpr, CLAMP: tl.constexpr, EPS: tl.constexpr, CUT_REL: tl.constexpr,
                        CUT_ABS: tl.constexpr, ALPHA_MIN: tl.constexpr, MAX_R: tl.constexpr,
                        ANTIALIAS: tl.constexpr, BLOCK: tl.constexpr):
    # one program per BLOCK Gaussians, all cameras; outputs [C, N, ...]
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = g < N
    mx = tl.load(means_ptr + 3 * g, mask=mask, other=0.0)
    my = tl.load(means_ptr + 3 * g + 1, mask=mask, other=0.0)
    mz = tl.load(means_ptr + 3 * g + 2, mask=mask, other=0.0)
    op = tl.load(opac_ptr + g, mask=mask, other=0.0)
    (_w, _x, _y, _z, _qn, _r00, _r01, _r02, _r10, _r11, _r12, _r20, _r21, _r22, _sx, _sy, _sz,
     m00, m01, m02, m10, m11, m12, m20, m21, m22) = _load_gaussian(quats_ptr, scales_ptr, g, mask)
    cut = 2.0 * tl.log(tl.maximum(op * 255.0, 1e-30))  # q at which alpha = ALPHA_MIN (reference.alpha_cutoff)
    cut = tl.maximum(cut * (1.0 + CUT_REL) + CUT_ABS, 0.0)
    Wf = W * 1.0
    Hf = H * 1.0
    n64 = tl.zeros([BLOCK], tl.int64) + N  # [C, N] offsets in int64 (N may be a constexpr 1)
    for cam in range(C):
        (r00, r01, r02, r10, r11, r12, r20, r21, r22, fx, fy, cx, cy, x, y, z, pz, c0, c1, j00, j01, j02, j10, j11,
         j12, k00, k01, k02, k11, k12, k22, u0, u1, u2, w0, w1, w2, a, b, c, det, ok, det_raw) = _camera_gaussian(
            view_ptr, K_ptr, cam, mx, my, mz, m00, m01, m02, m10, m11, m12, m20, m21, m22, Wf, Hf, near, far, eps2d,
            CAMERA, CLAMP, EPS)
        if ANTIALIAS:
            # Mip-Splatting's 2D filter: the blur keeps the splat's integral, so its opacity shrinks by
            # sqrt(det(Sigma2d) / det(Sigma2d + eps2d I)); the radii and culling use the compensated opacity
            ratio = det_raw / det
            comp = tl.where(ok & (ratio > 0), tl.sqrt(tl.maximum(ratio, 0.0)), 0.0)
            op_c = op * comp
            cut_c = 2.0 * tl.log(tl.maximum(op_c * 255.0, 1e-30))
            cut_c = tl.maximum(cut_c * (1.0 + CUT_REL) + CUT_ABS, 0.0)
        else:
            op_c = op
            cut_c = cut
        rx = tl.ceil(tl.sqrt(cut_c * a))
        ry = tl.ceil(tl.sqrt(cut_c * c))
        on_screen = (c0 + rx > 0) & (c0 - rx < Wf) & (c1 + ry > 0) & (c1 - ry < Hf)
        keep = mask & ok & (op_c >= ALPHA_MIN) & on_screen
        out = cam * n64 + g
        if ANTIALIAS:
            tl.store(comp_ptr + out, tl.where(keep, comp, 0.0), mask=mask)
        tl.store(means2d_ptr + 2 * out, tl.where(keep, c0, 0.0), mask=mask)
        tl.store(means2d_ptr + 2 * out + 1, tl.where(keep, c1, 0.0), mask=mask)
        tl.store(conics_ptr + 3 * out, tl.where(keep, c / det, 0.0), mask=mask)
        tl.store(conics_ptr + 3 * out + 1, tl.where(keep, -b / det, 0.0), mask=mask)
        tl.store(conics_ptr + 3 * out + 2, tl.where(keep, a / det, 0.0), mask=mask)
        tl.store(depths_ptr + out, tl.where(keep, pz, 0.0), mask=mask)
        tl.store(radii_ptr + 2 * out, tl.where(keep, tl.minimum(rx, MAX_R), 0.0).to(tl.int32), mask=mask)
        tl.store(radii_ptr + 2 * out + 1, tl.where(keep, tl.minimum(ry, MAX_R), 0.0).to(tl.int32), mask=mask)


# ---- backward ----------------------------------------------------------------------------------------------

@triton.jit
def _project_bwd_kernel(means_ptr, quats_ptr, scales_ptr, view_ptr, K_ptr, radii_ptr,
                        v_means2d_ptr, v_conics_ptr, v_depths_ptr, v_comp_ptr, v_means_ptr, v_quats_ptr,
                        v_scales_ptr, v_view_ptr, N, C, W, H, near, far, eps2d,
                        CAMERA: tl.constexpr, CLAMP: tl.constexpr, EPS: tl.constexpr, VIEW_GRAD: tl.constexpr,
                        DEPTH_GRAD: tl.constexpr, ANTIALIAS: tl.constexpr, BLOCK: tl.constexpr):
    # one program per BLOCK Gaussians; gradients summed over the cameras in registers, stored once. With
    # VIEW_GRAD, each camera's [R | t] gradient is summed over the block and added atomically (12 per camera).
    # Without DEPTH_GRAD the depths took no gradient (an RGB render): v_depths is not read.
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = g < N
    mx = tl.load(means_ptr + 3 * g, mask=mask, other=0.0)
    my = tl.load(means_ptr + 3 * g + 1, mask=mask, other=0.0)
    mz = tl.load(means_ptr + 3 * g + 2, mask=mask, other=0.0)
    (qw, qx, qy, qz, qn, q00, q01, q02, q10, q11, q12, q20, q21, q22, sx, sy, sz,
     m00, m01, m02, m10, m11, m12, m20, m21, m22) = _load_gaussian(quats_ptr, scales_ptr, g, mask)
    Wf = W * 1.0
    Hf = H * 1.0
    n64 = tl.zeros([BLOCK], tl.int64) + N
    v_mx = tl.zeros([BLOCK], tl.float32)
    v_my = tl.zeros([BLOCK], tl.float32)
    v_mz = tl.zeros([BLOCK], tl.float32)
    g00 = tl.zeros([BLOCK], tl.float32)  # dL/d(world covariance), symmetric
    g01 = tl.zeros([BLOCK], tl.float32)
    g02 = tl.zeros([BLOCK], tl.float32)
    g11 = tl.zeros([BLOCK], tl.float32)
    g12 = tl.zeros([BLOCK], tl.float32)
    g22 = tl.zeros([BLOCK], tl.float32)
    for cam in range(C):
        (r00, r01, r02, r10, r11, r12, r20, r21, r22, fx, fy, cx, cy, x, y, z, pz, c0, c1, j00, j01, j02, j10, j11,
         j12, k00, k01, k02, k11, k12, k22, u0, u1, u2, w0, w1, w2, a, b, c, det, ok, det_raw) = _camera_gaussian(
            view_ptr, K_ptr, cam, mx, my, mz, m00, m01, m02, m10, m11, m12, m20, m21, m22, Wf, Hf, near, far, eps2d,
            CAMERA, CLAMP, EPS)
        out = cam * n64 + g
        keep = mask & (tl.load(radii_ptr + 2 * out, mask=mask, other=0) > 0)  # culled pairs pass no gradient
        v_m0 = tl.load(v_means2d_ptr + 2 * out, mask=keep, other=0.0)
        v_m1 = tl.load(v_means2d_ptr + 2 * out + 1, mask=keep, other=0.0)
        vA = tl.load(v_conics_ptr + 3 * out, mask=keep, other=0.0)
        vB = tl.load(v_conics_ptr + 3 * out + 1, mask=keep, other=0.0)
        vC = tl.load(v_conics_ptr + 3 * out + 2, mask=keep, other=0.0)
        v_dep = tl.load(v_depths_ptr + out, mask=keep & DEPTH_GRAD, other=0.0)
        # conic = inverse of [[a, b], [b, c]]
        A = c / det
        B = -b / det
        Cn = a / det
        v_a = -(A * A * vA + A * B * vB + B * B * vC)
        v_b = -(2.0 * A * B * vA + (A * Cn + B * B) * vB + 2.0 * B * Cn * vC)
        v_c = -(B * B * vA + B * Cn * vB + Cn * Cn * vC)
        if ANTIALIAS:
            # comp = sqrt(r), r = det_raw / det with det_raw = (a - eps)(c - eps) - b^2 and det = ac - b^2
            v_comp = tl.load(v_comp_ptr + out, mask=keep, other=0.0)
            ratio = det_raw / det
            comp = tl.sqrt(tl.maximum(ratio, 0.0))
            v_r = tl.where(keep & (ratio > 0), v_comp * 0.5 / tl.where(comp > 0, comp, 1.0), 0.0) / det
            v_a += v_r * ((c - eps2d) - ratio * c)
            v_c += v_r * ((a - eps2d) - ratio * a)
            v_b += v_r * (2.0 * b * (ratio - 1.0))
        # (a, b, c) = (J0 Sc J0^T, J0 Sc J1^T, J1 Sc J1^T): the Jacobian's gradient ...
        vj00 = 2.0 * v_a * u0 + v_b * w0
        vj01 = 2.0 * v_a * u1 + v_b * w1
        vj02 = 2.0 * v_a * u2 + v_b * w2
        vj10 = v_b * u0 + 2.0 * v_c * w0
        vj11 = v_b * u1 + 2.0 * v_c * w1
        vj12 = v_b * u2 + 2.0 * v_c * w2
        # ... and the camera covariance's (symmetric)
        hb = 0.5 * v_b
        e00 = v_a * j00 * j00 + 2.0 * hb * j00 * j10 + v_c * j10 * j10
        e01 = v_a * j00 * j01 + hb * (j00 * j11 + j01 * j10) + v_c * j10 * j11
        e02 = v_a * j00 * j02 + hb * (j00 * j12 + j02 * j10) + v_c * j10 * j12
        e11 = v_a * j01 * j01 + 2.0 * hb * j01 * j11 + v_c * j11 * j11
        e12 = v_a * j01 * j02 + hb * (j01 * j12 + j02 * j11) + v_c * j11 * j12
        e22 = v_a * j02 * j02 + 2.0 * hb * j02 * j12 + v_c * j12 * j12
        d00, d01, d02, d11, d12, d22 = _sandwich(r00, r10, r20, r01, r11, r21, r02, r12, r22,
                                                 e00, e01, e02, e11, e12, e22)  # R^T E R
        g00 += d00
        g01 += d01
        g02 += d02
        g11 += d11
        g12 += d12
        g22 += d22
        if CAMERA == 0:
            v_x, v_y, v_z = _pinhole_vjp(x, y, z, fx, fy, cx, cy, Wf, Hf, v_m0, v_m1, vj00, vj02, vj11, vj12, CLAMP)
        else:
            v_x, v_y, v_z = _fisheye_vjp(x, y, z, fx, fy, v_m0, v_m1, vj00, vj01, vj02, vj10, vj11, vj12, EPS)
        v_z += v_dep
        v_x = tl.where(keep, v_x, 0.0)
        v_y = tl.where(keep, v_y, 0.0)
        v_z = tl.where(keep, v_z, 0.0)
        v_mx += r00 * v_x + r10 * v_y + r20 * v_z  # R_view^T v_p
        v_my += r01 * v_x + r11 * v_y + r21 * v_z
        v_mz += r02 * v_x + r12 * v_y + r22 * v_z
        if VIEW_GRAD:
            # p = R m + t: dL/dR += v_p m^T, dL/dt = v_p; Sigma_c = R Sigma R^T: dL/dR += 2 E R Sigma
            s00, s01, s02, s11, s12, s22 = _gram(m00, m01, m02, m10, m11, m12, m20, m21, m22)
            a00, a01, a02, a10, a11, a12, a20, a21, a22 = _mul_sym(  # R Sigma
                r00, r01, r02, r10, r11, r12, r20, r21, r22, s00, s01, s02, s11, s12, s22)
            vv = v_view_ptr + 16 * cam
            tl.atomic_add(vv, tl.sum(v_x * mx + 2.0 * (e00 * a00 + e01 * a10 + e02 * a20), axis=0), sem="relaxed")
            tl.atomic_add(vv + 1, tl.sum(v_x * my + 2.0 * (e00 * a01 + e01 * a11 + e02 * a21), axis=0), sem="relaxed")
            tl.atomic_add(vv + 2, tl.sum(v_x * mz + 2.0 * (e00 * a02 + e01 * a12 + e02 * a22), axis=0), sem="relaxed")
            tl.atomic_add(vv + 3, tl.sum(v_x, axis=0), sem="relaxed")
            tl.atomic_add(vv + 4, tl.sum(v_y * mx + 2.0 * (e01 * a00 + e11 * a10 + e12 * a20), axis=0), sem="relaxed")
            tl.atomic_add(vv + 5, tl.sum(v_y * my + 2.0 * (e01 * a01 + e11 * a11 + e12 * a21), axis=0), sem="relaxed")
            tl.atomic_add(vv + 6, tl.sum(v_y * mz + 2.0 * (e01 * a02 + e11 * a12 + e12 * a22), axis=0), sem="relaxed")
            tl.atomic_add(vv + 7, tl.sum(v_y, axis=0), sem="relaxed")
            tl.atomic_add(vv + 8, tl.sum(v_z * mx + 2.0 * (e02 * a00 + e12 * a10 + e22 * a20), axis=0), sem="relaxed")
            tl.atomic_add(vv + 9, tl.sum(v_z * my + 2.0 * (e02 * a01 + e12 * a11 + e22 * a21), axis=0), sem="relaxed")
            tl.atomic_add(vv + 10, tl.sum(v_z * mz + 2.0 * (e02 * a02 + e12 * a12 + e22 * a22), axis=0),
                          sem="relaxed")
            tl.atomic_add(vv + 11, tl.sum(v_z, axis=0), sem="relaxed")
    # Sigma = M M^T: dL/dM = 2 G M; M = R S
    n00 = 2.0 * (g00 * m00 + g01 * m10 + g02 * m20)
    n01 = 2.0 * (g00 * m01 + g01 * m11 + g02 * m21)
    n02 = 2.0 * (g00 * m02 + g01 * m12 + g02 * m22)
    n10 = 2.0 * (g01 * m00 + g11 * m10 + g12 * m20)
    n11 = 2.0 * (g01 * m01 + g11 * m11 + g12 * m21)
    n12 = 2.0 * (g01 * m02 + g11 * m12 + g12 * m22)
    n20 = 2.0 * (g02 * m00 + g12 * m10 + g22 * m20)
    n21 = 2.0 * (g02 * m01 + g12 * m11 + g22 * m21)
    n22 = 2.0 * (g02 * m02 + g12 * m12 + g22 * m22)
    v_sx = n00 * q00 + n10 * q10 + n20 * q20
    v_sy = n01 * q01 + n11 * q11 + n21 * q21
    v_sz = n02 * q02 + n12 * q12 + n22 * q22
    v00, v01, v02 = n00 * sx, n01 * sy, n02 * sz  # dL/dR
    v10, v11, v12 = n10 * sx, n11 * sy, n12 * sz
    v20, v21, v22 = n20 * sx, n21 * sy, n22 * sz
    vw = 2.0 * (-qz * v01 + qy * v02 + qz * v10 - qx * v12 - qy * v20 + qx * v21)
    vx = 2.0 * (qy * v01 + qz * v02 + qy * v10 - 2.0 * qx * v11 - qw * v12 + qz * v20 + qw * v21 - 2.0 * qx * v22)
    vy = 2.0 * (-2.0 * qy * v00 + qx * v01 + qw * v02 + qx * v10 + qz * v12 - qw * v20 + qz * v21 - 2.0 * qy * v22)
    vz = 2.0 * (-2.0 * qz * v00 - qw * v01 + qx * v02 + qw * v10 - 2.0 * qz * v11 + qy * v12 + qx * v20 + qy * v21)
    # q = q_raw / max(|q_raw|, 1e-12)
    dot = qw * vw + qx * vx + qy * vy + qz * vz
    inv = 1.0 / tl.maximum(qn, 1e-12)
    big = qn > 1e-12
    vw = tl.where(big, (vw - qw * dot) * inv, vw * inv)
    vx = tl.where(big, (vx - qx * dot) * inv, vx * inv)
    vy = tl.where(big, (vy - qy * dot) * inv, vy * inv)
    vz = tl.where(big, (vz - qz * dot) * inv, vz * inv)
    tl.store(v_means_ptr + 3 * g, v_mx, mask=mask)
    tl.store(v_means_ptr + 3 * g + 1, v_my, mask=mask)
    tl.store(v_means_ptr + 3 * g + 2, v_mz, mask=mask)
    tl.store(v_quats_ptr + 4 * g, vw, mask=mask)
    tl.store(v_quats_ptr + 4 * g + 1, vx, mask=mask)
    tl.store(v_quats_ptr + 4 * g + 2, vy, mask=mask)
    tl.store(v_quats_ptr + 4 * g + 3, vz, mask=mask)
    tl.store(v_scales_ptr + 3 * g, v_sx, mask=mask)
    tl.store(v_scales_ptr + 3 * g + 1, v_sy, mask=mask)
    tl.store(v_scales_ptr + 3 * g + 2, v_sz, mask=mask)


# ---- launchers ---------------------------------------------------------------------------------------------

def _alloc(shape, dtype, device) -> torch.Tensor:
    """Uninitialized output buffer (the tests swap in NaN-filled ones: every element must be written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_kernel_args(named: list[tuple[str, torch.Tensor, tuple]], device) -> None:
    """What the kernels index by hand: exact shapes, float32 (int32 for radii), one device, contiguous."""
    for name, t, shape in named:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        want = torch.int32 if name == "radii" else torch.float32
        if t.dtype != want:
            raise ValueError(f"{name} must be {want}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel indexes it densely)")


def _consts(camera: int, antialiased: bool) -> dict:
    return dict(CAMERA=camera, CLAMP=ref.CLAMP_FOV, EPS=ref.FISHEYE_EPS, ANTIALIAS=antialiased, BLOCK=BLOCK,
                num_warps=NUM_WARPS)


def project_fwd_triton(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d, camera,
                       antialiased: bool = False):
    """Forward launcher: (means2d [C,N,2], conics [C,N,3], depths [C,N], radii [C,N,2] int32, compensation
    [C,N] (antialiased; 0 where culled) or None)."""
    N, C, dev = means.shape[0], viewmats.shape[0], means.device
    _check_kernel_args([("means", means, (N, 3)), ("quats", quats, (N, 4)), ("scales", scales, (N, 3)),
                        ("opacities", opacities, (N,)), ("viewmats", viewmats, (C, 4, 4)), ("Ks", Ks, (C, 3, 3))],
                       dev)
    means2d = _alloc((C, N, 2), torch.float32, dev)
    conics = _alloc((C, N, 3), torch.float32, dev)
    depths = _alloc((C, N), torch.float32, dev)
    radii = _alloc((C, N, 2), torch.int32, dev)
    comp = _alloc((C, N), torch.float32, dev) if antialiased else None
    if N:
        _project_fwd_kernel[(-(-N // BLOCK),)](
            means, quats, scales, opacities, viewmats, Ks, means2d, conics, depths, radii,
            comp if antialiased else depths, N, C, width, height, float(near), float(far), float(eps2d),
            CUT_REL=ref.CUTOFF_REL, CUT_ABS=ref.CUTOFF_ABS, ALPHA_MIN=ref.ALPHA_MIN, MAX_R=ref.MAX_RADIUS,
            **_consts(camera, antialiased))
    return means2d, conics, depths, radii, comp


def project_bwd_triton(means, quats, scales, viewmats, Ks, radii, v_means2d, v_conics, v_depths, width, height,
                       near, far, eps2d, camera, view_grad: bool = False, v_comp: torch.Tensor | None = None):
    """Backward launcher: (v_means [N,3], v_quats [N,4], v_scales [N,3], v_viewmats [C,4,4] or None).
    ``v_depths`` [C,N] or None (no gradient reached the depths); ``v_comp`` [C,N]: the antialiased compensation's
    gradient (None: classic mode, or none reached it)."""
    N, C, dev = means.shape[0], viewmats.shape[0], means.device
    named = [("means", means, (N, 3)), ("quats", quats, (N, 4)), ("scales", scales, (N, 3)),
             ("viewmats", viewmats, (C, 4, 4)), ("Ks", Ks, (C, 3, 3)), ("radii", radii, (C, N, 2)),
             ("v_means2d", v_means2d, (C, N, 2)), ("v_conics", v_conics, (C, N, 3))]
    named += [(name, t, (C, N)) for name, t in (("v_depths", v_depths), ("v_comp", v_comp)) if t is not None]
    _check_kernel_args(named, dev)
    v_means = _alloc((N, 3), torch.float32, dev)
    v_quats = _alloc((N, 4), torch.float32, dev)
    v_scales = _alloc((N, 3), torch.float32, dev)
    v_view = torch.zeros((C, 4, 4), dtype=torch.float32, device=dev) if view_grad else None  # atomics add into it
    if N:
        _project_bwd_kernel[(-(-N // BLOCK),)](
            means, quats, scales, viewmats, Ks, radii, v_means2d, v_conics,
            v_depths if v_depths is not None else v_conics, v_comp if v_comp is not None else v_conics, v_means,
            v_quats, v_scales, v_view if view_grad else v_means, N, C, width, height, float(near), float(far),
            float(eps2d), VIEW_GRAD=view_grad, DEPTH_GRAD=v_depths is not None, **_consts(camera, v_comp is not None))
    return v_means, v_quats, v_scales, v_view


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d, camera,
                antialiased):
        means, quats, scales, opacities, viewmats, Ks = (t.detach().contiguous() for t in
                                                         (means, quats, scales, opacities, viewmats, Ks))
        means2d, conics, depths, radii, comp = project_fwd_triton(means, quats, scales, opacities, viewmats, Ks,
                                                                  width, height, near, far, eps2d, camera,
                                                                  antialiased)
        ctx.save_for_backward(means, quats, scales, viewmats, Ks, radii)
        ctx.cfg = (width, height, near, far, eps2d, camera)
        ctx.antialiased = antialiased
        ctx.mark_non_differentiable(radii)
        # outputs that take no gradient arrive as None, not as zeros autograd would fill (an RGB render's depths)
        ctx.set_materialize_grads(False)
        if comp is None:  # classic mode: an empty stand-in keeps the outputs' count fixed
            comp = means.new_empty(0)
            ctx.mark_non_differentiable(comp)
        return means2d, conics, depths, radii, comp

    @staticmethod
    def backward(ctx, v_means2d, v_conics, v_depths, _v_radii, v_comp):
        means, quats, scales, viewmats, Ks, radii = ctx.saved_tensors
        C, N = radii.shape[:2]
        v_means2d = v_means2d.contiguous() if v_means2d is not None else means.new_zeros(C, N, 2)
        v_conics = v_conics.contiguous() if v_conics is not None else means.new_zeros(C, N, 3)
        width, height, near, far, eps2d, camera = ctx.cfg
        v_means, v_quats, v_scales, v_view = project_bwd_triton(
            means, quats, scales, viewmats, Ks, radii, v_means2d, v_conics,
            v_depths.contiguous() if v_depths is not None else None, width, height, near, far, eps2d, camera,
            view_grad=ctx.needs_input_grad[4],
            v_comp=v_comp.contiguous() if ctx.antialiased and v_comp is not None else None)
        return v_means, v_quats, v_scales, None, v_view, None, None, None, None, None, None, None, None


# ---- public ------------------------------------------------------------------------------------------------

def project(means: torch.Tensor,  # [N, 3]
            quats: torch.Tensor,  # [N, 4] (w, x, y, z), normalized inside
            scales: torch.Tensor,  # [N, 3] linear
            opacities: torch.Tensor,  # [N] in [0, 1]
            viewmats: torch.Tensor,  # [C, 4, 4] world -> camera
            Ks: torch.Tensor,  # [C, 3, 3]
            width: int, height: int, *, near: float = 0.01, far: float = 1e10, eps2d: float = 0.3,
            camera_model: str = "pinhole", antialiased: bool = False) -> Projection:
    """means2d [C,N,2], conics [C,N,3], depths [C,N], radii [C,N,2] int32 (the opacity-aware box; 0 = culled),
    opacities [C,N]. Gradients flow to means, quats, scales, opacities and viewmats (when it requires grad:
    camera pose refinement); Ks get one on the torch (CPU) path only. NaN or inf, negative scales and
    opacities outside [0, 1] raise ValueError. ``antialiased``: each camera's opacity is multiplied by
    sqrt(det(Sigma2d) / det(Sigma2d + eps2d I)) (gsplat's "antialiased" mode, Mip-Splatting's 2D filter); culled
    pairs then get opacity 0."""
    C, N = check_projection_inputs(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                                   camera_model, camera_values=False)
    check_finite([("means", means), ("quats", quats), ("scales", scales), ("opacities", opacities)],
                 cameras=(viewmats, Ks), bounds=gaussian_bounds(scales, opacities))
    return project_checked(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                           camera_model, antialiased)


def project_checked(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                    camera_model, antialiased: bool = False) -> Projection:
    """``project`` on inputs the caller has already validated (``rasterize`` checks everything once)."""
    C, N = viewmats.shape[0], means.shape[0]
    if not use_triton(means):
        return ref.project_reference(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                                     camera_model, antialiased)
    means2d, conics, depths, radii, comp = _Project.apply(means, quats, scales, opacities, viewmats, Ks, width,
                                                          height, near, far, eps2d, camera_model_code(camera_model),
                                                          bool(antialiased))
    opac = opacities[None] * comp if antialiased else opacities[None].expand(C, N)
    return Projection(means2d, conics, depths, radii, opac)


def check_projection_inputs(means, quats, scales, opacities, viewmats, Ks, width, height, near, far, eps2d,
                            camera_model, *, camera_values: bool = True) -> tuple[int, int]:
    """Shapes, dtypes, devices and settings of ``project``; returns (C, N). ``camera_values=False`` leaves the
    cameras' values to the caller's own host sync (see ``camera.camera_problems``)."""
    if not isinstance(means, torch.Tensor) or means.dim() != 2 or means.shape[-1] != 3:
        raise ValueError("means must be a [N, 3] tensor, got "
                         + (str(list(means.shape)) if isinstance(means, torch.Tensor) else type(means).__name__))
    N, dev = means.shape[0], means.device
    if means.dtype != torch.float32:
        raise ValueError(f"means must be torch.float32, got {means.dtype}")
    for name, t, shape in (("quats", quats, (N, 4)), ("scales", scales, (N, 3)), ("opacities", opacities, (N,))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (N={N} from means), got {list(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{name} must be on {dev} like means, got {t.device}")
    C = check_cameras(viewmats, Ks, dev, values=camera_values)
    for name, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (isinstance(near, (int, float)) and math.isfinite(near) and near > 0):
        raise ValueError(f"near must be a finite number > 0, got {near!r}")
    if not (isinstance(far, (int, float)) and far > near):
        raise ValueError(f"far must be a number > near={near}, got {far!r}")
    if not (isinstance(eps2d, (int, float)) and math.isfinite(eps2d) and eps2d >= 0):
        raise ValueError(f"eps2d must be a finite number >= 0, got {eps2d!r}")
    camera_model_code(camera_model)
    return C, N
