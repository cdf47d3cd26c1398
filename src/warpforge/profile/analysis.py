"""The analysis: a pure function from a trace (+ counted work, ceilings, launch cost) to the picture.

* operator rows (module, op) and kernel rows, per iteration: time, share, FLOPs, bytes, arithmetic
  intensity, achieved TFLOP/s and GB/s, and their place on the roofline of the measured ceilings
  (fraction of the roof, memory- or compute-bound);
* the window's time split (``timeline.py``): compute, memory copies, communication, idle, idle split
  into host-bound and launch gaps, kernels shorter than the launch cost;
* findings in plain words (``findings.py``).

The rows and the Analysis it returns are defined in ``result.py``, which the findings read too.

On a CPU run there are no device events: rows carry host time and the roofline is omitted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from warpforge.hw.roofline import Ceilings, roofline
from warpforge.profile.attribute import Attribution, Instance, attribute
from warpforge.profile.events import Trace
from warpforge.profile.findings import findings_for, verdict_for
from warpforge.profile.flops import Counts
from warpforge.profile.result import Analysis, LaunchCost, Row
from warpforge.profile.timeline import TimeSplit, split_time

DEFAULT_LAUNCH_US = 5.0


def launch_cost(device_name: str | None = None) -> LaunchCost:
    """The eager launch cost `warpforge probe` measured on this device, else 5 us (and says so)."""
    from warpforge.hw.probe import load_cached

    try:
        cached = load_cached(device_name)
    except Exception:  # no CUDA device to name: the fallback applies
        cached = None
    us = (cached or {}).get("launch", {}).get("eager_us") if isinstance(cached, dict) else None
    if isinstance(us, (int, float)) and us > 0:
        return LaunchCost(float(us), f"probe ({cached.get('time', 'cached')})")
    return LaunchCost(DEFAULT_LAUNCH_US, f"default {DEFAULT_LAUNCH_US:g} us (no probe cache for this device; "
                                         "run `warpforge probe`)")


def short_kernel_name(name: str, width: int = 80) -> str:
    """A readable kernel name: no return type, namespaces or parameter list; template arguments kept
    (they name the functor: ``vectorized_elementwise_kernel<4, AddFunctor<float>>``)."""
    s = re.sub(r"^void\s+", "", name.strip())
    if s.endswith(")"):  # drop the trailing top-level parameter list
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i]
                break
    s = s.replace("(anonymous namespace)::", "")
    s = re.sub(r"\b[A-Za-z_]\w*::", "", s)
    return s if len(s) <= width else s[: width - 1] + "…"


def place(row: Row, ceil: Ceilings | None) -> None:
    """Fill a row's achieved rates and roofline placement from its work and time (per iteration)."""
    if row.time_us <= 0 or row.bytes is None:
        return
    sec = row.time_us * 1e-6
    row.GBps = row.bytes / sec / 1e9
    if row.flops:
        row.tflops = row.flops / sec / 1e12
        row.intensity = row.flops / row.bytes if row.bytes else None
    if ceil is None or (row.flops and row.ceiling is None) or (not row.flops and not row.bytes):
        return
    r = roofline(float(row.flops or 0.0), float(row.bytes), row.ceiling or "fp32", row.time_us * 1e-3, ceil)
    row.floor_us, row.fraction, row.bound = r["floor_ms"] * 1e3, r["fraction"], r["bound"]


def _op_rows(att: Attribution, n: int, on_gpu: bool) -> list[Row]:
    groups: dict[tuple[str, str], list[Instance]] = defaultdict(list)
    for inst in att.instances:
        groups[(inst.module, inst.label)].append(inst)
    rows = []
    for (m, op), insts in groups.items():
        t = sum(i.gpu_us for i in insts) if on_gpu else sum(i.host_us for i in insts)
        if t <= 0:
            continue
        worked = [i.work for i in insts if i.work is not None]
        w0 = worked[0] if worked else None
        kern: dict[str, float] = defaultdict(float)
        for i in insts:
            for g in i.gpu:
                kern[g.name] += g.dur_us
        rows.append(Row(
            name=f"{m or '(root)'} / {op}", module=m, op=op, kind=w0.kind if w0 else "—",
            calls=len(insts) / n, time_us=t / n, share=0.0, host_us=sum(i.host_us for i in insts) / n,
            flops=sum(w.flops for w in worked) / n if worked else None,
            bytes=sum(w.bytes for w in worked) / n if worked else None,
            ceiling=w0.ceiling if w0 else None, graph=any(i.graph for i in insts),
            launched=[short_kernel_name(k, 60) for k, _ in sorted(kern.items(), key=lambda kv: -kv[1])[:3]]))
    return rows


def _kernel_rows(att: Attribution, n: int) -> list[Row]:
    groups: dict[str, list[tuple[Instance | None, Any]]] = defaultdict(list)
    for inst in att.instances:
        for g in inst.gpu:
            if g.kind == "kernel":
                groups[g.name].append((inst, g))
    for g in att.unattributed:
        if g.kind == "kernel":
            groups[g.name].append((None, g))
    rows = []
    for name, pairs in groups.items():
        # A kernel carries its operator's work only when that operator call launched it alone.
        solo = [inst.work for inst, _ in pairs if inst is not None and inst.work is not None and len(inst.gpu) == 1]
        have = len(solo) == len(pairs)
        ops: dict[str, float] = defaultdict(float)
        for inst, g in pairs:
            ops[f"{inst.module or '(root)'} / {inst.label}" if inst else "(no launch record)"] += g.dur_us
        rows.append(Row(
            name=short_kernel_name(name), module=None, op=name,
            kind=solo[0].kind if have and solo else ("triton" if any(
                inst is not None and inst.label.startswith("triton::") for inst, _ in pairs) else "kernel"),
            calls=len(pairs) / n, time_us=sum(g.dur_us for _, g in pairs) / n, share=0.0,
            flops=sum(w.flops for w in solo) / n if have else None,
            bytes=sum(w.bytes for w in solo) / n if have else None,
            ceiling=solo[0].ceiling if have and solo else None,
            graph=any(inst is not None and inst.graph for inst, _ in pairs),
            launched=[k for k, _ in sorted(ops.items(), key=lambda kv: -kv[1])[:3]]))
    return rows


def _share(rows: list[Row]) -> list[Row]:
    total = sum(r.time_us for r in rows) or 1.0
    for r in rows:
        r.share = r.time_us / total
    return sorted(rows, key=lambda r: -r.time_us)


def analyze(trace: Trace, counts: Counts | None = None, *, ceilings: Ceilings | None = None,
            launch: LaunchCost | None = None) -> Analysis:
    """The whole picture of one window. ``ceilings`` None (or a CPU trace): no roofline placement."""
    counts = counts or Counts()
    att = attribute(trace, counts.records, counts.kernels_of)
    n = len(att.iterations)
    if n == 0:
        raise ValueError("empty window: the trace has no events (nothing ran between the profiler's start and stop)")
    on_gpu = trace.device_type == "cuda"
    notes = list(att.notes)
    ceil = ceilings if on_gpu else None
    if not on_gpu:
        notes.append("CPU run: times are host timers of each operator; the roofline is omitted "
                     "(no GPU ceilings apply)")
    elif ceil is None:
        notes.append("no ceilings given: the roofline is omitted")
    launch = launch if on_gpu else None
    ops = _share(_op_rows(att, n, on_gpu))
    kernels = _share(_kernel_rows(att, n)) if on_gpu else []
    for r in ops + kernels:
        place(r, ceil)
    if on_gpu and not att.instances and not att.unattributed and not any(g for g in trace.gpu):
        raise ValueError("empty window: no device work was recorded in the measured iterations")
    if not ops and not kernels:
        raise ValueError("empty window: no operator ran in the measured iterations "
                         "(does the callable run any torch operators?)")
    split = split_time(trace, att, ops, launch.us if launch else None)
    totals = _totals(counts, split, ops, ceil, n)
    if counts.error:
        notes.append(f"FLOP counting stopped early ({counts.error}): rows without FLOPs show time only")
    if any(r.op.startswith("triton::") for r in counts.records):
        notes.append("Triton kernels launched from Python count the bytes of their tensor arguments (an upper bound "
                     "for a kernel that reads part of a buffer, such as a paged KV cache) and FLOPs only for GEMMs "
                     "(integer M, N, K arguments) or kernels that declare launch_metadata")
    uncounted = dict(counts.uncounted.most_common())
    if uncounted:
        shown = ", ".join(f"{k} x{v}" for k, v in list(uncounted.items())[:8])
        notes.append(f"{sum(uncounted.values())} calls of {len(uncounted)} operators have no FLOP formula and count "
                     f"0 FLOPs (their bytes still count): {shown}")
    if launch is not None:
        notes.append(f"launch cost {launch.us:.2f} us from {launch.source}")
    a = Analysis(device_type=trace.device_type, iterations=n, ops=ops, kernels=kernels, split=split,
                 totals=totals, launch=launch, ceilings=ceil.as_dict() if ceil else None, findings=[],
                 verdict="", notes=notes, uncounted=uncounted)
    a.findings = findings_for(a, trace, att)
    a.verdict = verdict_for(a)
    return a


def _totals(counts: Counts, split: TimeSplit, ops: list[Row], ceil: Ceilings | None, n: int) -> dict[str, Any]:
    """Per-iteration totals and the whole-model point: counted work over the window's time."""
    t = {"window_us": split.window_us, "flops": float(counts.flops), "bytes": float(counts.bytes),
         "op_time_us": sum(r.time_us for r in ops), "records": len(counts.records)}
    model = Row(name="whole model", module="", op="(model)", kind="model", calls=1.0, time_us=split.window_us,
                share=1.0, flops=float(counts.flops), bytes=float(counts.bytes) if counts.records else None,
                ceiling=_dominant_ceiling(ops))
    place(model, ceil)
    t["model"] = model.as_dict()
    return t


def _dominant_ceiling(ops: list[Row]) -> str:
    """The precision of the compute roof that most of the FLOP-carrying time runs against."""
    by: dict[str, float] = defaultdict(float)
    for r in ops:
        if r.flops and r.ceiling:
            by[r.ceiling] += r.time_us
    return max(by, key=by.get) if by else "fp32"
