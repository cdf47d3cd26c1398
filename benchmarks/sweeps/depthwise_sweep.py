"""Which tiling makes MobileNetV2's depthwise convs fastest on the H200, for fp16 and for int8 output?

    python benchmarks/sweeps/depthwise_sweep.py --batch 32 --out depthwise.json

MobileNetV2 b32 spends ~260 us of its ~620 us forward in its 17 depthwise 3x3 convs (forward timeline,
2026-12-04), at ~40% of HBM bandwidth. Each of its 10 distinct depthwise shapes runs in the two modes the
optimizer's candidates use:

* ``f16``    fp16 in, fp16 out (the fp16 candidate);
* ``f16>q8`` fp16 in, int8 out (a depthwise conv feeding an int8 projection, its quantizer fused here);

under a grid of DepthwiseConfig tilings (block_p x block_c pixels x channels per program, warps), and the
default tiling (conv2d's own choice, conv_depthwise.depthwise_config) with the weights' precision flipped
(``flip-f32w``: the fp32 weight copy where conv2d reads the 16-bit weight, or back). Every result is checked
against the fp32 reference in the same run (fp16: relative error; int8: at most one code apart). Times: CUDA
graph, L2 flushed, median; GB/s counts the input read once and the output written once. The summary weighs
each shape by how often MobileNetV2 has it, default tiling against the best one per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import conv_depthwise  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels._dispatch import INTERPRET  # noqa: E402
from warpforge.kernels.conv import DepthwiseConfig, conv2d, depthwise_config  # noqa: E402

# MobileNetV2's depthwise 3x3 convs: (channels, input side, stride, how many of the 17)
SHAPES = ((32, 112, 1, 1), (96, 112, 2, 1), (144, 56, 1, 1), (144, 56, 2, 1), (192, 28, 1, 2), (192, 28, 2, 1),
          (384, 14, 1, 4), (576, 14, 1, 2), (576, 14, 2, 1), (960, 7, 1, 3))
MODES = ("f16", "f16>q8")


def configs(quick: bool) -> list[DepthwiseConfig]:
    """(block_c, pixels x channels per program, warps): the channel block against MobileNetV2's 96 and 144
    channels (64 wastes a quarter of the lanes there), the work per thread, the warps per program."""
    grid = ((16, 1024, 4), (32, 1024, 4), (64, 1024, 4)) if quick else (
        (16, 1024, 4), (32, 1024, 4), (64, 1024, 4), (16, 2048, 4), (32, 2048, 4), (64, 2048, 4), (32, 2048, 8))
    return [DepthwiseConfig(total // bc, bc, w) for bc, total, w in grid]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("depthwise_sweep.json"))
    ap.add_argument("--quick", action="store_true", help="three tilings instead of seven")
    ap.add_argument("--rep", type=int, default=30)
    a = ap.parse_args(argv)
    interp = INTERPRET  # (a smoke run on CPU: TRITON_INTERPRET=1 ... --batch 1 --quick --rep 1)
    if not torch.cuda.is_available() and not interp:
        ap.error("needs a GPU (or TRITON_INTERPRET=1 for a smoke run)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = torch.tensor([6.0 / 255], device=dev)  # unsigned codes of [0, 6] (a ReLU6), zero point -128
    rows, bad = [], []
    real_f32w = conv_depthwise._dw_fp32_weights
    for c, hw, s, count in SHAPES:
        n = a.batch
        x = torch.randn(n, c, hw, hw, device=dev, generator=gen).clamp(0, 6).half()
        x = x.to(memory_format=torch.channels_last)
        w = (torch.randn(c, 1, 3, 3, device=dev, generator=gen) / 3).half()
        b = torch.randn(c, device=dev, generator=gen).half()
        kw = dict(stride=s, padding=1, groups=c, activation="relu6")
        want = ref.conv2d_reference(x.float(), w.float(), b.float(), **kw)
        oh = (hw - 1) // s + 1
        label = f"dw {c} @{hw}/{s}"

        def run(mode, cfg):
            extra = dict(out_scale=scale, out_zero_point=-128) if mode.endswith(">q8") else {}
            return lambda: conv2d(x, w, b, config=cfg, **kw, **extra)

        def check(mode, got):
            if mode.endswith("q8"):
                wq = (torch.round(want / scale) - 128).clamp(-128, 127)
                return float((got.float() - wq).abs().max())  # codes apart
            return float((got.float() - want).abs().max() / want.abs().max())

        variants = [("default", None, False)]  # conv2d's own choice: depthwise_config(c)
        variants += [(f"p{cfg.block_p}c{cfg.block_c}w{cfg.num_warps}", cfg, False) for cfg in configs(a.quick)]
        variants += [("flip-f32w", None, True)]
        for mode in MODES:
            in_b = n * hw * hw * c * 2
            out_b = n * oh * oh * c * (1 if mode.endswith("q8") else 2)
            for vname, cfg, flip in variants:
                if flip:  # the fp32 weight copy where the default skips it, or back
                    conv_depthwise._dw_fp32_weights = lambda int8_out: not real_f32w(int8_out)
                try:
                    fn = run(mode, cfg)
                    got = fn()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    err = check(mode, got)
                    tol = 1.0 if mode.endswith("q8") else 2e-3
                    if not err <= tol:
                        bad.append(f"{label} {mode} {vname}: error {err:.3g} > {tol}")
                    us = time_fn(fn, cuda_graph=True, device=dev, warmup=5, rep=a.rep).median_ms * 1e3
                finally:
                    conv_depthwise._dw_fp32_weights = real_f32w
                used = cfg or depthwise_config(c)
                rows.append({"shape": label, "c": c, "hw": hw, "stride": s, "count": count, "mode": mode,
                             "variant": vname, "config": [used.block_p, used.block_c, used.num_warps], "us": us,
                             "gbs": (in_b + out_b) / us / 1e3, "err": err})
        best_us = {m: min(r["us"] for r in rows if r["shape"] == label and r["mode"] == m) for m in MODES}
        print(f"{label}: " + "  ".join(f"{m} {us:.1f}" for m, us in best_us.items()), flush=True)

    # summary: default vs best tiling per shape and mode, weighted by MobileNetV2's counts
    print(f"\n{'shape':18s} {'mode':7s} {'default us':>10s} {'GB/s':>6s} {'best us':>8s} {'GB/s':>6s}  best "
          f"{'flip-f32w':>9s}")
    totals = {m: [0.0, 0.0] for m in MODES}
    for c, hw, s, count in SHAPES:
        label = f"dw {c} @{hw}/{s}"
        for mode in MODES:
            rs = [r for r in rows if r["shape"] == label and r["mode"] == mode]
            d = next(r for r in rs if r["variant"] == "default")
            tiled = [r for r in rs if r["variant"] != "flip-f32w"]
            best = min(tiled, key=lambda r: r["us"])
            alt = {r["variant"]: r["us"] for r in rs}
            totals[mode][0] += count * d["us"]
            totals[mode][1] += count * best["us"]
            print(f"{label:18s} {mode:7s} {d['us']:10.1f} {d['gbs']:6.0f} {best['us']:8.1f} {best['gbs']:6.0f}  "
                  f"{best['variant']:12s} {alt.get('flip-f32w', float('nan')):9.1f}")
    print("\nMobileNetV2's 17 depthwise convs, summed (us): " + "  ".join(
        f"{m} default {t[0]:.1f} best {t[1]:.1f}" for m, t in totals.items()))
    if bad:
        print("WRONG RESULTS:\n  " + "\n  ".join(bad))
    a.out.write_text(json.dumps({"batch": a.batch, "rows": rows, "totals": totals, "wrong": bad}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    if INTERPRET and not torch.cuda.is_available():
        from warpforge.kernels._dispatch import force_triton

        with force_triton():
            raise SystemExit(main())
    raise SystemExit(main())
