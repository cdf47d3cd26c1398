"""Where a splat render's time goes on the GPU: every kernel of ``warpforge.splat.rasterize`` (and gsplat's
``rasterization`` when installed) at the forward and forward + backward rows, the host syncs each makes, and
the wall time per call against the summed kernel time (the gap is the GPU waiting on the host).

    python benchmarks/sweeps/splat_profile.py [--n 1000000] [--size 1920x1080] [--out profile.json]

Two CPU-only modes count the host side without a GPU:

    python benchmarks/sweeps/splat_profile.py --count          # launches of one forward and forward+backward
    python benchmarks/sweeps/splat_profile.py --host 300       # host ms per call, every Triton launch skipped

``--count`` runs every Triton kernel through the interpreter on a small scene (default 300 Gaussians, 64x48) and
lists, in order, the Triton launches and the torch ops that launch a CUDA kernel (not views or allocations);
one torch op may be several CUDA kernels (the sort), and CUDA's memsets for cached allocations do not show.
``--host`` times the Python and torch-op side of a call with the Triton launches replaced by no-ops (the
intersection count writes 1s, so the later stages see sane sizes): CPU torch ops stand in for CUDA launches, so
the figure compares commits on one machine and is no GPU time.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from warpforge.bench.suites._splat_run import PARAMS, Workload, gsplat_render, make_scene, ours_render


def _call(render, scene, backward: bool):
    params = [scene[k].detach().requires_grad_(backward) for k in PARAMS]
    img, alpha, _ = render(*params, scene["viewmats"], scene["Ks"])
    if backward:
        torch.autograd.grad((img * scene["v_img"]).sum(), params)


def syncs(render, scene, backward: bool) -> list[str]:
    """The host syncs of one call, each as the innermost warpforge (or gsplat) frame that asked for it."""
    out: list[str] = []
    if not torch.cuda.is_available():
        return out
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _call(render, scene, backward)
            torch.cuda.synchronize()
        for w in caught:
            if "synchroniz" not in str(w.message):
                continue
            out.append(f"{w.filename.split('site-packages/')[-1].split('src/')[-1]}:{w.lineno}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return out


def kernels(render, scene, backward: bool, reps: int = 10) -> dict:
    for _ in range(3):
        _call(render, scene, backward)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        _call(render, scene, backward)
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / reps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            _call(render, scene, backward)
        sync()
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name][0] += e.device_time_total / 1e3 / reps
            by[e.name][1] += 1
    rows = sorted(((k, v[0], v[1] // reps) for k, v in by.items()), key=lambda r: -r[1])
    gpu_ms = sum(r[1] for r in rows)
    return {"wall_ms": wall_ms, "kernel_ms": gpu_ms, "launches": sum(r[2] for r in rows),
            "kernels": [{"name": k[:90], "ms": round(ms, 4), "count": c} for k, ms, c in rows]}


# torch ops that launch no CUDA kernel (warpforge.profile.launches' rule)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_reshape_alias", "as_strided_", "set_", "resize_", "_local_scalar_dense", "is_same_size",
              "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


def count_launches(render, scene, backward: bool) -> list[str]:
    """The launches of one call, in order: Triton kernels (run by the interpreter) and kernel-launching torch
    ops. The harness's loss is counted too: 2 ops forward (mul, sum), 2 backward (ones_like, mul)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    from warpforge.kernels._dispatch import force_triton

    log: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _NO_KERNEL:
                log.append(f"torch:{name}")
            return out

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        log.append(f"triton:{self.fn.__name__}")
        with _disable_current_modes():  # the interpreter's own tensor copies are not launches
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        with force_triton(), Ops():
            _call(render, scene, backward)
    finally:
        InterpretedFunction.run = run
    return log


def host_ms(render, scene, backward: bool, calls: int) -> float:
    """Host milliseconds per call with every Triton launch skipped (best of 5 rounds of ``calls``)."""
    from triton.runtime.interpreter import InterpretedFunction

    from warpforge.kernels._dispatch import force_triton

    run = InterpretedFunction.run

    def skipped(self, *args, grid, warmup=False, **kwargs):
        if self.fn.__name__ == "_isect_count_kernel":
            args[4].fill_(1)  # one tile per Gaussian: the intersection arrays get a size
        return None

    InterpretedFunction.run = skipped
    try:
        with force_triton():
            for _ in range(max(3, calls // 10)):
                _call(render, scene, backward)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    _call(render, scene, backward)
                best = min(best, (time.perf_counter() - t0) * 1e3 / calls)
    finally:
        InterpretedFunction.run = run
    return best


def cpu_modes(a, w_: int, h_: int) -> None:
    """--count and --host: the host side on this machine's CPU (see the module docstring)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        raise SystemExit("--count and --host run the Triton interpreter on the CPU: set TRITON_INTERPRET=1")
    for backward in (False, True):
        wl = Workload(n=a.n, width=w_, height=h_, backward=backward)
        scene, render = make_scene(wl, torch.device("cpu")), ours_render(wl)
        if a.count:
            log = count_launches(render, scene, backward)
            n_triton = sum(x.startswith("triton:") for x in log)
            print(f"== {wl.label}: {len(log)} launches ({n_triton} Triton, {len(log) - n_triton} torch ops)")
            print("   " + " ".join(x.split(":", 1)[1] for x in log))
        if a.host:
            print(f"== {wl.label}: host {host_ms(render, scene, backward, a.host):.3f} ms a call "
                  "(CPU, Triton launches skipped)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=None, help="Gaussians (1000000; --count and --host: 300)")
    ap.add_argument("--size", default=None, help="WxH (1920x1080; --count and --host: 64x48)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-gsplat", action="store_true", help="profile warpforge only (gsplat's first call builds "
                    "its CUDA extension: ~80 s)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="only the host side: N forward calls of warpforge under cProfile, the top functions by "
                         "own time")
    ap.add_argument("--count", action="store_true", help="CPU: count the launches of one call (interpreter)")
    ap.add_argument("--host", type=int, default=0, metavar="N", help="CPU: host ms a call over N calls, Triton "
                    "launches skipped")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no CUDA kernels)")
    a = ap.parse_args()
    small = a.count or a.host
    a.n = a.n or (300 if small else 1_000_000)
    w_, h_ = (int(x) for x in (a.size or ("64x48" if small else "1920x1080")).split("x"))
    if small:
        cpu_modes(a, w_, h_)
        return
    dev = torch.device(a.device)
    if a.cprofile:
        import cProfile
        import pstats

        wl = Workload(n=a.n, width=w_, height=h_)
        scene, render = make_scene(wl, dev), ours_render(wl)
        for _ in range(3):
            _call(render, scene, False)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.cprofile):
            _call(render, scene, False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(40)
        return
    report: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "n": a.n,
                    "size": a.size, "rows": {}}
    for backward in (False, True):
        wl = Workload(n=a.n, width=w_, height=h_, backward=backward)
        scene = make_scene(wl, dev)
        renders = {"ours": ours_render(wl)}
        if dev.type == "cuda" and not a.no_gsplat:
            try:
                import gsplat  # noqa: F401

                renders["gsplat"] = gsplat_render(wl, packed=False)
            except ImportError:
                pass
        for name, render in renders.items():
            k = kernels(render, scene, backward)
            k["syncs"] = syncs(render, scene, backward)
            report["rows"][f"{name} {wl.label}"] = k
            print(f"\n== {name} {wl.label}: wall {k['wall_ms']:.3f} ms, kernels {k['kernel_ms']:.3f} ms, "
                  f"{k['launches']} launches, {len(k['syncs'])} syncs: {', '.join(k['syncs'])}")
            for r in k["kernels"][:a.top]:
                print(f"  {r['ms']:8.4f} ms  x{r['count']:<3d} {r['name']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
