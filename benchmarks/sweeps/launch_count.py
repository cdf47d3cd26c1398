"""Which kernels one forward of warpforge-fp16 and warpforge-int8 launches on CUDA, counted on a CPU.

    python benchmarks/sweeps/launch_count.py --model resnet50 --batch 32
    python benchmarks/sweeps/launch_count.py --model mobilenet_v2 --batch 32 --table

Builds both candidates as optimize's backends do (capture + fold_bn, channels_last, fuse_conv at fp16;
int8: then quantize_model, max calibration) on a small calibration batch, then records one forward at
--batch x --size px with ``warpforge.profile.launches.record_launches`` (Triton launches intercepted,
torch ops that launch a kernel counted; nothing is computed, so full size is cheap). Prints per candidate
the launches by kernel, the total, and the compulsory bytes (every tensor argument once); --table lists
every launch in order. No GPU needed, no figure here is a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from warpforge.zoo import get  # noqa: E402
from warpforge.optimize.backends import _pipeline  # noqa: E402
from warpforge.optimize.quant import quantize_model  # noqa: E402
from warpforge.profile.launches import record_launches  # noqa: E402


def build(model_name: str, calib_px: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    dt = torch.float16
    model = get(model_name, pretrained=False).model.eval()
    x = torch.randn(1, 3, calib_px, calib_px)
    fp16, _ = _pipeline(model, (x,), dt)
    int8, _ = _pipeline(model, (x,), dt)
    int8, _ = quantize_model(int8, [(x.to(dt),)])
    return {"warpforge-fp16": fp16, "warpforge-int8": int8}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--calib-px", type=int, default=64, help="calibration image size (scales do not change counts)")
    ap.add_argument("--table", action="store_true", help="every launch, in order")
    ap.add_argument("--out", type=Path, default=None, help="write the summaries as JSON")
    a = ap.parse_args(argv)
    built = build(a.model, a.calib_px)
    x = torch.randn(a.batch, 3, a.size, a.size, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    res = {}
    for name, m in built.items():
        with record_launches():
            m(x)  # warm-up: the depthwise weights' one-time repack (conv_common._prepared) is not per forward
        with record_launches() as log:
            m(x)
        res[name] = log.summary()
        print(f"== {name}: {a.model} batch {a.batch} {a.size}px")
        print(log.table() if a.table else json.dumps(res[name], indent=1))
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "batch": a.batch, "size": a.size, "candidates": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
