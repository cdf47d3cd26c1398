"""Value checks shared by the public splat functions: NaN and inf, camera values and the documented ranges of
the Gaussians' parameters, all read in one host sync (``rasterize`` runs them every call and reads them with
its intersection count, the sync it makes anyway).

On CUDA one kernel (``_check_kernel``) reads every checked tensor once and raises a flag: a render's checks are
two launches (the flag's zero fill and the kernel), where torch ops took about forty. It also inverts the view
matrices (the singularity test), and hands the camera centres to the SH stage. CPU: torch ops (``input_flag``).
Only on failure is anything named: ``raise_input_problem`` finds the first bad value with torch ops on either
path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from warpforge.kernels import use_triton  # importing the package chooses the interpreter before any @jit
from warpforge.splat.camera import camera_problems, raise_camera_problem

MAX_SLOTS = 6  # checked tensors per launch: the Gaussians' four parameters, the colours, a background
BLOCK = 2048  # elements of each tensor per program
NUM_WARPS = 4
CAM_BLOCK = 16  # cameras per step of the camera check
INF: tl.constexpr = tl.constexpr(float("inf"))


@triton.jit
def _slot_bad(ptr, n, lo, hi, offs, first):
    """Elements of one tensor's block that are NaN, infinite or outside [lo, hi] (a block past the tensor's end
    reads nothing)."""
    bad = 0
    if first < n:
        m = offs < n
        x = tl.load(ptr + offs, mask=m, other=0.0)
        ok = (tl.abs(x) < INF) & (x >= lo) & (x <= hi)  # NaN fails every comparison
        bad = tl.sum((m & ~ok).to(tl.int32), axis=0)
    return bad


@triton.jit
def _det3(a0, a1, a2, b0, b1, b2, c0, c1, c2):
    return a0 * (b1 * c2 - b2 * c1) - a1 * (b0 * c2 - b2 * c0) + a2 * (b0 * c1 - b1 * c0)


@triton.jit
def _check_kernel(p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5,
                  lo0, lo1, lo2, lo3, lo4, lo5, hi0, hi1, hi2, hi3, hi4, hi5,
                  view_ptr, K_ptr, C, centres_ptr, flag_ptr,
                  NT: tl.constexpr, CAMERAS: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr):
    # program i checks block i of each of the NT tensors; program 0 also the C cameras. flag_ptr: int64, zeroed
    # by the launcher, set to 1 by any program that finds a problem (every writer writes the same value).
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    bad = _slot_bad(p0, n0, lo0, hi0, offs, first)
    if NT > 1:
        bad += _slot_bad(p1, n1, lo1, hi1, offs, first)
    if NT > 2:
        bad += _slot_bad(p2, n2, lo2, hi2, offs, first)
    if NT > 3:
        bad += _slot_bad(p3, n3, lo3, hi3, offs, first)
    if NT > 4:
        bad += _slot_bad(p4, n4, lo4, hi4, offs, first)
    if NT > 5:
        bad += _slot_bad(p5, n5, lo5, hi5, offs, first)
    if CAMERAS:
        if pid == 0:
            # ``camera.camera_problems`` and ``camera.view_inverse_column``: finite values, positive focal
            # lengths, and the inverse's translation column by cofactors along the last row
            for c0 in range(0, C, CB):
                c = c0 + tl.arange(0, CB)
                cm = c < C
                v = view_ptr + 16 * c
                k = K_ptr + 9 * c
                fin = tl.full([CB], 1, tl.int1)
                for j in tl.static_range(16):
                    fin = fin & (tl.abs(tl.load(v + j, mask=cm, other=0.0)) < INF)
                for j in tl.static_range(9):
                    fin = fin & (tl.abs(tl.load(k + j, mask=cm, other=1.0)) < INF)
                fx = tl.load(k, mask=cm, other=1.0)
                fy = tl.load(k + 4, mask=cm, other=1.0)
                a0, a1, a2, a3 = (tl.load(v, mask=cm, other=1.0), tl.load(v + 1, mask=cm, other=0.0),
                                  tl.load(v + 2, mask=cm, other=0.0), tl.load(v + 3, mask=cm, other=0.0))
                b0, b1, b2, b3 = (tl.load(v + 4, mask=cm, other=0.0), tl.load(v + 5, mask=cm, other=1.0),
                                  tl.load(v + 6, mask=cm, other=0.0), tl.load(v + 7, mask=cm, other=0.0))
                e0, e1, e2, e3 = (tl.load(v + 8, mask=cm, other=0.0), tl.load(v + 9, mask=cm, other=0.0),
                                  tl.load(v + 10, mask=cm, other=1.0), tl.load(v + 11, mask=cm, other=0.0))
                l0, l1, l2, l3 = (tl.load(v + 12, mask=cm, other=0.0), tl.load(v + 13, mask=cm, other=0.0),
                                  tl.load(v + 14, mask=cm, other=0.0), tl.load(v + 15, mask=cm, other=1.0))
                q0 = -_det3(a1, a2, a3, b1, b2, b3, e1, e2, e3)
                q1 = _det3(a0, a2, a3, b0, b2, b3, e0, e2, e3)
                q2 = -_det3(a0, a1, a3, b0, b1, b3, e0, e1, e3)
                q3 = _det3(a0, a1, a2, b0, b1, b2, e0, e1, e2)
                det = l0 * q0 + l1 * q1 + l2 * q2 + l3 * q3
                x, y, z = q0 / det, q1 / det, q2 / det
                sound = (fin & (fx > 0) & (fy > 0) & (det != 0) & (tl.abs(x) < INF) & (tl.abs(y) < INF)
                         & (tl.abs(z) < INF))
                bad += tl.sum((cm & ~sound).to(tl.int32), axis=0)
                tl.store(centres_ptr + 3 * c, x, mask=cm)
                tl.store(centres_ptr + 3 * c + 1, y, mask=cm)
                tl.store(centres_ptr + 3 * c + 2, z, mask=cm)
    if bad > 0:
        tl.store(flag_ptr, 1)


def check_flag_triton(named: list[tuple[str, torch.Tensor]],
                      cameras: tuple[torch.Tensor, torch.Tensor] | None = None,
                      bounds: Sequence[tuple] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of ``_check_kernel``: (flag [1] int64, 0 when every check passed; camera centres [C, 3] or
    None). Every ``bounds`` entry names a tensor of ``named`` (its range applies to that slot)."""
    if not 1 <= len(named) <= MAX_SLOTS:
        raise ValueError(f"the check kernel takes 1 to {MAX_SLOTS} tensors, got {len(named)}")
    ranges = {name: (lo, hi) for name, _t, lo, hi, _hint in bounds}
    if not set(ranges) <= {name for name, _ in named}:
        raise ValueError(f"bounds {sorted(set(ranges) - {name for name, _ in named})} name no checked tensor")
    dev = named[0][1].device
    ts = [t.detach().contiguous() for _, t in named]
    lo, hi = [-float("inf")] * len(ts), [float("inf")] * len(ts)
    for i, (name, _) in enumerate(named):
        if name in ranges:
            lo[i] = float(ranges[name][0])
            hi[i] = float(ranges[name][1]) if ranges[name][1] is not None else hi[i]
    pad = MAX_SLOTS - len(ts)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    if cameras is not None:
        view, Ks = (t.detach().contiguous() for t in cameras)
        C = view.shape[0]
        centres = torch.empty((C, 3), dtype=torch.float32, device=dev)
    else:
        view = Ks = centres = ts[0]
        C = 0
    grid = (max(1, -(-max(t.numel() for t in ts) // BLOCK)),)
    _check_kernel[grid](*ts, *ts[:1] * pad, *(t.numel() for t in ts), *[0] * pad, *lo, *[0.0] * pad, *hi,
                        *[0.0] * pad, view, Ks, C, centres, flag, NT=len(ts), CAMERAS=cameras is not None,
                        BLOCK=BLOCK, CB=CAM_BLOCK, num_warps=NUM_WARPS)
    return flag, (centres if cameras is not None else None)


def gaussian_bounds(scales: torch.Tensor, opacities: torch.Tensor) -> list[tuple]:
    """The ranges the API documents: linear scales >= 0, opacities in [0, 1] (bounds for ``check_finite``).
    Log-scales or logits passed by mistake are the usual way to break them, so the message says so."""
    return [("scales", scales, 0.0, None, "linear scales, exp of the log-scales"),
            ("opacities", opacities, 0.0, 1.0, "after the sigmoid")]


def input_flag(named: list[tuple[str, torch.Tensor]], cameras: tuple[torch.Tensor, torch.Tensor] | None = None,
               bounds: Sequence[tuple] = ()) -> torch.Tensor:
    """A 0-d bool tensor, True when every tensor of ``named`` is finite, the cameras' values are sound and each
    ``bounds`` entry (name, tensor, low, high or None, hint) is in its range; no host sync. One reduction per
    tensor: a sum is NaN or inf whenever an element is (it may also overflow on huge finite values, so a
    non-finite sum is confirmed element by element before anything is raised)."""
    sums = torch.stack([t.detach().sum(dtype=torch.float32) for _, t in named])
    ok = torch.isfinite(sums).all()
    if cameras is not None:
        ok = ok & ~camera_problems(*cameras)
    for _, t, lo, hi, _ in bounds:
        ok = ok & _in_range_mask(t.detach(), lo, hi).all()
    return ok


def raise_input_problem(named: list[tuple[str, torch.Tensor]],
                        cameras: tuple[torch.Tensor, torch.Tensor] | None = None, bounds: Sequence[tuple] = ()) -> None:
    """ValueError naming what :func:`input_flag` found: the first tensor with a NaN or inf and its first bad
    index, the camera value that is wrong, or a value out of its documented range. Returns if nothing is."""
    if cameras is not None:
        raise_camera_problem(*cameras)
    for name, t in named:
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            raise ValueError(f"{name} has a non-finite value ({t[tuple(idx)].item()}) at index {idx}")
    for name, t, lo, hi, hint in bounds:
        bad = ~_in_range_mask(t.detach(), lo, hi)
        if bool(bad.any()):
            idx = bad.nonzero()[0].tolist()
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{name} must be {want} ({hint}), got {t[tuple(idx)].item()} at index {idx}")


def check_finite(named: list[tuple[str, torch.Tensor]], cameras: tuple[torch.Tensor, torch.Tensor] | None = None,
                 bounds: Sequence[tuple] = ()) -> None:
    """The checks read now (one host sync), and on failure the ValueError of :func:`raise_input_problem`."""
    DeferredCheck(named, cameras, bounds).resolve()


class DeferredCheck:
    """Input checks launched now and read with a later host sync the caller makes anyway (``rasterize``: the
    intersection count), so a render makes one sync, not two. Until :meth:`resolve` the outputs computed from
    the inputs may hold NaN; nothing sized from them is allocated before it.

    ``flag``: [1] int64, 0 when every check passed. ``centres``: the cameras' centres [C, 3] the kernel computed
    (no gradient), None on the torch path."""

    def __init__(self, named: list[tuple[str, torch.Tensor]],
                 cameras: tuple[torch.Tensor, torch.Tensor] | None = None, bounds: Sequence[tuple] = ()) -> None:
        self.args = (named, cameras, bounds)
        if use_triton(*(t for _, t in named)):
            self.flag, self.centres = check_flag_triton(named, cameras, bounds)
        else:
            self.flag, self.centres = (~input_flag(named, cameras, bounds)).to(torch.int64).reshape(1), None

    @property
    def ok(self) -> torch.Tensor:
        """A 0-d bool tensor: True when every check passed (reading it is a host sync)."""
        return self.flag[0] == 0

    def resolve(self, ok: bool | None = None) -> None:
        """Raise the checks' ValueError unless ``ok`` (the flag's value, read by the caller) is true; ``ok=None``
        reads the flag here (a host sync of its own)."""
        if ok is None:
            ok = bool(self.ok)
        if not ok:  # a flag raised by an overflowing sum of finite values finds nothing to name: no error
            raise_input_problem(*self.args)


def _in_range_mask(t: torch.Tensor, lo: float, hi: float | None) -> torch.Tensor:
    """lo <= t (<= hi); NaN is out of range (it is reported as non-finite first)."""
    return (t >= lo) if hi is None else (t >= lo) & (t <= hi)
