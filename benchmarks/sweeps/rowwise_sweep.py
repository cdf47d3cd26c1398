"""Sweep the row-wise kernels' tilings on the kernels suite's shapes: softmax and silu_and_mul.

    python benchmarks/sweeps/rowwise_sweep.py --out rowwise_sweep.json

Why: in the H200 run of 2026-12-01 (kernels.jsonl) softmax reached 55-74% of the HBM roof (target 80%)
and silu_and_mul 0.96x torch.compile (90% of the roof; compile ~94%). Both use one heuristic tiling
(activation.py ``row_config`` / ``softmax_config``). For each shape this times every RowConfig in the
grid below with the bench harness (CUDA graph of the launch, L2 flushed, host hidden), checks each
output against the fp32 reference once, and prints the default's TB/s next to the best point, and
torch.compile's, against the probe's measured HBM read bandwidth when the probe cache exists.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.bench.timing import time_fn  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels.activation import RowConfig, row_config, silu_and_mul, softmax, softmax_config  # noqa: E402

SOFTMAX_SHAPES = [(4096, 32768), (131072, 4096), (512, 131072), (256, 128256)]
SILU_SHAPES = [(4096, 14336), (16, 14336), (256, 14336)]


def softmax_grid(n: int) -> list[RowConfig]:
    out = []
    if n <= 32768:
        bn = 1 << (n - 1).bit_length()
        for bm, w in itertools.product((1, 2, 4), (4, 8, 16, 32)):
            if bm * bn // (32 * w) <= 128:  # at most 128 fp32 values per thread: beyond, it spills
                out.append(RowConfig(bm, bn, w))
    for bn, w in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        out.append(RowConfig(1, bn, w, looped=True))
    return out


def silu_grid() -> list[RowConfig]:
    return [RowConfig(bm, bn, w) for bm, bn, w in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096),
                                                                     (2, 4, 8, 16))
            if 4 <= bm * bn // (32 * w) <= 64]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("rowwise_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only as a dry run (tiny shapes, host timer)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a GPU (--device cpu for a dry run)")
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    dt = torch.bfloat16 if gpu else torch.float32
    read_bw = None
    if gpu:
        try:
            from warpforge.hw.roofline import ceilings
            read_bw = ceilings(dev).hbm_GBps  # the best of the probe's HBM figures (read/write/copy)
        except Exception:  # noqa: BLE001 - the fraction column is optional
            read_bw = None
    compiled_softmax = torch.compile(lambda x: torch.softmax(x.float(), -1).to(x.dtype)) if gpu else None
    compiled_silu = torch.compile(lambda x: (torch.nn.functional.silu(x[..., :x.shape[-1] // 2].float())
                                             * x[..., x.shape[-1] // 2:].float()).to(x.dtype)) if gpu else None
    t0 = time.perf_counter()
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def t(fn) -> float:
        return time_fn(fn, cuda_graph=gpu, device=dev, warmup=10 if gpu else 1, rep=50 if gpu else 2).median_ms

    jobs = [("softmax", s) for s in SOFTMAX_SHAPES] + [("silu_and_mul", s) for s in SILU_SHAPES]
    if not gpu:
        jobs = [("softmax", (8, 300)), ("softmax", (4, 40000)), ("silu_and_mul", (8, 200))]
    for op, (m, n) in jobs:
        if time.perf_counter() - t0 > a.budget_s:
            print(f"budget: stopping before {op} {m}x{n}")
            break
        if op == "softmax":
            x = torch.randn(m, n, generator=gen, device=dev).mul_(3).to(dt)
            want = ref.softmax_reference(x).float()
            nbytes = 2 * x.numel() * x.element_size()
            grid, default = softmax_grid(n), softmax_config(m, n)
            run = lambda cfg: softmax(x, config=cfg)  # noqa: E731
            peer = (lambda: compiled_softmax(x)) if gpu else None
        else:
            x = torch.randn(m, 2 * n, generator=gen, device=dev).to(dt)
            want = ref.silu_and_mul_reference(x).float()
            nbytes = 3 * m * n * x.element_size()
            grid, default = silu_grid(), row_config(m, n, max_block_n=1024)
            run = lambda cfg: silu_and_mul(x, config=cfg)  # noqa: E731
            peer = (lambda: compiled_silu(x)) if gpu else None
        if not gpu:
            grid = grid[:3]
        tol = 2e-2 if dt == torch.bfloat16 else 1e-5
        pts = {}
        for cfg in [default, *[c for c in grid if c != default]]:
            key = f"bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps}{' looped' if cfg.looped else ''}"
            try:
                err = float((run(cfg).float() - want).abs().max() / want.abs().max())
                ms = t(lambda c=cfg: run(c))
                pts[key] = {"ms": ms, "gbps": nbytes / ms / 1e6, "rel_err": err, "ok": err <= tol}
            except Exception as e:  # noqa: BLE001 - a tiling that cannot compile or run is data
                pts[key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        dkey = next(iter(pts))
        ok = {k: v for k, v in pts.items() if v.get("ok")}
        best = max(ok, key=lambda k: ok[k]["gbps"]) if ok else None
        peer_gbps = nbytes / t(peer) / 1e6 if peer else None
        row = {"op": op, "M": m, "N": n, "bytes": nbytes, "default": dkey, "best": best, "points": pts,
               "compile_gbps": peer_gbps, "read_gbps": read_bw}
        rows.append(row)
        d, b = pts[dkey], ok.get(best, {})
        frac = f" ({b['gbps'] / read_bw:.0%} of the HBM roof)" if read_bw and b else ""
        print(f"{op:13s} {m}x{n}: default [{dkey}] {d.get('gbps', 0):7.0f} GB/s; best [{best}] "
              f"{b.get('gbps', 0):7.0f} GB/s{frac}; torch.compile {peer_gbps or 0:7.0f} GB/s"
              + ("" if d.get("ok", False) else f"  DEFAULT FAILED: {d}"), flush=True)
    a.out.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
