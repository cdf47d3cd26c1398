"""Dense vs packed layout (``rasterize(packed=...)``) on the GPU: peak memory and time of one render of many cameras
that each see part of the street, forward only and forward + backward, with the images compared.

    python benchmarks/sweeps/splat_packed_memory.py [--n 300000] [--cameras 32] [--size 960x540]

Cameras: the street's drive-through (eye height, each seeing a stretch of the road). Peak memory is
torch.cuda.max_memory_allocated above what the scene itself holds; the bytes per (camera, Gaussian) pair are
that peak over C * N (dense) and over the visible pairs nnz (packed).
"""

from __future__ import annotations

import argparse
import time

import torch

from warpforge.splat.scene import render, street_scene


def measure(splats, views, w, h, bg, packed: bool, grad: bool) -> dict:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for i in range(4):  # the first call compiles and warms the allocator
        for p in splats.as_dict().values():
            p.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad):
            img, _, meta = render(splats, views.viewmats, views.Ks, w, h, background=bg, packed=packed)
            if grad:
                img.sum().backward()
        torch.cuda.synchronize()
        if i:
            ms.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base
    nnz = int(meta["gaussian_ids"].numel()) if packed else int((meta["radii"] > 0).all(-1).sum())
    return {"img": img.detach(), "peak": peak, "ms": sorted(ms)[len(ms) // 2], "nnz": nnz}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--cameras", type=int, default=32)
    ap.add_argument("--size", default="960x540")
    a = ap.parse_args()
    w, h = (int(x) for x in a.size.split("x"))
    street = street_scene(n=a.n, width=w, height=h, n_ring=0, n_drive=a.cameras)
    dev = torch.device("cuda")
    splats = street.splats.to(dev)
    for p in splats.as_dict().values():
        p.requires_grad_()
    views, bg = street.views.to(dev), street.background.to(dev)
    C, N = len(views), splats.n
    print(f"{torch.cuda.get_device_name()}: street {N:,} Gaussians, {C} drive cameras at {w}x{h}")
    for grad in (False, True):
        d = measure(splats, views, w, h, bg, False, grad)
        p = measure(splats, views, w, h, bg, True, grad)
        diff = float((d["img"] - p["img"]).abs().max())
        print(f"{'forward+backward' if grad else 'forward (no grad)'}: visible pairs {p['nnz']:,} of {C * N:,} "
              f"({p['nnz'] / (C * N):.1%}); |dense - packed| max {diff:.1e}")
        for name, r, pairs in (("dense", d, C * N), ("packed", p, p["nnz"])):
            print(f"  {name:>6}: peak {r['peak'] / 2**20:8.1f} MiB ({r['peak'] / pairs:6.1f} B per "
                  f"{'pair' if name == 'dense' else 'visible pair'}), {r['ms']:7.2f} ms")


if __name__ == "__main__":
    main()
