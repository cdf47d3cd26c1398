"""Sweep paged-decode launch knobs on the GPU: DecodeConfig (block_n, warps, stages) x split count.

    python benchmarks/sweeps/decode_sweep.py --out decode_sweep.json
    python benchmarks/sweeps/decode_sweep.py --ab fused --out decode_ab.json   # A/B of DecodeConfig flags

For each shape (B, context; 32 query / 8 KV heads, D 128, pages of 16, shuffled page tables) and KV
dtype, times every (config, num_splits) with the bench harness (CUDA graph of the launch, L2 flushed,
host hidden), checks each config once against the float32 reference, and prints per shape the default's
GB/s (K+V bytes over time) next to the best point found. The split count is a runtime argument, so it
is swept directly rather than through programs_per_sm.

``--ab FLAG,...`` instead times the default config against itself with each DecodeConfig flag turned on
(``fused_reduce``: one launch, the last split merges; ``qk_fp8``: fp8 pages, q in e4m3 and QK^T as an
e4m3 dot, over a few tilings), interleaved in one process, at the default split count and its
neighbours, on the shapes the issue misses (the 134 MB ones and B1 ctx512) and fp8 twins, with dense
SDPA beside the bf16 rows as the peer.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math

import torch

from warpforge.timing import time_fn, time_interleaved
from warpforge.kernels.attention import DecodeConfig, PagedKVCache, num_decode_splits, paged_decode
from warpforge.kernels.attention.decode import default_decode_config
from warpforge.kernels.reference import paged_decode_ref

HQ, HKV, D, PAGE = 32, 8, 128, 16
SHAPES = [(1, 32768, False), (8, 4096, False), (64, 512, False), (1, 131072, False), (16, 8192, False),
          (16, 8192, True), (1, 131072, True), (8, 4096, True), (64, 4096, True)]
# --ab: the 134 MB bf16 shapes (73-79% of HBM on the H200), the fixed-cost one, and fp8 twins
AB_SHAPES = [(1, 32768, False), (8, 4096, False), (64, 512, False), (1, 512, False), (16, 8192, False),
             (1, 32768, True), (8, 4096, True), (16, 8192, True)]
AB_FLAGS = ("fused_reduce", "qk_fp8")
# qk_fp8 tilings (block_n, warps, stages) the offline sm_90 compile fits without spills; the first is
# default_decode_config(..., qk_fp8=True)'s
QK8_TILINGS = ((128, 4, 2), (64, 8, 3), (64, 4, 2), (64, 4, 3), (128, 8, 2))


def inputs(B: int, ctx: int, fp8: bool, gen: torch.Generator, dev: torch.device):
    n = math.ceil(ctx / PAGE)
    table = torch.randperm(B * n, generator=gen).view(B, n).to(torch.int32).to(dev)
    shape = (B * n, HKV, PAGE, D)
    k = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    v = torch.randn(shape, dtype=torch.bfloat16, device=dev)
    if fp8:
        s = torch.full((HKV,), 0.125, device=dev)
        cache = PagedKVCache((k / 0.125).to(torch.float8_e4m3fn), (v / 0.125).to(torch.float8_e4m3fn), s, s.clone())
    else:
        cache = PagedKVCache(k, v)
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    return q, cache, table, lens


def _dense(pages: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] copy of the paged K or V (SDPA's input)."""
    B, n = table.shape
    return pages[table.long()].permute(0, 2, 1, 3, 4).reshape(B, HKV, n * PAGE, D)[:, :, :ctx].contiguous()


def run_ab(shapes, flags: list[str], rep: int, sms: int, gen, dev) -> list[dict]:
    """Default config vs the default with each flag on (and all on), interleaved; one row per split count."""
    results = []
    for B, ctx, fp8 in shapes:
        q, cache, table, lens = inputs(B, ctx, fp8, gen, dev)
        kv = 2 * B * ctx * HKV * D * (1 if fp8 else 2)
        base = default_decode_config(D, fp8)
        variants = {"default": base}
        for f in flags:
            if f != "qk_fp8":
                variants[f] = dataclasses.replace(base, **{f: True})
            elif fp8:  # fp8 pages only; its own tilings (the fp8 default's spills with it)
                for bn, w, st in QK8_TILINGS:
                    variants[f"qk_fp8 {bn}x{w}w{st}s"] = dataclasses.replace(
                        default_decode_config(D, True, qk_fp8=True), block_n=bn, num_warps=w, num_stages=st)
        if fp8 and {"fused_reduce", "qk_fp8"} <= set(flags):
            variants["qk_fp8+fused"] = dataclasses.replace(default_decode_config(D, True, qk_fp8=True),
                                                           fused_reduce=True)
        n_def = num_decode_splits(B, HKV, ctx, num_sms=sms, config=base)
        splits = sorted({s for s in (n_def // 2, n_def, 2 * n_def, 4 * n_def)
                         if s >= 1 and (ctx // s >= 64 or s == n_def)})
        ref = paged_decode_ref(q[:1].float(), cache.k_cache, cache.v_cache, table[:1], lens[:1],
                               k_scale=cache.k_scale, v_scale=cache.v_scale)
        errs, failed = {}, {}
        for name, cfg in list(variants.items()):
            try:
                got = paged_decode(q[:1], cache, table[:1], lens[:1], config=cfg, num_splits=max(2, n_def))
                errs[name] = ((got.float() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is data, not the end
                failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
                del variants[name]
                print(f"B{B} ctx{ctx} {name}: FAILED {failed[name]}", flush=True)
        peer = kd = vd = None
        if not fp8:
            kd, vd = _dense(cache.k_cache, table, ctx), _dense(cache.v_cache, table, ctx)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            peer = lambda: sdpa(q[:, :, None], kd, vd, enable_gqa=True)  # noqa: E731
        for s in splits:
            fns = {name: (lambda cfg=cfg: paged_decode(q, cache, table, lens, config=cfg, num_splits=s,
                                                       check_values=False))  # timed: the kernel alone
                   for name, cfg in variants.items()}
            if peer is not None:
                fns["sdpa dense"] = peer
            t = time_interleaved(fns, warmup=3, rep=rep, cuda_graph=True)
            row = {"B": B, "ctx": ctx, "fp8": fp8, "kv_bytes": kv, "splits": s, "default_splits": n_def,
                   "rel_err": errs, "failed": failed, "us": {n: t[n].median_ms * 1e3 for n in fns},
                   "GBps": {n: kv / t[n].median_ms / 1e6 for n in fns}}
            results.append(row)
            cells = "  ".join(f"{n} {row['us'][n]:7.2f} us {row['GBps'][n]:6.0f} GB/s" for n in fns)
            mark = "*" if s == n_def else " "
            print(f"B{B:<3d} ctx{ctx:<6d} {'fp8 ' if fp8 else 'bf16'} splits {s:<3d}{mark} {cells}"
                  f"  err {' '.join(f'{n} {e:.2g}' for n, e in errs.items())}", flush=True)
        q = cache = table = lens = peer = kd = vd = None
        torch.cuda.empty_cache()
    return results


def main() -> None:
    global D
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--shapes", default="", help="B:ctx[:fp8],... instead of the built-in list; e.g. the LLM "
                                                "suite's batch-1 decode: 1:384,1:1024 with --head-dim 64")
    ap.add_argument("--head-dim", type=int, default=D, help=f"head dim (default {D}; Llama-3.2-1B has 64)")
    ap.add_argument("--configs", default="all", choices=["all", "default"],
                    help="default: only the default tiling, sweeping the split count (short contexts)")
    ap.add_argument("--ab", default="", help=f"comma-separated DecodeConfig flags to A/B against the default "
                                             f"({', '.join(AB_FLAGS)}; 'fused' for fused_reduce; qk_fp8 "
                                             f"runs on the fp8 shapes only, over its tilings {QK8_TILINGS})")
    args = ap.parse_args()
    D = args.head_dim
    shapes = [(int(f[0]), int(f[1]), len(f) > 2 and f[2] == "fp8") for f in
              (x.split(":") for x in args.shapes.split(",") if x)]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    if args.ab:
        alias = {"fused": "fused_reduce"}
        flags = [alias.get(f, f) for f in args.ab.split(",") if f]
        bad = [f for f in flags if f not in AB_FLAGS]
        if bad:
            ap.error(f"--ab: unknown flag(s) {bad}; expected some of {AB_FLAGS}")
        results = run_ab(shapes or AB_SHAPES, flags, args.rep, sms, gen, dev)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    shapes = shapes or SHAPES
    configs = [DecodeConfig(block_n=bn, num_warps=w, num_stages=s)
               for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]
    if args.configs == "default":
        configs = [default_decode_config(D, False)]
    results = []
    summary = []
    for B, ctx, fp8 in shapes:
        q, cache, table, lens = inputs(B, ctx, fp8, gen, dev)
        kv = 2 * B * ctx * HKV * D * (1 if fp8 else 2)
        default_splits = num_decode_splits(B, HKV, ctx, num_sms=sms)
        ref = None
        if B * ctx <= 64 * 4096:
            ref = paged_decode_ref(q[:1].float(), cache.k_cache, cache.v_cache, table[:1], lens[:1],
                                   k_scale=cache.k_scale, v_scale=cache.v_scale)
        splits = sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 128, default_splits)
                         if ctx // s >= 64 or s == default_splits})
        rows = []
        for cfg in configs:
            try:
                if ref is not None:
                    got = paged_decode(q[:1], cache, table[:1], lens[:1], config=cfg, num_splits=min(4, max(splits)))
                    err = (got.float() - ref).abs().max().item()
                    if not err < 3e-2:
                        rows.append({"cfg": cfg.__dict__, "error": f"max err {err:.3g}"})
                        continue
                for s in splits:
                    t = time_fn(lambda: paged_decode(q, cache, table, lens, config=cfg, num_splits=s,
                                                     check_values=False), warmup=3,
                                rep=args.rep, cuda_graph=True)
                    rows.append({"cfg": {k: getattr(cfg, k) for k in ("block_n", "num_warps", "num_stages")},
                                 "splits": s, "ms": t.median_ms, "GBps": kv / t.median_ms / 1e6})
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is data
                rows.append({"cfg": {k: getattr(cfg, k) for k in ("block_n", "num_warps", "num_stages")},
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
        t_def = time_fn(lambda: paged_decode(q, cache, table, lens), warmup=3, rep=args.rep, cuda_graph=True)
        ok = [r for r in rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        top = sorted(ok, key=lambda r: r["ms"])[:5]
        results.append({"B": B, "ctx": ctx, "fp8": fp8, "kv_bytes": kv, "default_splits": default_splits,
                        "default_ms": t_def.median_ms, "default_GBps": kv / t_def.median_ms / 1e6,
                        "best": best, "top5": top, "rows": rows})
        summary.append(f"B{B:<4d} ctx{ctx:<7d} {'fp8 ' if fp8 else 'bf16'} "
                       f"default {kv / t_def.median_ms / 1e6:7.0f} GB/s "
                       f"({default_splits} splits, {t_def.median_ms * 1e3:6.1f} us)  best {best['GBps']:7.0f} GB/s "
                       f"{best['cfg']} splits {best['splits']} ({best['ms'] * 1e3:6.1f} us)")
        print(summary[-1], flush=True)
        q = cache = table = lens = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
