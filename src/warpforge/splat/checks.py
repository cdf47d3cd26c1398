"""Value checks shared by the public splat functions: NaN and inf, camera values and the documented ranges of
the Gaussians' parameters, all read in one host sync (``rasterize`` runs them every call and reads them with
its intersection count, the sync it makes anyway)."""

from __future__ import annotations

import torch

from warpforge.splat.camera import camera_problems, raise_camera_problem


def gaussian_bounds(scales: torch.Tensor, opacities: torch.Tensor) -> list[tuple]:
    """The ranges the API documents: linear scales >= 0, opacities in [0, 1] (bounds for ``check_finite``).
    Log-scales or logits passed by mistake are the usual way to break them, so the message says so."""
    return [("scales", scales, 0.0, None, "linear scales, exp of the log-scales"),
            ("opacities", opacities, 0.0, 1.0, "after the sigmoid")]


def input_flag(named: list[tuple[str, torch.Tensor]], cameras: tuple[torch.Tensor, torch.Tensor] | None = None,
               bounds: list[tuple] = ()) -> torch.Tensor:
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
                        cameras: tuple[torch.Tensor, torch.Tensor] | None = None, bounds: list[tuple] = ()) -> None:
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
                 bounds: list[tuple] = ()) -> None:
    """:func:`input_flag` read now (one host sync), and on failure the ValueError of
    :func:`raise_input_problem`."""
    if not bool(input_flag(named, cameras, bounds)):
        raise_input_problem(named, cameras, bounds)


class DeferredCheck:
    """Input checks launched now and read with a later host sync the caller makes anyway (``rasterize``: the
    intersection count), so a render makes one sync, not two. Until :meth:`resolve` the outputs computed from
    the inputs may hold NaN; nothing sized from them is allocated before it."""

    def __init__(self, named: list[tuple[str, torch.Tensor]],
                 cameras: tuple[torch.Tensor, torch.Tensor] | None = None, bounds: list[tuple] = ()) -> None:
        self.args = (named, cameras, bounds)
        self.ok = input_flag(named, cameras, bounds)

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
