"""``profile_train(setup)``: the measured run of a training setup, as a JSON-ready dict.

Order of the run: warm-up steps; plain steps (no hooks: the reference step time); instrumented steps
(the breakdown); on a GPU with collectives, a traced window (NCCL kernels overlapped vs exposed); one
memory step; one layer step. Plain steps are split around the instrumented ones so a drift in the
machine's speed reaches both.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from typing import Any

import torch
from torch import nn

from warpforge.profile.train import (BatchStream, Clock, Recorder, TrainConfig, TrainSetup, ddp_comm_hook,
                                     instrumented, nbytes, run_step, storage_of)
from warpforge.profile.train_breakdown import aggregate, breakdown, memory_phases, split_device_comm

SCHEMA = "warpforge.train-profile/1"


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fsdp(model: nn.Module | None) -> bool:
    """Sharded data parallel: FSDP2 (fully_shard: DTensor parameters) or the FSDP wrapper class."""
    if model is None:
        return False
    return any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules()) or any(
        hasattr(p, "to_local") for p in model.parameters())


def _ddp(model: nn.Module | None) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def _plain_steps(setup: TrainSetup, stream: BatchStream, rec: Recorder, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        run_step(setup, stream, rec, {})
        rec.clock.sync()
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _optimizer_state_bytes(opt: torch.optim.Optimizer | None) -> int:
    if opt is None:
        return 0
    return nbytes(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _grad_bytes(model: nn.Module | None) -> int:
    return 0 if model is None else nbytes(p.grad for p in model.parameters() if p.grad is not None)


def _memory_step(setup: TrainSetup, stream: BatchStream, rec: Recorder) -> dict[str, Any]:
    """One step with tensor sizes taken at the phase boundaries and saved activations counted."""
    model, opt = setup.model, setup.optimizer
    params = nbytes(model.parameters()) if model is not None else 0
    param_ptrs = {s[0] for s in map(storage_of, model.parameters()) if s} if model is not None else set()
    grads = {"start": _grad_bytes(model)}
    state = {"start": _optimizer_state_bytes(opt)}
    saved: dict[int, int] = {}
    seen_backward = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = storage_of(t)
        if s is not None and s[0] not in param_ptrs:
            saved[s[0]] = s[1]
        return t

    def at_backward() -> None:
        seen_backward.setdefault("activations", sum(saved.values()))

    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(setup.device)
    rec.on_backward = at_backward
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_step(setup, stream, rec, {})
    finally:
        rec.on_backward = None
    rec.clock.sync()
    # After the step: gradients are gone again when zero_grad(set_to_none) ran; the optimizer's state stays.
    state["optimizer"] = _optimizer_state_bytes(opt)
    grads["backward"] = nbytes(p for p in model.parameters() if p.requires_grad) if model is not None else 0
    mem = memory_phases(params, grads, state, seen_backward.get("activations", sum(saved.values())))
    mem["source"] = ("measured peak (torch.cuda.max_memory_allocated); split estimated from tensor sizes" if cuda
                     else "estimated from tensor sizes (parameters, gradients, optimizer state, tensors saved "
                          "for backward); no allocator on CPU to measure")
    if cuda:
        mem["measured_peak_bytes"] = torch.cuda.max_memory_allocated(setup.device)
    return mem


def _layer_step(setup: TrainSetup, stream: BatchStream, rec: Recorder) -> tuple[list[dict[str, Any]], int, int]:
    """Forward time of each layer that holds parameters (one step with per-layer hooks), its forward FLOPs,
    the whole forward's FLOPs and the bytes the whole step's operators must move (a second step under the
    FLOP counter: inputs read and outputs written by forward, backward and optimizer)."""
    from warpforge.profile.flops import FlopCounter
    from warpforge.profile.scope import ModuleScope

    model = setup.model
    if model is None:
        return [], 0, 0
    root = getattr(model, "module", model)  # DDP / FSDP wrappers: name the layers of the wrapped model
    leaves = {n: m for n, m in root.named_modules() if n and any(True for _ in m.parameters(recurse=False))}
    clock, times, opened = rec.clock, {}, {}
    handles = []
    for name, m in leaves.items():
        handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: opened.__setitem__(n, clock.mark())))
        handles.append(m.register_forward_hook(
            lambda _m, _a, _o, n=name: times.setdefault(n, []).append((opened[n], clock.mark()))))
    try:
        run_step(setup, stream, rec, {})  # timed alone: the counter below would slow every operator
    finally:
        for h in handles:
            h.remove()
    clock.sync()
    scope = ModuleScope(root)
    counter = FlopCounter(scope.current)
    fwd_records = {}
    rec.on_backward = lambda: fwd_records.setdefault("n", len(counter.counts.records))
    try:
        with scope, counter:
            run_step(setup, stream, rec, {})
    finally:
        rec.on_backward = None
    clock.sync()
    flops: dict[str, float] = {}
    for r in counter.counts.records:
        mod = r.module
        while mod and mod not in leaves:
            mod = mod.rpartition(".")[0]
        if mod:
            flops[mod] = flops.get(mod, 0) + r.flops
    rows = []
    for name, spans in times.items():
        ms = sum(clock.resolve(a, b) if clock.cuda else (b - a) / 1e6 for a, b in spans)
        rows.append({"layer": name, "type": type(leaves[name]).__name__, "calls": len(spans), "forward_ms": ms,
                     "flops": flops.get(name, 0)})
    rows.sort(key=lambda r: -r["forward_ms"])
    n_fwd = fwd_records.get("n", len(counter.counts.records))
    return rows, sum(r.flops for r in counter.counts.records[:n_fwd]), counter.counts.bytes


def _traced_comm(setup: TrainSetup, stream: BatchStream, rec: Recorder, n: int) -> dict[str, float] | None:
    """GPU: per-step NCCL kernel time, overlapped with compute and exposed, from a traced window."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run_step(setup, stream, rec, {})
        rec.clock.sync()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    split = split_device_comm(kernels)
    return {k: v / 1000.0 / n for k, v in split.items()}  # µs -> ms per step


def profile_train(setup: TrainSetup, config: TrainConfig | None = None, progress=None) -> dict[str, Any]:
    """Profile ``setup``; the result dict (per rank) is what the findings, the report and the merge read."""
    cfg = config or TrainConfig()
    say = progress or (lambda _msg: None)
    rank, world = _rank_world()
    clock = Clock(setup.device)
    rec = Recorder(clock)
    stream = BatchStream(setup.loader)
    notes: list[str] = []
    ddp = _ddp(setup.model)
    with instrumented(rec, setup):
        if ddp is not None and not clock.cuda:
            try:
                ddp.register_comm_hook(None, ddp_comm_hook(rec))
            except RuntimeError as e:  # a hook of the user's own: keep it, and say what that costs
                notes.append(f"DDP already has a comm hook ({e}); bucket all-reduces are not split out")
        say(f"warm-up: {cfg.warmup} steps")
        for _ in range(cfg.warmup):
            run_step(setup, stream, rec, {})
        clock.sync()
        n_plain = cfg.steps if cfg.plain is None else cfg.plain
        say(f"measuring: {n_plain} plain and {cfg.steps} instrumented steps")
        plain = _plain_steps(setup, stream, rec, n_plain // 2)
        records, info = [], {}
        t_wall = time.perf_counter_ns()
        for _ in range(cfg.steps):
            rec.begin()
            run_step(setup, stream, rec, info)
            records.append(rec.finish())
        wall_ms = (time.perf_counter_ns() - t_wall) / 1e6 / cfg.steps
        steps = [breakdown(r) for r in records]
        plain += _plain_steps(setup, stream, rec, n_plain - n_plain // 2)
        device_comm = None
        if clock.cuda and cfg.trace_comm and world > 1:
            say("tracing communication kernels")
            device_comm = _traced_comm(setup, stream, rec, min(cfg.steps, 5))
        say("memory and layer steps")
        memory = _memory_step(setup, stream, rec)
        layers, fwd_flops, step_bytes = _layer_step(setup, stream, rec)
    agg = aggregate(steps)
    if device_comm is not None:  # move NCCL's exposed time out of backward, where the stream waited for it
        exposed = min(device_comm["exposed"], agg["mean"]["backward"])
        for s in steps:
            scale = s["backward"] / agg["mean"]["backward"] if agg["mean"]["backward"] else 0.0
            s["backward"] -= exposed * scale
            s["comm_exposed"] += exposed * scale
            s["comm_overlapped"] = device_comm["overlapped"]
        agg = aggregate(steps)
        notes.append("communication split from NCCL kernels in a traced window of "
                     f"{min(cfg.steps, 5)} steps: {device_comm['exposed']:.3f} ms exposed, "
                     f"{device_comm['overlapped']:.3f} ms overlapped per step")
    plain_ms = sorted(plain)[len(plain) // 2] if plain else None
    med = agg["median_step_ms"]
    overhead = (med / plain_ms - 1.0) if plain_ms else None
    loader = setup.loader
    opt = setup.optimizer
    return {
        "schema": SCHEMA, "tool": "warpforge", "kind": "train", "target": setup.name,
        "meta": {"device": _device_name(setup.device), "device_type": setup.device.type, "torch": torch.__version__,
                 "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "steps": cfg.steps, "warmup": cfg.warmup, "plain_steps": len(plain), "rank": rank, "world": world,
                 "clock": "CUDA events" if clock.cuda else "host timers (perf_counter)"},
        "steps": steps, "aggregate": agg,
        "timing": {"instrumented_ms": med, "plain_ms": plain_ms, "overhead": overhead, "wall_ms": wall_ms,
                   "plain_all_ms": plain},
        "h2d": {"bytes": info.get("h2d_bytes", 0), "pinned": info.get("pinned")},
        "loader": {"type": type(loader).__name__, "num_workers": getattr(loader, "num_workers", None),
                   "pin_memory": getattr(loader, "pin_memory", None),
                   "prefetch_factor": getattr(loader, "prefetch_factor", None),
                   "epochs_rolled": stream.epochs},
        "optimizer": None if opt is None else {
            "type": type(opt).__name__, "param_tensors": sum(len(g["params"]) for g in opt.param_groups),
            "foreach": opt.defaults.get("foreach"), "fused": opt.defaults.get("fused")},
        "ddp": None if ddp is None else {"bucket_cap_mb": getattr(ddp, "bucket_bytes_cap", 0) / 2**20},
        "fsdp": _fsdp(setup.model),
        "memory": memory, "layers": layers, "flops_per_step": 3 * fwd_flops,
        "bytes_per_step": step_bytes,
        "device_comm": device_comm, "notes": notes,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from warpforge.hw.probe import cpu_name

    with contextlib.suppress(Exception):
        return cpu_name()
    return "CPU"
