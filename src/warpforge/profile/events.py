"""The events the analysis works on, and the parser from a Kineto (Chrome/Perfetto) trace.

Kineto's export is the same JSON that Perfetto, chrome://tracing and Holistic Trace Analysis read:
``{"traceEvents": [{"ph": "X", "cat": ..., "name": ..., "ts": us, "dur": us, "tid": ..., "args": {...}}]}``.
Host side: ``cpu_op`` (aten operators), ``user_annotation`` (record_function ranges: our module and
iteration ranges), ``cuda_runtime``/``cuda_driver`` (launch calls, with ``args.correlation``). Device
side: ``kernel``, ``gpu_memcpy``, ``gpu_memset``, with the same ``correlation`` as the call that
queued them; kernels replayed from a CUDA graph carry the correlation of the ``cudaGraphLaunch``.
GPU timestamps are already on the host clock. The analysis takes these dataclasses, so tests can
build synthetic timelines directly.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

ITER_ANNOTATION = "warpforge:iter"
MODULE_PREFIX = "module:"
COUNT_PREFIX = "warpforge:count#"  # one range per operator call of the counting pass: "warpforge:count#17"

HOST_KINDS = ("op", "annotation", "runtime")
GPU_KINDS = ("kernel", "memcpy", "memset")
_HOST_CATS = {"cpu_op": "op", "user_annotation": "annotation", "cuda_runtime": "runtime", "cuda_driver": "runtime"}
_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def module_annotation(path: str, root_type: str) -> str:
    """The range a module's forward runs in: "module:layer1.0", the root "module:(ResNet)"."""
    return MODULE_PREFIX + (path or f"({root_type})")


def module_of_annotation(name: str) -> str | None:
    """"module:layer1.0" -> "layer1.0"; "module:(ResNet)" (the root) -> ""; other names -> None."""
    if not name.startswith(MODULE_PREFIX):
        return None
    path = name[len(MODULE_PREFIX):]
    return "" if path.startswith("(") and path.endswith(")") else path


@dataclass(frozen=True)
class Span:
    """A named range on the trace's clock (the host's: device timestamps are already on it)."""

    name: str
    kind: str  # HOST_KINDS or GPU_KINDS
    ts_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


@dataclass(frozen=True)
class HostSpan(Span):
    """A host-side range: an aten operator, a record_function annotation, or a runtime/driver call."""

    tid: int | str = 0
    correlation: int | None = None  # runtime/driver calls: links to the device work they queued


@dataclass(frozen=True)
class GpuEvent(Span):
    """Device work: a kernel, a memcpy or a memset."""

    stream: int | str = 0
    device: int = 0
    correlation: int | None = None
    bytes: int | None = None  # memcpy/memset size as CUPTI reports it


@dataclass
class Trace:
    """One profiled window: host spans on every thread and device events on every stream."""

    host: list[HostSpan] = field(default_factory=list)
    gpu: list[GpuEvent] = field(default_factory=list)
    device_type: str = "cpu"  # "cuda" when device events were recorded

    def __post_init__(self) -> None:
        for s in self.host:
            if s.kind not in HOST_KINDS:
                raise ValueError(f"host span {s.name!r}: kind must be one of {HOST_KINDS}, got {s.kind!r}")
            if s.dur_us < 0:
                raise ValueError(f"host span {s.name!r}: negative duration {s.dur_us}")
        for g in self.gpu:
            if g.kind not in GPU_KINDS:
                raise ValueError(f"gpu event {g.name!r}: kind must be one of {GPU_KINDS}, got {g.kind!r}")
            if g.dur_us < 0:
                raise ValueError(f"gpu event {g.name!r}: negative duration {g.dur_us}")


def is_annotation(s: HostSpan) -> bool:
    """Our module and iteration ranges count as annotations whatever category the profiler gave them."""
    return s.kind == "annotation" or s.name == ITER_ANNOTATION or s.name.startswith(MODULE_PREFIX)


def normalize(spans: list[HostSpan]) -> list[HostSpan]:
    """Spans with our ranges re-kinded as annotations (the fast record function reports cpu_op)."""
    return [s if s.kind == "annotation" or not is_annotation(s) else replace(s, kind="annotation") for s in spans]


def is_launch(name: str) -> bool:
    """Runtime/driver calls that queue device work (not syncs, event records or queries)."""
    return "Launch" in name or "Memcpy" in name or "Memset" in name


def work_in_ranges(trace: Trace, prefix: str = COUNT_PREFIX) -> dict[int, list[str]]:
    """Device work queued inside each ``<prefix><n>`` range: n -> names of the kernels, copies and memsets
    it launched, in device order. The counting pass wraps every operator call in such a range, so this says
    which kernels each counted operator launched (what a CUDA graph captured of it, when one is replayed)."""
    ranges: dict = defaultdict(list)  # tid -> [(start, end, n)]
    for s in trace.host:
        if s.name.startswith(prefix):
            n = _int(s.name[len(prefix):])
            if n is not None:
                ranges[s.tid].append((s.ts_us, s.end_us, n))
    for v in ranges.values():
        v.sort()
    starts = {tid: [r[0] for r in v] for tid, v in ranges.items()}
    range_of_corr: dict[int, int] = {}
    for s in trace.host:
        if s.kind != "runtime" or s.correlation is None or not is_launch(s.name) or s.tid not in ranges:
            continue
        # The innermost range holding the launch: the latest-starting one that has not ended. Ranges
        # rarely nest (the counter runs each operator with itself switched off; a Triton launch inside a
        # custom operator does), so the walk back is short.
        rs = ranges[s.tid]
        i = bisect.bisect_right(starts[s.tid], s.ts_us) - 1
        for j in range(i, max(i - 64, -1), -1):
            if s.ts_us < rs[j][1]:
                range_of_corr[s.correlation] = rs[j][2]
                break
    out: dict[int, list[str]] = defaultdict(list)
    for g in sorted(trace.gpu, key=lambda g: g.ts_us):
        n = range_of_corr.get(g.correlation) if g.correlation is not None else None
        if n is not None:
            out[n].append(g.name)
    return dict(out)


def iteration_load(trace: Trace) -> dict[str, float]:
    """What the profiler recorded per measured iteration (its host cost grows with each): operator
    records, runtime/driver calls, launches, kernels replayed from CUDA graphs and the host time of the
    graph launches (CUPTI traces every replayed kernel, which it pays for at the launch)."""
    host = normalize(trace.host)
    iters = sorted((s.ts_us, s.end_us) for s in host if s.kind == "annotation" and s.name == ITER_ANNOTATION)
    if not iters:
        return {}
    starts = [a for a, _ in iters]

    def inside(ts: float) -> bool:
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts < iters[i][1]

    out = {"host_ops": 0.0, "runtime_calls": 0.0, "launches": 0.0, "graph_launches": 0.0,
           "graph_launch_host_us": 0.0, "graph_kernels": 0.0}
    graph_corr: set[int] = set()
    for s in host:
        if not inside(s.ts_us):
            continue
        if s.kind == "op":
            out["host_ops"] += 1
        elif s.kind == "runtime":
            out["runtime_calls"] += 1
            if is_launch(s.name):
                out["launches"] += 1
            if "GraphLaunch" in s.name:
                out["graph_launches"] += 1
                out["graph_launch_host_us"] += s.dur_us
                if s.correlation is not None:
                    graph_corr.add(s.correlation)
    out["graph_kernels"] = float(sum(1 for g in trace.gpu if g.correlation in graph_corr))
    return {k: v / len(iters) for k, v in out.items()}


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def parse_kineto(data: dict[str, Any], device_type: str | None = None) -> Trace:
    """A :class:`Trace` from a Kineto trace dict (``json.load`` of ``export_chrome_trace``).

    ``device_type`` defaults to "cuda" when the trace holds device events, else "cpu"."""
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("not a Kineto/Chrome trace: no traceEvents list")
    host: list[HostSpan] = []
    gpu: list[GpuEvent] = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        args = e.get("args") or {}
        ts, dur = e.get("ts"), e.get("dur", 0)
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            continue
        if cat in _HOST_CATS:
            host.append(HostSpan(name=str(e.get("name", "")), kind=_HOST_CATS[cat], ts_us=float(ts),
                                 dur_us=max(float(dur), 0.0), tid=e.get("tid", 0),
                                 correlation=_int(args.get("correlation"))))
        elif cat in _GPU_CATS:
            gpu.append(GpuEvent(name=str(e.get("name", "")), kind=_GPU_CATS[cat], ts_us=float(ts),
                                dur_us=max(float(dur), 0.0), stream=args.get("stream", e.get("tid", 0)),
                                device=_int(args.get("device", e.get("pid", 0))) or 0,
                                correlation=_int(args.get("correlation")), bytes=_int(args.get("bytes"))))
    return Trace(host=normalize(host), gpu=gpu, device_type=device_type or ("cuda" if gpu else "cpu"))
