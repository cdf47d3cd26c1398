"""Put a model's 4-D weights and its 4-D inputs in channels_last (NHWC in memory, NCHW shape).

Why: the conv kernels read and write channels_last (kernels/conv*.py), and cuDNN's fast paths on sm_90
prefer it too; converting once up front avoids a transpose around every conv. On a graph the pass also
converts each 4-D input on entry, so callers can keep passing NCHW-contiguous tensors.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext

CL = torch.channels_last


def _is_cl(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=CL)


class ChannelsLast:
    """Pass: 4-D parameters and buffers to channels_last; 4-D graph inputs converted on entry."""

    name = "channels_last"

    def apply(self, model: nn.Module, ctx: PassContext) -> nn.Module:
        moved = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.dim() == 4 and not _is_cl(t)]
        model.to(memory_format=CL)
        for path in moved:
            ctx.record(self.name, "converted", path, "4-D weight to channels_last")
        # Later passes trace shapes with these; the model's outputs do not depend on the layout.
        ctx.example_inputs = tuple(x.contiguous(memory_format=CL) if isinstance(x, torch.Tensor) and x.dim() == 4
                                   else x for x in ctx.example_inputs)
        if isinstance(model, fx.GraphModule):
            self._convert_inputs(model, ctx)
        return model

    def _convert_inputs(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, x in zip(placeholders, ctx.example_inputs):
            if not (isinstance(x, torch.Tensor) and x.dim() == 4):
                continue
            if any(u.op == "call_method" and u.target == "contiguous" and u.kwargs.get("memory_format") == CL
                   for u in node.users):
                continue  # already converted by an earlier run of this pass
            users = list(node.users)
            with gm.graph.inserting_after(node):
                conv = gm.graph.call_method("contiguous", (node,), {"memory_format": CL})
            for u in users:
                u.replace_input_with(node, conv)
            ctx.record(self.name, "converted", f"input {node.name}", "to channels_last on entry")
        _fx.finish(gm)


__all__ = ["ChannelsLast"]
