"""``warpforge.profile(fn, *inputs)``: warm up, count, capture, analyze — one call, one result.

Order of work: warm-up calls (untimed); one counted call (FLOPs and bytes per operator, per module;
on a GPU with an eager twin ``count_fn``, also which kernels each operator launched, so kernels replayed
from a CUDA graph find their operators); the measured windows under the profiler (on a GPU a detail window
for attribution and a light one, CUDA activity alone, for time: ``trace.py``), between two plain windows
that time the profiler's cost; then the analysis against the ceilings ``warpforge probe`` measured (the
datasheet until it has).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from warpforge.hw.roofline import Ceilings
from warpforge.profile.analysis import Analysis, LaunchCost, analyze, launch_cost
from warpforge.profile.events import iteration_load
from warpforge.profile.flops import Counts, count
from warpforge.profile.scope import module_depth
from warpforge.profile.trace import Capture, CaptureConfig, ProfileError, capture, overhead, write_trace

SCHEMA = 1
OVERHEAD_LIMIT = 0.05  # the profiler's cost on the window above which the report says what it distorts


@dataclass
class Profile:
    """The result of :func:`profile`: the analysis, the timing, and the trace to export."""

    target: str
    meta: dict[str, Any]
    analysis: Analysis
    counts: Counts
    window_ms: float
    plain_ms: float | None
    modules: list[dict[str, Any]] = field(default_factory=list)
    declared: dict[str, Any] | None = None  # the caller's per-call work and the rates it implies
    raw_trace: dict[str, Any] | None = field(default=None, repr=False)
    load: dict[str, float] = field(default_factory=dict)  # what the profiler recorded per iteration
    parts_ms: dict[str, float] | None = None  # the window under the CPU-only / CUDA-only profiler
    window: str = "full"  # the profiled window times come from: "light" (CUDA activity alone) or "full"
    detail_ms: float | None = None  # per iteration, the detail window (operator records and module hooks on)
    pad_us: float = 0.0  # the GPU sleep every CUDA window started behind (the host's head start)

    @property
    def overhead(self) -> float | None:
        """Profiler + hooks cost on the window: profiled / plain - 1 (None when not measured)."""
        return overhead(self.window_ms, self.plain_ms)

    @property
    def overhead_parts(self) -> dict[str, float] | None:
        """The cost of each half of the profiler alone: {"cpu": .., "cuda": ..} (None when not measured)."""
        if not self.parts_ms or not self.plain_ms:
            return None
        return {k: overhead(v, self.plain_ms) for k, v in self.parts_ms.items()}

    @property
    def verdict(self) -> str:
        return self.analysis.verdict

    @property
    def findings(self) -> list[dict[str, Any]]:
        return self.analysis.findings

    def as_dict(self) -> dict[str, Any]:
        a = self.analysis.as_dict()
        by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "flops": 0, "bytes": 0})
        for r in self.counts.records:
            k = by_kind[r.kind]
            k["calls"] += 1
            k["flops"] += r.flops
            k["bytes"] += r.bytes
        timing = {"window_ms": self.window_ms, "plain_ms": self.plain_ms, "overhead": self.overhead,
                  "overhead_parts": self.overhead_parts, "traced_per_iter": self.load,
                  "window": self.window, "detail_ms": self.detail_ms, "pad_us": self.pad_us,
                  "iters": self.meta.get("iters"), "warmup": self.meta.get("warmup")}
        below_noise(timing)
        return {
            "schema": SCHEMA, "tool": "warpforge.profile", "target": self.target, "meta": self.meta,
            "timing": timing,
            **a, "modules": self.modules, "declared": self.declared,
            "counts": {"flops": self.counts.flops, "bytes": self.counts.bytes, "records": len(self.counts.records),
                       "by_kind": dict(by_kind), "error": self.counts.error},
        }

    def write(self, out_dir: str | Path, *, trace: bool = False) -> dict[str, Path]:
        """report.json, report.html (self-contained) and, with ``trace``, trace.json.gz in ``out_dir`` (the
        names every warpforge command uses in its --out directory)."""
        import json

        from warpforge.profile.report import render_html

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        d = self.as_dict()
        paths: dict[str, Path] = {}
        if trace and self.raw_trace is not None:
            paths["trace"] = write_trace(self.raw_trace, out / "trace.json.gz")
            d["trace_file"] = paths["trace"].name
        paths["json"] = out / "report.json"
        paths["json"].write_text(json.dumps(d, indent=1, default=_json_default))
        paths["html"] = out / "report.html"
        paths["html"].write_text(render_html(d), encoding="utf-8")
        return paths


def below_noise(timing: dict[str, Any]) -> None:
    """A negative overhead is no figure: the profiled window ran faster than the plain runs, so run-to-run
    noise (a busy host, clocks) exceeds the profiler's cost. It is stored as null with ``overhead_note``
    saying so, never printed as "-73.3%"; the same for each half's cost."""
    o = timing.get("overhead")
    if isinstance(o, (int, float)) and o < 0:
        timing["overhead"] = None
        timing["overhead_note"] = (f"not measurable: the profiled window ({timing['window_ms']:.3f} ms) ran faster "
                                   f"than the plain runs ({timing['plain_ms']:.3f} ms), so run-to-run noise exceeds "
                                   "the profiler's cost on this machine")
    parts = timing.get("overhead_parts")
    if isinstance(parts, dict) and any(isinstance(v, (int, float)) and v < 0 for v in parts.values()):
        timing["overhead_parts"] = {k: (v if v is None or v >= 0 else None) for k, v in parts.items()}
        timing.setdefault("overhead_note", "a half of the profiler timed alone ran faster than the plain runs: "
                                           "noise exceeds its cost (not shown)")


def _json_default(x: Any) -> str:
    """Anything JSON cannot hold (a torch dtype or device in a declared work dict) as its string."""
    return str(x)


def _root_module(fn: Callable, module: torch.nn.Module | None) -> torch.nn.Module | None:
    if module is not None:
        return module
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)  # a bound method such as model.forward or model.generate
    return owner if isinstance(owner, torch.nn.Module) else None


def _compiled_original(m: torch.nn.Module | None) -> torch.nn.Module | None:
    """The eager module inside a torch.compile'd one (OptimizedModule keeps it as _orig_mod)."""
    orig = getattr(m, "_orig_mod", None)
    return orig if isinstance(orig, torch.nn.Module) else None


def _device_of(inputs: tuple, module: torch.nn.Module | None) -> torch.device:
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor):
            return t.device
    if module is not None:
        for t in list(module.parameters()) + list(module.buffers()):
            return t.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _meta(target: str, device: torch.device, cfg: CaptureConfig) -> dict[str, Any]:
    from warpforge.hw.probe import cpu_name

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf32 = {"matmul": bool(torch.backends.cuda.matmul.allow_tf32), "cudnn": bool(torch.backends.cudnn.allow_tf32)}
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    cuda = device.type == "cuda"
    return {"target": target, "device": torch.cuda.get_device_name(device) if cuda else cpu_name(),
            "device_type": device.type, "torch": torch.__version__, "triton": triton_v,
            "cuda": torch.version.cuda if cuda else None, "python": platform.python_version(),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "iters": cfg.iters, "warmup": cfg.warmup, "grad": cfg.grad, "tf32": tf32}


def profile(fn: Callable[..., Any], *inputs: Any, module: torch.nn.Module | None = None,
            count_fn: Callable[..., Any] | None = None, warmup: int = 5, iters: int = 20, grad: bool = False,
            nvtx: bool = True, module_depth_timed: int = 2, device: torch.device | str | None = None,
            ceilings: Ceilings | None = None, launch: LaunchCost | None = None, name: str | None = None,
            measure_overhead: bool = True, work: dict[str, Any] | None = None,
            overhead_parts: bool = False, window: str = "light") -> Profile:
    """Profile ``fn(*inputs)``: where its time goes, against the roofline of the measured ceilings.

    ``module``: the nn.Module whose submodules name the operators (default: ``fn`` itself when it is
    a Module, or the Module a bound method belongs to). ``count_fn``: an eager equivalent to count
    FLOPs on when ``fn`` hides its operators (CUDA-graph replay); a torch.compile'd module is
    counted on its eager original automatically. ``grad=False`` runs under ``torch.inference_mode``.
    ``work``: FLOPs and bytes one call does, as a benchmark case declares them ({"flops", "bytes",
    "dtype"}); the profile then reports the rates they imply over the device time and the window.
    ``overhead_parts``: also time the window under the CPU half and the CUDA half of the profiler alone
    (CUDA runs; two more windows), to say which half a high overhead comes from.
    ``window``: "light" (default) times the window under the CUDA activity alone and takes operators from a
    second, detail window (falling back to the detail window, with a note, where the two launched different
    work); "full" times the one window with everything on. CPU runs always have one window.
    Raises :class:`ProfileError` when the model fails or the window records nothing.
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable (a model or a function), got {type(fn).__name__}")
    cfg = CaptureConfig(warmup=warmup, iters=iters, nvtx=nvtx, module_depth=module_depth_timed, grad=grad,
                        overhead=measure_overhead, overhead_parts=overhead_parts, window=window)
    target = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    root = _root_module(fn, module)
    eager = _compiled_original(root)
    hook_root = None if eager is not None else root  # hooks inside a compiled graph would change it
    dev = torch.device(device) if device is not None else _device_of(inputs, root)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ProfileError(f"device {dev} requested but CUDA is not available")
    grad_ctx = contextlib.nullcontext if grad else torch.inference_mode

    try:
        with (torch.cuda.device(dev) if cuda else contextlib.nullcontext()), grad_ctx():
            for _ in range(cfg.warmup):
                fn(*inputs)
            if cuda:
                torch.cuda.synchronize()
    except Exception as e:
        raise ProfileError(f"{target} failed during warm-up: {type(e).__name__}: {e}") from e

    count_module = eager if eager is not None else root
    # An eager twin stands in for a call that hides its operators (a graph replay): on a GPU its counted call
    # is traced too, to learn which kernels each operator launched.
    counts = _count(count_fn or eager or fn, inputs, count_module, grad, kernels=cuda and count_fn is not None)
    counts_note = ("compiled module: FLOPs counted on its eager original; the compiled kernels carry time only"
                   if eager is not None else None)
    module_calls = sum(v for p, v in counts.module_calls.items() if module_depth(p) <= cfg.module_depth)
    from warpforge.results.host import check_host

    host = check_host(dev)  # a busy machine inflates host time and the overhead: said, and kept in meta
    try:
        cap: Capture = capture(fn, inputs, module=hook_root, device=dev, cfg=cfg, module_calls=module_calls)
    except Exception as e:
        raise ProfileError(f"{target} failed in the measured window: {type(e).__name__}: {e}") from e

    ceil = None
    if cuda:
        from warpforge.hw.roofline import ceilings as device_ceilings

        ceil = ceilings or device_ceilings(dev)
        launch = launch or launch_cost(torch.cuda.get_device_name(dev))
    try:
        analysis = analyze(cap.trace, counts, ceilings=ceil, launch=launch)
    except ValueError as e:
        raise ProfileError(f"{target}: {e}") from e
    analysis.notes[:0] = ([host.warning] if host.warning else []) + ([counts_note] if counts_note else []) + cap.notes
    if ceil is not None:
        analysis.notes.append(f"ceilings: {ceil.source}")
    load = cap.load if cap.load is not None else (iteration_load(cap.trace) if cuda else {})
    cost = overhead_finding(cap.overhead, cap.window_ms, cap.plain_ms, load)
    if cost is not None:
        analysis.findings = sorted(analysis.findings + [cost], key=lambda f: -f["severity"])
    return Profile(target=target, meta={**_meta(target, dev, cfg), "host": host.as_dict()}, analysis=analysis,
                   counts=counts,
                   window_ms=cap.window_ms, plain_ms=cap.plain_ms, modules=_module_rows(cap, analysis),
                   declared=declared_rates(work, analysis, ceil) if work else None, raw_trace=cap.raw,
                   load=load, parts_ms=cap.parts_ms, window=cap.window, detail_ms=cap.detail_ms, pad_us=cap.pad_us)


def overhead_finding(cost: float | None, window_ms: float, plain_ms: float | None,
                     load: dict[str, float]) -> dict[str, Any] | None:
    """A finding when the profiler cost the window more than OVERHEAD_LIMIT: what it recorded per iteration,
    and what that distorts (host-side idle time; device times per kernel are the GPU's own)."""
    if cost is None or cost < OVERHEAD_LIMIT or plain_ms is None:
        return None
    from warpforge.profile.findings import pct, us

    extra_us = (window_ms - plain_ms) * 1e3
    what = ""
    if load:
        ops = f"{load['host_ops']:,.0f} operators and " if load.get("host_ops") else ""
        what = f" Per iteration it recorded {ops}{load.get('runtime_calls', 0):,.0f} runtime calls"
        if load.get("graph_kernels"):
            what += (f", and traced {load['graph_kernels']:,.0f} kernels replayed from CUDA graphs one by one "
                     f"(the graph launches took {us(load.get('graph_launch_host_us', 0.0))} on the host)")
        what += "."
    return {"kind": "profiler-overhead", "severity": round(cost / (1 + cost), 4),
            "text": f"the profiler cost {pct(cost)} of this window ({us(extra_us)} per iteration: "
                    f"{window_ms:.3f} ms profiled vs {plain_ms:.3f} ms plain); the host-side idle time above "
                    f"includes it.{what}",
            "advice": "device times per kernel are the GPU's own; take the step's time from the plain run",
            "evidence": {"overhead": cost, "window_ms": window_ms, "plain_ms": plain_ms, "traced_per_iter": load}}


def declared_rates(work: dict[str, Any], a: Analysis, ceil: Ceilings | None) -> dict[str, Any]:
    """Rates of declared per-call work: over the device's busy time per iteration (what a benchmark's
    CUDA events around one call measure, less launch latency) and over the whole window."""
    from warpforge.hw.roofline import roofline

    flops, nbytes = float(work.get("flops", 0.0)), float(work.get("bytes", 0.0))
    out: dict[str, Any] = {"flops": flops, "bytes": nbytes, "dtype": work.get("dtype")}
    spans = {"device": a.split.busy_us if a.split.busy_us is not None else a.split.window_us,
             "window": a.split.window_us}
    for label, t_us in spans.items():
        if not t_us:
            continue
        out[f"{label}_us"] = t_us
        out[f"{label}_GBps"] = nbytes / (t_us * 1e-6) / 1e9
        out[f"{label}_TFLOPs"] = flops / (t_us * 1e-6) / 1e12
    if ceil is not None and spans["device"]:
        try:
            r = roofline(flops, nbytes, work.get("dtype") or "fp32", spans["device"] * 1e-3, ceil)
            out["roofline"] = {"floor_us": r["floor_ms"] * 1e3, "fraction": r["fraction"], "bound": r["bound"]}
        except ValueError as e:  # a dtype with no ceiling (float64)
            out["roofline"] = {"error": str(e)}
    return out


def _count(fn: Callable, inputs: tuple, module: torch.nn.Module | None, grad: bool, kernels: bool = False) -> Counts:
    """One counted call; a failure here costs the FLOP columns, not the profile. A traced call that fails
    is tried once more untraced (the profiler, not the model, may be what failed)."""
    try:
        return count(fn, *inputs, module=module, grad=grad, kernels=kernels)
    except Exception as e:
        if kernels:
            return _count(fn, inputs, module, grad)
        return Counts(error=f"{type(e).__name__}: {e}")


def _module_rows(cap: Capture, a: Analysis) -> list[dict[str, Any]]:
    """Module spans (CUDA events / host timer) beside the device time of the operators inside them."""
    rows = []
    for m in cap.modules:
        p = m["module"]
        inside = [r for r in a.ops
                  if r.module is not None and (p == "" or r.module == p or r.module.startswith(p + "."))]
        t = sum(r.time_us for r in inside)
        flops = sum(r.flops or 0.0 for r in inside)
        rows.append({**m, "op_time_us": t, "flops": flops,
                     "busy_share": t / m["span_us"] if m["span_us"] > 0 else None})
    return rows
