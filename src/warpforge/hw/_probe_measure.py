"""The probe's individual measurements. Each returns a JSON-able dict; sizes come from a ProbePlan.

Bandwidth figures are bytes / median time; a copy counts the bytes read AND written. Kernels that
run well under a millisecond are timed in bursts of back-to-back calls (see :func:`burst_ms`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from warpforge.timing import time_fn
from warpforge.hw.probe_plan import MiB, ProbePlan


def burst_ms(fn: Callable[[], Any], *, k: int, warmup: int, rep: int, device: torch.device | None = None) -> float:
    """Median ms per call of ``fn`` timed as bursts of ``k`` back-to-back calls per sample.

    One event pair around a single short call also times the host's launch latency (the start
    event runs at once, the kernel only after Python has launched it: ~10 us, 2-4% of a 0.5 ms
    kernel). Inside a burst the GPU queue stays full, so only the first launch latency counts.
    """
    def burst() -> None:
        for _ in range(k):
            fn()

    return time_fn(burst, warmup=warmup, rep=rep, flush_l2=False, device=device).median_ms / k


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ---- HBM ---------------------------------------------------------------------------------------------

def measure_hbm(dev: torch.device, plan: ProbePlan, gen: torch.Generator, total_mem: int) -> dict[str, Any]:
    """Read (warpforge sum), write (warpforge fill), copy (warpforge copy, and torch's copy_ beside it)."""
    from warpforge.kernels import memory

    nbytes = min(plan.hbm_bytes, total_mem // 16) // 4 * 4  # two buffers; leave room on small parts
    src = torch.rand(nbytes // 4, device=dev, generator=gen)
    dst = torch.empty_like(src)
    kw = {"k": plan.burst, "warmup": 2, "rep": plan.hbm_rep}
    res = {"buffer_bytes": nbytes}
    res["read_GBps"] = _gbps(nbytes, burst_ms(lambda: memory.sum(src), **kw))
    res["write_GBps"] = _gbps(nbytes, burst_ms(lambda: memory.fill(dst, 0.5), **kw))
    res["copy_GBps"] = _gbps(2 * nbytes, burst_ms(lambda: memory.copy(src, dst), **kw))
    res["torch_copy_GBps"] = _gbps(2 * nbytes, burst_ms(lambda: dst.copy_(src), **kw))
    ok = torch.equal(memory.copy(src, dst), src)
    ref = src.to(torch.float64).sum().item()
    res["check_ok"] = bool(ok and abs(memory.sum(src).item() - ref) <= 1e-5 * abs(ref))
    return res


# ---- cache hierarchy: bandwidth sweep ---------------------------------------------------------------

def measure_sweep(dev: torch.device, plan: ProbePlan, gen: torch.Generator, sms: int, l2_MiB: float) -> dict:
    """Bandwidth of the working-set sweep kernel at each size in plan.sweep_MiB (largest first allocated)."""
    from warpforge.hw import _probe_kernels as pk

    sizes = sorted(plan.sweep_MiB)
    buf = torch.rand(sizes[-1] * MiB // 4, device=dev, generator=gen)
    programs = sms * pk.SWEEP_PROGRAMS_PER_SM
    points = []
    for mib in sizes:
        run, nbytes = pk.sweep_launcher(buf, mib * MiB, plan.sweep_bytes_per_launch, programs)
        ms = burst_ms(run, k=plan.burst, warmup=1, rep=plan.sweep_rep)
        points.append({"MiB": mib, "GBps": _gbps(nbytes, ms)})
    return {"points": points, **analyze_sweep(points, l2_MiB)}


def analyze_sweep(points: list[dict[str, float]], l2_MiB: float) -> dict[str, Any]:
    """L2 plateau, HBM stream and the cliff between them from sweep points [{"MiB", "GBps"}].

    plateau: median over working sets <= L2/2 (safely resident); stream: median over sets >= 4x L2
    (fallbacks: the smallest / largest set); cliff: the smallest set whose bandwidth falls below
    the midpoint of the two, reported only when the plateau is clearly (>= 1.2x) above the stream.
    """
    pts = sorted(points, key=lambda p: p["MiB"])
    if not pts:
        raise ValueError("analyze_sweep needs at least one point")
    low = [p["GBps"] for p in pts if p["MiB"] <= l2_MiB / 2] or [pts[0]["GBps"]]
    high = [p["GBps"] for p in pts if p["MiB"] >= 4 * l2_MiB] or [pts[-1]["GBps"]]
    plateau, stream = statistics.median(low), statistics.median(high)
    cliff = None
    if plateau >= 1.2 * stream:
        mid = (plateau + stream) / 2
        cliff = next((p["MiB"] for p in pts if p["GBps"] < mid), None)
    return {"plateau_GBps": plateau, "stream_GBps": stream, "cliff_MiB": cliff}


# ---- load-to-use latency: pointer chase -------------------------------------------------------------

def _chase_level(chain, steps: int, warm: int, cache: str, reps: int) -> dict[str, Any]:
    from warpforge.hw import _probe_kernels as pk

    slots = chain.order.numel()
    samples, ok = [], True
    for r in range(reps):
        # Each repeat starts at a fresh point of the cycle: for the HBM chain its lines are still cold.
        pos = (r * (warm + steps + 1)) % slots
        start = int(chain.order[pos])
        res = pk.chase(chain, start, warm, steps, cache=cache, timed=True)
        ok &= res["final"] == int(chain.order[(pos + warm + steps) % slots]) * chain.stride
        samples.append(res)
    cycles = statistics.median(s["cycles"] for s in samples)
    ns = statistics.median(s["ns"] for s in samples)
    return {"cycles": cycles, "ns": ns, "hops": steps, "chain_ok": ok}


def measure_latency(dev: torch.device, plan: ProbePlan, gen: torch.Generator, sms: int, l2_bytes: int) -> dict:
    """L1, L2 and HBM load-to-use latency in SM cycles and ns, and the SM clock they imply."""
    from warpforge.hw import _probe_kernels as pk

    out: dict[str, Any] = {"method": "in-kernel %clock64 and %globaltimer around a dependent-load chain"}
    # L1: 16 KiB (well inside any L1), 128 B apart, cached at L1 (.ca); warm-up laps in-kernel.
    l1 = pk.make_chain(16 << 10, 128, dev, gen)
    out["l1"] = {"ws_bytes": 16 << 10, "stride_bytes": 128,
                 **_chase_level(l1, plan.chase_steps, 2 * l1.order.numel(), ".ca", plan.chase_rep)}
    # L2: 2 MiB (past L1, far inside L2), .cg so L1 never serves it; primed by one .cg sweep.
    l2 = pk.make_chain(2 * MiB, 128, dev, gen)
    prime, _ = pk.sweep_launcher(l2.next.view(torch.float32), 2 * MiB, 4 * MiB, sms * pk.SWEEP_PROGRAMS_PER_SM)
    prime()
    out["l2"] = {"ws_bytes": 2 * MiB, "stride_bytes": 128,
                 **_chase_level(l2, plan.chase_steps, 256, ".cg", plan.chase_rep)}
    # HBM: 4x L2 (>= 256 MiB) in random order 512 B apart, so neither L2 nor a prefetcher helps;
    # the chain's construction leaves its lines in L2, so the L2 is flushed by a 2x-L2 write.
    ws = max(4 * l2_bytes, 256 * MiB)
    hbm = pk.make_chain(ws, 512, dev, gen)
    torch.empty(2 * l2_bytes, dtype=torch.uint8, device=dev).fill_(0x5A)
    out["hbm"] = {"ws_bytes": ws, "stride_bytes": 512,
                  **_chase_level(hbm, plan.chase_hbm_steps, 1, ".cg", plan.chase_rep)}
    l1_ns = out["l1"]["ns"]
    out["clock_MHz"] = out["l1"]["cycles"] / l1_ns * 1e3 if l1_ns > 0 else None
    return out


# ---- matrix throughput through cuBLAS ---------------------------------------------------------------

def _matmul_fn(prec: str, n: int, dev: torch.device, gen: torch.Generator) -> tuple[Callable[[], Any], str]:
    a = torch.randn(n, n, device=dev, generator=gen)
    b = torch.randn(n, n, device=dev, generator=gen)
    if prec in ("fp32", "tf32"):
        c = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=c)), "torch.matmul"
    if prec in ("fp16", "bf16"):
        dt = torch.float16 if prec == "fp16" else torch.bfloat16
        a, b = a.to(dt), b.to(dt)
        c = torch.empty_like(a)
        return (lambda: torch.matmul(a, b, out=c)), "torch.matmul"
    if prec == "fp8":
        # cuBLAS fp8 wants A row-major and B column-major (B = [N, K] row-major, transposed).
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev, dtype=torch.float32)
        return (lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)), \
            "torch._scaled_mm e4m3 (fast accumulation), bf16 out"
    if prec == "int8":
        ai = torch.randint(-100, 100, (n, n), device=dev, dtype=torch.int8, generator=gen)
        bi = torch.randint(-100, 100, (n, n), device=dev, dtype=torch.int8, generator=gen).t()
        return (lambda: torch._int_mm(ai, bi)), "torch._int_mm (int32 accumulate), TOPS"
    raise ValueError(f"unknown precision {prec!r}")


def measure_matmul(dev: torch.device, plan: ProbePlan, gen: torch.Generator) -> dict[str, Any]:
    """TFLOP/s (int8: TOPS) of an n x n x n matmul per precision; a failure is recorded, not raised."""
    out: dict[str, Any] = {}
    prev = torch.get_float32_matmul_precision()
    n = plan.matmul_n
    try:
        for prec in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8"):
            # "highest": fp32 matmuls stay on FFMA; "high": cuBLAS may use tf32 tensor cores.
            torch.set_float32_matmul_precision("high" if prec == "tf32" else "highest")
            try:
                fn, how = _matmul_fn(prec, n, dev, gen)
                rep = plan.fp32_rep if prec == "fp32" else plan.matmul_rep
                # A ceiling is the best sustained rate: the median of each trial, best of three trials.
                # A trial right after another precision's products reads ~15% low (clocks and power settle
                # between shapes; notes/probe.md).
                trials = [time_fn(fn, warmup=max(3, rep // 2), rep=rep, flush_l2=False, device=dev).median_ms
                          for _ in range(3)]
                ms = min(trials)
                out[prec] = {"tflops": 2 * n**3 / (ms * 1e-3) / 1e12, "n": n, "ms": ms, "how": how,
                             "trial_ms": trials}
            except Exception as e:  # noqa: BLE001 - fp8/int8 are missing on older parts; keep the rest
                out[prec] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
            finally:
                torch.cuda.empty_cache()
    finally:
        torch.set_float32_matmul_precision(prev)
    return out


# ---- launch cost ------------------------------------------------------------------------------------

def measure_launch(dev: torch.device, plan: ProbePlan, gen: torch.Generator) -> dict[str, Any]:
    """Eager: a Python loop of tiny torch ops (host launch path). Graph: the same op captured
    ``plan.launch_kernels`` times in one CUDA graph and replayed (GPU-side per-kernel cost)."""
    x = torch.rand(1, device=dev, generator=gen)
    k = plan.launch_kernels

    def eager() -> None:
        for _ in range(k):
            x.add_(1.0)

    eager_ms = time_fn(eager, warmup=1, rep=plan.launch_rep, flush_l2=False, device=dev, hide_host=False).median_ms / k
    graph_ms = time_fn(lambda: x.add_(1.0), warmup=2, rep=plan.launch_rep, flush_l2=False, cuda_graph=True,
                       graph_calls=k, device=dev).median_ms
    return {"eager_us": eager_ms * 1e3, "eager_per_s": 1e3 / eager_ms, "graph_us": graph_ms * 1e3,
            "kernels_per_sample": k, "op": "x.add_(1.0) on one element"}


# ---- host <-> device --------------------------------------------------------------------------------

def measure_pcie(dev: torch.device, plan: ProbePlan, gen: torch.Generator) -> dict[str, Any]:
    """Host-device copy bandwidth, pinned (async DMA) and pageable (staged by the driver)."""
    n = plan.pcie_bytes
    d = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=gen)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned.copy_(d)
    pageable.copy_(d)
    kw = {"warmup": 1, "rep": plan.pcie_rep, "flush_l2": False, "device": dev}
    res = {"bytes": n}
    res["h2d_pinned_GBps"] = _gbps(n, time_fn(lambda: d.copy_(pinned, non_blocking=True), **kw).median_ms)
    res["d2h_pinned_GBps"] = _gbps(n, time_fn(lambda: pinned.copy_(d, non_blocking=True), **kw).median_ms)
    res["h2d_pageable_GBps"] = _gbps(n, time_fn(lambda: d.copy_(pageable), **kw).median_ms)
    res["d2h_pageable_GBps"] = _gbps(n, time_fn(lambda: pageable.copy_(d), **kw).median_ms)
    return res


# ---- CPU side (the whole probe without a GPU) -------------------------------------------------------

def measure_cpu(plan: ProbePlan) -> dict[str, Any]:
    """Host memory copy (bytes read + written) and fp32 matmul through torch on the CPU."""
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    n = plan.cpu_copy_bytes // 4
    src = torch.rand(n, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = time_fn(lambda: dst.copy_(src), warmup=1, rep=plan.cpu_rep, device=cpu).median_ms
    m = plan.cpu_matmul_n
    a = torch.randn(m, m, generator=gen)
    b = torch.randn(m, m, generator=gen)
    c = torch.empty_like(a)
    mm_ms = time_fn(lambda: torch.matmul(a, b, out=c), warmup=1, rep=plan.cpu_rep, device=cpu).median_ms
    gflops = 2 * m**3 / (mm_ms * 1e-3) / 1e9
    if not (math.isfinite(gflops) and gflops > 0):
        raise RuntimeError(f"CPU matmul timing gave {gflops} GFLOP/s")
    return {"memcpy_GBps": _gbps(2 * n * 4, copy_ms), "memcpy_bytes": n * 4,
            "fp32_matmul_GFLOPs": gflops, "matmul_n": m, "threads": torch.get_num_threads()}
