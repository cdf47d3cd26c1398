"""Timing harness: CUDA events with a cold L2, CUDA-graph replay, a host timer on CPU.

Every measurement is a list of per-call samples summarized by the median with p20/p80 and the
IQR, never a mean (one preempted repeat would drag it). On the GPU:

* warm-up calls first (autotuning, lazy module loads, allocator growth happen there, untimed);
* one ``torch.cuda.Event`` pair per repeat around the call alone;
* between repeats, a buffer of at least twice the L2 is read (outside the events) so that
  inputs written by the previous repeat are not served from L2: a cached input would flatter
  exactly the memory-bound kernels we care about. Read, not written: see ``_flush_l2``;
* before each repeat a GPU sleep (``torch.cuda._sleep``) longer than the host's time to issue one
  call is enqueued, so the GPU never runs dry waiting for Python: otherwise a short kernel behind
  a slow launcher (a Triton launcher costs ~20-40 us of host time) is timed together with the
  host latency that its start event waited out: short decode GEMVs would all read the host's
  latency floor, whatever the kernel did. ``hide_host=False`` keeps the host
  in (for measuring launch cost itself);
* ``cuda_graph=True`` captures several back-to-back calls in one graph and times replays: for
  launch-bound work the CPU launch cost would otherwise be what we measure. Only the first call
  of a replay sees a cold L2, so this mode reports steady-state back-to-back time, which is what
  a captured decode step sees.

On CPU the host clock (``time.perf_counter_ns``) times each call; there is no flush.

**Stability** (:func:`time_stable`, what the suites use): the interleaved samples of each callable are
cut into ``rounds`` consecutive rounds (every round holds every callable, round-robin). A callable is
stable when its round medians agree within ``NOISE_BOUND`` (max / min) and its p80 / p20 is within it
too. If any callable is not, everything is timed again (``retries`` times); if that does not settle it,
the result says ``noisy`` and keeps the spreads, so a reader sees how far to trust it. The per-round
medians also give each ratio its interval (``results.ratio.same_work_ratio``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+: on 3.10 it is only named in annotations, never evaluated
    from typing import Unpack

# Fallback flush size when the driver does not report the L2 size (larger than any current L2 x 2).
_FALLBACK_FLUSH_BYTES = 256 << 20
# Calls captured per graph: amortizes the graph-launch cost (~a few us) over several calls.
GRAPH_CALLS = 10
# The stated bound for a timing to count as stable: round medians within 10% of each other (max / min)
# and p80 / p20 within 10%. On an idle H200 kernel timings spread 1-3%; host-bound calls on a busy host
# spread 2x (a compiled model's calls at 0.89 and 1.77 ms within one block), which is what it catches.
NOISE_BOUND = 1.10
ROUNDS = 3
RETRIES = 1

_flush_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (2x L2 of zeros, the sum's output)


@dataclass(frozen=True)
class Timing:
    """Summary of one timed callable; all times in milliseconds per call."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    iqr_ms: float  # p75 - p25
    min_ms: float
    n: int  # number of samples
    method: str  # "cuda_event", "cuda_graph" or "host", "+l2flush-read" when the L2 was flushed, "+hostpad" (see above)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Timing.n must be >= 1, got {self.n}")
        if not (self.min_ms <= self.p20_ms <= self.median_ms <= self.p80_ms):
            raise ValueError(f"Timing percentiles out of order: {self}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The q-th quantile (0 <= q <= 1) of already-sorted samples, by linear interpolation.

    Same definition as numpy's default ("linear"): position h = (n - 1) q between order statistics.
    """
    if not sorted_samples:
        raise ValueError("percentile of an empty sample list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    h = (len(sorted_samples) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_samples) - 1)
    a, b = sorted_samples[lo], sorted_samples[hi]
    # Clamped so rounding can never put a lower quantile above a higher one (Timing checks the order).
    return min(max(a + (h - lo) * (b - a), a), b)


def summarize(samples_ms: Sequence[float], method: str) -> Timing:
    """Median, p20, p80, IQR (p75 - p25) and min of per-call samples in milliseconds."""
    s = sorted(float(x) for x in samples_ms)
    if not s:
        raise ValueError("summarize needs at least one sample")
    if not all(math.isfinite(x) and x >= 0 for x in s):
        raise ValueError(f"samples must be finite and non-negative, got {list(samples_ms)[:8]}...")
    return Timing(
        median_ms=percentile(s, 0.5),
        p20_ms=percentile(s, 0.2),
        p80_ms=percentile(s, 0.8),
        iqr_ms=percentile(s, 0.75) - percentile(s, 0.25),
        min_ms=s[0],
        n=len(s),
        method=method,
    )


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be cuda or cpu, got {dev}")
    return dev


def flush_bytes(device: torch.device) -> int:
    """Bytes read per flush: twice the device's L2 (so no line of the previous repeat survives)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return 2 * l2 if l2 > 0 else _FALLBACK_FLUSH_BYTES


def _flush_l2(device: torch.device) -> None:
    """Evict the L2 by *reading* 2x its size. A flush that writes (a memset) leaves up to a whole L2
    of dirty lines, and the timed kernel pays for writing them back as it evicts them (a read-only
    kernel then reads well under the bandwidth the profiler shows for it; notes/harness.md has the
    figures). Clean lines evict free."""
    # Allocated once per device and reused: allocating 100+ MiB per repeat would time the allocator.
    bufs = _flush_buffers.get(device.index)
    if bufs is None:
        bufs = (torch.zeros(flush_bytes(device) // 4, dtype=torch.float32, device=device),
                torch.empty((), dtype=torch.float32, device=device))
        _flush_buffers[device.index] = bufs
    torch.sum(bufs[0], dim=0, out=bufs[1])


def _check_counts(warmup: int, rep: int) -> None:
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if rep < 1:
        raise ValueError(f"rep must be >= 1, got {rep}")


@contextlib.contextmanager
def own_cublas_workspace() -> Iterator[None]:
    """Around a CUDA-graph capture: drop cuBLAS's cached workspaces before and after it (as torch.compile's
    cudagraph trees do). torch.cuda.graph captures every graph on one shared stream, and cuBLAS keeps one
    workspace per (handle, stream): without this, the workspace allocated in the first capture's private
    pool is baked into every later graph, outliving the graph that owns it. That ended in an
    "unspecified launch failure" (ViT-B/16 b32): the fused-linear tactic choice captures and
    drops a graph per layer, then the model's graph and torch.compile's ran on that memory. Cleared, each
    capture allocates its own workspace in its own pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()
    try:
        yield
    finally:
        if clear is not None and torch.cuda.is_available():
            clear()


def capture_graph(fn: Callable[[], Any], device: torch.device, warmup: int, calls: int = 1) -> torch.cuda.CUDAGraph:
    """Warm fn up on a side stream (as capture requires), then capture ``calls`` back-to-back calls."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with own_cublas_workspace(), torch.cuda.graph(graph):  # captures on torch's shared capture stream
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - re-raised with the reason capture usually fails
        raise RuntimeError(
            f"CUDA-graph capture failed ({type(e).__name__}: {e}); the callable must not synchronize "
            "with the host (.item(), .cpu(), printing tensors) or change shapes between calls"
        ) from e
    torch.cuda.synchronize(device)
    return graph


class SampleOptions(TypedDict, total=False):
    """How :func:`interleaved_samples` takes its samples (its defaults apply to what is left out):
    :func:`time_interleaved` and :func:`time_stable` pass these through."""

    warmup: int
    rep: int
    flush_l2: bool
    cuda_graph: bool
    device: torch.device | str | int | None
    graph_calls: int
    hide_host: bool


def interleaved_samples(fns: dict[str, Callable[[], Any]], *, warmup: int = 10, rep: int = 50, flush_l2: bool = True,
                        cuda_graph: bool = False, device: torch.device | str | int | None = None,
                        graph_calls: int = GRAPH_CALLS, hide_host: bool = True) -> tuple[dict[str, list[float]], str]:
    """Per-call samples (ms) of every callable in the order they were taken, and the method."""
    if not fns:
        raise ValueError("time_interleaved needs at least one callable")
    _check_counts(warmup, rep)
    dev = _resolve_device(device)
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    order = [names[(i + j) % len(names)] for i in range(rep) for j in range(len(names))]

    if dev.type == "cpu":
        for name in names:
            for _ in range(warmup):
                fns[name]()
        for name in order:
            t0 = time.perf_counter_ns()
            fns[name]()
            samples[name].append((time.perf_counter_ns() - t0) / 1e6)
        return samples, "host"

    if graph_calls < 1:
        raise ValueError(f"graph_calls must be >= 1, got {graph_calls}")
    with torch.cuda.device(dev):
        if cuda_graph:
            graphs = {n: capture_graph(fns[n], dev, warmup, graph_calls) for n in names}
            calls: dict[str, Callable[[], Any]] = {n: graphs[n].replay for n in names}
            per_sample = graph_calls
        else:
            for name in names:
                for _ in range(warmup):
                    fns[name]()
            calls, per_sample = fns, 1
        torch.cuda.synchronize(dev)
        pad = _host_pad_cycles(calls, names, dev) if hide_host else 0
        events = [(name, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for name in order]
        for name, start, end in events:
            if pad:
                torch.cuda._sleep(pad)  # keeps the GPU busy while the host issues this repeat
            if flush_l2:
                _flush_l2(dev)  # enqueued before `start`, so not inside the timed span
            start.record()
            calls[name]()
            end.record()
        torch.cuda.synchronize(dev)
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end) / per_sample)
    method = ("cuda_graph" if cuda_graph else "cuda_event") + ("+l2flush-read" if flush_l2 else "") + \
        ("+hostpad" if pad else "")
    return samples, method


def time_interleaved(fns: dict[str, Callable[[], Any]], **options: Unpack[SampleOptions]) -> dict[str, Timing]:
    """Time several callables round-robin so clock and thermal drift hit each alike.

    Repeat i runs every callable once, starting at a rotating position so none always runs right
    after the flush or right after a particular neighbour. Returns one Timing per name. ``options``: how the
    samples are taken (:class:`SampleOptions`: warmup 10, rep 50, L2 flushed, no CUDA graph by default).
    """
    samples, method = interleaved_samples(fns, **options)
    return {n: summarize(v, method) for n, v in samples.items()}


# ---- stability: rounds, spreads, re-timing ---------------------------------------------------------

@dataclass(frozen=True)
class Spread:
    """How far one callable's samples disagree: across rounds and within them."""

    rounds: float  # max / min of the round medians (1.0 with one round)
    p80_p20: float  # p80 / p20 of all its samples

    def within(self, bound: float) -> bool:
        return self.rounds <= bound and self.p80_p20 <= bound

    def as_dict(self) -> dict[str, float | None]:
        return {"rounds": _ratio_or_none(self.rounds), "p80_p20": _ratio_or_none(self.p80_p20)}


def _ratio_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None  # a zero p20 or round median: unbounded, stored as null


def _over(hi: float, lo: float) -> float:
    if lo > 0:
        return hi / lo
    return 1.0 if hi <= 0 else math.inf


def round_medians(samples: Sequence[float], rounds: int) -> list[float]:
    """Medians of ``rounds`` consecutive, near-equal chunks of samples (in the order taken)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    n = len(samples)
    if n == 0:
        raise ValueError("round_medians of an empty sample list")
    k = min(rounds, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [percentile(sorted(samples[a:b]), 0.5) for a, b in zip(bounds, bounds[1:])]


def spread_of(samples: Sequence[float], rounds: int) -> tuple[Spread, list[float]]:
    """The spread of one callable's samples (in the order taken) and its round medians."""
    meds = round_medians(samples, rounds)
    s = sorted(samples)
    return Spread(rounds=_over(max(meds), min(meds)), p80_p20=_over(percentile(s, 0.8), percentile(s, 0.2))), meds


def spread_of_rounds(rounds: Sequence[Sequence[float]]) -> tuple[Spread, list[float]]:
    """The same, for samples already grouped by round (e.g. a suite's timing blocks)."""
    if not rounds or not all(rounds):
        raise ValueError("spread_of_rounds needs at least one non-empty round")
    meds = [percentile(sorted(r), 0.5) for r in rounds]
    s = sorted(x for r in rounds for x in r)
    return Spread(rounds=_over(max(meds), min(meds)), p80_p20=_over(percentile(s, 0.8), percentile(s, 0.2))), meds


@dataclass(frozen=True)
class Stable:
    """Timings that passed the stability rule, or were re-timed and are marked noisy."""

    timings: dict[str, Timing]
    rounds_ms: dict[str, list[float]]  # per-round medians, paired by position across callables
    spread: dict[str, Spread]
    attempts: int  # 1: stable at once; more: re-timed
    noisy: bool
    bound: float

    def as_dict(self) -> dict[str, Any]:
        """The record's ``stability`` block."""
        return {"bound": self.bound, "rounds": max((len(v) for v in self.rounds_ms.values()), default=0),
                "attempts": self.attempts, "noisy": self.noisy,
                "spread": {n: s.as_dict() for n, s in self.spread.items()}}


def stabilize(measure: Callable[[], tuple[dict[str, list[float]], str]], *, rounds: int = ROUNDS,
              bound: float = NOISE_BOUND, retries: int = RETRIES) -> Stable:
    """Call ``measure`` (per-callable samples in the order taken, and the method) until every callable's
    :class:`Spread` is within ``bound``, at most ``1 + retries`` times; the last attempt is kept, marked
    noisy when it still is not."""
    if not bound >= 1.0:
        raise ValueError(f"bound must be >= 1.0 (a ratio of times), got {bound}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    attempts = 0
    while True:
        attempts += 1
        samples, method = measure()
        spreads, meds = {}, {}
        for n, v in samples.items():
            spreads[n], meds[n] = spread_of(v, rounds)
        settled = all(sp.within(bound) for sp in spreads.values())
        if settled or attempts > retries:
            return Stable(timings={n: summarize(v, method) for n, v in samples.items()}, rounds_ms=meds,
                          spread=spreads, attempts=attempts, noisy=not settled, bound=bound)


def time_stable(fns: dict[str, Callable[[], Any]], *, rounds: int = ROUNDS, bound: float = NOISE_BOUND,
                retries: int = RETRIES, **options: Unpack[SampleOptions]) -> Stable:
    """:func:`time_interleaved` under the stability rule (see the module docstring): ``rep`` interleaved
    repeats cut into ``rounds`` rounds, re-timed up to ``retries`` times when a spread exceeds ``bound``."""
    def measure() -> tuple[dict[str, list[float]], str]:
        return interleaved_samples(fns, **options)
    return stabilize(measure, rounds=rounds, bound=bound, retries=retries)


def _host_pad_cycles(calls: dict[str, Callable[[], Any]], names: list[str], dev: torch.device) -> int:
    """GPU clock cycles of sleep that outlast the host's time to issue one repeat of the slowest
    callable (measured here, a few calls each), with margin for the flush and the two events."""
    host_us = 0.0
    for name in names:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter_ns()
            calls[name]()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize(dev)
        host_us = max(host_us, sorted(ts)[1])
    pad_us = min(2 * host_us + 30.0, 20_000.0)
    ghz = clock_ghz(dev)
    return int(pad_us * 1e3 * ghz)


_clock_cache: dict[int, float] = {}


def clock_ghz(dev: torch.device) -> float:
    """The SM clock (GHz) the sleep's cycle count is converted with; the max clock if unknown
    (sleeping longer than needed only costs idle time between repeats)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _clock_cache:
        try:
            ghz = torch.cuda.clock_rate(idx) / 1e3  # MHz, through NVML
        except Exception:  # noqa: BLE001 - no NVML: assume a fast part
            ghz = 0.0
        _clock_cache[idx] = ghz if ghz > 0.3 else 2.0
    return _clock_cache[idx]


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 10,
    rep: int = 50,
    flush_l2: bool = True,
    cuda_graph: bool = False,
    device: torch.device | str | int | None = None,
    graph_calls: int = GRAPH_CALLS,
    hide_host: bool = True,
) -> Timing:
    """Time one callable (see the module docstring for the method). ``device`` defaults to the
    current CUDA device when there is one, else the CPU host timer."""
    return time_interleaved({"fn": fn}, warmup=warmup, rep=rep, flush_l2=flush_l2, cuda_graph=cuda_graph,
                            device=device, graph_calls=graph_calls, hide_host=hide_host)["fn"]
