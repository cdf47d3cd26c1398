"""Replace Conv2d [-> + residual] [-> ReLU/ReLU6/SiLU/GELU] with one ``warpforge.kernels.conv.conv2d`` call.

The kernel's epilogue is ``act(conv(x) + bias + residual)``, so the patterns are conv -> act,
conv -> add -> act (a ResNet block's ``relu(bn(conv(h)) + identity)`` once BN is folded) and
conv -> add. Run after fold_bn: a BatchNorm between conv and act blocks the match.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from warpforge.kernels.conv import CONV_DTYPES, conv2d, reads_image
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext

_ACT_MODULES = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.SiLU: "silu"}
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", torch.relu_: "relu", F.relu6: "relu6", F.silu: "silu",
                  F.gelu: "gelu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}
_ADDS = (operator.add, operator.iadd, torch.add)


class FusedConv2d(nn.Module):
    """``act(conv2d(x, weight) + bias + residual)`` through the warpforge kernel (torch reference on CPU).

    Takes NCHW tensors in any memory format and returns channels_last [N, Cout, OH, OW]: the kernel reads
    and writes channels_last only, and the conversion is a no-op once the channels_last pass has run.
    With ``out_scale`` set (by optimize.quant when an int8 layer consumes this one's output) it returns
    int8 quantized at that scale and ``out_zero_point``, straight from the kernel's epilogue. An image
    stem on the space-to-depth path takes its input as given, fp32 included (kernels.conv.reads_image).
    """

    def __init__(self, conv: nn.Conv2d, activation: str | None, has_residual: bool) -> None:
        super().__init__()
        self.weight = conv.weight  # [Cout, C/groups, KH, KW]
        self.bias = conv.bias      # [Cout] or None
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.activation = activation
        self.has_residual = has_residual
        self.register_buffer("out_scale", None)  # [1] fp32: int8 out for the next (int8) layer
        self.out_zero_point = 0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        cl = torch.channels_last
        if not reads_image(x, self.weight, self.stride, self.dilation, self.groups):
            if x.dtype == torch.float32:  # an fp32 image the image_input pass handed on (else: no-op)
                x = x.to(self.weight.dtype)
            x = x.contiguous(memory_format=cl)
        if residual is not None:
            residual = residual.contiguous(memory_format=cl)
        return conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding, dilation=self.dilation,
                      groups=self.groups, activation=self.activation, residual=residual,
                      out_scale=getattr(self, "out_scale", None), out_zero_point=getattr(self, "out_zero_point", 0))

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, groups={self.groups}, "
                f"activation={self.activation}, residual={self.has_residual}")


def _activation(gm: fx.GraphModule, node: fx.Node, src: fx.Node) -> str | None:
    """The kernel's name for node's activation when node is exactly act(src), else None."""
    if not node.args or node.args[0] is not src:
        return None
    mod = _fx.called_module(gm, node)
    if mod is not None:
        if isinstance(mod, nn.GELU):
            return "gelu" if mod.approximate == "none" else None  # the kernel's gelu is the erf form
        return _ACT_MODULES.get(type(mod))
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS and len(node.args) == 1:
        name = _ACT_FUNCTIONS[node.target]
        return None if name == "gelu" and node.kwargs.get("approximate", "none") != "none" else name
    if node.op == "call_method" and node.target in _ACT_METHODS and len(node.args) == 1:
        return _ACT_METHODS[node.target]
    return None


def _residual(node: fx.Node, src: fx.Node) -> fx.Node | None:
    """The other operand when node is ``src + other`` with other a same-shape tensor, else None."""
    if node.op != "call_function" or node.target not in _ADDS or len(node.args) != 2 or node.kwargs:
        return None  # torch.add(..., alpha=) is not the kernel's plain add
    a, b = node.args
    other = b if a is src else a if b is src else None
    if not isinstance(other, fx.Node) or other is src:
        return None
    # The kernel adds a full [N, Cout, OH, OW] tensor: a broadcast operand (bias-like) does not fit.
    shape = _fx.shape_of(src)
    return other if shape is not None and _fx.shape_of(other) == shape else None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


class FuseConvEpilogue:
    """Pass: each Conv2d with its residual add and activation becomes one :class:`FusedConv2d`."""

    name = "fuse_conv"

    def apply(self, model: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        sites, aliases = _fx.prepare(model, self.name, ctx)
        for conv_node, conv in _fx.calls_to(model, nn.Conv2d):
            reason = self._why_not(conv, conv_node, sites, aliases)
            if reason is not None:
                ctx.record(self.name, "skipped", conv_node.target, reason)
                continue
            chain, last, residual, act = [conv_node], conv_node, None, None
            nxt = _only_user(last)
            if nxt is not None and (res := _residual(nxt, last)) is not None:
                chain, last, residual = chain + [nxt], nxt, res
                nxt = _only_user(last)
            if nxt is not None and (a := _activation(model, nxt, last)) is not None:
                chain, last, act = chain + [nxt], nxt, a
            fused_name = conv_node.target.replace(".", "_") + "_fused"
            model.add_submodule(fused_name, FusedConv2d(conv, act, residual is not None))
            with model.graph.inserting_before(last):
                args = (conv_node.args[0],) + ((residual,) if residual is not None else ())
                new = model.graph.call_module(fused_name, args)
            new.meta = dict(last.meta)  # same output: later matches (residual shapes) still see its shape
            last.replace_all_uses_with(new)
            for n in reversed(chain):
                model.graph.erase_node(n)
            parts = ([conv_node.target] + ([f"+ {residual.name}"] if residual is not None else [])
                     + ([act] if act else []))
            ctx.record(self.name, "fused" if len(chain) > 1 else "replaced", " -> ".join(parts),
                       f"{len(chain)} op(s) into {fused_name}")
        return _fx.finish(model)

    @staticmethod
    def _why_not(conv: nn.Conv2d, node: fx.Node, sites: dict, aliases: dict) -> str | None:
        if conv.weight.dtype not in CONV_DTYPES:
            return f"weight dtype {conv.weight.dtype} (the kernel takes fp32/fp16/bf16)"
        if conv.padding_mode != "zeros":
            return f"padding_mode={conv.padding_mode!r} (the kernel pads with zeros)"
        if isinstance(conv.padding, str):
            return f"padding={conv.padding!r} (the kernel takes explicit padding)"
        if sites.get(node.target, 0) != 1 or aliases.get(id(conv), 0) != 1:
            return "the conv module is shared or called more than once"
        if len(node.args) != 1 or node.kwargs:
            return "unexpected call signature"
        return None


__all__ = ["FuseConvEpilogue", "FusedConv2d"]
