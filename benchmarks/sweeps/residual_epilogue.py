"""A ResNet block's last conv, the 1x1 that adds the residual: every persistent tiling, with the epilogue's
residual and output moving through TMA descriptors or per-element loads and stores, int8 and fp16, in one call.

    python benchmarks/sweeps/residual_epilogue.py --batch 32 --out residual_epilogue.json          (~1 min)

Why: the H200 kernel timeline of warpforge-int8's ResNet-50 at batch 32 (forward_timeline, session 12)
showed layer1's three 1x1 64->256 @56 convs with an int8 residual at 38-40 us each, against 24.7 us for
the same conv without a residual and 41-42 us for fp16's with one: int8 moves half the bytes and was 5-8%
faster. Offline (sm_90 TTGIR, triton 3.6) the int8 residual crossed shared memory as fp32 (64 KB a
128x128 tile) into the accumulator's layout, and the tile's per-element int64 addresses held ~128
registers a thread (254 in all: one block per SM). The TMA epilogue (kernels/conv_pointwise.py, TMA_EPI) has no
per-element addresses (171 registers offline) and hoists the per-channel factors out of the tile loop.
Measured (H200, git 23aa851): TMA on / off, int8 64->256 @56 best tiling 43.1 / 40.5 us, 128->512 @28
23.4 / 26.8 us (benchmarks/results/h200/sweeps/residual_epilogue_resnet50_b32.txt).

Per layer (ResNet-50's residual 1x1s: 64->256 @56, 128->512 @28, 256->1024 @14, 512->2048 @7, relu,
unsigned int8 in/out and residual as warpforge-int8 runs them; fp16 with an fp16 residual), for every
persistent tiling whose K tile holds C and for the tuned choice: us with the TMA epilogue and with per-element
loads and stores (the descriptors withheld), and with the residual through an MMA with the identity
(ConvConfig.res_dot: the pipeliner prefetches it; pinned tilings only), the bytes each moves and its DRAM
bandwidth. Each result is checked against the reference first (int8:
at most one code off, as rounding ties may break either way; fp16: relative error within fp16 tolerance).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels import conv_pointwise  # noqa: E402
from warpforge.kernels.conv import conv2d  # noqa: E402
from warpforge.kernels.conv_tuning import CONV_CONFIGS, RESIDUAL_TILINGS, _fits  # noqa: E402
from warpforge.kernels.conv_int8 import INT8_CONV_CONFIGS, INT8_RESIDUAL_TILINGS, conv2d_int8  # noqa: E402
from warpforge.kernels.tolerance import rel_err, tolerance  # noqa: E402

CL = torch.channels_last
# --occupancy: the residual tuner's extra persistent tilings (16 warps per SM instead of 8; kernels/conv_tuning.py
# RESIDUAL_TILINGS and kernels/conv_int8.py INT8_RESIDUAL_TILINGS), pinned as configs.
OCCUPANCY_TILINGS = {"int8": INT8_RESIDUAL_TILINGS, "fp16": RESIDUAL_TILINGS}
LAYERS = [(64, 56, 256), (128, 28, 512), (256, 14, 1024), (512, 7, 2048)]  # (C, hw, Cout), stride 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("residual_epilogue.json"))
    ap.add_argument("--layers", default="", help="comma-separated indices into LAYERS (default: all)")
    ap.add_argument("--settings", default="1:0,0:0,1:1",
                    help="comma-separated TMA:DOT pairs (TMA 0: per-element epilogue; DOT 1: res_dot on the "
                         "pinned tilings; DOT may be left out: 0)")
    ap.add_argument("--occupancy", action="store_true",
                    help="also time OCCUPANCY_TILINGS (more warps per SM), pinned as configs")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU: this sweep times kernels")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = [int(i) for i in a.layers.split(",") if i] or list(range(len(LAYERS)))

    def t(fn) -> float:
        return time_fn(fn, cuda_graph=True, device=dev, warmup=10, rep=50).median_ms * 1e3

    rows = []
    for i in idx:
        c, hw, cout = LAYERS[i]
        n, m = a.batch, a.batch * hw * hw
        x = torch.randn(n, c, hw, hw, generator=gen, device=dev).relu()
        w = torch.randn(cout, c, 1, 1, generator=gen, device=dev) * (2.0 / c) ** 0.5
        b = torch.randn(cout, generator=gen, device=dev) * 0.1
        r = torch.randn(n, cout, hw, hw, generator=gen, device=dev).relu()
        # int8 as the int8 pass gives a ReLU-fed block: unsigned codes (zero point -128) in, residual, out
        xs = torch.tensor([float(x.max()) / 255], device=dev)
        rs = torch.tensor([float(r.max()) / 255], device=dev)
        ws = w.abs().amax((1, 2, 3)).clamp_min(1e-12) / 127
        wq = torch.round(w / ws[:, None, None, None]).clamp(-127, 127).to(torch.int8).contiguous(memory_format=CL)
        xq = (torch.round(x / xs) - 128).clamp(-128, 127).to(torch.int8).contiguous(memory_format=CL)
        rq = (torch.round(r / rs) - 128).clamp(-128, 127).to(torch.int8).contiguous(memory_format=CL)
        y = torch.nn.functional.conv2d(x, w, b) + r
        os_ = torch.tensor([float(y.relu().max()) / 255], device=dev)
        q8 = dict(activation="relu", x_zero_point=-128, residual=rq, residual_scale=rs, residual_zero_point=-128,
                  out_scale=os_, out_zero_point=-128)
        want8 = ref.conv2d_int8_reference(xq, wq, xs, ws.float(), b.float(), activation="relu", x_zero_point=-128,
                                          residual=((rq.float() + 128) * rs).contiguous(memory_format=CL),
                                          out_scale=os_, out_zero_point=-128)
        x16, w16, b16 = x.half().contiguous(memory_format=CL), w.half().contiguous(memory_format=CL), b.half()
        r16 = r.half().contiguous(memory_format=CL)
        want16 = ref.conv2d_reference(x16, w16, b16, activation="relu", residual=r16, compute_dtype=torch.float64)
        bytes8 = m * c + 2 * m * cout + cout * c
        bytes16 = 2 * (m * c + 2 * m * cout + cout * c)
        row = {"layer": f"1x1 {c}->{cout} @{hw} +res", "m": m, "bytes_int8": bytes8, "bytes_fp16": bytes16,
               "points": {}}
        def fitting(cfgs):  # the persistent tilings the tuner would offer this conv (conv_tuning._fits)
            return [cf for cf in cfgs if cf.persistent and _fits(cf, m, cout, c, 1, CONV_CONFIGS[0], pointwise=True)]

        cfgs8 = [None] + fitting(INT8_CONV_CONFIGS) + (fitting(OCCUPANCY_TILINGS["int8"]) if a.occupancy else [])
        cfgs16 = [None] + fitting(CONV_CONFIGS) + (fitting(OCCUPANCY_TILINGS["fp16"]) if a.occupancy else [])
        real_tma = conv_pointwise._tma_epilogue
        for flag, dot in ((*sp.split(":"), "0")[:2] for sp in a.settings.split(",")):
            conv_pointwise._tma_epilogue = real_tma if flag == "1" else (lambda *_a: {})
            for kind, cfgs in (("int8", cfgs8), ("fp16", cfgs16)):
                for cf in cfgs:
                    if dot == "1":
                        if cf is None:
                            continue  # the tuner chooses res_dot itself
                        cf = replace(cf, res_dot=True)
                    name = f"{kind} tma={flag} dot={dot} {'tuned' if cf is None else cf}"
                    try:
                        if kind == "int8":
                            def fn(cf=cf):
                                return conv2d_int8(xq, wq, xs, ws, b, config=cf, **q8)
                            got = fn()
                            err = int((got.int() - want8.int()).abs().max())
                            ok = err <= 1
                        else:
                            def fn(cf=cf):
                                return conv2d(x16, w16, b16, activation="relu", residual=r16, config=cf)
                            got = fn()
                            err = rel_err(got, want16)
                            ok = err <= tolerance(torch.float16)
                        us = t(fn)
                        nbytes = bytes8 if kind == "int8" else bytes16
                        row["points"][name] = {"us": us, "err": err, "ok": ok, "tb_s": nbytes / us / 1e6}
                    except Exception as e:  # noqa: BLE001  (a tiling that does not compile is a data point)
                        row["points"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        conv_pointwise._tma_epilogue = real_tma
        rows.append(row)
        print(f"== {row['layer']}  (int8 {bytes8 / 1e6:.1f} MB, fp16 {bytes16 / 1e6:.1f} MB)")
        for name, p in row["points"].items():
            if "error" in p:
                print(f"   {name:70s} ERROR {p['error'][:90]}")
            else:
                print(f"   {name:70s} {p['us']:7.1f} us  {p['tb_s']:5.2f} TB/s  err {p['err']:.3g}"
                      f"{'' if p['ok'] else '  WRONG'}")
        a.out.write_text(json.dumps({"batch": a.batch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
