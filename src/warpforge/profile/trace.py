"""Capture: warm-up, then measured windows under the PyTorch profiler (Kineto), timed with and without it.

On CUDA two profiled windows run (``window="light"``, the default there):

* the *detail* window carries what the attribution reads: operator records, a ``warpforge:iter`` range per
  iteration and a ``module:<path>`` range per module call (a profiler range for the Kineto trace, an NVTX range
  named by the module path so an Nsight Systems timeline reads like the model) and, for modules up to
  ``module_depth``, a CUDA event pair for the module's span. This is the window ``trace.json.gz`` holds;
* the *timed* window runs the same calls under the CUDA activity alone (CUPTI: runtime calls, kernels, copies,
  graph nodes; no operator records, no ranges, no hooks; an NVTX range per iteration only, with ``nvtx``). Its
  launches are matched to the detail window's (``window.py``) and its device times replace the detail window's
  in the analysis; its CUDA events are the profiled time the overhead compares with the plain run. Where the
  two windows launched different work, the detail window is used whole and the analysis says so.

``window="full"`` (and every CPU run, where there are no kernels to match) keeps one window with everything on.

The profiler's own cost is measured, not assumed: the same window runs without profiler or hooks before and
after the profiled ones (CUDA events around the whole window; the host clock on CPU), and the JSON reports
``profiled / plain - 1``. A first call inside each profiler session is traced but excluded: CUPTI's start-up
cost lands there, not in the window. Every CUDA window, plain or profiled, starts behind the same short GPU
sleep (:func:`host_pad_us`), so the host queues its first call while the GPU waits instead of the GPU waiting
on the host's start-up.

Where the cost comes from: the profiler works on the host (a record per operator, a CUPTI record per
runtime call and per kernel, also per kernel replayed from a CUDA graph), so it adds nothing to a
GPU-bound window and everything to a host-bound one, such as an LLM decode step that syncs every step.
The windows therefore run with the lightest settings that keep what the analysis reads
(:func:`profiler_options`), and ``overhead_parts`` can time the window under the CPU half and the
CUDA half of the profiler alone, to say which half costs what.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from warpforge.profile.events import ITER_ANNOTATION, Trace, module_annotation, parse_kineto
from warpforge.profile.scope import ModuleScope, fast_range, module_depth
from warpforge.profile.window import fallback, transfer

WINDOWS = ("light", "full")
# The host's head start (host_pad_us): twice one call's host time plus a margin, at least PAD_MIN_US, at most
# PAD_MAX_US and PAD_SHARE of the whole window's host time (a host-bound window hides about the pad's length
# of host time, the same in the plain and the profiled windows; this bounds that to a few percent of it).
PAD_MIN_US, PAD_MAX_US, PAD_MARGIN_US, PAD_SHARE = 20.0, 2000.0, 30.0, 0.05


class ProfileError(RuntimeError):
    """The profile could not be taken: the model failed, or the window recorded nothing."""


@dataclass(frozen=True)
class CaptureConfig:
    warmup: int = 5  # untimed calls first: autotuning, lazy loads, allocator growth happen there
    iters: int = 20  # measured iterations
    nvtx: bool = True  # NVTX ranges per module and iteration (CUDA only)
    module_depth: int = 2  # modules this deep get a timed span (CUDA events / host timer)
    grad: bool = False  # False: run under torch.inference_mode, as an inference engine does
    overhead: bool = True  # also time the window without the profiler
    overhead_parts: bool = False  # also time it under the CPU-only and the CUDA-only profiler (CUDA runs)
    window: str = "light"  # "light": a detail window for attribution, a CUDA-only one for time (CUDA); "full": one

    def __post_init__(self) -> None:
        if self.window not in WINDOWS:
            raise ValueError(f"window must be one of {WINDOWS}, got {self.window!r}")
        for name, lo in (("warmup", 0), ("iters", 1), ("module_depth", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


@dataclass
class Capture:
    trace: Trace
    raw: dict[str, Any]  # the Kineto trace as exported (Chrome/Perfetto JSON)
    device: torch.device
    iters: int
    window_ms: float  # per iteration, of the profiled window the times come from (see `window`)
    plain_ms: float | None  # per iteration, without the profiler (mean of the runs before and after)
    modules: list[dict[str, Any]]  # per module: calls and span per iteration (the detail window's CUDA events)
    parts_ms: dict[str, float] | None = None  # per iteration under one half of the profiler: "cpu", "cuda"
    window: str = "full"  # "light": times from the CUDA-only window; "full": from the one window with everything
    detail_ms: float | None = None  # per iteration, the detail window (operator records and hooks on)
    pad_us: float = 0.0  # the GPU sleep in front of every CUDA window (0 on CPU)
    notes: list[str] = field(default_factory=list)  # for the analysis: which window, or why not the light one
    load: dict[str, float] | None = None  # light window: what it traced per iteration (None: read the trace)

    @property
    def overhead(self) -> float | None:
        return overhead(self.window_ms, self.plain_ms)


def overhead(profiled_ms: float, plain_ms: float | None) -> float | None:
    """The profiler's cost on a window: profiled / plain - 1 (None when the plain run was not timed)."""
    if plain_ms is None or not plain_ms > 0:
        return None
    return profiled_ms / plain_ms - 1.0


def plain_window_ms(before: float | None, after: float | None) -> float | None:
    """The window without the profiler: the mean of the runs before and after it, so a drift over the
    profile (clocks, a growing KV cache) hits the plain time as it hits the profiled one."""
    if before is None or after is None:
        return None
    return (before + after) / 2


def _experimental_config():
    """No external correlation where torch allows it (2.6+): that is a CUPTI push and pop around every
    operator, used only to draw operator-to-kernel arrows in trace viewers. Kernels still link to the
    launch call that queued them by CUPTI's own correlation id, which is what the analysis reads."""
    cls = getattr(torch._C._profiler, "_ExperimentalConfig", None)
    if cls is None:
        return None
    try:
        return cls(disable_external_correlation=True)
    except TypeError:  # an older torch without the option
        return None


def profiler_options() -> dict[str, Any]:
    """Keyword arguments of ``torch.profiler.profile`` for the measured window: the lightest settings that
    keep operator spans, launch calls and device work. Shapes come from the counting pass, module paths
    from our own ranges; Python stacks, memory, FLOP estimates and external correlation are off."""
    opts: dict[str, Any] = dict(record_shapes=False, with_stack=False, profile_memory=False, with_flops=False,
                                with_modules=False)
    cfg = _experimental_config()
    if cfg is not None:
        opts["experimental_config"] = cfg
    return opts


class _EventPool:
    """CUDA timing events made before the window, so the hooks only record them."""

    def __init__(self, n: int):
        self.free = [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def take(self) -> torch.cuda.Event:
        return self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)


class _ModuleHooks:
    """Per-module ranges, NVTX and span timing for the profiled window."""

    def __init__(self, module: torch.nn.Module, cfg: CaptureConfig, cuda: bool, pool: _EventPool | None):
        self.scope = ModuleScope(module, on_enter=self.enter, on_exit=self.exit)
        self.cuda, self.pool, self.depth = cuda, pool, cfg.module_depth
        self.nvtx = cfg.nvtx and cuda
        self.open: list = []
        self.timed: list[tuple[str, Any, Any]] = []  # (path, start, end): CUDA events or ns

    def enter(self, path: str) -> None:
        rf = fast_range(module_annotation(path, self.scope.root_type))
        rf.__enter__()
        if self.nvtx:
            torch.cuda.nvtx.range_push(self.scope.display(path))
        start = None
        if module_depth(path) <= self.depth:
            if self.pool is not None:
                start = self.pool.take()
                start.record()
            else:
                start = time.perf_counter_ns()
        self.open.append((rf, start))

    def exit(self, path: str) -> None:
        if not self.open:
            return
        rf, start = self.open.pop()
        if start is not None:
            if self.pool is not None:
                end = self.pool.take()
                end.record()
            else:
                end = time.perf_counter_ns()
            self.timed.append((path, start, end))
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        rf.__exit__(None, None, None)

    def spans(self, iters: int) -> list[dict[str, Any]]:
        calls: dict[str, int] = defaultdict(int)
        total_us: dict[str, float] = defaultdict(float)
        for path, a, b in self.timed:
            calls[path] += 1
            total_us[path] += a.elapsed_time(b) * 1e3 if self.pool is not None else (b - a) / 1e3
        return [{"module": p, "type": self.scope.types.get(p, ""), "depth": module_depth(p),
                 "calls": calls[p] / iters, "span_us": total_us[p] / iters}
                for p in sorted(calls, key=lambda p: (module_depth(p), -total_us[p]))]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def host_pad_us(host_us: float, iters: int) -> float:
    """The GPU sleep (us) in front of a window whose calls take ``host_us`` each to issue on the host.

    It must outlast the host's start-up of the first call (to its first launch at most one call's host time),
    or a GPU-bound loop is charged that start-up: the GPU would idle from the start event until the first
    kernel arrives. Twice one call plus a margin covers a first call slower than the one measured. A host-bound
    loop is the other side: there the GPU catches up with the host after the sleep, so the window misses about
    the sleep's length of host time; the cap at PAD_SHARE of ``iters`` calls keeps that to a few percent, the
    same in the plain and the profiled windows (with 20 iterations the share binds first: one call's host time).
    """
    want = 2 * max(host_us, 0.0) + PAD_MARGIN_US
    return max(PAD_MIN_US, min(want, PAD_MAX_US, PAD_SHARE * iters * max(host_us, 0.0)))


def _host_us(call: Callable[[int], None]) -> float:
    """Host time to issue one call (the faster of two, each after a sync, so neither waits on the other)."""
    out = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter_ns()
        call(-1)
        out.append((time.perf_counter_ns() - t) / 1e3)
    torch.cuda.synchronize()
    return min(out)


def pad_cycles(pad_us: float, device: torch.device) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` for about ``pad_us``, at the SM clock NVML reports (2 GHz, about
    the fastest part's, when it reports none). The sleep counts cycles, so a GPU running at another clock sleeps
    longer or shorter in proportion; the same cycles go in front of the plain and the profiled windows."""
    from warpforge.timing import clock_ghz

    return max(int(pad_us * 1e3 * clock_ghz(device)), 1)


def _window_ms(call: Callable[[int], None], iters: int, cuda: bool, pad_cycles: int = 0) -> float:
    """Per-iteration ms of ``iters`` back-to-back calls: one CUDA event pair around all (GPU time as
    the stream sees it, host gaps included), or the host clock on CPU. ``pad_cycles``: a GPU sleep queued
    before the start event (:func:`host_pad_us`), so the host queues the first calls while the GPU waits."""
    _sync(cuda)
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if pad_cycles > 0:
            torch.cuda._sleep(pad_cycles)  # ahead of the start event: not in the window's time
        a.record()
        for i in range(iters):
            call(i)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    t = time.perf_counter_ns()
    for i in range(iters):
        call(i)
    return (time.perf_counter_ns() - t) / 1e6 / iters


def capture(fn: Callable[..., Any], inputs: tuple, *, module: torch.nn.Module | None, device: torch.device,
            cfg: CaptureConfig, module_calls: int = 0) -> Capture:
    """The measured windows (after the caller's warm-up): plain, timed (light, CUDA only), detail, plain.
    ``module_calls``: timed module calls per iteration, from the counting pass, to size the CUDA event pool."""
    cuda = device.type == "cuda"
    light = cuda and cfg.window == "light"
    grad_ctx = contextlib.nullcontext if cfg.grad else torch.inference_mode

    def plain(_i: int) -> None:
        fn(*inputs)

    def traced(i: int) -> None:
        with fast_range(ITER_ANNOTATION):
            if cuda and cfg.nvtx:
                torch.cuda.nvtx.range_push(f"iteration {i}")
            try:
                fn(*inputs)
            finally:
                if cuda and cfg.nvtx:
                    torch.cuda.nvtx.range_pop()

    def bare(i: int) -> None:  # the timed window: an NVTX range per iteration at most (~100 ns with no tool)
        if cfg.nvtx:
            torch.cuda.nvtx.range_push(f"iteration {i}")
        try:
            fn(*inputs)
        finally:
            if cfg.nvtx:
                torch.cuda.nvtx.range_pop()

    pool = _EventPool(2 * module_calls * cfg.iters + 16) if cuda else None
    hooks = _ModuleHooks(module, cfg, cuda, pool) if module is not None else None
    pad_us, cycles = 0.0, 0
    timed: tuple[dict[str, Any], float] | None = None
    with (torch.cuda.device(device) if cuda else contextlib.nullcontext()), grad_ctx():
        if cuda:
            pad_us = host_pad_us(_host_us(plain), cfg.iters)
            cycles = pad_cycles(pad_us, device)
        before = _window_ms(plain, cfg.iters, cuda, cycles) if cfg.overhead else None
        # The timed window first: behind the detail window it paid for that session's teardown (a 1.35 ms
        # graph-replay step read +5.2% there, +2.3% under the same CUDA activity in a later session).
        if light:
            timed = _timed_window(fn, inputs, bare, cfg.iters, cycles)
        raw, detail_ms = _detail_window(fn, inputs, traced, hooks, cfg.iters, cuda, cycles)
        after = _window_ms(plain, cfg.iters, cuda, cycles) if cfg.overhead else None
        parts = _parts_ms(plain, cfg.iters, cycles) if cuda and cfg.overhead_parts else None
    trace = parse_kineto(raw, device_type="cuda" if cuda else "cpu")
    cap = Capture(trace=trace, raw=raw, device=device, iters=cfg.iters, window_ms=detail_ms,
                  plain_ms=plain_window_ms(before, after), modules=hooks.spans(cfg.iters) if hooks is not None else [],
                  parts_ms=parts, window="full", detail_ms=detail_ms, pad_us=pad_us)
    if timed is not None:
        try:
            t = transfer(trace, parse_kineto(timed[0], device_type="cuda"))
        except Exception as e:  # noqa: BLE001 - a trace the matcher did not foresee costs the light window only
            t = fallback(f"matching failed: {type(e).__name__}: {e}")
        cap.notes.append(t.note)
        if t.trace is not None:
            cap.trace, cap.window_ms, cap.window, cap.load = t.trace, timed[1], "light", t.load
    return cap


def _detail_window(fn: Callable[..., Any], inputs: tuple, traced: Callable[[int], None], hooks: _ModuleHooks | None,
                   iters: int, cuda: bool, cycles: int) -> tuple[dict[str, Any], float]:
    """The window under the whole profiler (CPU operators, and CUDA activity on a GPU) with module hooks and
    iteration ranges: its Kineto trace and its per-iteration ms."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(profile(activities=activities, **profiler_options()))
        if hooks is not None:
            stack.enter_context(hooks.scope)
        fn(*inputs)  # traced, outside any iteration range: absorbs the profiler's start-up
        if hooks is not None:
            hooks.timed.clear()  # module spans of the measured iterations only
        ms = _window_ms(traced, iters, cuda, cycles)
        _sync(cuda)
    return export_trace(prof), ms  # exported before another profiler session starts


def _timed_window(fn: Callable[..., Any], inputs: tuple, bare: Callable[[int], None], iters: int,
                  cycles: int) -> tuple[dict[str, Any], float]:
    """The light window: the calls under the CUDA activity alone, no hooks, no profiler ranges. Its pad kernel
    (``cycles`` > 0 on every CUDA window) marks where its iterations start in the trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA], **profiler_options()) as prof:
        fn(*inputs)  # absorbs CUPTI's start-up
        ms = _window_ms(bare, iters, True, cycles)
        _sync(True)
    return export_trace(prof), ms


def _parts_ms(call: Callable[[int], None], iters: int, cycles: int = 0) -> dict[str, float]:
    """The window (no hooks, no ranges) under the CPU half alone (operator records) and the CUDA half alone
    (CUPTI: runtime calls, kernels, graph nodes), each after one untimed call that absorbs its start-up."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, act in (("cpu", ProfilerActivity.CPU), ("cuda", ProfilerActivity.CUDA)):
        with profile(activities=[act], **profiler_options()):
            call(-1)
            out[name] = _window_ms(call, iters, True, cycles)
    return out


def export_trace(prof) -> dict[str, Any]:
    """The Kineto trace as a dict (exported through a temporary file, the profiler's only way out)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="warpforge-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_trace(raw: dict[str, Any], path: str | Path) -> Path:
    """Gzip'd Chrome/Perfetto trace: opens in ui.perfetto.dev, chrome://tracing and HTA."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(raw, f)
    return path
