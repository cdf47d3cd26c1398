"""Where does a whole forward's time go between the kernels? The kernel timeline of warpforge-fp16 and
warpforge-int8 replaying their CUDA graphs, from CUPTI (torch.profiler), in one call.

    python benchmarks/sweeps/forward_timeline.py --model resnet50 --batch 32 --out timeline.json   (~1 min)

Why: on the H200 (session 12, git e05cc2f) the per-layer sums of conv_int8_sweep account for 0.864 ms of
warpforge-int8's 1.131 ms ResNet-50 forward at batch 32 (0.266 ms "rest"), and 1.085 of fp16's 1.406 ms.
The per-layer figures are each kernel alone (its own CUDA graph, L2 flushed); the rest is what sits
between them: pools, the head, quantizers, and each kernel boundary in the graph (drain of one grid, launch
of the next). This sweep measures instead of guessing: for each candidate (built as optimize builds it,
random weights, calibrated on one random batch) it replays the graph --iters times under the profiler and
reports per forward: the span (first kernel start to last kernel end), the busy time (sum of kernel
durations), the idle gaps between consecutive kernels (count, median, sum), and per kernel (in launch order)
its duration and the gap before it. Each candidate's output is checked against eager fp32 first (cosine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conv_int8_sweep import build_candidates  # noqa: E402  (the candidates as that sweep builds them)


def timeline(fn, x, iters: int) -> list[list[dict]]:
    """Kernel events of each of ``iters`` calls (after warm-up), sorted by start."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(x)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
          and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    ev.sort(key=lambda e: e.time_range.start)
    kernels = [{"name": e.name, "start": e.time_range.start, "us": e.time_range.elapsed_us()} for e in ev]
    # split into calls: a gap of > 50 us is the host's synchronize between replays
    calls, cur = [], []
    for k in kernels:
        if cur and k["start"] - (cur[-1]["start"] + cur[-1]["us"]) > 50:
            calls.append(cur)
            cur = []
        cur.append(k)
    if cur:
        calls.append(cur)
    return calls


def summarize(call: list[dict]) -> dict:
    gaps = [b["start"] - (a["start"] + a["us"]) for a, b in zip(call, call[1:])]
    span = call[-1]["start"] + call[-1]["us"] - call[0]["start"]
    return {"kernels": len(call), "span_us": span, "busy_us": sum(k["us"] for k in call),
            "gap_sum_us": sum(gaps), "gap_median_us": statistics.median(gaps) if gaps else 0.0,
            "gap_max_us": max(gaps) if gaps else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("forward_timeline.json"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU: this sweep reads CUPTI kernel timestamps")
    dev = torch.device("cuda")
    model, x, built = build_candidates(a.model, a.batch, dev)
    with torch.no_grad():
        want = model(x).float()
    res = {"model": a.model, "batch": a.batch, "candidates": {}}
    for key, b in built.items():
        got = b(x).float()
        cos = float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0))
        calls = [c for c in timeline(b, x, a.iters) if len(c) > 3]
        sums = [summarize(c) for c in calls]
        med = {k: statistics.median(s[k] for s in sums) for k in sums[0]}
        # per kernel of the median-span call: name, duration, the gap before it
        mid = sorted(range(len(calls)), key=lambda i: sums[i]["span_us"])[len(calls) // 2]
        call = calls[mid]
        per = [{"name": k["name"][:80], "us": k["us"],
                "gap_before_us": (k["start"] - (p["start"] + p["us"])) if p else 0.0}
               for p, k in zip([None] + call[:-1], call)]
        by_name: dict[str, list[float]] = {}
        for k in call:
            by_name.setdefault(k["name"][:60], []).append(k["us"])
        res["candidates"][key] = {"cosine_vs_fp32": cos, "graphed": bool(getattr(b, "cuda_graph", None)),
                                  "median": med, "calls": len(calls), "kernels": per,
                                  "by_name_us": {n: [len(v), sum(v)] for n, v in by_name.items()}}
        print(f"== {key}: cosine vs fp32 {cos:.5f}, {len(calls)} calls; per call (median): "
              f"{med['kernels']:.0f} kernels, span {med['span_us']:.1f} us, busy {med['busy_us']:.1f} us, "
              f"gaps {med['gap_sum_us']:.1f} us (median {med['gap_median_us']:.2f}, max {med['gap_max_us']:.1f})")
        for n, v in sorted(by_name.items(), key=lambda t: -sum(t[1]))[:12]:
            print(f"   {sum(v):8.1f} us  x{len(v):3d}  {n}")
        for p in per:
            print(f"     {p['gap_before_us']:6.2f} gap  {p['us']:7.2f} us  {p['name'][:70]}")
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
