"""Splat rasterizer tuning on the GPU: where the time goes (torch.profiler kernel table of one forward+backward
on the bench's 1M-Gaussian 1080p scene) and the blend kernels' tiling (Gaussians unrolled x warps a tile)
swept forward and backward, each configuration checked against the default one on the same inputs.

    python benchmarks/sweeps/splat_sweep.py --out sweep.json [--n 1000000] [--configs f2x2/b1x1,1x1,...]
        [--bench OUT.jsonl [--bench-filter TEXT]]

``--bench``: then run the ``splat`` suite in this process with the fastest configuration that passed its
check (gsplat must be installed), records to OUT.jsonl; the sweep's JSON names the configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from warpforge.bench.suites import _splat_run as sr
from warpforge.splat import blend, tiles
from warpforge.splat.project import project
from warpforge.splat.render import rasterize


def _ms(fn, warmup: int = 5, rep: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_table(w: sr.Workload, scene: dict) -> list[dict]:
    params = [scene[k].detach().requires_grad_() for k in sr.PARAMS]

    def step():
        img, _, _ = rasterize(*params, scene["viewmats"], scene["Ks"], w.width, w.height, sh_degree=w.sh_degree)
        torch.autograd.grad((img * scene["v_img"]).sum(), params)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": e.key[:90], "us_per_step": t / 5, "calls_per_step": e.count / 5})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def blend_inputs(w: sr.Workload, scene: dict) -> dict:
    from warpforge.splat.sh import spherical_harmonics
    tw, th = -(-w.width // 16), -(-w.height // 16)
    with torch.no_grad():
        p = project(scene["means"], scene["quats"], scene["scales"], scene["opacities"], scene["viewmats"],
                    scene["Ks"], w.width, w.height)
        colors = sr._sh_colors(spherical_harmonics, w, scene["means"], scene["sh"], scene["viewmats"])
        _, keys, ids = tiles.intersect_tiles(p.means2d, p.radii, p.depths, p.conics, p.opacities, 16, tw, th)
        offsets = tiles.tile_offsets(keys, w.cameras, tw, th)
    return dict(means2d=p.means2d.contiguous(), conics=p.conics.contiguous(), colors=colors.contiguous(),
                opacities=p.opacities.contiguous(), offsets=offsets, ids=ids, n_isects=ids.numel())


def _set(cfg: str) -> None:
    """'2x2': forward and backward unrolled 2 deep at 2 warps a tile; 'f2x2/b1x1': each its own."""
    parts = cfg.split("/")
    for part in parts:
        which = part[0] if part[0] in "fb" else "fb"
        u, w = (int(x) for x in part.lstrip("fb").split("x"))
        if "f" in which:
            blend.FWD_UNROLL, blend.FWD_WARPS = u, w
        if "b" in which:
            blend.BWD_UNROLL, blend.BWD_WARPS = u, w


def sweep_blend(w: sr.Workload, b: dict, configs: list[str]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    v_out = torch.rand(w.cameras, w.height, w.width, 3, device="cuda", generator=g) - 0.5
    v_alpha = torch.zeros(w.cameras, w.height, w.width, 1, device="cuda")
    args = (b["means2d"], b["conics"], b["colors"], b["opacities"], None, w.width, w.height, 16, b["offsets"],
            b["ids"])
    ref_out = ref_grads = None
    rows = []
    base = configs[0]
    for cfg in configs:
        _set(base)
        _set(cfg)
        row = {"config": cfg, "fwd": f"f{blend.FWD_UNROLL}x{blend.FWD_WARPS}",
               "bwd": f"b{blend.BWD_UNROLL}x{blend.BWD_WARPS}"}
        try:
            out, alphas, T, last = blend._fwd_triton(*args)
            grads, _ = blend._bwd_triton(*args, T, last, v_out, v_alpha, True)
            torch.cuda.synchronize()
            if ref_out is None:
                ref_out, ref_grads = out.clone(), [x.clone() for x in grads]
            row["fwd_max_diff"] = float((out - ref_out).abs().max())
            row["bwd_min_cos"] = min(float(torch.nn.functional.cosine_similarity(
                a.flatten().double(), r.flatten().double(), dim=0)) for a, r in zip(grads, ref_grads))
            row["fwd_ms"] = _ms(lambda: blend._fwd_triton(*args))
            row["bwd_ms"] = _ms(lambda: blend._bwd_triton(*args, T, last, v_out, v_alpha, True))
        except Exception as e:  # a configuration that does not compile or run is a row, not the end
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--configs", default="f2x2/b1x1,1x1,2x2,f2x4,f4x2,f1x2,b2x1,b1x2",
                    help="UNROLLxWARPS of the blend kernels, both or f... (forward) / b... (backward), e.g. "
                         "f2x2/b1x1; the first is the baseline the others are checked against")
    ap.add_argument("--bench", default=None, help="then run the splat suite with the winner, records here")
    ap.add_argument("--bench-filter", default=None, help="the suite's -k filter")
    a = ap.parse_args()
    w = sr.Workload(n=a.n, backward=True)
    scene = sr.make_scene(w, torch.device("cuda"))
    configs = a.configs.split(",")
    b = blend_inputs(w, scene)
    res = {"n": a.n, "n_isects": b["n_isects"], "blend": sweep_blend(w, b, configs)}
    ok = [r for r in res["blend"] if "error" not in r and r["fwd_max_diff"] < 1e-3 and r["bwd_min_cos"] > 0.9999]
    # the forward and backward launch separately: each takes its own fastest passing setting
    best = (f"{min(ok, key=lambda r: r['fwd_ms'])['fwd']}/{min(ok, key=lambda r: r['bwd_ms'])['bwd']}" if ok
            else configs[0])
    _set(best)
    res["kernels_with"] = best
    res["kernels"] = kernel_table(w, scene)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n{res['n_isects']} intersections\n{'kernel':<92}us/step  calls")
    for r in res["kernels"][:25]:
        print(f"{r['kernel']:<92} {r['us_per_step']:8.1f} {r['calls_per_step']:5.1f}")
    print(f"(kernel table with blend {best})\nconfig   fwd ms   bwd ms  fwd maxdiff  bwd min cos")
    for r in res["blend"]:
        if "error" in r:
            print(f"{r['config']:<6}  {r['error']}")
        else:
            print(f"{r['config']:<6} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwd_max_diff']:11.2e} "
                  f"{r['bwd_min_cos']:12.8f}")
    if a.bench:
        from rich.console import Console

        from warpforge.bench.cli import cli_bench
        print(f"== splat suite with blend {best}", flush=True)
        cli_bench(suite="splat", list_suites=False, quick=False, case_filter=a.bench_filter, store_url=None,
                  no_store=True, out=a.bench, console=Console(width=150))


if __name__ == "__main__":
    main()
