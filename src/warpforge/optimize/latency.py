"""The latency protocol the optimizer ranks candidates by (MLPerf's inference scenarios, simplified).

* **Single stream**: queries issued back to back, one at a time: each query is timed on its own and the
  device is synchronized before the next one starts, so no query overlaps another (as a camera frame or
  a trading signal sees it). Summarized by p50/p90/p99 over ``queries`` samples after ``warmup`` untimed
  queries. On CUDA each query is bracketed by a CUDA event pair (the span includes the host's launch
  work the GPU waits for, which is part of a real query's latency); on CPU the host clock.
* **Offline**: ``calls`` back-to-back calls at the inputs' batch size with no synchronization in between
  (the device may queue work), one timer around all of them; items/s = batch x calls / elapsed.
* **Peak memory**: ``torch.cuda.max_memory_allocated`` above what was allocated when the measurement
  started; on CPU there is no such counter and the figure is None (not a guess).

Unlike ``warpforge.timing`` (kernel timing: cold L2, a GPU sleep to hide the host), nothing here
flushes caches or hides the host: a query's latency includes both, and a model's weights being warm in
L2 between back-to-back queries is what a deployed model sees too. Candidates are interleaved in rounds
(``single_stream_interleaved``) so clock and thermal drift hit every candidate alike, under the bench
harness's stability rule (``single_stream_stable``): a candidate whose round medians or p80/p20 spread
beyond ``warpforge.timing.NOISE_BOUND`` has every candidate timed again, and what does not settle is noisy.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from warpforge.timing import NOISE_BOUND, RETRIES, percentile, spread_of


@dataclass(frozen=True)
class Latency:
    """Single-stream query latency in milliseconds."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    n: int        # timed queries
    warmup: int   # untimed queries before them
    method: str   # "cuda_event+sync" or "host"
    rounds_ms: tuple[float, ...] = ()  # the median of each round (the interval of a speedup)
    spread: dict[str, float | None] | None = None  # {"rounds": max/min of them, "p80_p20": ...}
    noisy: bool = False  # a spread above NOISE_BOUND after re-timing

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Throughput:
    """Offline throughput: back-to-back calls at one batch size."""

    items_per_s: float
    batch: int
    calls: int
    total_ms: float
    method: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _device(device: torch.device | str | None) -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested but CUDA is not available")
    return dev


def batch_size(inputs: Sequence[Any]) -> int:
    """Items per call: dim 0 of the first tensor input with one (1 when no input has a batch dim)."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    return 1


def summarize(samples_ms: Sequence[float], warmup: int, method: str, rounds: int = 1,
              bound: float = NOISE_BOUND) -> Latency:
    """p50/p90/p99 and friends of samples in the order taken; with ``rounds`` > 1 also the round medians,
    their spread and whether it exceeds ``bound`` (noisy)."""
    s = sorted(float(x) for x in samples_ms)
    if not s:
        raise ValueError("no latency samples to summarize")
    sp, meds = spread_of([float(x) for x in samples_ms], rounds)
    return Latency(p50_ms=percentile(s, 0.5), p90_ms=percentile(s, 0.9), p99_ms=percentile(s, 0.99),
                   mean_ms=sum(s) / len(s), min_ms=s[0], max_ms=s[-1], n=len(s), warmup=warmup, method=method,
                   rounds_ms=tuple(meds), spread=sp.as_dict(), noisy=not sp.within(bound))


def _check(queries: int, warmup: int) -> None:
    if queries < 1:
        raise ValueError(f"queries must be >= 1, got {queries}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _queries(fn: Callable[..., Any], inputs: tuple, n: int, dev: torch.device) -> list[float]:
    """n back-to-back queries, each timed alone and synchronized before the next."""
    out = []
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(n):
            start.record()
            fn(*inputs)
            end.record()
            end.synchronize()  # single stream: the next query waits for this one
            out.append(start.elapsed_time(end))
    else:
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn(*inputs)
            out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def single_stream_interleaved(fns: dict[str, Callable[..., Any]], inputs: tuple, *, queries: int = 200,
                              warmup: int = 20, rounds: int = 10,
                              device: torch.device | str | None = None) -> dict[str, Latency]:
    """Single-stream latency of each callable on the same inputs, in ``rounds`` rotating blocks of queries."""
    _check(queries, warmup)
    if not fns:
        raise ValueError("single_stream_interleaved needs at least one callable")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = _device(device)
    rounds = min(rounds, queries)
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad(), (torch.cuda.device(dev) if dev.type == "cuda" else nullcontext()):
        for n in names:
            for _ in range(warmup):
                fns[n](*inputs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        for r in range(rounds):
            per = queries // rounds + (1 if r < queries % rounds else 0)
            for j in range(len(names)):
                n = names[(r + j) % len(names)]
                samples[n] += _queries(fns[n], inputs, per, dev)
    method = "cuda_event+sync" if dev.type == "cuda" else "host"
    return {n: summarize(samples[n], warmup, method, rounds=rounds) for n in names}


def single_stream_stable(fns: dict[str, Callable[..., Any]], inputs: tuple, *, queries: int = 200,
                         warmup: int = 20, rounds: int = 10, device: torch.device | str | None = None,
                         retries: int = RETRIES) -> tuple[dict[str, Latency], int]:
    """:func:`single_stream_interleaved` under the stability rule: timed again (every candidate, up to
    ``retries`` times) while any candidate is noisy. Returns the last attempt's latencies (each says whether
    it is still noisy) and the number of attempts."""
    attempts = 0
    while True:
        attempts += 1
        lat = single_stream_interleaved(fns, inputs, queries=queries, warmup=warmup, rounds=rounds, device=device)
        if not any(x.noisy for x in lat.values()) or attempts > retries:
            return lat, attempts


def single_stream(fn: Callable[..., Any], inputs: tuple, *, queries: int = 200, warmup: int = 20,
                  device: torch.device | str | None = None) -> Latency:
    """Single-stream latency of one callable (see the module docstring)."""
    return single_stream_interleaved({"fn": fn}, inputs, queries=queries, warmup=warmup, rounds=1,
                                     device=device)["fn"]


def offline(fn: Callable[..., Any], inputs: tuple, *, calls: int = 50, warmup: int = 5,
            device: torch.device | str | None = None) -> Throughput:
    """Items per second over ``calls`` back-to-back calls at the inputs' batch size."""
    _check(calls, warmup)
    dev = _device(device)
    batch = batch_size(inputs)
    with torch.no_grad(), (torch.cuda.device(dev) if dev.type == "cuda" else nullcontext()):
        for _ in range(warmup):
            fn(*inputs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn(*inputs)
            end.record()
            end.synchronize()
            total_ms, method = start.elapsed_time(end), "cuda_event"
        else:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn(*inputs)
            total_ms, method = (time.perf_counter_ns() - t0) / 1e6, "host"
    return Throughput(items_per_s=batch * calls / (total_ms / 1e3) if total_ms > 0 else float("inf"),
                      batch=batch, calls=calls, total_ms=total_ms, method=method)


class PeakMemory:
    """``with PeakMemory(dev) as m: ...`` then ``m.bytes``: peak CUDA allocation above the level at entry.

    None on CPU: torch keeps no allocation high-water mark there, and a process RSS would count the
    interpreter and every other candidate."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = _device(device)
        self.bytes: int | None = None
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)


__all__ = ["Latency", "PeakMemory", "Throughput", "batch_size", "offline", "single_stream",
           "single_stream_interleaved", "single_stream_stable"]
