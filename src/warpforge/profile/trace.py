"""Capture: warm-up, then a measured window under the PyTorch profiler (Kineto), timed with and without it.

The profiled window wraps every iteration in a ``warpforge:iter`` range and every module call in a
``module:<path>`` range (a profiler range for the Kineto trace, an NVTX range named by the module
path on CUDA so an Nsight Systems timeline reads like the model) and, for modules up to
``module_depth``, a CUDA event pair (a host timer on CPU) for the module's span.

The profiler's own cost is measured, not assumed: the same window runs without profiler or hooks
before and after the profiled one (CUDA events around the whole window; the host clock on CPU),
and the JSON reports ``profiled / plain - 1``. A first iteration inside the profiler is traced but
excluded: CUPTI's start-up cost lands there, not in the window.

Where the cost comes from: the profiler works on the host (a record per operator, a CUPTI record per
runtime call and per kernel, also per kernel replayed from a CUDA graph), so it adds nothing to a
GPU-bound window and everything to a host-bound one, such as an LLM decode step that syncs every step.
The window therefore runs with the lightest settings that keep what the analysis reads
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from warpforge.profile.attribute import module_annotation
from warpforge.profile.events import ITER_ANNOTATION, Trace, parse_kineto
from warpforge.profile.scope import ModuleScope, fast_range, module_depth


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

    def __post_init__(self) -> None:
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
    window_ms: float  # per iteration, under the profiler and hooks
    plain_ms: float | None  # per iteration, without them (mean of the runs before and after)
    modules: list[dict[str, Any]]  # per module: calls and span per iteration
    parts_ms: dict[str, float] | None = None  # per iteration under one half of the profiler: "cpu", "cuda"

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


def _window_ms(call: Callable[[int], None], iters: int, cuda: bool) -> float:
    """Per-iteration ms of ``iters`` back-to-back calls: one CUDA event pair around all (GPU time as
    the stream sees it, host gaps included), or the host clock on CPU."""
    _sync(cuda)
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    """The measured window (after the caller's warm-up). ``module_calls``: timed module calls per
    iteration, from the counting pass, to size the CUDA event pool."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
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

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    pool = _EventPool(2 * module_calls * cfg.iters + 16) if cuda else None
    hooks = _ModuleHooks(module, cfg, cuda, pool) if module is not None else None
    with (torch.cuda.device(device) if cuda else contextlib.nullcontext()), grad_ctx():
        before = _window_ms(plain, cfg.iters, cuda) if cfg.overhead else None
        with contextlib.ExitStack() as stack:
            prof = stack.enter_context(profile(activities=activities, **profiler_options()))
            if hooks is not None:
                stack.enter_context(hooks.scope)
            fn(*inputs)  # traced, outside any iteration range: absorbs the profiler's start-up
            if hooks is not None:
                hooks.timed.clear()  # module spans of the measured iterations only
            window = _window_ms(traced, cfg.iters, cuda)
            _sync(cuda)
        after = _window_ms(plain, cfg.iters, cuda) if cfg.overhead else None
        raw = export_trace(prof)  # before another profiler session starts
        parts = _parts_ms(plain, cfg.iters) if cuda and cfg.overhead_parts else None
    return Capture(trace=parse_kineto(raw, device_type="cuda" if cuda else "cpu"), raw=raw, device=device,
                   iters=cfg.iters, window_ms=window, plain_ms=plain_window_ms(before, after),
                   modules=hooks.spans(cfg.iters) if hooks is not None else [], parts_ms=parts)


def _parts_ms(call: Callable[[int], None], iters: int) -> dict[str, float]:
    """The window (no hooks, no ranges) under the CPU half alone (operator records) and the CUDA half alone
    (CUPTI: runtime calls, kernels, graph nodes), each after one untimed call that absorbs its start-up."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, act in (("cpu", ProfilerActivity.CPU), ("cuda", ProfilerActivity.CUDA)):
        with profile(activities=[act], **profiler_options()):
            call(-1)
            out[name] = _window_ms(call, iters, True)
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
