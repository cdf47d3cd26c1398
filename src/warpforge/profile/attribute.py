"""From a trace to operator instances: which module ran which operator, and which device work it launched.

Host spans on each thread nest (an aten op inside a module range, a launch call inside an op), so
a stack sweep gives every span its parent. Walking down from the roots, an operator *instance* is
the outermost op in a module's scope that the FLOP counter saw for that module (``aten::linear``
under inference mode, ``aten::addmm`` under no_grad), or, where the counter saw nothing beneath,
the outermost op itself (ranges that are not aten operators but wrap some, such as a compiled region, are
looked through). A launch call inside an instance links (by correlation id) the kernels,
copies and memsets it queued to that instance. Launches outside any op are instances of their own:
``cudaGraphLaunch`` (every kernel the graph replays: attributed to the graph's launch site) and
driver launches (Triton kernels started from Python: labelled ``triton::<kernel>``).

Instances are then matched to the counted records of the same (module, operator) in call order, so
each carries its FLOPs and bytes; a count mismatch falls back to the average and says so.

Kernels replayed from a CUDA graph have no operator around them in the window. The counted call (the
eager twin of the graph, ``count_fn``) says which kernels each of its operators launched (``Counts.kernels``
when it was traced on the GPU; a Triton launch always names its own kernel), so replayed kernels are
matched one-to-one, per kernel name in launch order, to the counted operators not already seen eagerly
in the window: each becomes an instance of that operator (its module, FLOPs and bytes). Where a name's
counts differ, each of its kernels gets the average of that name's counted work; names the counted call
never launched stay with the graph's launch site.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from warpforge.profile.events import (ITER_ANNOTATION, GpuEvent, HostSpan, Trace, is_launch, module_of_annotation,
                                      normalize)
from warpforge.profile.flops import Counts, OpCount

GRAPH_LABEL = "cuda_graph_replay"
_RANK = {"annotation": 0, "op": 1, "runtime": 2}  # tie-break for spans starting together: outer first


@dataclass
class Work:
    """FLOPs and bytes of one instance (possibly averaged), with the ceiling's precision key."""

    flops: float
    bytes: float
    ceiling: str | None
    kind: str
    shapes: str = ""


@dataclass
class Instance:
    """One operator call in the measured window."""

    module: str
    label: str  # "aten::addmm", "triton::_copy_kernel", GRAPH_LABEL, ...
    iteration: int
    ts_us: float
    host_us: float  # inclusive host duration of the op (of the launch call for bare launches)
    gpu: list[GpuEvent] = field(default_factory=list)
    graph: bool = False
    work: Work | None = None

    @property
    def gpu_us(self) -> float:
        return sum(g.dur_us for g in self.gpu)


@dataclass
class Attribution:
    instances: list[Instance]
    iterations: list[tuple[float, float]]  # host [start, end) of each measured iteration
    unattributed: list[GpuEvent]  # device work in the window with no launch record
    launch_of: dict[int, HostSpan]  # correlation -> the launch call
    main_tid: int | str | None
    notes: list[str]


def _nest(spans: list[HostSpan]) -> tuple[list[HostSpan], list[int]]:
    """Spans of all threads sorted, with each one's parent index (-1: a root) from a stack sweep."""
    by_tid: dict = defaultdict(list)
    for s in spans:
        by_tid[s.tid].append(s)
    ordered: list[HostSpan] = []
    parent: list[int] = []
    for tid in by_tid:
        group = sorted(by_tid[tid], key=lambda s: (s.ts_us, -s.dur_us, _RANK[s.kind]))
        stack: list[int] = []
        for s in group:
            # A span belongs inside the top of the stack if it starts before that one ends (start-based,
            # so a child ending a rounding error after its parent still nests).
            while stack and ordered[stack[-1]].end_us <= s.ts_us:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            ordered.append(s)
            stack.append(len(ordered) - 1)
    return ordered, parent


def _iterations(spans: list[HostSpan]) -> list[tuple[float, float]]:
    iters = sorted((s.ts_us, s.end_us) for s in spans if s.kind == "annotation" and s.name == ITER_ANNOTATION)
    if iters:
        return iters
    if not spans:
        return []
    return [(min(s.ts_us for s in spans), max(s.end_us for s in spans))]


def attribute(trace: Trace, records: list[OpCount] | None = None,
              kernels_of: Callable[[int], list[str]] | None = None) -> Attribution:
    """Operator instances of the measured iterations, each with its device work and counted work.
    ``kernels_of(i)``: the kernel names counted record ``i`` launched (default: a Triton record's own kernel,
    as ``Counts.kernels_of`` gives when the counted call was not traced)."""
    records = records or []
    notes: list[str] = []
    host = normalize(trace.host)
    iters = _iterations(host)
    starts = [a for a, _ in iters]

    def iteration(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 and ts < iters[i][1] else None

    spans, parent = _nest(host)
    children: list[list[int]] = [[] for _ in spans]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    counted: dict[str, set[str]] = defaultdict(set)
    for r in records:
        counted[r.module].add(r.op)

    # countable_below[i]: a counted op of the same module scope lies strictly beneath span i.
    countable_below = [False] * len(spans)
    module_at = [""] * len(spans)
    for i, s in enumerate(spans):  # parents precede children in `spans`, so one pass assigns modules
        m = module_of_annotation(s.name) if s.kind == "annotation" else None
        module_at[i] = m if m is not None else (module_at[parent[i]] if parent[i] >= 0 else "")
    for i in range(len(spans) - 1, -1, -1):  # children follow parents: a reverse pass is bottom-up
        p = parent[i]
        if p >= 0 and spans[p].kind == "op" and module_at[p] == module_at[i]:
            if countable_below[i] or (spans[i].kind == "op" and spans[i].name in counted[module_at[i]]):
                countable_below[p] = True

    instances: list[Instance] = []
    inst_of_corr: dict[int, Instance] = {}
    launch_of: dict[int, HostSpan] = {}
    iter_tids: set = {s.tid for s in spans if s.kind == "annotation" and s.name == ITER_ANNOTATION}

    def launches_under(i: int, inst: Instance) -> None:
        todo = [i]
        while todo:
            j = todo.pop()
            s = spans[j]
            if s.kind == "runtime" and s.correlation is not None:
                inst_of_corr[s.correlation] = inst
                launch_of[s.correlation] = s
                if "GraphLaunch" in s.name:
                    inst.graph = True
            todo.extend(children[j])

    todo = [i for i, p in enumerate(parent) if p < 0]
    while todo:
        i = todo.pop()
        s = spans[i]
        it = iteration(s.ts_us)
        if s.kind == "annotation" or (s.kind == "op" and it is None):
            todo.extend(children[i])
            continue
        if it is None:  # a launch outside the measured iterations (profiler warm-up): not ours
            if s.correlation is not None:
                launch_of[s.correlation] = s
            continue
        m = module_at[i]
        if s.kind == "op":
            # A range that is not an aten operator but wraps operators (a compiled region, a user
            # record_function) is looked through, so its kernels keep their own rows.
            wrapper = not s.name.startswith("aten::") and any(spans[c].kind == "op" for c in children[i])
            if s.name in counted[m] or not (countable_below[i] or wrapper):
                inst = Instance(module=m, label=s.name, iteration=it, ts_us=s.ts_us, host_us=s.dur_us)
                instances.append(inst)
                launches_under(i, inst)
            else:
                todo.extend(children[i])
        elif s.correlation is not None and is_launch(s.name):  # a bare launch (graph, Triton, extension)
            graph = "GraphLaunch" in s.name
            inst = Instance(module=m, label=GRAPH_LABEL if graph else s.name, iteration=it, ts_us=s.ts_us,
                            host_us=s.dur_us, graph=graph)
            instances.append(inst)
            inst_of_corr[s.correlation] = inst
            launch_of[s.correlation] = s

    # Device work: to its instance; work whose launch is outside the window is dropped; work with no
    # launch record at all (CUPTI lost it, or another process) is kept if it runs inside the window.
    t0 = iters[0][0] if iters else float("-inf")
    t1 = max((g.end_us for g in trace.gpu), default=float("-inf"))
    t1 = max(t1, iters[-1][1]) if iters else t1
    unattributed: list[GpuEvent] = []
    bare_named: set[int] = set()
    for g in sorted(trace.gpu, key=lambda g: g.ts_us):
        inst = inst_of_corr.get(g.correlation) if g.correlation is not None else None
        if inst is not None:
            inst.gpu.append(g)
            launch = launch_of.get(g.correlation)
            if (launch is not None and not inst.graph and id(inst) not in bare_named
                    and inst.label == launch.name and g.kind == "kernel"):
                # A bare launch is named by what it launched; driver-API launches (cuLaunchKernel*, not
                # the runtime's cudaLaunchKernel) are Triton's.
                driver = launch.name.startswith("cu") and not launch.name.startswith("cuda")
                inst.label = f"triton::{g.name}" if driver else g.name
                bare_named.add(id(inst))
        elif (g.correlation is None or g.correlation not in launch_of) and t0 <= g.ts_us < t1:
            unattributed.append(g)
    if unattributed:
        notes.append(f"{len(unattributed)} device events in the window have no launch record; "
                     "they count in the time split but in no operator row")
    notes.extend(_match(instances, records, len(iters)))
    if any(i.graph for i in instances):
        notes.extend(map_replayed(instances, records, kernels_of or Counts(records=records).kernels_of, launch_of,
                                  max(len(iters), 1)))
    main = next(iter(iter_tids)) if len(iter_tids) == 1 else None
    return Attribution(instances=instances, iterations=iters, unattributed=unattributed, launch_of=launch_of,
                       main_tid=main, notes=notes)


def _match(instances: list[Instance], records: list[OpCount], n_iters: int) -> list[str]:
    """Give each instance the counted work of its (module, op), in call order within an iteration."""
    by_key: dict[tuple[str, str], list[OpCount]] = defaultdict(list)
    for r in records:
        by_key[(r.module, r.op)].append(r)
    groups: dict[tuple[str, str, int], list[Instance]] = defaultdict(list)
    for inst in instances:
        groups[(inst.module, inst.label, inst.iteration)].append(inst)
    mismatched: set[tuple[str, str]] = set()
    for (m, op, _it), insts in groups.items():
        recs = by_key.get((m, op))
        if not recs:
            continue
        insts.sort(key=lambda x: x.ts_us)
        if len(insts) == len(recs):
            for inst, r in zip(insts, recs):
                inst.work = Work(r.flops, r.bytes, r.ceiling, r.kind, r.shapes)
        else:  # the window ran this op a different number of times than the counted call
            mismatched.add((m, op))
            f = sum(r.flops for r in recs) / len(insts)
            b = sum(r.bytes for r in recs) / len(insts)
            for inst in insts:
                inst.work = Work(f, b, recs[0].ceiling, recs[0].kind, recs[0].shapes)
    if not mismatched:
        return []
    shown = ", ".join(f"{m or '(root)'}/{op}" for m, op in sorted(mismatched)[:5])
    return [f"{len(mismatched)} operators ran a different number of times per iteration than in the counted call "
            f"({shown}{', ...' if len(mismatched) > 5 else ''}): their FLOPs and bytes are averaged over calls"]


def map_replayed(instances: list[Instance], records: list[OpCount], kernels_of: Callable[[int], list[str]],
                 launch_of: dict[int, HostSpan], n_iters: int) -> list[str]:
    """Move kernels replayed from CUDA graphs onto instances of the counted operators that launched them
    (see the module docstring); ``instances`` is extended in place. Returns the notes that say how."""
    replayed = [(inst, g) for inst in instances if inst.graph for g in inst.gpu
                if g.correlation is not None and "GraphLaunch" in getattr(launch_of.get(g.correlation), "name", "")]
    if not replayed:
        return []
    seen_eagerly = {(i.module, i.label) for i in instances if not i.graph}
    captured: dict[str, list[tuple[int, float]]] = defaultdict(list)  # kernel -> (record, share of its work)
    for idx, r in enumerate(records):
        names = kernels_of(idx) if (r.module, r.op) not in seen_eagerly else []
        for k in names:
            captured[k].append((idx, 1.0 / len(names)))
    by_name: dict[tuple[int, str], list[tuple[Instance, GpuEvent]]] = defaultdict(list)
    for inst, g in sorted(replayed, key=lambda p: p[1].ts_us):
        by_name[(inst.iteration, g.name)].append((inst, g))

    exact: dict[tuple[int, int], Instance] = {}  # (iteration, record) -> its instance
    averaged: list[Instance] = []
    off: dict[str, tuple[int, int]] = {}  # kernel -> (replayed per iteration, counted)
    moved: set[int] = set()
    for (it, name), pairs in by_name.items():
        eager = captured.get(name)
        if not eager:
            continue
        if len(eager) == len(pairs):
            for (_inst, g), (idx, share) in zip(pairs, eager):
                r = records[idx]
                tgt = exact.get((it, idx))
                if tgt is None:
                    tgt = exact[(it, idx)] = Instance(module=r.module, label=r.op, iteration=it, ts_us=g.ts_us,
                                                      host_us=0.0, graph=True,
                                                      work=Work(0.0, 0.0, r.ceiling, r.kind, r.shapes))
                tgt.gpu.append(g)
                tgt.work.flops += share * r.flops
                tgt.work.bytes += share * r.bytes
                moved.add(id(g))
            continue
        off[name] = (len(pairs), len(eager))
        flops = sum(share * records[idx].flops for idx, share in eager) / len(pairs)
        nbytes = sum(share * records[idx].bytes for idx, share in eager) / len(pairs)
        ops = {(records[idx].module, records[idx].op) for idx, _ in eager}
        module, op = next(iter(ops)) if len(ops) == 1 else (pairs[0][0].module, GRAPH_LABEL)
        r0 = records[eager[0][0]]
        for _inst, g in pairs:
            averaged.append(Instance(module=module, label=op, iteration=it, ts_us=g.ts_us, host_us=0.0, gpu=[g],
                                     graph=True, work=Work(flops, nbytes, r0.ceiling, r0.kind, r0.shapes)))
            moved.add(id(g))
    for inst in instances:
        if inst.graph:
            inst.gpu = [g for g in inst.gpu if id(g) not in moved]
    instances.extend(exact.values())
    instances.extend(averaged)

    per = len(replayed) / n_iters
    n_exact = sum(len(i.gpu) for i in exact.values()) / n_iters
    n_avg = len(averaged) / n_iters
    rest = per - n_exact - n_avg
    if not n_exact and not n_avg:
        return [f"{per:g} kernels per iteration were replayed from CUDA graphs and none is a kernel the counted call "
                f"launched: they stay with the graph's launch site ({GRAPH_LABEL}), time only; pass count_fn, an "
                "eager twin of the replayed step, to place them"]
    parts = [f"{per:g} kernels per iteration were replayed from CUDA graphs: {n_exact:g} matched one-to-one (by kernel "
             "name, in launch order) to the counted call's operators that launched them, with their module, "
             "FLOPs and bytes"]
    if off:
        shown = ", ".join(f"{short_name(k)} {a:g} replayed vs {b:g} counted" for k, (a, b) in sorted(off.items())[:4])
        parts.append(f"{n_avg:g} of {len(off)} kernel name{'s' if len(off) > 1 else ''} whose counts differ "
                     f"({shown}{', ...' if len(off) > 4 else ''}) get the average of that name's counted work")
    if rest > 0:
        parts.append(f"{rest:g} the counted call never launched stay under {GRAPH_LABEL}, time only")
    return ["; ".join(parts)]


def short_name(kernel: str, width: int = 48) -> str:
    """A kernel name cut for a note (full names carry template and parameter lists)."""
    return kernel if len(kernel) <= width else kernel[: width - 1] + "…"
