"""A pipeline is a list of passes applied in order; ``optimize_graph`` is capture + pipeline + a check.

    model, report = optimize_graph(model, (x,))   # report["passes"][i]["counts"] == {"folded": 3, ...}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from warpforge.optimize.capture import capture as capture_model
from warpforge.optimize.passes.attention import ReplaceAttention
from warpforge.optimize.passes.base import Pass, PassContext, PassResult
from warpforge.optimize.passes.channels_last import ChannelsLast
from warpforge.optimize.passes.fold_bn import FoldBatchNorm
from warpforge.optimize.passes.fuse_conv import FuseConvEpilogue
from warpforge.optimize.passes.fuse_linear import FuseLinear
from warpforge.optimize.passes.fuse_norm import FuseNorm
from warpforge.optimize.passes.image_input import ImageInput
from warpforge.optimize.passes.pool import FastMaxPool


def default_passes() -> list[Pass]:
    """fold_bn first (a BatchNorm between conv and act would block fusion), then layout, then fusion, an
    image stem reading the input as given (passes/image_input.py), max pools onto the pool kernel, then
    attention onto flash attention (on CUDA only: see passes/attention.py)."""
    return [FoldBatchNorm(), ChannelsLast(), FuseConvEpilogue(), ImageInput(), FastMaxPool(),
            ReplaceAttention(cuda_only=True)]


def float_passes() -> list[Pass]:
    """The float candidates' pipeline (warpforge-fp32/fp16/bf16): the defaults, then layer norms with the
    residual adds before them onto the norm kernel (passes/fuse_norm.py), then linears merged and fused into
    the matmul kernel (passes/fuse_linear.py): fewer memory passes over the transformer's activations
    (figures: benchmarks/notes/optimize.md). Not the quantizing candidates' first step: int8, fp8 and
    weight-only passes replace Linear modules themselves."""
    return default_passes() + [FuseNorm(), FuseLinear()]


class Pipeline:
    """Passes run in order on one model; each pass's share of the change log becomes a PassResult."""

    def __init__(self, passes: Sequence[Pass]) -> None:
        for p in passes:
            if not isinstance(p, Pass):
                raise ValueError(f"passes must have .name and .apply(model, ctx), got {type(p).__name__}")
        self.passes = list(passes)

    def run(self, model: nn.Module, ctx: PassContext) -> tuple[nn.Module, list[PassResult]]:
        results = []
        for p in self.passes:
            start = len(ctx.changes)
            model = p.apply(model, ctx)
            results.append(PassResult(p.name, tuple(ctx.changes[start:])))
        return model, results


def _max_abs_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, (tuple, list)):
        return max((_max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, dict):
        return max((_max_abs_diff(a[k], b[k]) for k in a), default=0.0)
    return 0.0


def optimize_graph(model: nn.Module, example_inputs: tuple[Any, ...], passes: Sequence[Pass] | None = None, *,
                   device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32, capture: str = "auto", shapes: Any = None
                   ) -> tuple[nn.Module, dict[str, Any]]:
    """Capture an inference copy of ``model`` (eval mode; the original is untouched) by ``capture``
    ("auto": torch.export, else FX; "export"; "fx": see optimize.capture), run ``passes`` (default:
    :func:`default_passes`), and compare outputs with the eval-mode original on example_inputs.

    ``shapes`` (optimize.shapes.ShapeSpec): the input dims declared dynamic, kept symbolic by the capture.

    Returns (optimized model, report) with report keys "capture" (method, operator coverage, modules left eager),
    "passes" (per pass: counts per action and each change) and "max_abs_diff".
    """
    if device is None:
        first = next((t for t in example_inputs if isinstance(t, torch.Tensor)), None)
        device = first.device if first is not None else torch.device("cpu")
    original = model
    was_training = original.training
    original.eval()  # inference: BN uses running statistics, dropout is off (restored below)
    try:
        cap = capture_model(original, example_inputs, capture, shapes)
        ctx = PassContext(example_inputs=example_inputs, device=device, dtype=dtype)
        optimized, results = Pipeline(default_passes() if passes is None else passes).run(cap.module, ctx)
        with torch.no_grad():
            diff = _max_abs_diff(original(*example_inputs), optimized(*example_inputs))
    finally:
        original.train(was_training)
    report = {"capture": cap.coverage(), "passes": [r.as_dict() for r in results], "max_abs_diff": diff}
    return optimized, report


__all__ = ["Pipeline", "default_passes", "float_passes", "optimize_graph"]
