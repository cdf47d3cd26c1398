"""Per-layer precision fallback: the layers a 16-bit candidate must keep in fp32 to meet its budget.

When the fp16 (or bf16) warpforge pipeline misses the accuracy budget, the error usually comes from a
few layers (an activation beyond fp16's range, a long reduction, a sensitive head). Like Polygraphy's
precision debugging, this finds them by bisection over the layers in execution order instead of giving
the whole model up to fp32:

1. every layer fp32 must pass (else the miss is not a per-layer precision problem: no fallback);
2. binary search for the shortest prefix of layers that, kept fp32, passes (its last layer is where
   the error starts to matter);
3. binary search for the latest start of a window ending there that still passes;
4. inside a window of at most ``SHRINK_LIMIT`` layers, drop each layer that is not needed.

Each trial swaps the chosen layers of the 16-bit graph for their fp32 twins (the same pipeline run at
fp32: the original fp32 weights, not 16-bit weights cast back) behind casts, and runs the validation
inputs. Monotonicity (more fp32 layers never hurt) is assumed, as Polygraphy does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from warpforge.optimize.runtime import CastIO

SHRINK_LIMIT = 8  # windows up to this many layers are pruned one layer at a time
MAX_TRIALS = 40  # validation runs allowed for one search


def layer_names(gm: nn.Module) -> list[str]:
    """Modules with parameters that the graph calls, in execution order (the fallback's units)."""
    if not isinstance(gm, fx.GraphModule):
        raise ValueError(f"layer_names: expected a torch.fx.GraphModule (the warpforge pipeline's output), "
                         f"got {type(gm).__name__}")
    seen: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target not in seen:
            mod = gm.get_submodule(node.target)
            if any(True for _ in mod.parameters()):
                seen.append(node.target)
    return seen


def with_fp32_layers(gm_low: nn.Module, gm32: nn.Module, names: Sequence[str], dtype: torch.dtype) -> nn.Module:
    """A copy of ``gm_low`` whose ``names`` modules are the fp32 twins from ``gm32``, cast in and out."""
    out = copy.copy(gm_low)  # shallow: the untouched modules are shared, not duplicated
    out._modules = dict(gm_low._modules)
    for name in names:
        twin = CastIO(gm32.get_submodule(name), torch.float32, out_dtype=dtype)
        _set_submodule(out, name, twin)
    return out


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    *path, leaf = name.split(".")
    parent = root
    for part in path:  # copy each parent on the way down so the original graph keeps its modules
        child = copy.copy(getattr(parent, part))
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[leaf] = module


@dataclass
class Fallback:
    """The search's outcome: ``kept`` layers in fp32 (None: no set passes), the trials it ran."""

    layers: int
    kept: list[str] | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "kept_fp32": self.kept, "trials": len(self.trials), "note": self.note,
                "trial_log": self.trials[:MAX_TRIALS]}


def search(layers: Sequence[str], passes: Callable[[list[str]], tuple[bool, str]],
           max_trials: int = MAX_TRIALS) -> Fallback:
    """The smallest set of ``layers`` found to pass when kept fp32 (see the module docstring).

    ``passes(kept)`` -> (within budget, why not); it is called at most ``max_trials`` times."""
    layers = list(layers)
    res = Fallback(layers=len(layers), kept=None)
    memo: dict[tuple[str, ...], bool] = {}

    def trial(kept: list[str]) -> bool:
        key = tuple(kept)
        if key not in memo:
            if len(res.trials) >= max_trials:
                raise _OutOfTrials
            ok, why = passes(kept)
            memo[key] = ok
            res.trials.append({"fp32_layers": len(kept), "first": kept[0] if kept else None,
                               "last": kept[-1] if kept else None, "passed": ok, "why": "" if ok else why})
        return memo[key]

    try:
        if not layers:
            res.note = "no layer with parameters to keep in fp32"
            return res
        if not trial(layers):
            res.note = "still over budget with every layer fp32: not a per-layer precision problem"
            return res
        lo, hi = 1, len(layers)  # shortest passing prefix length in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if trial(layers[:mid]):
                hi = mid
            else:
                lo = mid + 1
        end = hi
        lo, hi = 0, end - 1  # latest passing window start in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if trial(layers[mid:end]):
                lo = mid
            else:
                hi = mid - 1
        res.kept = layers[lo:end]
        if len(res.kept) <= SHRINK_LIMIT:
            for name in list(res.kept):
                fewer = [n for n in res.kept if n != name]
                if fewer and trial(fewer):
                    res.kept = fewer
        res.note = (f"{len(res.kept)} of {len(layers)} layers kept fp32 "
                    f"({len(res.trials)} trials, bisection over execution order)")
    except _OutOfTrials:
        res.note = (f"stopped after {max_trials} trials" +
                    (f" with {len(res.kept)} layers kept fp32 (not pruned further)" if res.kept else ""))
    return res


class _OutOfTrials(Exception):
    pass
