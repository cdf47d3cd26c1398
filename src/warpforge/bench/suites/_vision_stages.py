"""Per-stage GPU time of one forward of a warpforge graph: the INT8 rows' split (vision suite).

    split = stage_split(built.module, inputs)   # {"int8 conv": ms, "float conv": ms, "quantize": ms, ...}

Why: an INT8 row times the whole CUDA graph, which says whether INT8 beats fp16 but not where the time
goes. This runs the captured FX graph once more, node by node (``torch.fx.Interpreter``), with a CUDA
event pair around every node, after a GPU sleep long enough for the host to queue the whole forward
(so the events measure the GPU, not Python's launch cost), and sums the event times per stage:

* ``int8 conv``: QuantConv2d (its own input quantizer included when its input is float),
* ``float conv``: FusedConv2d (the RGB stem, MobileNetV2's depthwise convs, fp16's every conv),
* ``quantize``: a standalone QuantizeInput (a tensor several int8 convs read: a max pool's output),
* ``linear``: nn.Linear / QuantLinearW8A8, ``other``: pools, casts, flatten, the graph's glue.

Eager, not the graph replay: launch gaps the graph removes are not in the figures, but each node's
share is. Costs two forwards (a warm-up and the timed one). CUDA only; None elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

SLEEP_CYCLES = 200_000_000  # ~0.1 s at 1.98 GHz: the host queues a whole forward (~60-100 nodes) meanwhile


def _graph_module(module: nn.Module) -> tuple[fx.GraphModule | None, Any]:
    """The GraphModule inside (CastIO wraps it: its input cast dtype too)."""
    inner, dtype = module, None
    while not isinstance(inner, fx.GraphModule) and hasattr(inner, "inner"):
        dtype = getattr(inner, "dtype", dtype)
        inner = inner.inner
    return (inner if isinstance(inner, fx.GraphModule) else None), dtype


def _stage(gm: fx.GraphModule, n: fx.Node) -> str | None:
    from warpforge.kernels.quantize import quantize_int8
    from warpforge.optimize.passes.fuse_conv import FusedConv2d
    from warpforge.optimize.quant import QuantConv2d, QuantizeInput, QuantLinearW8A8

    if n.op in ("placeholder", "output", "get_attr") or (n.op == "call_function" and n.target.__name__ == "getitem"):
        return None
    if n.op == "call_module":
        m = gm.get_submodule(n.target)
        if isinstance(m, QuantConv2d):
            return "int8 conv"
        if isinstance(m, FusedConv2d):
            return "float conv"
        if isinstance(m, (nn.Linear, QuantLinearW8A8)):
            return "linear"
        if isinstance(m, QuantizeInput):
            return "quantize"
    if n.op == "call_function" and n.target is quantize_int8:
        return "quantize"
    return "other"


class _Timed(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def run_node(self, n: fx.Node) -> Any:
        stage = _stage(self.module, n)
        if stage is None:
            return super().run_node(n)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = super().run_node(n)
        end.record()
        self.marks.append((stage, start, end))
        return out


def stage_split(module: nn.Module, inputs: tuple) -> dict[str, Any] | None:
    """ms per stage (and node count per stage) of one eager forward of ``module``'s FX graph on CUDA."""
    gm, dtype = _graph_module(module)
    if gm is None or not all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        return None
    args = tuple(x.to(dtype) if dtype is not None and x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        _Timed(gm).run(*args)  # warm-up: tuning, lazy allocations
        torch.cuda.synchronize()
        timed = _Timed(gm)
        torch.cuda._sleep(SLEEP_CYCLES)
        timed.run(*args)
        torch.cuda.synchronize()
    ms: dict[str, float] = {}
    nodes: dict[str, int] = {}
    for stage, start, end in timed.marks:
        ms[stage] = ms.get(stage, 0.0) + start.elapsed_time(end)
        nodes[stage] = nodes.get(stage, 0) + 1
    return {"method": "eager FX interpreter, CUDA events per node after a host head start; sums per stage",
            "ms": {k: round(v, 4) for k, v in ms.items()}, "nodes": nodes, "total_ms": round(sum(ms.values()), 4)}


__all__ = ["stage_split"]
