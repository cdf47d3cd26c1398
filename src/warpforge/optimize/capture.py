"""Capture a model as an FX graph the passes can rewrite, keeping untraceable submodules eager.

Why ``torch.fx.symbolic_trace`` and not ``torch.export``: export lowers to ATen with parameters lifted
to graph inputs and BatchNorm decomposed into ``_native_batch_norm_legit_no_training``, so the
module-level rewrites here (fold a ``BatchNorm2d`` module into its ``Conv2d``, swap a conv module for a
fused one) would have to pattern-match ATen ops and re-home parameters. Export also fails on a whole model
when one submodule has data-dependent control flow, while FX can keep that submodule as a leaf (called
eagerly) and trace the rest. So: FX only, and the submodules left eager are reported for coverage.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn


@dataclass
class Captured:
    """The traced copy of a model and what could not be traced."""

    module: fx.GraphModule           # owns deep copies of the model's submodules: passes may edit it in place
    eager: dict[str, str] = field(default_factory=dict)  # module path -> why it is left eager (a leaf call)
    method: str = "torch.fx.symbolic_trace"

    def coverage(self) -> dict[str, Any]:
        """Parameters inside traced code vs inside eager leaves (what the passes can and cannot see)."""
        total = sum(p.numel() for p in self.module.parameters())
        eager = sum(p.numel() for path in self.eager for p in self.module.get_submodule(path).parameters())
        return {"method": self.method, "eager_modules": dict(self.eager), "params_total": total,
                "params_eager": eager, "traced_fraction": 1.0 if total == 0 else (total - eager) / total}


class _LeafTracer(fx.Tracer):
    """FX's tracer, plus chosen module objects treated as leaves (called as is, not traced into)."""

    def __init__(self, leaves: set[int] | None = None) -> None:
        super().__init__()
        # ids of module objects. Optional: unpickling a GraphModule re-traces it with its tracer class,
        # constructed without arguments (and with every submodule a leaf).
        self.leaves = leaves if leaves is not None else set()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _try_trace(mod: nn.Module, leaves: set[int]) -> str | None:
    """None when ``mod`` traces with these leaves, else the error's first line."""
    try:
        _LeafTracer(leaves).trace(mod)
        return None
    except Exception as e:  # FX raises TraceError, TypeError, ... from arbitrary user Python
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _find_eager(mod: nn.Module, path: str, leaves: set[int], eager: dict[str, str]) -> None:
    """Make ``mod`` traceable by turning the fewest, deepest submodules into leaves.

    Children are fixed first, so a parent whose only problem is one child keeps its own code traced.
    """
    err = _try_trace(mod, leaves)
    if err is None:
        return
    for name, child in mod.named_children():
        if id(child) not in leaves:
            _find_eager(child, f"{path}.{name}" if path else name, leaves, eager)
    err = _try_trace(mod, leaves)
    if err is not None:
        if not path:
            raise ValueError(f"the model's own forward cannot be traced by torch.fx ({err}); "
                             "nothing to optimize as a graph")
        leaves.add(id(mod))
        eager[path] = err


def capture(model: nn.Module, example_inputs: tuple[Any, ...]) -> Captured:
    """Trace a deep copy of ``model``; submodules FX cannot trace stay eager and are listed in ``eager``.

    An eval-mode model is checked against the copy on ``example_inputs`` (same outputs: tracing changes
    no arithmetic; a tiny tolerance only for GPU kernels that reduce in a run-dependent order), so a capture that silently dropped behaviour fails here, not in a
    pass. A training-mode model is not run (its forward would move BatchNorm statistics, dropout is random).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise ValueError(f"example_inputs must be a tuple of the forward's arguments, got {type(example_inputs).__name__}")
    root = copy.deepcopy(model)  # passes rewrite in place; the user's model must stay as it was
    leaves: set[int] = set()
    eager: dict[str, str] = {}
    _find_eager(root, "", leaves, eager)
    graph = _LeafTracer(leaves).trace(root)
    for node in graph.nodes:
        if isinstance(node.type, str):
            # A postponed annotation (``from __future__ import annotations``) is a string: FX would emit it
            # as a global of the generated code, and such a GraphModule cannot be pickled.
            node.type = None
    gm = fx.GraphModule(root, graph, class_name=type(model).__name__ + "Captured")
    if not model.training:
        with torch.no_grad():
            want, got = model(*example_inputs), gm(*example_inputs)
        if not _same(want, got):
            raise ValueError("the traced graph does not reproduce the model's outputs on example_inputs")
    return Captured(gm, eager)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        if torch.equal(a, b) or not a.is_floating_point():
            return torch.equal(a, b)
        tol = 1e-5 if a.element_size() >= 4 else 1e-2
        return torch.allclose(a, b, rtol=tol, atol=tol * max(1.0, a.abs().max().item()), equal_nan=True)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


__all__ = ["Captured", "capture"]
