"""The light timed window: device times from a window traced by CUPTI alone, operators from the detail window.

On CUDA the capture (``trace.py``) runs two profiled windows of the same calls. The *detail* window records
everything the attribution reads (operator records, module and iteration ranges, NVTX, CUDA events per module)
and costs the host the most. The *timed* window runs under the CUDA activity alone (runtime calls and device
work; no operator records, no hooks), so its CUDA events are the ones compared with the plain run and its device
timeline is the one the analysis reads.

:func:`transfer` joins them. Device work is grouped by the launch call that queued it (a kernel launch, a copy, a
graph launch with every kernel it replays) and the groups are put in launch order. Every iteration of the detail
window (its ``warpforge:iter`` ranges) must launch the same sequence of groups (launch call name and device work
names), and the timed window, after its pad (the GPU sleep ``trace._window_ms`` queues in front of both loops),
must launch exactly that sequence once per iteration. Then each detail launch is replaced by its timed twin (the
call's host span and the device work it queued), and every other detail host span (operators, module and iteration
ranges, syncs) is placed on the timed window's clock by linear interpolation between the matched launch calls
around it. Attribution and the time split then read one coherent timeline: which operator launched what from the
detail window, when the host launched it and when and how long the device ran it from the timed one. Where the
host was between two launches (what a host-bound gap is blamed on) is the detail window's order of spans, scaled
to the timed window's pace: an estimate, exact at every launch.

Anything else (a different sequence, a different count, device work with no launch record, launch calls that
overlap across threads) returns no trace and says why: the caller keeps the detail window whole.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field, replace

from warpforge.profile.events import ITER_ANNOTATION, GpuEvent, HostSpan, Trace, is_launch, iteration_load, normalize

PAD_KERNEL = "spin_kernel"  # torch.cuda._sleep's kernel: at::cuda::(anonymous namespace)::spin_kernel(long)


@dataclass(frozen=True)
class Group:
    """One launch call and the device work it queued, in device order."""

    launch: HostSpan
    work: tuple[GpuEvent, ...]

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """What must agree between the windows: the call's name and the names of its work (a graph's kernels
        sorted, since branches of a graph on several streams may start in another order)."""
        return self.launch.name, tuple(sorted(g.name for g in self.work))

    @property
    def is_pad(self) -> bool:
        return any(PAD_KERNEL in g.name for g in self.work)


@dataclass
class Transfer:
    """The merged trace (None when the windows did not match), what was done or why not, and what the timed
    window traced per iteration."""

    trace: Trace | None
    note: str
    load: dict[str, float] = field(default_factory=dict)


def groups(trace: Trace) -> tuple[list[Group], list[GpuEvent]]:
    """Launch groups in launch order, and the device work no launch call in the trace queued."""
    launch: dict[int, HostSpan] = {}
    for s in trace.host:
        if s.kind == "runtime" and s.correlation is not None and is_launch(s.name):
            if s.correlation not in launch or s.ts_us < launch[s.correlation].ts_us:
                launch[s.correlation] = s
    work: dict[int, list[GpuEvent]] = defaultdict(list)
    orphans: list[GpuEvent] = []
    for g in trace.gpu:
        if g.correlation is not None and g.correlation in launch:
            work[g.correlation].append(g)
        else:
            orphans.append(g)
    out = [Group(launch[c], tuple(sorted(ws, key=lambda g: g.ts_us))) for c, ws in work.items()]
    out.sort(key=lambda gr: (gr.launch.ts_us, gr.launch.correlation))
    return out, orphans


class Warp:
    """A non-decreasing piecewise-linear map from one window's host clock to the other's, through anchor points
    (detail time, timed time); outside the anchors, a shift by the nearest one."""

    def __init__(self, points: list[tuple[float, float]]):
        if not points:
            raise ValueError("a warp needs at least one anchor point")
        self.xs = [x for x, _ in points]
        self.ys = [y for _, y in points]

    def __call__(self, t: float) -> float:
        xs, ys = self.xs, self.ys
        i = bisect.bisect_right(xs, t)
        if i == 0:
            return t + ys[0] - xs[0]
        if i == len(xs):
            return t + ys[-1] - xs[-1]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (t - x0) * (y1 - y0) / (x1 - x0)


def fallback(why: str) -> Transfer:
    """No merged trace: the detail window stands, and the note says why."""
    return Transfer(None, f"light window not used ({why}): times, busy and idle are the detail window's "
                          "(operator records and module hooks on), and so is the overhead reported")


def _iterations(host: list[HostSpan]) -> list[tuple[float, float]]:
    return sorted((s.ts_us, s.end_us) for s in host if s.kind == "annotation" and s.name == ITER_ANNOTATION)


def transfer(detail: Trace, timed: Trace) -> Transfer:
    """The detail window's host spans on the timed window's clock, with the timed window's launches and device
    work (see the module docstring), or no trace and the reason."""
    host = normalize(detail.host)
    iters = _iterations(host)
    if not iters:
        return fallback("the detail window has no iteration ranges")
    n = len(iters)
    starts = [a for a, _ in iters]

    def iteration(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts < iters[i][1] else None

    d_groups, d_orphans = groups(Trace(host=host, gpu=detail.gpu, device_type="cuda"))
    t_end = max([iters[-1][1]] + [g.end_us for gr in d_groups if iteration(gr.launch.ts_us) is not None
                                  for g in gr.work])
    lost = [g for g in d_orphans if iters[0][0] <= g.ts_us < t_end]
    if lost:
        return fallback(f"{len(lost)} device events of the detail window have no launch record")
    per_iter: list[list[Group]] = [[] for _ in range(n)]
    for gr in d_groups:
        it = iteration(gr.launch.ts_us)
        if it is not None:
            per_iter[it].append(gr)
    seq = [gr.key for gr in per_iter[0]]
    if not seq:
        return fallback("the detail window's first iteration launched no device work")
    for i, grs in enumerate(per_iter[1:], start=1):
        if [gr.key for gr in grs] != seq:
            return fallback(f"the detail window's iterations launch different work ({len(grs)} launches in "
                            f"iteration {i + 1}, {len(seq)} in the first, or other kernels)")
    d_pads = [gr for gr in d_groups if gr.is_pad and gr.launch.end_us <= iters[0][0]]
    if not d_pads:
        return fallback("no GPU sleep in front of the detail window's iterations")
    d_pad = d_pads[-1]

    t_groups, t_orphans = groups(timed)
    if not t_groups:
        return fallback("the timed window's trace holds no launch calls with device work (runtime API records)")
    pad_at = [i for i, gr in enumerate(t_groups) if gr.is_pad]
    if not pad_at:
        return fallback("no GPU sleep in front of the timed window's iterations")
    t_pad = t_groups[pad_at[-1]]
    measured = t_groups[pad_at[-1] + 1:]
    if any(g.ts_us >= t_pad.work[0].ts_us for g in t_orphans):
        return fallback("device work in the timed window has no launch record")
    k = len(seq)
    if len(measured) != n * k:
        return fallback(f"the timed window launched {len(measured)} times in {n} iterations, the detail window "
                        f"{k} times per iteration")
    for j, gr in enumerate(measured):
        if gr.key != seq[j % k]:
            (dn, dk), (tn, tk) = seq[j % k], gr.key
            what = f"{tn} vs {dn}" if tn != dn else f"{', '.join(tk) or '-'} vs {', '.join(dk) or '-'}"
            return fallback(f"launch {j % k + 1} of iteration {j // k + 1} differs between the windows: {what}")

    pairs = [(d_pad, t_pad)] + [(d, t) for i in range(n) for d, t in zip(per_iter[i], measured[i * k:(i + 1) * k])]
    # Both ends of every matched launch call are anchors. They must rise together in both windows (calls of one
    # thread do not overlap); then no other span can slip inside a timed launch call and be read as its child.
    points = sorted(p for d, t in pairs
                    for p in ((d.launch.ts_us, t.launch.ts_us), (d.launch.end_us, t.launch.end_us)))
    if any(x1 <= x0 or y1 <= y0 for (x0, y0), (x1, y1) in zip(points, points[1:])):
        return fallback("launch calls overlap or tie (launches from several threads, or zero-length records), so "
                        "no one clock maps the windows")
    warp = Warp(points)

    anchor = {id(d.launch): t.launch for d, t in pairs}
    lo, hi = d_pad.launch.ts_us, iters[-1][1]
    merged: list[HostSpan] = []
    for s in host:
        twin = anchor.get(id(s))
        if twin is not None:
            merged.append(replace(twin, tid=s.tid))
        elif s.end_us > lo and s.ts_us < hi:
            a = warp(s.ts_us)
            merged.append(replace(s, ts_us=a, dur_us=max(warp(s.end_us) - a, 0.0), correlation=None))
    gpu = [g for _, t in pairs for g in t.work]
    trace = Trace(host=merged, gpu=gpu, device_type="cuda")
    # What the timed window traced per iteration: its own runtime calls inside the iterations (placed as above).
    w_iters = [s for s in merged if s.kind == "annotation" and s.name == ITER_ANNOTATION]
    rt = [s for s in timed.host if s.kind == "runtime"]
    load = iteration_load(Trace(host=w_iters + rt, gpu=gpu, device_type="cuda"))
    note = (f"times from the light window (CUDA activity alone, no operator records or module hooks): its "
            f"{k} launch{'es' if k > 1 else ''} per iteration x {n} iterations matched by name, in launch order, "
            "to the detail window's, whose operator and module ranges say what launched them")
    return Transfer(trace, note, load)
