"""Where the window's time went: compute, memory copies, communication and idle, per iteration.

Busy time is the union of device intervals over all streams (overlap counts once). Each idle gap is
split by the launch of the work that ends it: while that work had not been queued yet (its launch
call had not returned) the GPU was waiting on the host — *host-bound*; once queued, the rest of the
gap is the GPU's own latency between queued work — a *launch gap*. Kernels shorter than the host's
launch cost are counted with the gaps in front of them: that pair is what a CUDA graph removes.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from warpforge.profile.attribute import Attribution
from warpforge.profile.events import ITER_ANNOTATION, GpuEvent, HostSpan, Trace, module_of_annotation, normalize

STRIP_MAX = 4000  # intervals kept for the report's one-iteration timeline strip


@dataclass
class TimeSplit:
    """Per-iteration microseconds (counts per iteration) of one window."""

    window_us: float
    busy_us: float | None = None
    compute_us: float | None = None
    memory_us: float | None = None  # memcpy / memset
    comm_us: float | None = None  # NCCL kernels
    overlap_us: float | None = None  # categories running at once
    idle_us: float | None = None
    idle_host_us: float | None = None
    idle_launch_us: float | None = None
    kernels: float | None = None
    short_threshold_us: float | None = None
    short_kernels: float | None = None
    short_kernel_us: float | None = None
    short_gap_us: float | None = None  # idle gaps that end in a short kernel
    bound_us: dict[str, float] = field(default_factory=dict)  # op time by roofline bound
    host_gaps: list[dict[str, Any]] = field(default_factory=list)  # host-bound idle by what the host was in
    syncs: dict[str, float] = field(default_factory=dict)  # "cudaStreamSynchronize in aten::item" -> per iter
    ops_us: float | None = None  # CPU run: time inside operators
    overhead_us: float | None = None  # CPU run: time between operators (Python, dispatch)
    strip: list[list] = field(default_factory=list)  # one iteration: [start_us, dur_us, category]

    @property
    def short_window_share(self) -> float:
        if not self.window_us or self.short_kernel_us is None:
            return 0.0
        return (self.short_kernel_us + (self.short_gap_us or 0.0)) / self.window_us

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["short_window_share"] = self.short_window_share
        return d


def _category(g: GpuEvent) -> str:
    if g.kind in ("memcpy", "memset"):
        return "memory"
    return "comm" if "nccl" in g.name.lower() else "compute"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


class HostIndex:
    """The innermost host span covering a time on a thread."""

    def __init__(self, spans: list[HostSpan]):
        self.by_tid: dict = defaultdict(list)
        for s in spans:
            self.by_tid[s.tid].append(s)
        for v in self.by_tid.values():
            v.sort(key=lambda s: (s.ts_us, -s.dur_us))
        self.starts = {t: [s.ts_us for s in v] for t, v in self.by_tid.items()}

    def at(self, tid, t: float, kinds: tuple[str, ...] = ("op", "annotation", "runtime")) -> HostSpan | None:
        spans = self.by_tid.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t) - 1
        for j in range(i, max(i - 2000, -1), -1):  # nested spans start later: the first cover is innermost
            s = spans[j]
            if s.end_us > t and s.kind in kinds:
                return s
        return None


def split_time(trace: Trace, att: Attribution, ops: list, launch_us: float | None) -> TimeSplit:
    n = max(len(att.iterations), 1)
    if trace.device_type != "cuda":
        window = sum(b - a for a, b in att.iterations)
        inside = sum(i.host_us for i in att.instances)
        return TimeSplit(window_us=window / n, ops_us=inside / n, overhead_us=max(window - inside, 0.0) / n)

    events = sorted([g for i in att.instances for g in i.gpu] + att.unattributed, key=lambda g: g.ts_us)
    t0 = att.iterations[0][0] if att.iterations else (events[0].ts_us if events else 0.0)
    if events:
        # Device work queued before the window and still running when its first iteration starts (the GPU
        # sleep that gives the host its head start, trace._window_ms) holds the GPU: the window's device
        # time starts when that work ends, not earlier, and never after the window's own first work.
        ids = {id(g) for g in events}
        held = [g.end_us for g in trace.gpu if id(g) not in ids and g.ts_us <= events[0].ts_us and g.end_us > t0]
        if held:
            t0 = min(max(held), events[0].ts_us)
    # The window ends when both the host's last iteration and the device's last work have ended.
    t1 = max([g.end_us for g in events] + ([att.iterations[-1][1]] if att.iterations else []), default=t0)
    by_cat: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for g in events:
        a, b = max(g.ts_us, t0), min(g.end_us, t1)
        if b > a:
            by_cat[_category(g)].append((a, b))
    busy = _union([iv for v in by_cat.values() for iv in v])
    cat_us = {c: _length(_union(by_cat.get(c, []))) for c in ("compute", "memory", "comm")}
    window = t1 - t0
    busy_us = _length(busy)
    gaps = _gaps(t0, t1, busy, events, att)
    idle_host = sum(h for _, _, h, _ in gaps)
    idle = window - busy_us

    kernels = [g for g in events if g.kind == "kernel"]
    thr = launch_us
    short = [g for g in kernels if thr is not None and g.dur_us < thr]
    short_ids = {id(g) for g in short}
    short_gap = sum(g1 - g0 for g0, g1, _, nxt in gaps if nxt is not None and id(nxt) in short_ids)

    bound: dict[str, float] = defaultdict(float)
    for r in ops:
        bound[r.bound or "unplaced"] += r.time_us
    host = HostIndex(normalize(trace.host))
    return TimeSplit(
        window_us=window / n, busy_us=busy_us / n, compute_us=cat_us["compute"] / n, memory_us=cat_us["memory"] / n,
        comm_us=cat_us["comm"] / n, overlap_us=max(sum(cat_us.values()) - busy_us, 0.0) / n, idle_us=idle / n,
        idle_host_us=idle_host / n, idle_launch_us=max(idle - idle_host, 0.0) / n, kernels=len(kernels) / n,
        short_threshold_us=thr, short_kernels=len(short) / n if thr is not None else None,
        short_kernel_us=sum(g.dur_us for g in short) / n if thr is not None else None,
        short_gap_us=short_gap / n if thr is not None else None, bound_us=dict(bound),
        host_gaps=_host_waits(gaps, host, att, n), syncs=_syncs(trace, att, host, n), strip=_strip(att, gaps))


def _gaps(t0: float, t1: float, busy: list[tuple[float, float]], events: list[GpuEvent],
          att: Attribution) -> list[tuple[float, float, float, GpuEvent | None]]:
    """Idle gaps as (start, end, host-bound part, the device event that ends the gap)."""
    starts = [g.ts_us for g in events]
    out = []
    edges = [t0] + [x for iv in busy for x in iv] + [t1]
    for g0, g1 in zip(edges[0::2], edges[1::2]):
        if g1 <= g0:
            continue
        k = bisect.bisect_left(starts, g1 - 1e-9)
        nxt = events[k] if k < len(events) else None
        launch = att.launch_of.get(nxt.correlation) if nxt is not None and nxt.correlation is not None else None
        if nxt is None:  # after the last device work: the host was still finishing the iteration
            host_part = g1 - g0
        elif launch is None:  # no launch record: cannot blame the host
            host_part = 0.0
        else:
            host_part = min(max(launch.end_us - g0, 0.0), g1 - g0)
        out.append((g0, g1, host_part, nxt))
    return out


def _host_waits(gaps: list, host: HostIndex, att: Attribution, n: int) -> list[dict[str, Any]]:
    """Host-bound idle grouped by what the main thread was running in the middle of each wait."""
    waits: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for g0, _g1, h, _nxt in gaps:
        if h <= 0:
            continue
        mid = g0 + h / 2
        during = None
        if att.main_tid is not None:
            during = host.at(att.main_tid, mid, kinds=("op",)) or host.at(att.main_tid, mid, kinds=("annotation",))
        key = _doing(during)
        waits[key][0] += h
        waits[key][1] += 1
    return [{"host_was_in": k, "us": v[0] / n, "gaps": v[1] / n}
            for k, v in sorted(waits.items(), key=lambda kv: -kv[1][0])[:5]]


def _doing(s: HostSpan | None) -> str:
    """What the host was running, in words: an op's name, else Python inside a module or between ops."""
    if s is None or s.name == ITER_ANNOTATION:
        return "Python between operators"
    m = module_of_annotation(s.name)
    if m is not None:
        return f"Python in module {m or '(root)'}"
    return s.name


def _syncs(trace: Trace, att: Attribution, host: HostIndex, n: int) -> dict[str, float]:
    """Blocking host-device syncs inside the measured iterations, by the operator that issued them."""
    if not att.iterations:
        return {}
    t0, t1 = att.iterations[0][0], att.iterations[-1][1]
    c: Counter[str] = Counter()
    for s in trace.host:
        if s.kind != "runtime" or not (t0 <= s.ts_us < t1):
            continue
        if "Synchronize" in s.name or s.name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyDtoH"):
            op = host.at(s.tid, s.ts_us, kinds=("op",))
            c[f"{s.name} in {op.name}" if op else s.name] += 1
    return {k: v / n for k, v in c.most_common(8)}


def _strip(att: Attribution, gaps: list) -> list[list]:
    """The last measured iteration's device timeline: busy intervals by category and idle gaps by cause."""
    if not att.instances:
        return []
    last = max(i.iteration for i in att.instances)
    evs = sorted((g for i in att.instances if i.iteration == last for g in i.gpu), key=lambda g: g.ts_us)
    if not evs:
        return []
    a, b = evs[0].ts_us, max(g.end_us for g in evs)
    out: list[list] = []
    for g in evs:
        cat = _category(g)
        if out and out[-1][2] == cat and g.ts_us <= out[-1][0] + out[-1][1] + 1e-9:
            out[-1][1] = max(out[-1][1], g.end_us - out[-1][0])  # merge touching work of one category
        else:
            out.append([g.ts_us, g.dur_us, cat])
    for g0, g1, h, _ in gaps:
        if g0 >= a and g1 <= b:
            if h > 0:
                out.append([g0, h, "idle-host"])
            if g1 - g0 - h > 0:
                out.append([g0 + h, g1 - g0 - h, "idle-launch"])
    out.sort(key=lambda x: x[0])
    if len(out) > STRIP_MAX:  # keep the picture, not every sliver
        out = sorted(out, key=lambda x: -x[1])[:STRIP_MAX]
        out.sort(key=lambda x: x[0])
    return [[round(s - a, 3), round(d, 3), c] for s, d, c in out]
