"""Findings in plain words, each with the evidence behind it, and a one-line verdict for the window.

Thresholds are stated where they are used. Severity is the share of the window (or of device
time) a finding is about, so the list sorts by what is worth fixing first.
"""

from __future__ import annotations

from typing import Any

from warpforge.profile.attribute import Attribution
from warpforge.profile.events import Trace
from warpforge.profile.result import Analysis, Row

# Launch-bound: most kernels are shorter than one launch, and they and the idle gaps before them
# take at least half the window. Ten per iteration at least, so one tiny kernel is not a pattern.
LAUNCH_SHARE, LAUNCH_KERNEL_SHARE, LAUNCH_MIN_KERNELS = 0.5, 0.5, 10
HOST_SHARE = 0.2  # GPU waiting on the host this much of the window is worth saying
LOW_FRACTION, HIGH_FRACTION = 0.5, 0.8  # of the roof that binds
ROW_SHARE = 0.05  # operators below this share of device time are not called out one by one


def pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def us(x: float) -> str:
    if x >= 1000:
        return f"{x / 1000:.2f} ms"
    return f"{x:.1f} µs" if x < 100 else f"{x:.0f} µs"


def rate(r: Row) -> str:
    """Achieved rate against the roof that binds the row, e.g. "1.10 TB/s of 4.60 TB/s"."""
    if r.bound == "memory" and r.GBps is not None:
        return f"{r.GBps / 1e3:.2f} TB/s" if r.GBps >= 100 else f"{r.GBps:.1f} GB/s"
    if r.tflops is not None:
        return f"{r.tflops:.1f} TFLOP/s" if r.tflops >= 1 else f"{r.tflops * 1e3:.0f} GFLOP/s"
    return "—"


def roof_name(r: Row) -> str:
    return "memory roof" if r.bound == "memory" else f"{r.ceiling} compute roof"


def _f(kind: str, severity: float, text: str, advice: str = "", **evidence: Any) -> dict[str, Any]:
    return {"kind": kind, "severity": round(float(severity), 4), "text": text, "advice": advice, "evidence": evidence}


def findings_for(a: Analysis, trace: Trace, att: Attribution) -> list[dict[str, Any]]:
    out = _cpu_findings(a) if a.device_type != "cuda" else _gpu_findings(a, att)
    out.extend(_row_findings(a))
    return sorted(out, key=lambda f: -f["severity"])


def _cpu_findings(a: Analysis) -> list[dict[str, Any]]:
    s = a.split
    out = []
    if s.window_us and s.overhead_us is not None and s.overhead_us / s.window_us >= 0.3:
        share = s.overhead_us / s.window_us
        out.append(_f("host-overhead", share,
                      f"{pct(share)} of each iteration ({us(s.overhead_us)}) runs outside operators: Python and "
                      "dispatch overhead", "batch more work per call, or compile the model",
                      overhead_us=s.overhead_us, window_us=s.window_us))
    return out


def _gpu_findings(a: Analysis, att: Attribution) -> list[dict[str, Any]]:
    s = a.split
    w = s.window_us or 1.0
    out = []
    n_short, n_k = s.short_kernels or 0.0, s.kernels or 0.0
    launch_bound = (n_short >= LAUNCH_MIN_KERNELS and n_k and n_short / n_k >= LAUNCH_KERNEL_SHARE
                    and s.short_window_share >= LAUNCH_SHARE)
    if launch_bound:
        mean_k = (s.short_kernel_us or 0.0) / n_short
        mean_gap = (s.short_gap_us or 0.0) / n_short
        out.append(_f("launch-bound", s.short_window_share,
                      f"{pct(s.short_window_share)} of GPU time is {n_short:,.0f} kernels under "
                      f"{s.short_threshold_us:.1f} µs per iteration and the idle gaps before them: launch-bound — "
                      "capture a CUDA graph or fuse",
                      "capture the step in a CUDA graph (torch.compile mode='reduce-overhead' or torch.cuda.graphs), "
                      "or fuse the small ops into fewer kernels",
                      short_kernels_per_iter=n_short, kernels_per_iter=n_k, mean_kernel_us=mean_k,
                      mean_gap_us=mean_gap, launch_us=s.short_threshold_us,
                      launch_source=a.launch.source if a.launch else None))
    host_rest = (s.idle_host_us or 0.0) - ((s.short_gap_us or 0.0) if launch_bound else 0.0)
    if host_rest / w >= HOST_SHARE:
        where = "; ".join(f"{us(g['us'])} in {g['gaps']:,.0f} gaps while the host ran {g['host_was_in']}"
                          for g in s.host_gaps[:3])
        out.append(_f("host-bound", host_rest / w,
                      f"the GPU waits on the host {pct(host_rest / w)} of the window ({us(host_rest)} per iteration): "
                      f"the CPU is not feeding it. Where the host was: {where}",
                      "take host work (Python, data preparation, syncs) off the critical path; overlap it with GPU "
                      "work or capture the step in a CUDA graph", gaps=s.host_gaps, idle_host_us=s.idle_host_us))
    if (s.idle_launch_us or 0.0) / w >= HOST_SHARE:
        out.append(_f("launch-gaps", s.idle_launch_us / w,
                      f"{pct(s.idle_launch_us / w)} of the window is gaps between work already queued "
                      "(the GPU's own launch latency)", "fewer, larger kernels: fuse, or replay a CUDA graph",
                      idle_launch_us=s.idle_launch_us))
    if s.syncs:
        total = sum(s.syncs.values())
        shown = ", ".join(f"{k} x{v:g}" for k, v in list(s.syncs.items())[:4])
        out.append(_f("syncs", min(0.05 * total, 0.3),
                      f"{total:g} blocking host-device sync{'' if total == 1 else 's'} per iteration ({shown})",
                      "each sync drains the GPU queue: keep values on the device (no .item(), .cpu(), "
                      "nonzero or data-dependent shapes in the step)", syncs=s.syncs))
    if (s.memory_us or 0.0) / w >= 0.05:
        out.append(_f("copies", s.memory_us / w,
                      f"memcpy/memset take {pct(s.memory_us / w)} of the window ({us(s.memory_us)} per iteration)",
                      "keep tensors resident on the GPU; use pinned memory and non_blocking copies that overlap",
                      memory_us=s.memory_us))
    if (s.comm_us or 0.0) / w >= 0.1:
        out.append(_f("communication", s.comm_us / w, f"NCCL communication takes {pct(s.comm_us / w)} of the window",
                      "overlap communication with compute, or shard differently", comm_us=s.comm_us))
    kt = sum(s.bound_us.values()) or 1.0
    if s.bound_us:
        parts = ", ".join(f"{pct(v / kt)} {k}" for k, v in sorted(s.bound_us.items(), key=lambda kv: -kv[1]))
        out.append(_f("bound-split", 0.0, f"operator time by roofline bound: {parts}", "", bound_us=s.bound_us))
    out.append(_f("utilization", 0.0,
                  f"GPU busy {pct((s.busy_us or 0.0) / w)} of the window ({us(s.busy_us or 0.0)} of "
                  f"{us(s.window_us)} per iteration); {n_k:,.0f} kernels per iteration",
                  "", busy_us=s.busy_us, window_us=s.window_us))
    return out


def _row_findings(a: Analysis) -> list[dict[str, Any]]:
    out = []
    where = "GPU time" if a.device_type == "cuda" else "operator time"
    top = a.ops[:10]
    if top and top[0].share >= 0.3:
        r = top[0]
        out.append(_f("dominant-op", r.share * 0.5, f"{r.name} alone takes {pct(r.share)} of {where}",
                      "start there", op=r.name, time_us=r.time_us))
    for r in top:
        if r.fraction is None or r.share < ROW_SHARE:
            continue
        tiny = a.launch is not None and r.calls > 0 and r.time_us / r.calls < a.launch.us
        if r.fraction < LOW_FRACTION and not tiny:  # calls shorter than a launch: the launch is the problem
            advice = ("memory-bound well below the roof: small, strided or uncoalesced accesses, or too few "
                      "blocks in flight; fuse it with its neighbours or use a better kernel"
                      if r.bound == "memory" else
                      "compute-bound well below the roof: a shape or dtype that misses the tensor cores, or "
                      "tiles too small for the problem")
            ceil = _roof_value(a, r)
            out.append(_f("below-roof", r.share * (1 - r.fraction),
                          f"{r.name} runs at {pct(r.fraction)} of the {roof_name(r)} ({rate(r)}{ceil}), "
                          f"{pct(r.share)} of {where}", advice, op=r.name, fraction=r.fraction, bound=r.bound,
                          GBps=r.GBps, tflops=r.tflops, intensity=r.intensity))
        elif r.fraction >= HIGH_FRACTION and r.share >= 0.1:
            advice = ("near the memory roof: only moving fewer bytes helps (fuse, lower precision)"
                      if r.bound == "memory" else "near the compute roof: only a lower precision or less work helps")
            out.append(_f("near-roof", r.share * 0.1,
                          f"{r.name} runs at {pct(r.fraction)} of the {roof_name(r)} ({rate(r)}{_roof_value(a, r)}), "
                          f"{pct(r.share)} of {where}", advice, op=r.name, fraction=r.fraction, bound=r.bound))
    out.extend(_op_type_findings(a, where))
    if a.device_type == "cuda":
        fp32 = [r for r in a.ops if r.kind in ("matmul", "conv", "attention") and r.ceiling == "fp32"]
        share = sum(r.share for r in fp32)
        if share >= 0.1 and a.ceilings:
            t = a.ceilings["tflops"]
            out.append(_f("fp32-matmul", share * 0.5,
                          f"{pct(share)} of GPU time is fp32 matmul/conv/attention on the CUDA cores (TF32 off)",
                          f"allow TF32 (torch.set_float32_matmul_precision('high')) or run bf16: the roof rises "
                          f"{t['tf32'] / t['fp32']:.0f}x / {t['bf16'] / t['fp32']:.0f}x",
                          ops=[r.name for r in fp32[:5]]))
        unplaced = sum(r.share for r in a.ops if r.fraction is None)
        if unplaced >= 0.1:
            out.append(_f("unplaced", unplaced * 0.1,
                          f"{pct(unplaced)} of GPU time is in operators with no counted work (not on the roofline)",
                          "CUDA-graph replays, compiled regions and uncounted ops show time only; profile the eager "
                          "model (or pass count_fn) to count them", share=unplaced))
    return out


def _op_type_findings(a: Analysis, where: str) -> list[dict[str, Any]]:
    """Repeated layers: one operator type spread over many modules, each too small to call out alone."""
    by: dict[str, list] = {}
    for r in a.ops:
        if r.fraction is not None:
            by.setdefault(r.op, []).append(r)
    out = []
    for op, rows in by.items():
        share = sum(r.share for r in rows)
        if len(rows) < 2 or share < 0.1:
            continue
        t = sum(r.time_us for r in rows)
        frac = sum(r.fraction * r.time_us for r in rows) / t  # time-weighted
        bound = max(("memory", "compute"), key=lambda b: sum(r.time_us for r in rows if r.bound == b))
        if frac < LOW_FRACTION:
            out.append(_f("below-roof-type", share * (1 - frac),
                          f"{op} in {len(rows)} modules takes {pct(share)} of {where} at {pct(frac)} of the "
                          f"{bound} roof on average (time-weighted)",
                          "one better kernel (or a fusion) for this operator pays off in every layer",
                          op=op, modules=[r.module for r in rows[:8]], fraction=frac, share=share))
    return out


def _roof_value(a: Analysis, r: Row) -> str:
    if not a.ceilings:
        return ""
    if r.bound == "memory":
        return f" of {a.ceilings['hbm_GBps'] / 1e3:.2f} TB/s"
    v = a.ceilings["tflops"].get(r.ceiling or "fp32")
    return f" of {v:.0f} TFLOP/s" if v else ""


def verdict_for(a: Analysis) -> str:
    """One line: what bounds this window."""
    if a.device_type != "cuda":
        return "CPU run (host timers, no roofline)"
    kinds = {f["kind"] for f in a.findings}
    s = a.split
    w = s.window_us or 1.0
    busy = f"GPU busy {pct((s.busy_us or 0.0) / w)}"
    if "launch-bound" in kinds:
        return f"launch-bound ({busy})"
    if "host-bound" in kinds and (s.idle_host_us or 0.0) / w >= 0.3:
        return f"host-bound ({busy})"
    if (s.idle_launch_us or 0.0) / w >= 0.3:
        return f"launch-latency-bound ({busy})"
    if (s.comm_us or 0.0) / w >= 0.3:
        return f"communication-bound ({busy})"
    kt = sum(s.bound_us.values())
    if kt > 0:
        for b in ("memory", "compute"):
            if s.bound_us.get(b, 0.0) / kt >= 0.5:
                return f"{b}-bound ({busy})"
    return f"mixed ({busy})"
