"""Small FX helpers the passes share."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp


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
