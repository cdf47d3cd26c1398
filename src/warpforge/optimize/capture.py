"""Capture a model as a module-level FX graph the passes can rewrite: ``torch.export`` first, FX second.

    cap = capture(model, (x,))            # method="auto": export, else FX with eager leaves
    cap.method, cap.coverage()            # "torch.export" | "torch.fx.symbolic_trace", what was captured

The passes (passes/) rewrite module calls and torch functions: fold a ``BatchNorm2d`` module into the
``Conv2d`` module before it, swap a conv module for a fused one, match ``F.scaled_dot_product_attention``
or ``softmax(q @ k^T) @ v``. Both methods produce that form, with modules at their original paths:

* **torch.export** (non-strict, batch dim symbolic) traces the whole forward through the dispatcher, and
  ``raise_aten`` turns its ATen program back into module calls and the torch functions the passes match
  (ops with no such form stay ATen calls, which run as exported). The coverage lists the program's ATen
  operators and which of them stayed plain ATen calls, like a TensorRT dry run's operator support list.
* **torch.fx.symbolic_trace** is the fallback when export fails (data-dependent control flow, an op export
  cannot trace, a program only valid for some batch sizes) or when asked for (``method="fx"``). It keeps
  the submodules it cannot trace as leaves that run eagerly, listed with the reason in ``eager``; the
  export failure is kept in ``export_error``. A training-mode model goes to FX directly: export would fix
  BatchNorm and Dropout to their training behaviour and record the statistics updates as mutations.

Either graph is checked against the model on ``example_inputs`` (eval mode). The exported one also at a
second batch size (the batch of 2 it was exported at when the example has batch 1, else batch 1): export
assumes a symbolic batch is never 1, so a model that branches on ``batch == 1`` shows up there, and falls
back to FX rather than returning a graph that is wrong at some batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from warpforge.optimize.raise_aten import ExportRefused, export_and_raise

METHODS = ("auto", "export", "fx")
EXPORT, FX = "torch.export", "torch.fx.symbolic_trace"


@dataclass
class Captured:
    """The captured copy of a model, how it was captured, and what could not be."""

    module: fx.GraphModule           # owns deep copies of the model's submodules: passes may edit it in place
    eager: dict[str, str] = field(default_factory=dict)  # module path -> why it is left eager (a leaf call)
    method: str = FX                 # EXPORT or FX
    asked: str = "fx"                # the method= capture was called with
    export_error: str | None = None  # why torch.export was not used (auto fell back to FX)
    aten_ops: dict[str, int] = field(default_factory=dict)  # export: the program's operators -> calls
    aten_kept: dict[str, int] = field(default_factory=dict)  # export: of those, calls left as plain ATen nodes

    def coverage(self) -> dict[str, Any]:
        """How it was captured; parameters inside traced code vs inside eager leaves (what the passes can and
        cannot see); for export, each ATen operator's calls and how many stayed plain ATen calls."""
        total = sum(p.numel() for p in self.module.parameters())
        eager = sum(p.numel() for path in self.eager for p in self.module.get_submodule(path).parameters())
        return {"method": self.method, "asked": self.asked, "export_error": self.export_error,
                "eager_modules": dict(self.eager), "params_total": total, "params_eager": eager,
                "traced_fraction": 1.0 if total == 0 else (total - eager) / total,
                "aten_ops": dict(self.aten_ops), "aten_kept": dict(self.aten_kept)}


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


def capture(model: nn.Module, example_inputs: tuple[Any, ...], method: str = "auto", shapes: Any = None) -> Captured:
    """Capture a deep copy of ``model`` (see the module docstring): ``method`` "auto" (torch.export, else FX),
    "export" (torch.export or a ValueError saying why not) or "fx" (FX only).

    An eval-mode model is checked against the copy on ``example_inputs`` (same outputs: capture changes no
    arithmetic; a tiny tolerance only for GPU kernels that reduce in a run-dependent order), so a capture
    that silently dropped behaviour fails here, not in a pass. A training-mode model is not run (its
    forward would move BatchNorm statistics, dropout is random).

    ``shapes`` (optimize.shapes.ShapeSpec): dims declared dynamic are exported symbolic within their ranges,
    and the exported graph is also checked at both ends of the ranges (FX graphs read shapes at run time).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        raise ValueError("example_inputs must be a tuple of the forward's arguments, "
                         f"got {type(example_inputs).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    export_error = None
    if method != "fx":
        try:
            return _capture_export(model, example_inputs, method, shapes)
        except ExportRefused as e:
            if method == "export":
                raise ValueError(f"torch.export cannot capture the model: {e}") from None
            export_error = str(e)
    cap = _capture_fx(model, example_inputs, export_error)
    cap.asked, cap.export_error = method, export_error
    return cap


def _capture_export(model: nn.Module, example_inputs: tuple, method: str, shapes: Any = None) -> Captured:
    if model.training:
        raise ExportRefused("not tried: the model is in training mode (export would fix BatchNorm and Dropout "
                            "to training behaviour and record the statistics updates)")
    root = copy.deepcopy(model)  # passes rewrite in place; the user's model must stay as it was
    raised = export_and_raise(root, example_inputs, shapes)
    gm = raised.module
    checks = _check_inputs(example_inputs, raised.export_inputs)
    if shapes is not None and shapes.declared:
        checks += shapes.at_ends(example_inputs, torch.Generator().manual_seed(0))
    for inputs in checks:
        with torch.no_grad():
            want = model(*inputs) if inputs is example_inputs else _run_or_none(model, inputs)
            if want is None:
                continue  # the model itself does not run at this batch size: nothing to compare
            got = _run_or_none(gm, inputs)
        if got is None or not _same(want, got):
            batch = next((x.shape[0] for x in inputs if x.dim() >= 1), None)
            shapes_note = f" (input shapes {[list(x.shape) for x in inputs]})" if shapes is not None and \
                shapes.declared else ""
            raise ExportRefused(f"the raised graph does not reproduce the model's outputs at batch {batch}"
                                + shapes_note)
    return Captured(gm, method=EXPORT, asked=method, aten_ops=raised.aten_ops, aten_kept=raised.kept)


def _check_inputs(example_inputs: tuple, export_inputs: tuple) -> list[tuple]:
    """The example inputs, then one other batch size: the exported one, or a batch of 1."""
    if export_inputs is not example_inputs and any(a is not b for a, b in zip(export_inputs, example_inputs)):
        return [example_inputs, export_inputs]
    return [example_inputs, tuple(x[:1] if x.dim() >= 1 else x for x in example_inputs)]


def _run_or_none(fn: nn.Module, inputs: tuple) -> Any:
    try:
        return fn(*inputs)
    except Exception:  # noqa: BLE001 - a model may reject another batch size; the caller decides
        return None


def _capture_fx(model: nn.Module, example_inputs: tuple, export_error: str | None) -> Captured:
    root = copy.deepcopy(model)  # passes rewrite in place; the user's model must stay as it was
    leaves: set[int] = set()
    eager: dict[str, str] = {}
    try:
        _find_eager(root, "", leaves, eager)
    except ValueError as e:
        if export_error is None:
            raise
        raise ValueError(f"{e}; torch.export failed too ({export_error})") from None
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


__all__ = ["EXPORT", "FX", "METHODS", "Captured", "capture"]
