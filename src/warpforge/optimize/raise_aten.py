"""Capture by ``torch.export``, then raise its ATen graph back to the module-level FX graph the passes rewrite.

Non-strict ``torch.export`` traces the whole forward through the dispatcher: it follows Python that FX's
symbolic tracing cannot (shape arithmetic, calls FX does not wrap), and when it fails it says where. Its
graph is ATen with parameters lifted to inputs (``aten.conv2d(x, p_stem_0_weight, ...)``,
``aten.batch_norm``, ``aten.hardtanh_(x, 0, 6)``), while the passes match module calls and torch functions:
a ``BatchNorm2d`` module fed by a ``Conv2d`` module, ``F.relu6``, ``operator.add``,
``F.scaled_dot_product_attention``, ``torch.softmax(q @ k^T * c) @ v``. Raising rebuilds that form on a
copy of the model:

1. **Module calls.** The nodes one call of a leaf ``torch.nn`` module produced (export's
   ``nn_module_stack`` says which) become one ``call_module`` of that module at its original path
   (``features.2.conv.0.0``), the names FX capture gives, so pass reports, per-layer precisions and
   fallback names agree between the two. Only for a closed call: one tensor from outside, one result
   used outside, no other tensor than the module's own parameters and buffers, and a module whose
   ``forward`` takes the input alone (then calling it recomputes exactly those nodes).
2. **Functions.** The ATen ops the passes look for are written back in the torch form they match
   (``aten.add_.Tensor`` -> ``operator.iadd``, ``aten.softmax.int`` -> ``torch.softmax``,
   ``aten.to.dtype`` -> ``.to(dtype)``, ...: ``_FORMS``); export's trace-time dtype checks are dropped.
3. **The rest** stays an ATen ``call_function`` (it runs as in the exported program) and is counted in
   ``kept``; the parameters and buffers such ops read become ``get_attr`` of their module paths.

The batch (dim 0 of each tensor input) is exported symbolic (``Dim.AUTO``), from a batch of 2 when the
example has batch 1 (export fixes dims of size 1), so the graph serves other batch sizes as an FX graph
does. A program that fixed or bounded the batch, mutates buffers or inputs, or holds higher-order ops is
refused (:class:`ExportRefused`, with the reason), and capture falls back to FX.

What export fixes that FX reads at run time: the other dims of the inputs (a reshape to
``[batch, 10, 4, 12]`` keeps the 10 tokens: optimize() takes inputs that differ in the batch only) and the
device of tensors the forward creates (``torch.ones(4)`` becomes ``aten.ones(..., device=cpu)``): a raised
graph serves the device and the shapes it was captured for, batch aside.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils._pytree import tree_unflatten

aten = torch.ops.aten
_UNBOUNDED = 2 ** 62  # a range's upper end past this is export's int_oo


class ExportRefused(Exception):
    """torch.export failed on the model, or its program cannot be raised; the message says why."""


@dataclass
class Raised:
    """The raised graph and what became of the exported program's operators."""

    module: fx.GraphModule
    aten_ops: dict[str, int]  # every operator of the exported program -> calls
    kept: dict[str, int]      # of those, the calls left as ATen call_function nodes
    export_inputs: tuple      # the inputs export traced (batch 2 where the example had batch 1)


def export_and_raise(root: nn.Module, example_inputs: tuple, shapes: Any = None) -> Raised:
    """Export ``root`` (the caller's private copy: the raised graph owns its modules) and raise the program.
    ``shapes`` (an optimize.shapes.ShapeSpec): the declared dynamic dims, exported symbolic in their ranges."""
    inputs = _export_inputs(example_inputs)
    if shapes is not None and shapes.declared:
        dims = shapes.export_shapes()
    else:
        dims = tuple({0: torch.export.Dim.AUTO} if x.dim() >= 1 else None for x in inputs)
    try:
        with _quiet():
            ep = torch.export.export(root, inputs, dynamic_shapes=dims, strict=False)
    except Exception as e:  # noqa: BLE001 - export raises many types from arbitrary user code
        raise ExportRefused(_reason(e)) from None
    _check_program(ep, {i for i, x in enumerate(inputs) if shapes is None or shapes.batch_free(i)})
    gm, kept = _raise(ep, root, type(root).__name__ + "Captured")
    ops = Counter(_op_name(n.target) for n in ep.graph.nodes if n.op == "call_function" and n.target not in _DROPPED)
    return Raised(gm, dict(ops), dict(kept), inputs)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A failed export prints the partial graph to stderr and logs a failed guard with it (dozens of lines
    each time); its exception says why in one line, which capture keeps. So export's output goes to the run's
    log file (optimize.logs), and the guard warning is off."""
    from warpforge.optimize.logs import to_log

    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with to_log("torch.export (capture)"):
            yield
    finally:
        log.setLevel(level)


def _export_inputs(example_inputs: tuple) -> tuple:
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise ExportRefused(f"argument {i} is a {type(x).__name__}, not a tensor: the exported graph would "
                                "hold its value as a constant")
    # A dim of size 1 is always specialized by export; a batch of 2 keeps it symbolic (same values twice).
    return tuple(torch.cat([x, x]) if x.dim() >= 1 and x.shape[0] == 1 else x for x in example_inputs)


def _reason(e: BaseException) -> str:
    """The error's first line, and the user's line it points at when export names one."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    where = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    at = f" (at {where[-1][0].rsplit('/', 1)[-1]}:{where[-1][1]} in {where[-1][2]})" if where else ""
    return f"{type(e).__name__}: {first[:300]}{at}"


def _check_program(ep: torch.export.ExportedProgram, free_batch: set[int] | None = None) -> None:
    """Refuse what a plain module-level graph cannot hold, or holds only for some batch sizes (of the inputs
    in ``free_batch``, default all: a batch the user declared with a range is bounded on purpose)."""
    sig = ep.graph_signature
    mutated = [f"{s.kind.name.lower()} {s.target}" for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if mutated:
        raise ExportRefused(f"the forward mutates {', '.join(mutated[:3])}" + (" ..." if len(mutated) > 3 else ""))
    odd = [f"{s.kind.name.lower()} {s.arg.name}" for s in sig.input_specs
           if s.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT)]
    if odd:
        raise ExportRefused(f"the program takes {', '.join(odd)} (not a tensor the module holds)")
    hops = sorted({str(n.target) for n in ep.graph.nodes if n.op == "get_attr"}
                  | {_op_name(n.target) for n in ep.graph.nodes
                     if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if hops:
        raise ExportRefused(f"higher-order ops / subgraphs in the program: {', '.join(hops[:3])}")
    ranges = {str(sym): vr for sym, vr in ep.range_constraints.items()}
    user = {s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT}
    order = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if n.op != "placeholder" or n.name not in user or not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        if free_batch is not None and order.index(n.name) not in free_batch:
            continue
        batch = val.shape[0]
        if not isinstance(batch, torch.SymInt):
            raise ExportRefused(f"export fixed the batch (dim 0) of input {n.name} at {batch}: the model's code "
                                "depends on that size")
        vr = ranges.get(str(batch))
        if vr is not None and (int(vr.lower) > 2 or vr.upper < _UNBOUNDED):
            raise ExportRefused(f"export bounded the batch (dim 0) of input {n.name} to [{vr.lower}, {vr.upper}]: "
                                "the model's code branches on it")


# --- raising -----------------------------------------------------------------------------------------

def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.conv2d.default"
    return getattr(target, "__name__", str(target))


def _bind(node: fx.Node) -> dict[str, Any]:
    """An ATen node's arguments by schema name, defaults filled in."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


Form = tuple[Callable[..., Any] | str, tuple, dict]  # (target, args, kwargs); a str target: a Tensor method


def _act(fn: Callable[..., Any], inplace: bool = False) -> Callable[[dict], Form]:
    return lambda b: (fn, (b["self"],), {"inplace": True} if inplace else {})


def _binary(fn: Callable[..., Any]) -> Callable[[dict], Form | None]:
    return lambda b: (fn, (b["self"], b["other"]), {}) if b.get("alpha", 1) == 1 else None


def _hardtanh(inplace: bool) -> Callable[[dict], Form]:
    def form(b: dict) -> Form:
        kw = {"inplace": True} if inplace else {}
        if (b["min_val"], b["max_val"]) == (0, 6):
            return F.relu6, (b["self"],), kw
        return F.hardtanh, (b["self"], b["min_val"], b["max_val"]), kw
    return form


def _sdpa(b: dict) -> Form:
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return (F.scaled_dot_product_attention, (b["query"], b["key"], b["value"]),
            {k: b[k] for k, d in defaults.items() if k in b and b[k] != d})


def _overloads(table: dict[str, Any]) -> dict[Any, Any]:
    """``table`` keyed by ATen overloads ("add_.Tensor" -> aten.add_.Tensor), without the ones this torch lacks."""
    out = {}
    for name, value in table.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            out[op] = value
    return out


# ATen op -> the torch form a pass matches (None from a form: that call keeps its ATen op).
_FORMS = _overloads({
    "relu.default": lambda b: (torch.relu, (b["self"],), {}),
    "relu_.default": lambda b: (torch.relu_, (b["self"],), {}),
    "hardtanh.default": _hardtanh(False), "hardtanh_.default": _hardtanh(True),
    "silu.default": _act(F.silu), "silu_.default": _act(F.silu, True),
    "hardswish.default": _act(F.hardswish), "hardswish_.default": _act(F.hardswish, True),
    "gelu.default": lambda b: (F.gelu, (b["self"],),
                               {} if b["approximate"] == "none" else {"approximate": b["approximate"]}),
    "sigmoid.default": lambda b: (torch.sigmoid, (b["self"],), {}),
    "tanh.default": lambda b: (torch.tanh, (b["self"],), {}),
    "add.Tensor": _binary(operator.add), "add_.Tensor": _binary(operator.iadd),
    "sub.Tensor": _binary(operator.sub), "sub_.Tensor": _binary(operator.isub),
    "mul.Tensor": _binary(operator.mul), "mul_.Tensor": _binary(operator.imul),
    "div.Tensor": _binary(operator.truediv), "div_.Tensor": _binary(operator.itruediv),
    "matmul.default": lambda b: (operator.matmul, (b["self"], b["other"]), {}),
    "bmm.default": lambda b: (torch.bmm, (b["self"], b["mat2"]), {}),
    "softmax.int": lambda b: (torch.softmax, (b["self"], b["dim"]),
                              {} if b.get("dtype") is None else {"dtype": b["dtype"]}),
    "_softmax.default": lambda b: None if b["half_to_float"] else (torch.softmax, (b["self"], b["dim"]), {}),
    "transpose.int": lambda b: (torch.transpose, (b["self"], b["dim0"], b["dim1"]), {}),
    "permute.default": lambda b: (torch.permute, (b["self"], list(b["dims"])), {}),
    "scaled_dot_product_attention.default": _sdpa,
    "dropout.default": lambda b: (F.dropout, (b["input"], b["p"], b["train"]), {}),
    "flatten.using_ints": lambda b: (torch.flatten, (b["self"], b["start_dim"], b["end_dim"]), {}),
    "mT.default": lambda b: (getattr, (b["self"], "mT"), {}),
    # Tensor methods (a str target is a call_method node): the attention pass looks through no-op casts
    # and names a masked_fill on the scores as a mask.
    "to.dtype": lambda b: None if b["copy"] or b["non_blocking"] or b["memory_format"] is not None else (
        "to", (b["self"], b["dtype"]), {}),
    "type_as.default": lambda b: ("type_as", (b["self"], b["other"]), {}),
    "masked_fill.Scalar": lambda b: ("masked_fill", (b["self"], b["mask"], b["value"]), {}),
    "masked_fill.Tensor": lambda b: ("masked_fill", (b["self"], b["mask"], b["value"]), {}),
})
# Trace-time checks of a tensor's dtype and device (export adds one before each cast): dropped, as FX has none.
_DROPPED = tuple(_overloads({"_assert_tensor_metadata.default": None}))


def _leaf_type(mod: nn.Module) -> bool:
    """A torch.nn module with no children whose forward takes the input alone (calling it redoes its nodes)."""
    if next(mod.children(), None) is not None or not type(mod).__module__.startswith("torch.nn.modules"):
        return False
    try:
        return len(inspect.signature(type(mod).forward).parameters) == 2  # (self, input)
    except (TypeError, ValueError):
        return False


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else None
    except AttributeError:
        return None


def _mutates(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _private(x: fx.Node, users: set[fx.Node]) -> bool:
    """x is a fresh tensor (not a view, input or parameter) that only ``users`` read: mutating it in place
    is seen by no one else, so an in-place op on it may become a node FX's dead-code elimination can drop."""
    if x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload) or not set(x.users) <= users:
        return False
    schema = x.target._schema
    if all(r.alias_info is None for r in schema.returns):
        return True
    # An in-place op returns its first argument: fresh when that one is and nothing else reads it (a view is not).
    return schema.is_mutable and bool(x.args) and isinstance(x.args[0], fx.Node) and _private(x.args[0], {x})


def _module_calls(ep: torch.export.ExportedProgram, root: nn.Module, lifted: dict[str, str]
                  ) -> dict[fx.Node, tuple[str, fx.Node, list[fx.Node]]]:
    """result node -> (module path, its input, the nodes of the call) for each closed leaf-module call."""
    groups: dict[str, list[fx.Node]] = {}
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack") if n.op == "call_function" else None
        if stack:
            groups.setdefault(next(reversed(stack)), []).append(n)  # the innermost module (one key per call)
    owned: dict[str, set[fx.Node]] = {}  # module path -> placeholders of its own parameters and buffers
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in lifted:
            owned.setdefault(lifted[n.name].rpartition(".")[0], set()).add(n)
    calls = {}
    for nodes in groups.values():
        path = next(reversed(nodes[0].meta["nn_module_stack"].values()))[0]
        mod = _submodule(root, path)
        if mod is None or not _leaf_type(mod):
            continue
        inside, own = set(nodes), owned.get(path, set())
        outer = {a for n in nodes for a in n.all_input_nodes if a not in inside and a not in own}
        results = [n for n in nodes if any(u not in inside for u in n.users)]
        if len(outer) != 1 or results != [nodes[-1]]:
            continue
        x = next(iter(outer))
        if x.name in lifted or not isinstance(x.meta.get("val"), torch.Tensor):
            continue  # another module's parameter, or a size: not the module's input
        if any(_mutates(n) for n in nodes) and not _private(x, inside):
            continue  # ReLU(inplace=True) on a view or an input: the ATen op keeps the mutation visible
        calls[nodes[-1]] = (path, x, nodes)
    return calls


def _fx_stack(stack: dict | None) -> dict[str, tuple[str, Any]]:
    """Export's nn_module_stack ({"L__self__block.relu@1": ("block.relu", "torch...ReLU")}) in FX's form
    ({"block.relu": ("block.relu", ...)}, no root entry), which the attention pass reads for its report."""
    return {path: (path, kind) for path, kind in (stack or {}).values() if path}


def _has_attr(root: nn.Module, target: str) -> bool:
    obj: Any = root
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return isinstance(obj, torch.Tensor)


def _raise(ep: torch.export.ExportedProgram, root: nn.Module, class_name: str) -> tuple[fx.GraphModule, Counter]:
    sig = ep.graph_signature
    lifted = {s.arg.name: s.target for s in sig.input_specs if s.kind != InputKind.USER_INPUT}
    for s in sig.input_specs:  # a tensor made in forward (no module attribute) is held as a buffer of the copy
        if s.kind == InputKind.CONSTANT_TENSOR and not _has_attr(root, s.target):
            name = "_export_" + re.sub(r"\W", "_", s.target)
            root.register_buffer(name, ep.constants[s.target], persistent=False)
            lifted[s.arg.name] = name
    calls = _module_calls(ep, root, lifted)
    inner = {n for _, _, nodes in calls.values() for n in nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    kept: Counter[str] = Counter()

    def value(n: fx.Node) -> fx.Node:
        if n not in env:  # a lifted parameter / buffer / constant, read where first used
            env[n] = graph.get_attr(lifted[n.name])
        return env[n]

    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name not in lifted:
                env[n] = graph.placeholder(n.name)
        elif n.op == "call_function":
            if n in calls:
                path, x, _ = calls[n]
                new = graph.call_module(path, (value(x),))
            elif n in inner or n.target in _DROPPED:
                continue
            else:
                form = _FORMS[n.target](_bind(n)) if n.target in _FORMS else None
                if form is not None and _mutates(n) and not _private(n.args[0], {n}):
                    form = None  # in place on a tensor others see: the ATen op keeps the mutation
                if form is None:
                    form = n.target, n.args, n.kwargs
                    if isinstance(n.target, torch._ops.OpOverload):
                        kept[_op_name(n.target)] += 1
                target, args, kwargs = form
                new = graph.create_node("call_method" if isinstance(target, str) else "call_function", target,
                                        fx.map_arg(args, value), fx.map_arg(kwargs, value),
                                        name=n.name if target is n.target else None)
            new.meta["nn_module_stack"] = _fx_stack(n.meta.get("nn_module_stack"))
            if n.meta.get("stack_trace"):
                new.meta["stack_trace"] = n.meta["stack_trace"]
            env[n] = new
        elif n.op == "output":
            flat = fx.map_arg(n.args[0], value)
            graph.output(tree_unflatten(list(flat), ep.call_spec.out_spec))
    return fx.GraphModule(root, graph, class_name=class_name), kept


__all__ = ["ExportRefused", "Raised", "export_and_raise"]
