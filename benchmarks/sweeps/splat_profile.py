"""Where a splat render's time goes on the GPU: every kernel of ``warpforge.splat.rasterize`` (and gsplat's
``rasterization`` when installed) at the forward and forward + backward rows, the host syncs each makes, and
the wall time per call against the summed kernel time (the gap is the GPU waiting on the host).

    python benchmarks/sweeps/splat_profile.py [--n 1000000] [--size 1920x1080] [--out profile.json]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--size", default="1920x1080")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-gsplat", action="store_true", help="profile warpforge only (gsplat's first call builds "
                    "its CUDA extension: ~80 s)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="only the host side: N forward calls of warpforge under cProfile, the top functions by "
                         "own time")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no CUDA kernels)")
    a = ap.parse_args()
    w_, h_ = (int(x) for x in a.size.split("x"))
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
