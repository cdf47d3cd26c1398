"""Pure arithmetic of a training step's breakdown: intervals in, exclusive phase times out.

A step is recorded as spans on one clock (host nanoseconds on CPU, milliseconds from the step's first
CUDA event on a GPU): top-level phases (``data``, ``h2d``, ``forward``, ``backward``, ``optimizer``),
synchronous collectives nested in them (the host is blocked: all of it is exposed), and asynchronous
collectives (DDP's bucket all-reduces, run beside the backward pass). Each instant of the step goes to
exactly one part, so the parts add up to the step time by construction and ``other`` is what no
recorded phase covered (Python between phases, launch gaps, the step's final synchronisation).

An asynchronous collective is *overlapped* while backward compute is still running and *exposed* once
the last gradient bucket has been handed over and the host only waits for the reductions to land. The
last bucket's hand-over time stands in for the end of backward compute: after it autograd has no
gradient left to produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PHASES = ("data", "h2d", "forward", "backward", "optimizer")
PARTS = (*PHASES, "comm_exposed", "other")
COMM_KINDS = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter", "reduce_scatter",
              "broadcast", "alltoall", "sendrecv")


@dataclass
class StepRecord:
    """One step's spans on one clock (any unit; ``unit_ms`` converts to milliseconds)."""

    start: float
    end: float
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (phase, t0, t1), top level
    sync_comm: list[tuple[str, float, float, int]] = field(default_factory=list)  # (op, t0, t1, bytes)
    async_comm: list[tuple[str, float, float, int]] = field(default_factory=list)  # (op, issued, landed, bytes)
    unit_ms: float = 1e-6  # host nanoseconds by default


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted, non-empty intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def intersect_len(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two interval sets."""
    xs, ys = union(xs), union(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(rec: StepRecord) -> dict[str, Any]:
    """The step's exclusive parts in ms (``PARTS`` plus ``comm_overlapped``, which overlaps others and is not
    part of the sum), the step time, and the collectives' count and bytes."""
    u = rec.unit_ms
    step = rec.end - rec.start
    out = {k: 0.0 for k in PARTS}
    sync = [(a, b) for _op, a, b, _n in rec.sync_comm]
    asyn = union([(a, b) for _op, a, b, _n in rec.async_comm])
    # Exposed asynchronous communication: after the last hand-over, inside the phase that waits for it.
    exposed_async: list[tuple[float, float]] = []
    if rec.async_comm:
        last_issue = max(a for _op, a, _b, _n in rec.async_comm)
        waiting = [p for p in rec.phases if p[1] <= last_issue <= p[2]]
        hi = waiting[0][2] if waiting else rec.end
        exposed_async = clip(asyn, last_issue, hi)
    exposed = union(sync + exposed_async)
    covered = 0.0
    for name, a, b in rec.phases:
        inside = length(clip(exposed, a, b))
        out[name] += (b - a - inside) * u
        covered += b - a
    out["comm_exposed"] = length(clip(exposed, rec.start, rec.end)) * u
    # Collectives outside every phase still count as exposed; what is left is "other".
    in_phases = sum(length(clip(exposed, a, b)) for _n, a, b in rec.phases)
    out["other"] = max(0.0, step - covered - (length(clip(exposed, rec.start, rec.end)) - in_phases)) * u
    overlapped = length(clip(asyn, rec.start, rec.end)) - length(clip(exposed_async, rec.start, rec.end))
    comm = rec.sync_comm + rec.async_comm
    return {"step_ms": step * u, **out, "comm_overlapped": max(0.0, overlapped) * u,
            "collectives": len(comm), "comm_bytes": sum(n for *_x, n in comm)}


def is_comm_kernel(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in COMM_KINDS)


def split_device_comm(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """From device kernels ``(name, start, end)`` of a traced window: communication kernels' time split into
    overlapped with compute kernels and exposed (no compute kernel running), in the input's unit."""
    comm = [(a, b) for n, a, b in kernels if is_comm_kernel(n)]
    compute = [(a, b) for n, a, b in kernels if not is_comm_kernel(n)]
    total = length(comm)
    over = intersect_len(comm, compute)
    return {"comm": total, "overlapped": over, "exposed": total - over, "compute": length(compute)}


def aggregate(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of each part over the steps, each part's share of the mean step, and the step's spread."""
    if not steps:
        raise ValueError("aggregate: no steps")
    n = len(steps)
    keys = ("step_ms", *PARTS, "comm_overlapped")
    mean = {k: sum(s[k] for s in steps) / n for k in keys}
    times = sorted(s["step_ms"] for s in steps)
    total = mean["step_ms"]
    parts_sum = sum(mean[k] for k in PARTS)
    return {"mean": mean, "share": {k: (mean[k] / total if total > 0 else 0.0) for k in (*PARTS, "comm_overlapped")},
            "steps": n, "median_step_ms": times[n // 2], "min_step_ms": times[0], "max_step_ms": times[-1],
            "parts_sum_ms": parts_sum, "parts_error": abs(parts_sum - total) / total if total > 0 else 0.0,
            "collectives": sum(s["collectives"] for s in steps) / n,
            "comm_bytes": sum(s["comm_bytes"] for s in steps) / n}


def memory_phases(params: int, grads: dict[str, int], opt_state: dict[str, int], activations: int) -> dict[str, Any]:
    """Bytes live at each phase of a step, estimated from tensor sizes, and where the peak falls.

    ``grads`` / ``opt_state``: bytes present at the start of the step and after backward / after the
    optimizer. Forward holds its saved activations at its end; backward frees them as gradients appear,
    so its high point is taken as ``max(activations, gradients)`` on top of what persists; the optimizer
    holds parameters, gradients and its state."""
    g0, g1 = grads.get("start", 0), grads.get("backward", 0)
    s0, s1 = opt_state.get("start", 0), opt_state.get("optimizer", 0)
    phases = {
        "forward": {"parameters": params, "gradients": g0, "optimizer_state": s0, "activations": activations},
        "backward": {"parameters": params, "gradients": g1, "optimizer_state": s0,
                     "activations": max(0, activations - g1) if activations > g1 else 0},
        "optimizer": {"parameters": params, "gradients": g1, "optimizer_state": s1, "activations": 0},
    }
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    return {"phases": phases, "totals": totals, "peak_phase": peak_phase, "peak_bytes": totals[peak_phase],
            "split": phases[peak_phase]}
