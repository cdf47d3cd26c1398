"""Regions: optimize the parts of a model that capture when the whole model does not.

Detectors end in post-processing whose shapes depend on the data (a score threshold, top-k, NMS): torch.export
stops at the first data-dependent guard and torch.fx at the first Python branch or loop over a traced value,
so neither captures the model, and the backbone, neck and heads, where the time goes, would run eagerly.
torch.compile breaks the graph there; TensorRT users export the network up to the post-processing. Here:

    plan = plan_regions(model, inputs, "auto", why_whole_failed)   # which submodules capture, which stay eager
    shell, details = build_regions(model, inputs, torch.float16, "auto", passes, why_whole_failed)

1. One eager run with forward hooks records the inputs each child of the root actually receives (all its
   calls: a head shared by the FPN levels is called once per level, at other shapes).
2. Each child is captured (optimize.capture: torch.export, else FX) with its first call's inputs, and the
   captured graph must reproduce every recorded call, both sides in strict fp32 (runtime.strict_fp32: on a
   GPU, cuDNN would run eager fp32 convs as TF32, ~1e-3 off warpforge's fp32 kernels, and the check is
   1e-5). A child that does becomes a region; a child that does not is split into its children (recorded
   by another eager run) and its own forward code stays eager.
   A child without parameters stays eager (nothing for a pass to fold or fuse), as does one called with
   arguments that are not tensors (a capture would bake them in).
3. The build runs the candidate's passes on each region at the candidate's precision (optimize_graph, as
   for a whole model), wraps it in a :class:`Region` (a precision boundary, like CastIO, and on the GPU a
   CUDA graph per recorded input shape) and puts it in place of the child in a copy of the model: the
   root's own code and the parts left eager run as written, in fp32. The optimizer gates the whole model's
   outputs as for any candidate.

Every part left eager carries the reason, in ``details["regions"]`` and the report.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from warpforge.optimize.capture import FX, _same
from warpforge.optimize.capture import capture as capture_model
from warpforge.optimize.runtime import strict_fp32

MAX_CALLS = 8  # calls recorded per module: a shared head runs once per pyramid level


@dataclass
class Call:
    args: tuple  # positional inputs (keyword arguments bound to their positions), cloned
    out: Any     # what the eager module returned, cloned


@dataclass
class Planned:
    """A region: a submodule that captures, with the inputs it received."""

    path: str
    method: str                  # the capture= that reproduced every call ("auto" or "fx")
    captured_by: str             # EXPORT or FX
    calls: list[Call]
    params: int
    arg_names: tuple[str, ...]   # the forward's parameter names, to bind keyword arguments at run time
    leaves: dict[str, str] = field(default_factory=dict)  # FX: submodules (relative paths) it calls eagerly, and why


@dataclass
class Plan:
    regions: list[Planned] = field(default_factory=list)
    eager: list[dict[str, Any]] = field(default_factory=list)  # {"path", "reason", "params"}
    whole: str = ""              # why the whole model did not capture

    def outer(self) -> list[Planned]:
        """The regions not nested in another one's eager leaves (their parameters hold the nested ones')."""
        return [r for r in self.regions if not any(r.path.startswith(o.path + ".") for o in self.regions)]

    def optimized_params(self, model: nn.Module) -> int:
        """Parameters that run in a region's graph: each region's, less those in the submodules FX left eager
        inside it (unless a nested region holds them)."""
        ids: dict[int, int] = {}
        for r in self.regions:
            m = model.get_submodule(r.path)
            leaves = {id(p) for rel in r.leaves for p in m.get_submodule(rel).parameters()}
            ids.update({id(p): p.numel() for p in m.parameters() if id(p) not in leaves})
        return sum(ids.values())

    def as_dict(self, model: nn.Module) -> dict[str, Any]:
        total_params = _params(model)
        done = self.optimized_params(model)
        return {"whole_model_error": self.whole,
                "regions": [{"path": r.path, "status": "optimized", "captured_by": r.captured_by, "params": r.params,
                             "calls": len(r.calls), "nested": r not in self.outer(),
                             "input_shapes": [[list(t.shape) for t in tree_flatten(c.args)[0]
                                               if isinstance(t, torch.Tensor)] for c in r.calls]}
                            for r in self.regions],
                "eager": [dict(e, status="eager") for e in self.eager],
                "params_total": total_params, "params_optimized": done,
                "optimized_fraction": done / total_params if total_params else 0.0}


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _clone(x: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


def _arg_names(m: nn.Module) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(m.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _positional(m: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments in positional order (defaults filled in); ValueError when that is not possible."""
    if not kwargs:
        return tuple(args)
    try:
        bound = inspect.signature(m.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"its call does not bind to its forward's signature ({e})") from None
    bound.apply_defaults()
    if bound.kwargs:
        raise ValueError(f"called with keyword-only arguments {sorted(bound.kwargs)}")
    return tuple(bound.args)


def record_calls(model: nn.Module, inputs: tuple, modules: dict[str, nn.Module]) -> dict[str, list[Call] | str]:
    """One eager run of ``model`` on ``inputs`` in strict fp32 (its outputs are the references replays are held
    to); per path in ``modules``, its calls (up to MAX_CALLS), or why its calls cannot be replayed (keyword-only
    arguments)."""
    got: dict[str, list[Call] | str] = {p: [] for p in modules}
    handles = []
    for path, m in modules.items():
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any, path: str = path) -> None:
            calls = got[path]
            if isinstance(calls, str) or len(calls) >= MAX_CALLS:
                return
            try:
                calls.append(Call(_clone(_positional(mod, args, kwargs)), _clone(out)))
            except ValueError as e:
                got[path] = str(e)
        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), strict_fp32():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return got


def _why_not_tensors(args: tuple) -> str | None:
    for i, a in enumerate(args):
        leaves = tree_flatten(a)[0]
        bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if bad or not leaves:
            return (f"argument {i} is {type(a).__name__}" + (f" holding {bad[0]}" if bad and bad[0] != type(a).__name__
                                                              else "") +
                    ", not tensors: a capture would bake its value in")
    return None


def _try_region(path: str, m: nn.Module, calls: list[Call], capture: str) -> Planned | str:
    """The region ``m`` makes, or why it makes none (the capture errors, first line each)."""
    errors = []
    for method in (("auto", "fx") if capture == "auto" else (capture,)):
        try:
            cap = capture_model(m, calls[0].args, method)
        except Exception as e:  # noqa: BLE001 - any user module may refuse capture in its own way
            errors.append(f"{method}: {_first_line(e)}")
            continue
        bad = _replays(cap.module, calls)
        if bad is None:
            return Planned(path, method, cap.method, calls, _params(m), _arg_names(m), dict(cap.eager))
        errors.append(f"captured by {cap.method}, but {bad}")
        if cap.method == FX:
            break  # "auto" already fell back to FX: trying FX again gives the same graph
    return "; ".join(errors)


def _replays(fn: nn.Module, calls: list[Call]) -> str | None:
    """None when ``fn`` reproduces every recorded call, else which one it does not; in strict fp32, as the calls
    were recorded."""
    for i, c in enumerate(calls):
        try:
            with torch.no_grad(), strict_fp32():
                got = fn(*c.args)
        except Exception as e:  # noqa: BLE001
            return f"call {i + 1} of {len(calls)} fails on it ({_first_line(e)})"
        if not _same(c.out, got):
            shapes = [list(t.shape) for t in tree_flatten(c.args)[0] if isinstance(t, torch.Tensor)]
            return f"it does not reproduce call {i + 1} of {len(calls)} (inputs {shapes})"
    return None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def plan_regions(model: nn.Module, inputs: tuple, capture: str, whole: str) -> Plan:
    """The regions of ``model`` and the parts left eager, found top-down from the root's children (module
    docstring). ``whole``: why the whole model did not capture (the reason its own code stays eager)."""
    plan = Plan(whole=whole)
    plan.eager.append({"path": "(root)", "params": sum(p.numel() for p in model.parameters(recurse=False)),
                       "reason": f"the model's own forward: the whole model did not capture ({whole})"})
    seen: set[int] = set()
    level = {n: c for n, c in model.named_children()}
    while level:
        calls = record_calls(model, inputs, {p: m for p, m in level.items() if _params(m)})
        split: dict[str, nn.Module] = {}
        for path, m in level.items():
            if id(m) in seen:
                continue
            seen.add(id(m))
            params = _params(m)
            if not params:
                plan.eager.append({"path": path, "params": 0, "reason": "no parameters: nothing for a pass to fold "
                                                                         "or fuse; runs as written"})
                continue
            rec = calls[path]
            children = dict(m.named_children())
            if not rec and children:  # a container (ModuleList, ModuleDict): its children are called instead
                split.update({f"{path}.{n}": c for n, c in children.items()})
                continue
            why = rec if isinstance(rec, str) else None
            if why is None and not rec:
                why = "not called on the example inputs"
            if why is None:
                why = _why_not_tensors(rec[0].args)
            if why is None:
                got = _try_region(path, m, rec, capture)
                if isinstance(got, Planned):
                    plan.regions.append(got)
                    split.update(_inside_leaves(got, m, plan))
                    continue
                why = f"does not capture ({got})"
            own = sum(p.numel() for p in m.parameters(recurse=False))
            if children and why != "not called on the example inputs":
                plan.eager.append({"path": path, "params": own, "reason": f"its own forward code: {why}; its "
                                                                          "children are tried one by one"})
                split.update({f"{path}.{n}": c for n, c in children.items()})
            else:
                plan.eager.append({"path": path, "params": params, "reason": why})
        level = split
    plan.regions.sort(key=lambda r: list(dict(model.named_modules())).index(r.path))
    return plan


def _inside_leaves(region: Planned, m: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    """The children of the submodules FX left eager inside ``region`` (they hold parameters): tried as regions
    nested in it, as the region's own children would be."""
    out = {}
    for rel, why in region.leaves.items():
        leaf = m.get_submodule(rel)
        if not _params(leaf):
            continue
        full = f"{region.path}.{rel}"
        if type(leaf).forward is nn.Module.forward:  # a container (ModuleList): its children are called instead
            out.update({f"{full}.{n}": c for n, c in leaf.named_children()})
            continue
        plan.eager.append({"path": full, "params": sum(p.numel() for p in leaf.parameters(recurse=False)),
                           "reason": f"its own forward code, inside region {region.path}: not traceable ({why}); its "
                                     "children are tried one by one"})
        out.update({f"{full}.{n}": c for n, c in leaf.named_children()})
    return out


# model -> [(key, plan)]: every float candidate of one optimize() run plans the same regions.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_plan(model: nn.Module, inputs: tuple, capture: str, whole: str) -> Plan:
    key = (capture, tuple((id(x), x._version) if isinstance(x, torch.Tensor) else repr(x) for x in inputs))
    entries = _PLANS.setdefault(model, [])
    hit = next((p for k, p in entries if k == key), None)
    if hit is None:
        hit = plan_regions(model, inputs, capture, whole)
        entries.append((key, hit))
    return hit


def forget_plans(model: nn.Module) -> None:
    _PLANS.pop(model, None)


class Region(nn.Module):
    """An optimized submodule in its parent's place: takes what the original took (keyword arguments bound to
    their positions), computes in ``inner``'s precision (a CastIO), returns fp32. Plain attributes of the
    original (``out_channels`` and the like) stay readable. On the GPU, a call whose inputs match a recorded
    call's shapes replays that shape's CUDA graph (built by :meth:`graph`; not saved: rebuilt by a new build)."""

    def __init__(self, inner: nn.Module, path: str, arg_names: tuple[str, ...], original: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.path = path
        self.arg_names = arg_names
        self.attrs = {k: v for k, v in vars(original).items() if not k.startswith("_") and k != "training"
                      and isinstance(v, (bool, int, float, str, tuple, type(None)))}
        self._graphs: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            attrs = self.__dict__.get("attrs", {})
            if name in attrs:
                return attrs[name]
            raise

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_graphs"] = {}  # CUDA graphs live in one process
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            missing = [n for n in self.arg_names[len(args):] if n not in kwargs]
            if missing or set(kwargs) - set(self.arg_names[len(args):]):
                raise TypeError(f"region {self.path}: arguments {sorted(kwargs)} do not bind to the positions "
                                f"{list(self.arg_names)} it was captured with")
            args = args + tuple(kwargs[n] for n in self.arg_names[len(args):])
        if self._graphs:
            flat, spec = tree_flatten(args)
            graphed = self._graphs.get(_key(flat, spec))
            if graphed is not None:
                return graphed(*flat)
        return self.inner(*args)

    def graph(self, calls: list[Call]) -> list[str]:
        """A CUDA graph per distinct input shape of ``calls`` (CUDA tensors only); returns why any failed."""
        from warpforge.optimize.runtime import CudaGraphed

        failed = []
        for c in calls:
            flat, spec = tree_flatten(c.args)
            if not flat or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in flat):
                return [f"region {self.path}: inputs are not all CUDA tensors; runs uncaptured"]
            key = _key(flat, spec)
            if key in self._graphs:
                continue
            try:
                self._graphs[key] = CudaGraphed(lambda *f, spec=spec: self.inner(*tree_unflatten(list(f), spec)), flat)
            except RuntimeError as e:
                failed.append(f"region {self.path}: {e}")
        return failed


def _key(flat: list, spec: Any) -> Any:
    return str(spec), tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else repr(t)
                            for t in flat)


def time_share(shell: nn.Module, inputs: tuple, regions: list[nn.Module], calls: int = 3) -> dict[str, Any]:
    """The share of a call's time spent inside ``regions`` (after one warm-up call, over ``calls`` calls): host
    clock around each region's forward, the device synchronized at each boundary, so the eager parts' queued
    work is not counted as a region's. The synchronizations themselves cost time: a share, not a latency."""
    import time

    dev = next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    inside = [0.0]
    start = [0.0]

    def pre(mod: nn.Module, args: tuple) -> None:
        sync()
        start[0] = time.perf_counter()

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        sync()
        inside[0] += time.perf_counter() - start[0]

    handles = [h for m in regions for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.no_grad():
            shell(*inputs)
            inside[0] = 0.0
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                shell(*inputs)
            sync()
            total = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    return {"regions_ms": 1e3 * inside[0] / calls, "call_ms": 1e3 * total / calls,
            "share": inside[0] / total if total > 0 else None, "calls": calls,
            "how": "host clock around each region, device synchronized at each boundary, example inputs"}


def _place(shell: nn.Module, path: str, region: Region) -> None:
    """Put ``region`` at ``path`` in ``shell``, looking through regions already placed (a path inside one
    continues in its captured graph, which keeps the module paths)."""
    parent_path, _, name = path.rpartition(".")
    parent = shell
    for part in parent_path.split(".") if parent_path else ():
        parent = getattr(parent, part)
        if isinstance(parent, Region):
            parent = parent.inner.inner  # Region -> CastIO -> the captured graph
    setattr(parent, name, region)


def _merge_passes(reports: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The passes' reports of every region as one list: counts summed, each change's place prefixed by its region."""
    merged: dict[str, dict[str, Any]] = {}
    for path, rep in reports:
        for p in rep["passes"]:
            m = merged.setdefault(p["name"], {"name": p["name"], "counts": {}, "changes": []})
            for k, v in p["counts"].items():
                m["counts"][k] = m["counts"].get(k, 0) + v
            m["changes"] += [{**c, "where": f"{path}.{c['where']}"} for c in p["changes"]]
    return list(merged.values())


def _merge_coverage(covs: list[dict[str, Any]]) -> dict[str, Any]:
    ours: dict[str, int] = {}
    ops: dict[str, int] = {}
    for c in covs:
        for src, dst in ((c.get("warpforge_ops", {}), ours), (c.get("torch_ops", {}), ops)):
            for k, v in src.items():
                dst[k] = dst.get(k, 0) + v
    total = sum(ours.values()) + sum(ops.values())
    return {"warpforge_ops": ours, "torch_ops": ops, "ops_total": total,
            "warpforge_fraction": sum(ours.values()) / total if total else 0.0}


def build_regions(model: nn.Module, inputs: tuple, dtype: torch.dtype, capture: str, passes: list | None,
                  whole: str, coverage: Callable[[nn.Module], dict[str, Any]] | None = None
                  ) -> tuple[nn.Module, dict[str, Any]]:
    """A copy of ``model`` whose regions run the pipeline (``passes``) at ``dtype``, the rest as written in
    fp32; and the build's details: ``regions`` (each region and each part left eager, with the reason),
    ``capture`` (method "regions"), merged ``passes`` and ``coverage`` (``coverage(graph)`` per region: the
    candidates' operator count, backends.op_coverage). ValueError when no region captures."""
    from warpforge.optimize.pipeline import optimize_graph
    from warpforge.optimize.runtime import CastIO, _cast_floats

    plan = _cached_plan(model, inputs, capture, whole)
    if not plan.regions:
        raise ValueError(f"the whole model does not capture ({whole}), and no submodule does either: "
                         + "; ".join(f"{e['path']}: {e['reason']}" for e in plan.eager[1:]))
    shell = copy.deepcopy(model)
    reports, covs, fallbacks = [], [], []
    device = next((t.device for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)), torch.device("cpu"))
    outer = plan.outer()
    for r in plan.regions:  # outer regions before the ones nested in their eager leaves (module order)
        nested = r not in outer
        sub = model.get_submodule(r.path)
        src = sub if dtype == torch.float32 else copy.deepcopy(sub).to(dtype)
        gm, rep = optimize_graph(src, _cast_floats(r.calls[0].args, dtype), passes, device=device, dtype=dtype,
                                 capture=r.method)
        # Nested in a region's eager leaf, it returns what the region around it computes in.
        region = Region(CastIO(gm, dtype, dtype if nested else torch.float32).eval(), r.path, r.arg_names, sub)
        if dtype == torch.float32:  # 16-bit regions round: the gate judges them on the whole model's outputs
            bad = _replays(region, r.calls)
            if bad is not None:
                raise ValueError(f"region {r.path} after the passes: {bad}")
        if device.type == "cuda" and not nested:  # a nested region runs inside its outer region's graph
            fallbacks += [{"what": "cuda graph", "reason": why} for why in region.graph(r.calls)]
        _place(shell, r.path, region)
        reports.append((r.path, rep))
        if coverage is not None:
            covs.append(coverage(gm))
    total = _params(model)
    eager_params = total - plan.optimized_params(model)
    cap = {"method": "regions", "asked": capture, "export_error": whole,
           "eager_modules": {e["path"]: e["reason"] for e in plan.eager}, "params_total": total,
           "params_eager": eager_params, "traced_fraction": (total - eager_params) / total if total else 0.0,
           "aten_ops": {}, "aten_kept": {},
           "regions": {r.path: rep["capture"]["method"] for r, (_, rep) in zip(plan.regions, reports)}}
    fallbacks.append({"what": "whole model", "reason": f"optimized as {len(plan.regions)} region(s), the rest eager: "
                                                       f"{whole}"})
    fallbacks += [{"what": e["path"], "reason": f"left eager: {e['reason']}"} for e in plan.eager if e["params"]]
    regions_info = plan.as_dict(model)
    regions_info["time_share"] = time_share(shell, inputs, [shell.get_submodule(r.path) for r in outer])
    details = {"regions": regions_info, "capture": cap, "passes": _merge_passes(reports),
               "coverage": _merge_coverage(covs), "fallbacks": fallbacks}
    return shell.eval(), details


__all__ = ["Plan", "Planned", "Region", "build_regions", "forget_plans", "plan_regions", "record_calls"]
