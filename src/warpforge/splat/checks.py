"""Value checks shared by the public splat functions: NaN and inf, camera values and the documented ranges of
the Gaussians' parameters, all in one host sync (``rasterize`` runs them every call)."""

from __future__ import annotations

import torch

from warpforge.splat.camera import camera_problems, raise_camera_problem


def gaussian_bounds(scales: torch.Tensor, opacities: torch.Tensor) -> list[tuple]:
    """The ranges the API documents: linear scales >= 0, opacities in [0, 1] (bounds for ``check_finite``).
    Log-scales or logits passed by mistake are the usual way to break them, so the message says so."""
    return [("scales", scales, 0.0, None, "linear scales, exp of the log-scales"),
            ("opacities", opacities, 0.0, 1.0, "after the sigmoid")]


def check_finite(named: list[tuple[str, torch.Tensor]], cameras: tuple[torch.Tensor, torch.Tensor] | None = None,
                 bounds: list[tuple] = ()) -> None:
    """ValueError naming the first tensor with a NaN or inf and its first bad index, or (with ``cameras``) the
    camera value that is wrong, or (``bounds``: (name, tensor, low, high or None, hint)) a value out of its
    documented range. The common case costs one reduction per tensor and one host sync for all of them: a sum
    is NaN or inf whenever an element is (it may also overflow on huge finite values, so a non-finite sum is
    confirmed element by element before anything is raised)."""
    sums = torch.stack([t.detach().sum(dtype=torch.float32) for _, t in named])
    ok = torch.isfinite(sums).all()
    if cameras is not None:
        ok = ok & ~camera_problems(*cameras)
    for _, t, lo, hi, _ in bounds:
        ok = ok & _in_range_mask(t.detach(), lo, hi).all()
    if bool(ok):
        return
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


def _in_range_mask(t: torch.Tensor, lo: float, hi: float | None) -> torch.Tensor:
    """lo <= t (<= hi); NaN is out of range (it is reported as non-finite first)."""
    return (t >= lo) if hi is None else (t >= lo) & (t <= hi)
