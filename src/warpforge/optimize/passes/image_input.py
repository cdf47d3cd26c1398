"""Hand a network's image input, as the caller gave it, to a space-to-depth stem that reads it directly.

Why: before ResNet-50's 7x7/2 stem the 16-bit candidates cast the fp32 NCHW input to fp16, the channels_last
pass copied it to NHWC, and then the stem's space-to-depth pack read it once more: three passes over the
image, each a kernel of its own. The pack gathers 2x2 pixels x C channels
per s2d pixel through x's strides anyway and can cast what it loads, so it reads the fp32 NCHW input
itself (``kernels.conv.reads_image``): one pass over the image instead of three.

The pass runs after fuse_conv: a 4-D graph input whose only readers are such stems (a 16-bit
``FusedConv2d`` on the space-to-depth path, through the channels_last pass's entry copy or not) loses that
copy, and its position goes in the graph's ``raw_inputs`` (``runtime.raw_inputs``), which ``runtime.CastIO``
passes through uncast.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from warpforge.kernels.conv_stem import is_s2d_stem
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext
from warpforge.optimize.passes.fuse_conv import FusedConv2d
from warpforge.optimize.runtime import raw_inputs

CL = torch.channels_last


def image_stem(m: nn.Module | None) -> bool:
    """A 16-bit FusedConv2d on the space-to-depth path, without a residual: it reads any layout and fp32."""
    if not isinstance(m, FusedConv2d) or m.has_residual or m.weight.dtype not in (torch.float16, torch.bfloat16):
        return False
    return is_s2d_stem(m.groups, m.stride, m.dilation, *m.weight.shape[1:2], *m.weight.shape[2:])


def _is_entry_copy(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "contiguous" and node.kwargs.get("memory_format") == CL


class ImageInput:
    """Pass: graph inputs read only by image stems are handed to them uncast and in the caller's layout."""

    name = "image_input"

    def apply(self, model: nn.Module, ctx: PassContext) -> nn.Module:
        if not isinstance(model, fx.GraphModule):
            return model
        placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(ctx.example_inputs) or not all(
                isinstance(x, torch.Tensor) for x in ctx.example_inputs):
            return model  # positions must line up with the callers' arguments (CastIO's)
        raw = set(raw_inputs(model))
        for i, (node, x) in enumerate(zip(placeholders, ctx.example_inputs)):
            if x.dim() != 4 or not x.is_floating_point() or i in raw:
                continue
            users = list(node.users)
            entry = users[0] if len(users) == 1 and _is_entry_copy(users[0]) else None
            src = entry if entry is not None else node
            readers = list(src.users)
            if not readers or not all(r.op == "call_module" and image_stem(_fx.called_module(model, r))
                                      and r.args[:1] == (src,) and src not in r.args[1:] and not r.kwargs
                                      for r in readers):
                continue
            if entry is not None:
                entry.replace_all_uses_with(node)
                model.graph.erase_node(entry)
            raw.add(i)
            ctx.record(self.name, "handed", f"input {node.name} -> {', '.join(str(r.target) for r in readers)}",
                       "read as given (fp32, any layout) by the space-to-depth stem's pack: no cast, no "
                       "channels_last copy")
        if raw:  # both copies: see runtime.raw_inputs
            model.raw_inputs = model.meta["raw_inputs"] = tuple(sorted(raw))
        _fx.finish(model)
        return model


__all__ = ["ImageInput", "image_stem"]
