"""Splat rasterizer tuning on the GPU: where the time goes (torch.profiler kernel table of one forward+backward
on the bench's 1M-Gaussian 1080p scene) and the blend kernels' tiling (CHUNK Gaussians a step x warps a tile)
swept forward and backward, each configuration checked against the default one on the same inputs.

    python benchmarks/sweeps/splat_sweep.py --out sweep.json [--n 1000000] [--configs 8x4,s4x1,...]
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
    """'8x4': the chunked kernels, CHUNK 8, 4 warps; 's4x1': one Gaussian at a time, unrolled 4, 1 warp;
    'j4x1': the same with the backward's per-Gaussian sums joined into one reduction."""
    seq = cfg[0] in "sj"
    a, b = (int(x) for x in cfg.lstrip("sj").split("x"))
    blend.SEQ, blend.JOIN = seq, cfg.startswith("j")
    if seq:
        blend.UNROLL, blend.SEQ_WARPS = a, b
    else:
        blend.CHUNK, blend.FWD_WARPS, blend.BWD_WARPS = a, b, b


def sweep_blend(w: sr.Workload, b: dict, configs: list[str]) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    v_out = torch.rand(w.cameras, w.height, w.width, 3, device="cuda", generator=g) - 0.5
    v_alpha = torch.zeros(w.cameras, w.height, w.width, 1, device="cuda")
    args = (b["means2d"], b["conics"], b["colors"], b["opacities"], None, w.width, w.height, 16, b["offsets"],
            b["ids"])
    ref_out = ref_grads = None
    rows = []
    for cfg in configs:
        _set(cfg)
        row = {"config": cfg}
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
    ap.add_argument("--configs", default="8x4,s4x1,s1x1,s2x2,s4x4,j1x1,j2x2,j4x4,j2x4,j4x2",
                    help="CHUNKxWARPS (chunked kernels), sUNROLLxWARPS (one Gaussian at a time) or jUNROLLxWARPS (the "
                         "same, sums joined) list; the first is the baseline the others are checked against")
    ap.add_argument("--bench", default=None, help="then run the splat suite with the winner, records here")
    ap.add_argument("--bench-filter", default=None, help="the suite's -k filter")
    a = ap.parse_args()
    w = sr.Workload(n=a.n, backward=True)
    scene = sr.make_scene(w, torch.device("cuda"))
    configs = a.configs.split(",")
    b = blend_inputs(w, scene)
    res = {"n": a.n, "n_isects": b["n_isects"], "blend": sweep_blend(w, b, configs)}
    ok = [r for r in res["blend"] if "error" not in r and r["fwd_max_diff"] < 1e-3 and r["bwd_min_cos"] > 0.9999]
    best = min(ok, key=lambda r: r["fwd_ms"] + r["bwd_ms"])["config"] if ok else configs[0]
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
