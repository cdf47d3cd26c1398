"""Does a second resident block (a register cap) or a deeper K step hide the int8 MMA's per-step wait?

    python benchmarks/sweeps/conv_variants.py --batch 32 --out conv_variants.json        (~3 min)

Why: Nsight Compute on the H200 (2026-12-02, benchmarks/sweeps/ncu_conv.py) has the int8 3x3 convs at
one 8-warp block per SM (180 registers), the tensor cores idle between K steps: Triton 3.6 makes a wgmma
asynchronous only with an fp32 accumulator (its pipeliner's "rule 2.1"), so each int32 step waits for
its MMA, then a barrier, then issues the next loads. Two ways to fill that gap without a new kernel:
``maxnreg`` (two blocks per SM: one's MMA runs while the other waits) and ``block_k`` 256 (half the
waits per K). For each ResNet-50 b32 layer: fp16 conv2d as tuned, conv2d_int8 as tuned, and
conv2d_int8 at each fixed tiling below (unsigned x, int8 out, bias + relu: as the optimizer runs them),
every int8 result checked against the int8 reference (at most one requantization step apart).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conv_int8_sweep import inputs  # noqa: E402

from warpforge.bench.suites._kernels_fused import RESNET50  # noqa: E402
from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels.conv import ConvConfig, conv2d  # noqa: E402
from warpforge.kernels.conv_int8 import conv2d_int8  # noqa: E402

VARIANTS = [
    ConvConfig(128, 128, 128, 8, 8, 3),
    ConvConfig(128, 128, 128, 8, 8, 3, maxnreg=128),
    ConvConfig(128, 128, 128, 8, 8, 2, maxnreg=128),
    ConvConfig(128, 128, 256, 8, 8, 3),
    ConvConfig(128, 128, 256, 8, 8, 2),
    ConvConfig(128, 128, 256, 8, 8, 2, maxnreg=128),
    ConvConfig(64, 128, 128, 8, 4, 4, maxnreg=128),
    ConvConfig(128, 64, 128, 8, 4, 4, maxnreg=128),
    ConvConfig(64, 128, 256, 8, 4, 3, maxnreg=128),
    ConvConfig(128, 128, 64, 8, 8, 4, maxnreg=128),
    ConvConfig(128, 128, 64, 8, 8, 3, maxnreg=128),
    ConvConfig(64, 128, 64, 8, 4, 4, maxnreg=128),
]


def label(c: ConvConfig) -> str:
    return (f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
            + (f" r{c.maxnreg}" if c.maxnreg else "") + (f" k{c.split_k}" if c.split_k > 1 else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("conv_variants.json"))
    ap.add_argument("--layers", default="", help="comma-separated indices into RESNET50 (default: all but the stem)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = [int(i) for i in a.layers.split(",") if i] or list(range(1, len(RESNET50)))
    rows = []

    def t(fn) -> float:
        return time_fn(fn, cuda_graph=True, device=dev, warmup=10, rep=40).median_ms * 1e3

    for i in idx:
        la = RESNET50[i]
        d = inputs(la, a.batch, dev, gen)
        kw = dict(stride=la.stride, padding=la.pad, activation="relu")
        q8 = dict(x_zero_point=-128, w_sum=d["w_sum"], out_zero_point=-128, **kw)
        want = ref.conv2d_int8_reference(d["xq"], d["wq"], d["xs"], d["ws"], d["b32"], out_scale=d["os_"],
                                         out_dtype=torch.int8, out_zero_point=-128, x_zero_point=-128, **kw)

        def int8(cfg, d=d, q8=q8):
            return conv2d_int8(d["xq"], d["wq"], d["xs"], d["ws"], d["b32"], out_scale=d["os_"], config=cfg, **q8)

        row = {"layer": la.label, "count": la.count, "fp16_us": t(lambda: conv2d(d["x16"], d["w16"], d["b16"], **kw)),
               "int8_tuned_us": t(lambda: int8(None)), "points": {}}
        for cfg in VARIANTS:
            if cfg.block_k > max(64, la.cin):  # a K step wider than C only multiplies zeros
                continue
            try:
                diff = int((int8(cfg).int() - want.int()).abs().max())
                row["points"][label(cfg)] = {"us": t(lambda c=cfg: int8(c)), "max_diff": diff}
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit is data
                row["points"][label(cfg)] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        ok = {k: v for k, v in row["points"].items() if "us" in v and v["max_diff"] <= 1}
        best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
        row["best"], row["best_us"] = best, (ok[best]["us"] if best else None)
        bad = [k for k, v in row["points"].items() if "us" in v and v["max_diff"] > 1]
        rows.append(row)
        pts = "  ".join(f"{k} {v['us']:.1f}" for k, v in row["points"].items() if "us" in v)
        print(f"{la.label:22s} x{la.count} fp16 {row['fp16_us']:6.1f} int8 tuned {row['int8_tuned_us']:6.1f} best "
              f"{row['best_us'] or 0:6.1f} [{best}]" + (f" WRONG {bad}" if bad else "") + f"\n    {pts}", flush=True)
        # Free this layer's tensors before the next layer's are made (rebound, not del: the lambda above reads d).
        d = want = None
        torch.cuda.empty_cache()
    tot = {k: sum((r[k] or r["int8_tuned_us"]) * r["count"] for r in rows) for k in ("fp16_us", "int8_tuned_us",
                                                                                      "best_us")}
    print(f"layers swept (x counts): fp16 {tot['fp16_us']:.0f} us, int8 tuned {tot['int8_tuned_us']:.0f} us, "
          f"int8 best variant {tot['best_us']:.0f} us")
    a.out.write_text(json.dumps({"rows": rows, "totals": tot}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
