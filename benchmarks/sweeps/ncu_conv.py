"""Why do the int8 convs run at a fifth of the tensor cores' rate? Hardware counters on a few ResNet-50 b32
conv layers, int8 against fp16, as the optimizer runs them (tuned tilings, bias + relu, int8 out).

    ncu --clock-control none --profile-from-start off --set full -o conv \
        python benchmarks/sweeps/ncu_conv.py --out ncu_conv.json

Without ncu it still times each case (CUDA graph, L2 flushed) and prints the tiling chosen, the compiled
kernel's registers / spills / shared memory, and writes every conv kernel's cubin (for ``cuobjdump
--dump-sass``) under --cubins. Each case runs once between ``cudaProfilerStart`` / ``Stop`` after its
warm-up, so ncu (``--profile-from-start off``) sees one launch per case, in the order printed.

Cases (layer labels as in the kernels suite): the stem (fp16 only), a 3x3 stride-1 conv (the int8 side's
largest group: 320 us of 1112 in session 10's sweep), a short-K 1x1 (persistent winner), a strided 1x1
with long K (int8 37 us where cuDNN fp16 takes 25). Each int8 result is checked against the int8 reference
(exact int32 accumulation: at most one step of requantization rounding apart) in the same run.
``--depthwise``: MobileNetV2's depthwise convs, fp16 out against int8 out (DEPTHWISE).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conv_int8_sweep import inputs  # noqa: E402

from warpforge.bench.suites._kernels_fused import RESNET50  # noqa: E402
from warpforge.timing import time_fn  # noqa: E402
from warpforge.kernels import conv_depthwise, conv_gemm, conv_pointwise, conv_tuning  # noqa: E402
from warpforge.kernels import reference as ref  # noqa: E402
from warpforge.kernels.conv import conv2d  # noqa: E402
from warpforge.kernels.conv_int8 import conv2d_int8  # noqa: E402

LABELS = ("7x7/2 3->64 @224", "3x3/1 256->256 @14", "3x3/1 64->64 @56", "1x1/1 64->256 @56",
          "1x1/2 1024->2048 @14", "1x1/1 256->1024 @14")


# MobileNetV2 b32's largest depthwise convs (label, channels, input side, stride). In its int8 forward the
# depthwise convs stay fp16 but store int8 for the int8 projection after them, and run 10-35% slower than
# in the fp16 forward (H200, 2026-12-04 forward timeline: 96 @112/2 45.5 -> 61.7 us, 144 @56 53.2 -> 60.8)
# though they write half the bytes; the PTX shows 8 multiplies and 8 conversions more a thread.
DEPTHWISE = (("dw3x3/2 96 @112", 96, 112, 2), ("dw3x3/1 144 @56", 144, 56, 1), ("dw3x3/1 32 @112", 32, 112, 1))


@dataclass(frozen=True)
class _Dw:
    label: str
    cin: int
    hw: int
    stride: int
    cout: int = 0
    k: int = 3
    groups: int = 1


def depthwise_cases(batch: int, dev: torch.device, gen: torch.Generator) -> list:
    """fp16 out and int8 out (unsigned, after the ReLU6) of each DEPTHWISE conv on the same fp16 input; the
    int8 result checked against the fp32 reference quantized the same way (at most one step apart)."""
    cases = []
    for label, c, hw, s in DEPTHWISE:
        la = _Dw(label, c, hw, s, cout=c, groups=c)
        x = torch.randn(batch, c, hw, hw, device=dev, generator=gen).clamp(0, 6).half().to(
            memory_format=torch.channels_last)
        w = (torch.randn(c, 1, 3, 3, device=dev, generator=gen) / 3).half()
        b = torch.randn(c, device=dev, generator=gen).half()
        kw = dict(stride=s, padding=1, groups=c, activation="relu6")
        scale = torch.tensor([6.0 / 255], device=dev)
        want = ref.conv2d_reference(x, w, b, **kw).float()
        want_q = (torch.round(want / scale) - 128).clamp(-128, 127).to(torch.int8)
        cases.append((f"fp16 {label}", la, lambda x=x, w=w, b=b, kw=kw: conv2d(x, w, b, **kw), None))
        cases.append((f"fp16 int8-out {label}", la, lambda x=x, w=w, b=b, kw=kw, sc=scale: conv2d(
            x, w, b, out_scale=sc, out_zero_point=-128, **kw), want_q))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("ncu_conv.json"))
    ap.add_argument("--cubins", type=Path, default=None, help="copy the conv kernels' cubins and metadata here")
    ap.add_argument("--depthwise", action="store_true",
                    help="MobileNetV2's depthwise convs instead, fp16 out against int8 out (see DEPTHWISE)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = depthwise_cases(a.batch, dev, gen) if a.depthwise else []
    for la in [] if a.depthwise else RESNET50:
        if la.label not in LABELS:
            continue
        d = inputs(la, a.batch, dev, gen)
        kw = dict(stride=la.stride, padding=la.pad, activation="relu")
        cases.append((f"fp16 {la.label}", la, lambda d=d, kw=kw: conv2d(d["x16"], d["w16"], d["b16"], **kw), None))
        if la.cin < 16:  # the stem (space-to-depth): fp16 only
            continue
        q8 = dict(x_zero_point=-128, w_sum=d["w_sum"], out_zero_point=-128, **kw)
        want = ref.conv2d_int8_reference(d["xq"], d["wq"], d["xs"], d["ws"], d["b32"], out_scale=d["os_"],
                                         out_dtype=torch.int8, out_zero_point=-128, x_zero_point=-128, **kw)
        cases.append((f"int8 {la.label}", la, lambda d=d, q8=q8: conv2d_int8(d["xq"], d["wq"], d["xs"], d["ws"],
                                                                             d["b32"], out_scale=d["os_"], **q8), want))
    rows = []
    for name, la, fn, want in cases:
        got = fn()  # tunes (or takes the shipped winner) and compiles
        torch.cuda.synchronize()
        diff = None if want is None else int((got.int() - want.int()).abs().max())
        us = time_fn(fn, cuda_graph=True, device=dev, warmup=10, rep=50).median_ms * 1e3
        m = a.batch * (la.hw // la.stride) ** 2
        flop = 2.0 * m * la.cout * la.cin * la.k ** 2 / getattr(la, "groups", 1)
        chosen = [str(v) for k, v in conv_tuning._CHOSEN.items()
                  if k[0].endswith("int8_gemm") == name.startswith("int8")
                  and k[2][5] == la.k and k[2][4] == la.cin and k[2][3] == la.cout]
        rows.append({"case": name, "us": us, "max_diff": diff, "tflops": flop / us / 1e6, "config": chosen})
        print(f"{name:28s} {us:8.1f} us  {flop / us / 1e6:6.0f} TFLOP/s  diff {diff}  {chosen}", flush=True)
    # one launch each under the profiler
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _name, _la, fn, _want in cases:
        fn()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    kinfo = []
    for jit in (conv_gemm._conv_gemm_kernel, conv_pointwise._conv_pointwise_persistent_kernel,
                conv_depthwise._conv_depthwise_kernel):
        for dev_cache in getattr(jit, "device_caches", {}).values():
            for key, k in dev_cache[0].items():
                md = k.metadata
                try:
                    k._init_handles()
                except Exception:  # noqa: BLE001 - counts are optional
                    pass
                kinfo.append({"kernel": jit.fn.__name__, "n_regs": getattr(k, "n_regs", None),
                              "n_spills": getattr(k, "n_spills", None), "shared": getattr(md, "shared", None),
                              "num_warps": getattr(md, "num_warps", None), "key": str(key)[:600]})
                if a.cubins is not None and "cubin" in k.asm:
                    a.cubins.mkdir(parents=True, exist_ok=True)
                    p = a.cubins / f"{jit.fn.__name__}_{len(kinfo)}.cubin"
                    p.write_bytes(k.asm["cubin"])
                    kinfo[-1]["cubin"] = p.name
                    for stage in ("ttgir", "ptx"):
                        if stage in k.asm:
                            (a.cubins / f"{p.stem}.{stage}").write_text(k.asm[stage])
    for r in kinfo:
        print(f"{r['kernel']:36s} regs {r['n_regs']} spills {r['n_spills']} smem {r['shared']} warps {r['num_warps']} "
              f"{r.get('cubin', '')}")
    a.out.write_text(json.dumps({"cases": rows, "kernels": kinfo}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
