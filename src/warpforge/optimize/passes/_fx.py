"""Small FX helpers the passes share."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp


def require_graph(model: nn.Module, pass_name: str) -> None:
    """ValueError unless ``model`` is an FX graph, the only thing a rewriting pass takes."""
    if not isinstance(model, fx.GraphModule):
        raise ValueError(f"{pass_name} needs a torch.fx.GraphModule (see optimize.capture), got {type(model).__name__}")


def prepare(model: nn.Module, pass_name: str, ctx) -> tuple[dict[str, int], dict[int, int]]:
    """A fusing pass's start: ``model`` checked (:func:`require_graph`), the shapes of the PassContext's example
    inputs propagated when it has some (a fused add must not broadcast); its :func:`call_sites` and :func:`aliases`."""
    require_graph(model, pass_name)
    if ctx.example_inputs:
        propagate_shapes(model, ctx.example_inputs)
    return call_sites(model), aliases(model)


def propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Fill ``node.meta["tensor_meta"]`` (shape, dtype, memory format) by running ``example_inputs``.

    Runs in eval mode and restores each module's flag after: a training-mode forward would move
    BatchNorm running statistics, which is a side effect a shape query must not have.
    """
    modes = [(m, m.training) for m in gm.modules()]
    gm.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*example_inputs)
    finally:
        for m, training in modes:
            m.training = training


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """The node's output shape from :func:`propagate_shapes`, or None when unknown / not one tensor."""
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def called_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def calls_to(gm: fx.GraphModule, module_type: type[nn.Module]) -> Iterator[tuple[fx.Node, nn.Module]]:
    """(node, module) for each node calling a module of exactly ``module_type`` (a subclass is another layer),
    over the graph's nodes as they were at the first step, each looked up when reached (a pass rewrites as
    it goes)."""
    for node in list(gm.graph.nodes):
        m = called_module(gm, node)
        if type(m) is module_type:
            yield node, m


def replace_module(gm: nn.Module, target: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at module path ``target`` (what a call_module node names) and return it."""
    parent, _, attr = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, attr, new)
    return new


def call_sites(gm: fx.GraphModule) -> dict[str, int]:
    """How many graph nodes call each module path (a module called twice cannot be rewritten for one call)."""
    sites: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            sites[n.target] = sites.get(n.target, 0) + 1
    return sites


def aliases(gm: fx.GraphModule) -> dict[int, int]:
    """How many paths reach each module object (shared modules: editing one edits all)."""
    seen: dict[int, int] = {}
    for _, m in gm.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    return seen


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop now-unused submodules, check the graph, regenerate forward."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
