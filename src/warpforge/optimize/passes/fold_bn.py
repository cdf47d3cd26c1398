"""Fold eval-mode BatchNorm into the Conv / Linear before it: y = (W x + b - mean) * s + beta with
s = gamma / sqrt(var + eps) becomes W' x + b' with W' = W * s (per output channel), b' = (b - mean) * s + beta.

Pairs: Conv2d -> BatchNorm2d, Conv1d -> BatchNorm1d, Linear -> BatchNorm1d on a 2-D [N, F] output (on
[N, C, L] BatchNorm1d normalizes dim 1, which is not the Linear's feature dim, so shapes are checked).
The new weights are computed in float64 and rounded once, so the folded model equals the original to
fp32 rounding.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext

_PAIRS = ((nn.Conv2d, nn.BatchNorm2d), (nn.Conv1d, nn.BatchNorm1d), (nn.Linear, nn.BatchNorm1d))


def _why_not(gm: fx.GraphModule, bn_node: fx.Node, sites: dict, aliases: dict) -> str | None:
    """None when bn_node can be folded into its input, else the reason it is skipped."""
    bn = _fx.called_module(gm, bn_node)
    src = bn_node.args[0] if bn_node.args else None
    layer = _fx.called_module(gm, src) if isinstance(src, fx.Node) else None
    if layer is None or not any(isinstance(layer, a) and type(bn) is b for a, b in _PAIRS):
        return "input is not a Conv/Linear module of the matching kind"
    if bn.training:
        return "BatchNorm is in training mode (batch statistics)"
    if bn.running_mean is None or bn.running_var is None:
        return "BatchNorm has no running statistics (track_running_stats=False)"
    if len(src.users) != 1:
        return f"{src.target} output has other users ({len(src.users)})"
    if sites.get(src.target, 0) != 1 or sites.get(bn_node.target, 0) != 1:
        return "a module is called more than once"
    if aliases.get(id(layer), 0) != 1 or aliases.get(id(bn), 0) != 1:
        return "a module is shared under several paths"
    if isinstance(layer, nn.Linear) and _fx.shape_of(src) is not None and len(_fx.shape_of(src)) != 2:
        return f"Linear output is {len(_fx.shape_of(src))}-D (BatchNorm1d would normalize another dim)"
    if isinstance(layer, nn.Linear) and _fx.shape_of(src) is None:
        return "Linear output shape unknown (no example inputs)"
    return None


@torch.no_grad()
def _fold(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> None:
    f64 = torch.float64
    w = layer.weight.to(f64)  # [Cout, ...]
    b = layer.bias.to(f64) if layer.bias is not None else torch.zeros(w.shape[0], dtype=f64, device=w.device)
    gamma = bn.weight.to(f64) if bn.weight is not None else torch.ones_like(b)
    beta = bn.bias.to(f64) if bn.bias is not None else torch.zeros_like(b)
    scale = gamma / torch.sqrt(bn.running_var.to(f64) + bn.eps)  # [Cout]
    new_w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
    new_b = (b - bn.running_mean.to(f64)) * scale + beta
    dtype = layer.weight.dtype
    # Fresh Parameters rather than in-place writes: a conv without bias gains one; the weight keeps its memory format.
    layer.weight = nn.Parameter(new_w.to(dtype).contiguous(memory_format=_format(layer.weight)),
                                requires_grad=layer.weight.requires_grad)
    layer.bias = nn.Parameter(new_b.to(dtype), requires_grad=layer.weight.requires_grad)


def _format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format


class FoldBatchNorm:
    """Pass: fold each eval-mode BatchNorm into the Conv/Linear that alone feeds it."""

    name = "fold_bn"

    def apply(self, model: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        _fx.require_graph(model, self.name)
        bn_nodes = [n for n in model.graph.nodes
                    if isinstance(_fx.called_module(model, n), nn.modules.batchnorm._BatchNorm)]
        if any(isinstance(_fx.called_module(model, n.args[0]), nn.Linear) for n in bn_nodes
               if n.args and isinstance(n.args[0], fx.Node)) and ctx.example_inputs:
            _fx.propagate_shapes(model, ctx.example_inputs)  # Linear -> BN1d needs the output rank
        sites, aliases = _fx.call_sites(model), _fx.aliases(model)
        for bn_node in bn_nodes:
            bn = _fx.called_module(model, bn_node)
            reason = _why_not(model, bn_node, sites, aliases)
            if reason is not None:
                ctx.record(self.name, "skipped", bn_node.target, f"{type(bn).__name__}: {reason}")
                continue
            src = bn_node.args[0]
            layer = _fx.called_module(model, src)
            _fold(layer, bn)
            bn_node.replace_all_uses_with(src)
            model.graph.erase_node(bn_node)
            ctx.record(self.name, "folded", f"{bn_node.target} -> {src.target}",
                       f"{type(bn).__name__}({bn.num_features}) into {type(layer).__name__}")
        return _fx.finish(model)


__all__ = ["FoldBatchNorm"]
