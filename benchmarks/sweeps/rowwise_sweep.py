"""Sweep the row-wise kernels' tilings on the kernels suite's shapes: softmax and silu_and_mul.

    python benchmarks/sweeps/rowwise_sweep.py --out rowwise_sweep.json [--only softmax]

Why: in the H200 run of 2026-12-01 (kernels.jsonl) softmax reached 55-74% of the HBM roof (target 80%)
and silu_and_mul 0.96x torch.compile (90% of the roof; compile ~94%). Both ran one heuristic tiling
(activation.py ``row_config`` / ``softmax_config``); the launchers now tune over ``softmax_candidates`` /
``gated_candidates``. For each shape this times the tuner's candidates first (marked ``tuner``), then
a wider grid (whole rows, persistent whole rows, the looped kernel, the persistent streamed kernel at
several programs per SM), with the bench harness (CUDA graph of the launch, L2 flushed, host hidden).
Every config runs once into a NaN-poisoned output checked against the float64 reference before it is
timed; a config that is wrong or leaves an element unwritten is reported and not timed. Prints the
default's TB/s next to the best correct point and torch.compile's, against the probe's HBM bandwidth
when the probe cache exists.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import force_triton  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels.activation import (RowConfig, gated_candidates, silu_and_mul, softmax,  # noqa: E402
                                          softmax_candidates)
from warpforge.kernels.tolerance import rel_err, tolerance  # noqa: E402

SOFTMAX_SHAPES = [(4096, 32768), (131072, 4096), (512, 131072), (256, 128256)]
SILU_SHAPES = [(4096, 14336), (16, 14336), (256, 14336)]


def _unique(cfgs) -> list[RowConfig]:
    out: list[RowConfig] = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def softmax_grid(m: int, n: int) -> list[RowConfig]:
    """The tuner's candidates, then whole-row, persistent whole-row, looped and persistent streamed tilings."""
    out = list(softmax_candidates(m, n))
    if n <= 32768:
        bn = 1 << (n - 1).bit_length()
        for bm, w in itertools.product((1, 2, 4), (4, 8, 16, 32)):
            e = bm * bn // (32 * w)  # fp32 values per thread: beyond 128, or past 32768 per program, it spills
            if e <= 128 and bm * bn <= 32768:
                out.append(RowConfig(bm, bn, w))
            if 8 <= e <= 32 and bm <= 2:  # persistent: 32 or 48 warps per SM (~40-66 registers, offline sm_90)
                out += [RowConfig(bm, bn, w, programs_per_sm=k) for k in sorted({max(1, 32 // w), max(1, 48 // w)})]
    for bn, w in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        out.append(RowConfig(1, bn, w, looped=True))
    for bn, w in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
        if 8 <= bn // (32 * w) <= 32:  # fp32 of x per thread; the running max and sum cost 1/4 of that
            out += [RowConfig(1, bn, w, looped=True, programs_per_sm=k) for k in (1, 2, 4) if k * w <= 64]
            if n > 32768 and w >= 8:  # rows past the whole-row limit: the L2 eviction hints too
                out += [RowConfig(1, bn, w, looped=True, programs_per_sm=k, l2_hints=True) for k in (1, 2)]
    return _unique(out)


def silu_grid(m: int, d: int) -> list[RowConfig]:
    return _unique([*gated_candidates(m, d),
                    *[RowConfig(bm, bn, w)
                      for bm, bn, w in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096), (2, 4, 8, 16))
                      if 4 <= bm * bn // (32 * w) <= 64]])


def _key(cfg: RowConfig) -> str:
    return (f"bm{cfg.block_m} bn{cfg.block_n} w{cfg.num_warps}{' looped' if cfg.looped else ''}"
            f"{f' persistent{cfg.programs_per_sm}' if cfg.persistent else ''}{' l2hints' if cfg.l2_hints else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("rowwise_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only as a dry run (tiny shapes, host timer)")
    ap.add_argument("--only", choices=("softmax", "silu_and_mul"), help="sweep one kernel")
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

    def t(fn) -> float:
        return time_fn(fn, cuda_graph=gpu, device=dev, warmup=10 if gpu else 1, rep=50 if gpu else 2).median_ms

    jobs = [("softmax", s) for s in SOFTMAX_SHAPES] + [("silu_and_mul", s) for s in SILU_SHAPES]
    if not gpu:
        jobs = [("softmax", (8, 300)), ("softmax", (4, 40000)), ("silu_and_mul", (8, 200))]
    jobs = [j for j in jobs if a.only in (None, j[0])]
    with contextlib.nullcontext() if gpu else force_triton():  # CPU: the kernels through the interpreter
        rows = _sweep(jobs, a, dev, dt, gen, t, read_bw, compiled_softmax, compiled_silu, t0)
    a.out.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


def _sweep(jobs, a, dev, dt, gen, t, read_bw, compiled_softmax, compiled_silu, t0) -> list[dict]:
    gpu = dev.type == "cuda"
    rows = []
    for op, (m, n) in jobs:
        if time.perf_counter() - t0 > a.budget_s:
            print(f"budget: stopping before {op} {m}x{n}")
            break
        if op == "softmax":
            x = torch.randn(m, n, generator=gen, device=dev).mul_(3).to(dt)
            want = ref.softmax_reference(x, torch.float64)
            out = torch.empty_like(x)
            nbytes = 2 * x.numel() * x.element_size()
            grid, tuner = softmax_grid(m, n), softmax_candidates(m, n)
            run = lambda cfg: softmax(x, out=out, config=cfg)  # noqa: E731
            peer = (lambda: compiled_softmax(x)) if gpu else None
        else:
            x = torch.randn(m, 2 * n, generator=gen, device=dev).to(dt)
            want = ref.silu_and_mul_reference(x, torch.float64)
            out = torch.empty(m, n, device=dev, dtype=dt)
            nbytes = 3 * m * n * x.element_size()
            grid, tuner = silu_grid(m, n), gated_candidates(m, n)
            run = lambda cfg: silu_and_mul(x, out=out, config=cfg)  # noqa: E731
            peer = (lambda: compiled_silu(x)) if gpu else None
        if not gpu:
            grid = _unique(grid[:3] + [c for c in grid if c.persistent][:2])
        tol = tolerance(dt)
        pts = {}
        for cfg in grid:
            key = _key(cfg)
            try:
                out.fill_(float("nan"))  # an element the config does not write reads as NaN -> inf error
                run(cfg)
                err = rel_err(out, want)
                pt = {"rel_err": err, "ok": err <= tol, "tuner": cfg in tuner}
                if pt["ok"]:  # only correct configs are timed
                    ms = t(lambda c=cfg: run(c))
                    pt.update(ms=ms, gbps=nbytes / ms / 1e6)
                pts[key] = pt
            except Exception as e:  # noqa: BLE001 - a tiling that cannot compile or run is data
                pts[key] = {"error": f"{type(e).__name__}: {str(e)[:160]}", "tuner": cfg in tuner}
        dkey = _key(tuner[0])
        ok = {k: v for k, v in pts.items() if v.get("ok")}
        best = max(ok, key=lambda k: ok[k]["gbps"]) if ok else None
        tbest = max((k for k in ok if ok[k]["tuner"]), key=lambda k: ok[k]["gbps"], default=None)
        peer_gbps = nbytes / t(peer) / 1e6 if peer else None
        bad = sorted(k for k, v in pts.items() if not v.get("ok"))
        row = {"op": op, "M": m, "N": n, "bytes": nbytes, "default": dkey, "best": best, "tuner_best": tbest,
               "points": pts, "compile_gbps": peer_gbps, "read_gbps": read_bw, "failed": bad}
        rows.append(row)
        d, b, tb = pts[dkey], ok.get(best, {}), ok.get(tbest, {})
        frac = f" ({b['gbps'] / read_bw:.0%} of the HBM roof)" if read_bw and b else ""
        print(f"{op:13s} {m}x{n}: default [{dkey}] {d.get('gbps', 0):7.0f} GB/s; tuner's best [{tbest}] "
              f"{tb.get('gbps', 0):7.0f}; best [{best}] {b.get('gbps', 0):7.0f} GB/s{frac}; torch.compile "
              f"{peer_gbps or 0:7.0f} GB/s" + (f"  WRONG OR FAILED: {bad}" if bad else ""), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
