"""Where does the INT8 ResNet-50 time go? Per layer: fp16 conv2d against conv2d_int8 at every tiling,
the glue kernels, and both candidates' whole forward, in one call.

    python benchmarks/sweeps/conv_int8_sweep.py --batch 32 --out conv_int8_sweep.json             (~4 min)
    python benchmarks/sweeps/conv_int8_sweep.py --model mobilenet_v2 --batch 32 --out conv_int8_mnv2.json

Why: on the H200 (vision suite, 2026-12-01, git d94da65) the warpforge-int8 ResNet-50 at batch 32 took
2.68 ms against 1.70 ms for warpforge-fp16 (0.64x; the target is 1.3x), and MobileNetV2 0.63x. The PTX of
the int8 implicit GEMM looks right offline (wgmma m64n128k32 s8, 16-byte cp.async, no spills), so this
sweep measures instead of guessing. For each distinct ResNet-50 conv shape (bias + relu fused, as the
optimizer runs them) it times, with the bench harness (CUDA graph of the launch, L2 flushed, host hidden):

* ``fp16``: conv2d as tuned (the fp16 pipeline's layer),
* ``int8 tuned``: conv2d_int8 with int8 out (out_scale: the next layer's quantizer fused), as tuned, on
  unsigned x (zero point -128: what the optimizer gives every ReLU-fed conv, i.e. all of ResNet-50's) and
  on signed x (``int8_signed_us``: the masked-load path without a padding row),
* ``int8 dual``: fp16 out and its int8 copy (``out_q``: a ResNet block's last conv feeding the next block),
* every INT8_CONV_CONFIGS entry (unsigned x, int8 out) and the EXTRA tilings below, fixed; ``f16mma`` in a
  tiling's name: int8 loads, fp16 tensor cores (the MMA stays in flight, which Triton 3.6 never does for
  an int32 accumulator),
* ``quantize``: quantize_int8 of the layer's fp16 input (what a layer pays when its producer is float).

MobileNetV2 adds its depthwise convs (fp16 in; fp16 out against int8 out, as warpforge-int8 runs them).
Then (``--forward``, default) the two candidates themselves, built as optimize builds them (random weights,
calibrated on one random batch) and replayed as their CUDA graphs: their ms, and the per-layer sums above
weighted by layer counts, so the difference is what sits between the convs (pools, the head, launches).
The offline side of the same question: tests/kernels/sm90_compile.py --all --only=conv (registers,
blocks per SM, whether the MMA stays in flight: never for int32 accumulators in Triton 3.6).

Each int8 run is checked once against the int8 reference (exact int32 accumulation: identical up to
the last rounding of the requantized output). Prints per layer fp16 us, int8 tuned us, best int8 us and
its tiling, the ratio fp16 / best; the sum over the network weighted by the layer counts; and writes all
points to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.bench.suites._kernels_fused import RESNET50, ConvLayer  # noqa: E402
from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels.conv import ConvConfig, conv2d  # noqa: E402
from warpforge.kernels.conv_int8 import INT8_CONV_CONFIGS, conv2d_int8  # noqa: E402
from warpforge.kernels.matmul_int8 import matmul_int8  # noqa: E402
from warpforge.kernels.quantize import quantize_int8  # noqa: E402

CL = torch.channels_last
EXTRA = [  # not in the tuner: candidates this sweep tests
    ConvConfig(128, 256, 64, 8, 8, 3),
    ConvConfig(256, 128, 64, 8, 8, 3),
    ConvConfig(128, 128, 256, 8, 8, 3),
    ConvConfig(128, 128, 32, 8, 8, 4),  # short-K 1x1s (C = 16..32)
    ConvConfig(128, 64, 32, 8, 4, 4),
    ConvConfig(128, 128, 128, 8, 8, 3, f16_mma=True),  # int8 operands on fp16 tensor cores, deeper K steps
    ConvConfig(128, 64, 128, 8, 4, 3, f16_mma=True),
]


def model_layers(name: str) -> list[ConvLayer]:
    """The distinct dense (groups == 1) conv shapes of a zoo model at 224 px, with their counts: the convs
    warpforge-int8 runs on conv2d_int8 (depthwise convs stay fp16). Square kernels, padding k // 2."""
    from warpforge.zoo import get

    seen: dict[tuple, int] = {}
    model = get(name, pretrained=False).model.eval()
    hooks = [m.register_forward_hook(lambda m, a, o: seen.__setitem__(
        key := (m.in_channels, a[0].shape[-1], m.out_channels, m.kernel_size[0], m.stride[0]), seen.get(key, 0) + 1))
        for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups == 1]
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    return [ConvLayer(*k, count=n) for k, n in seen.items()]


def inputs(layer: ConvLayer, batch: int, dev: torch.device, gen: torch.Generator):
    """fp16 x/w/b, and int8 x (unsigned, zero point -128, and signed), w, scales, as warpforge-int8 has them."""
    x = torch.randn(batch, layer.cin, layer.hw, layer.hw, generator=gen, device=dev).relu()
    he = (2.0 / (layer.cin * layer.k ** 2)) ** 0.5
    w = torch.randn(layer.cout, layer.cin, layer.k, layer.k, generator=gen, device=dev) * he
    b = torch.randn(layer.cout, generator=gen, device=dev) * 0.1
    x16, w16 = x.half().contiguous(memory_format=CL), w.half().contiguous(memory_format=CL)
    xs = torch.tensor([float(x.abs().max()) / 255], device=dev)  # unsigned grid: 255 steps over [0, max]
    xs_signed = torch.tensor([float(x.abs().max()) / 127], device=dev)
    ws = w.abs().amax((1, 2, 3)).clamp_min(1e-12) / 127
    wq = torch.round(w / ws[:, None, None, None]).clamp(-127, 127).to(torch.int8).contiguous(memory_format=CL)
    xq = quantize_int8(x16, xs, zero_point=-128)
    xq_signed = quantize_int8(x16, xs_signed)
    y = torch.nn.functional.conv2d(x, w, b, layer.stride, layer.pad).relu()
    os_ = torch.tensor([float(y.abs().max()) / 255], device=dev)
    return dict(x16=x16, w16=w16, b16=b.half(), xq=xq, xq_signed=xq_signed, wq=wq, xs=xs, xs_signed=xs_signed,
                ws=ws.float(), b32=b.float(), os_=os_, w_sum=wq.sum((1, 2, 3), dtype=torch.int32))


def depthwise_layers(name: str) -> list[tuple[int, int, int, int, int]]:
    """(C, hw, k, stride, count) of the depthwise convs of a zoo model at 224 px (they stay fp16 in int8)."""
    from warpforge.zoo import get

    seen: dict[tuple, int] = {}
    model = get(name, pretrained=False).model.eval()
    hooks = [m.register_forward_hook(lambda m, a, o: seen.__setitem__(
        key := (m.in_channels, a[0].shape[-1], m.kernel_size[0], m.stride[0]), seen.get(key, 0) + 1))
        for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels]
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    for h in hooks:
        h.remove()
    return [(*k, n) for k, n in seen.items()]


def build_candidates(name: str, batch: int, dev: torch.device):
    """(fp32 model, input, {warpforge-fp16, warpforge-int8}) as optimize builds them: random weights, int8
    calibrated on one random batch, each replaying its own CUDA graph on the GPU."""
    from warpforge.zoo import get
    from warpforge.optimize.backends import _build_warpforge, _build_warpforge_int8

    torch.manual_seed(0)
    model = get(name, pretrained=False).model.eval().to(dev)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    calib = [(torch.randn(batch, 3, 224, 224, device=dev),)]
    built = {"warpforge-fp16": _build_warpforge("fp16")(model, (x,)),
             "warpforge-int8": _build_warpforge_int8()(model, (x,), calib)}
    return model, x, built


def forward_times(name: str, batch: int, dev: torch.device, t) -> dict[str, float]:
    """ms per call of warpforge-fp16 and warpforge-int8 as optimize builds them (each its own CUDA graph)."""
    _, x, built = build_candidates(name, batch, dev)
    out = {}
    for key, b in built.items():
        out[key] = t(lambda b=b: b(x), graph=False) / 1e3
        out[key + " graphed"] = bool(b.cuda_graph)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("conv_int8_sweep.json"))
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "mobilenet_v2"],
                    help="whose conv shapes: resnet50 (the kernels suite's list) or mobilenet_v2 (its dense convs)")
    ap.add_argument("--layers", default="", help="comma-separated indices into the model's list (default: all)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop sweeping new layers after this")
    ap.add_argument("--no-forward", action="store_true", help="skip timing the two candidates' whole forward")
    ap.add_argument("--tuned-only", action="store_true", help="skip the fixed tilings (each compiles): tuned and "
                                                               "peers only, about 5x faster")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only as a dry run of the script (references, "
                                                     "host timer: the figures mean nothing)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a GPU: this sweep times kernels (--device cpu for a dry run)")
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = RESNET50 if a.model == "resnet50" else model_layers(a.model)
    idx = [int(i) for i in a.layers.split(",") if i] or list(range(len(layers)))
    t0 = time.perf_counter()
    rows = []

    def t(fn, graph: bool = True) -> float:
        return time_fn(fn, cuda_graph=graph and dev.type == "cuda", device=dev,
                       warmup=1 if dev.type != "cuda" else 10, rep=2 if dev.type != "cuda" else 50).median_ms * 1e3

    for i in idx:
        if time.perf_counter() - t0 > a.budget_s:
            print(f"budget: stopping before layer {i}")
            break
        la = layers[i]
        d = inputs(la, a.batch, dev, gen)
        x16, w16, b16, xq, wq, xs, ws, b32, os_ = (d[k] for k in ("x16", "w16", "b16", "xq", "wq", "xs", "ws", "b32",
                                                                   "os_"))
        kw = dict(stride=la.stride, padding=la.pad, activation="relu")
        row = {"layer": la.label, "count": la.count, "points": {}}

        row["fp16_us"] = t(lambda: conv2d(x16, w16, b16, **kw))
        row["quantize_us"] = t(lambda: quantize_int8(x16, xs, zero_point=-128))
        if la.cin < 16:  # the stem stays fp16 in the optimizer
            rows.append(row)
            print(f"{la.label:24s} x{la.count}  fp16 {row['fp16_us']:8.1f} us  (stem: fp16 only)")
            continue
        q8 = dict(x_zero_point=-128, w_sum=d["w_sum"], out_zero_point=-128, **kw)
        want = ref.conv2d_int8_reference(xq, wq, xs, ws, b32, out_scale=os_, out_dtype=torch.int8,
                                         out_zero_point=-128, x_zero_point=-128, **kw)

        def int8(cfg):
            return conv2d_int8(xq, wq, xs, ws, b32, out_scale=os_, config=cfg, **q8)

        row["int8_tuned_us"] = t(lambda: int8(None))
        row["int8_signed_us"] = t(lambda: conv2d_int8(d["xq_signed"], wq, d["xs_signed"], ws, b32, out_scale=os_, **kw))
        out_q = torch.empty(want.shape, dtype=torch.int8, device=dev, memory_format=CL)
        # Peers and a route not taken: cuDNN's fp16 conv alone (no epilogue), and for 1x1 stride-1 layers
        # (a plain GEMM over [N*H*W, C]) cuBLAS int8 (torch._int_mm, int32 out, no epilogue) and our
        # persistent TMA int8 matmul (matmul_int8: signed x, fp16 out, bias + relu fused).
        row["cudnn_fp16_us"] = t(lambda: torch.nn.functional.conv2d(x16, w16, b16, la.stride, la.pad))
        if la.k == 1 and la.stride == 1:
            m = a.batch * la.hw * la.hw
            a2 = d["xq_signed"].permute(0, 2, 3, 1).reshape(m, la.cin)
            b2 = wq.reshape(la.cout, la.cin).t()
            for key, fn in (("cublas_int8_us", lambda: torch._int_mm(a2, b2)),
                            ("tma_int8_us", lambda: matmul_int8(a2, b2, d["xs_signed"], ws, bias=b32,
                                                                activation="relu", out_dtype=torch.float16))):
                try:
                    row[key] = t(fn)
                except Exception as e:  # noqa: BLE001 - a peer that refuses this shape is data
                    row[key + "_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["int8_dual_us"] = t(lambda: conv2d_int8(xq, wq, xs, ws, b32, out_scale=os_, out_dtype=torch.float16,
                                                    out_q=out_q, **q8))
        for cfg in [] if a.tuned_only else [*INT8_CONV_CONFIGS, *EXTRA]:
            key = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} k{cfg.split_k}"
                   + (" f16mma" if cfg.f16_mma else "") + (f" p{cfg.persistent}" if cfg.persistent else ""))
            try:
                got = int8(cfg)
                diff = int((got.int() - want.int()).abs().max())
                row["points"][key] = {"us": t(lambda c=cfg: int8(c)), "max_diff": diff}
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit this shape is data
                row["points"][key] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        if a.tuned_only:
            got = int8(None)
            row["points"]["tuned"] = {"us": row["int8_tuned_us"], "max_diff": int((got.int() - want.int()).abs().max())}
        ok = {k: v for k, v in row["points"].items() if "us" in v and v["max_diff"] <= 1}
        best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
        row["best"] = best
        row["best_us"] = ok[best]["us"] if best else None
        rows.append(row)
        bad = [k for k, v in row["points"].items() if "us" in v and v["max_diff"] > 1]
        print(f"{la.label:24s} x{la.count}  fp16 {row['fp16_us']:8.1f}  int8 tuned {row['int8_tuned_us']:8.1f}  "
              f"signed {row['int8_signed_us']:8.1f}  dual {row['int8_dual_us']:8.1f}  "
              f"best {row['best_us'] or 0:8.1f} [{best}]  quant {row['quantize_us']:6.1f} us  "
              f"cudnn16 {row['cudnn_fp16_us']:7.1f}  cublas8 {row.get('cublas_int8_us', 0):7.1f}  "
              f"tma8 {row.get('tma_int8_us', 0):7.1f}  "
              f"fp16/best {row['fp16_us'] / row['best_us'] if row['best_us'] else 0:5.2f}x"
              + (f"  WRONG: {bad}" if bad else ""), flush=True)
        # Free this layer's tensors before the next layer's are made (rebound, not del: the lambdas above read them).
        d = x16 = w16 = xq = wq = want = out_q = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # The stem stays fp16 in warpforge-int8: count its fp16 time on the int8 side too.
    tot = {k: sum((r["fp16_us"] if r.get(k) is None else r[k]) * r["count"] for r in rows)
           for k in ("fp16_us", "int8_tuned_us", "int8_dual_us", "best_us")}
    print(f"dense convs (x counts): fp16 {tot['fp16_us']:.0f} us, int8 tuned {tot['int8_tuned_us']:.0f} us, "
          f"int8 best {tot['best_us']:.0f} us")
    dw_rows = []
    if a.model == "mobilenet_v2":
        for c, hw, k, stride, count in depthwise_layers(a.model):
            x16 = torch.randn(a.batch, c, hw, hw, generator=gen, device=dev).half().contiguous(memory_format=CL)
            w16 = (torch.randn(c, 1, k, k, generator=gen, device=dev) * 0.3).half()
            b16 = torch.zeros(c, device=dev, dtype=torch.float16)
            kw = dict(stride=stride, padding=k // 2, groups=c, activation="relu6")
            dw_scale = torch.tensor([0.05], device=dev)
            r = {"layer": f"dw {k}x{k}/{stride} {c} @{hw}", "count": count,
                 "fp16_us": t(lambda: conv2d(x16, w16, b16, **kw)),
                 "int8_out_us": t(lambda: conv2d(x16, w16, b16, out_scale=dw_scale, out_zero_point=-128, **kw))}
            dw_rows.append(r)
            print(f"{r['layer']:24s} x{count}  fp16 out {r['fp16_us']:8.1f}  int8 out {r['int8_out_us']:8.1f} us")
        for k in ("fp16_us", "int8_out_us"):
            tot["dw_" + k] = sum(r[k] * r["count"] for r in dw_rows)
        print(f"depthwise (x counts): fp16 out {tot['dw_fp16_us']:.0f} us, int8 out {tot['dw_int8_out_us']:.0f} us")
    fwd = {}
    if not a.no_forward:
        fwd = forward_times(a.model, a.batch, dev, t)
        f16, f8 = fwd["warpforge-fp16"], fwd["warpforge-int8"]
        conv8 = tot["int8_tuned_us"] + tot.get("dw_int8_out_us", 0.0)
        conv16 = tot["fp16_us"] + tot.get("dw_fp16_us", 0.0)
        split = (f"; convs alone {conv16 / 1e3:.3f} vs {conv8 / 1e3:.3f} ms, the rest {f16 - conv16 / 1e3:.3f} vs "
                 f"{f8 - conv8 / 1e3:.3f} ms" if len(rows) == len(layers) else " (not every layer swept: no split)")
        print(f"forward: warpforge-fp16 {f16:.3f} ms, warpforge-int8 {f8:.3f} ms, fp16/int8 {f16 / f8:.2f}x "
              f"(target 1.3x){split}")
    a.out.write_text(json.dumps({"model": a.model, "batch": a.batch, "rows": rows, "depthwise": dw_rows,
                                 "totals_us": tot, "forward_ms": fwd}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
