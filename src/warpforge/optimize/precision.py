"""Per-layer precision fallback: the layers a low-precision candidate must keep in higher precision to
meet its budget.

When the fp16 (or bf16) warpforge pipeline misses the accuracy budget, the error usually comes from a
few layers (an activation beyond fp16's range, a long reduction, a sensitive head). Like Polygraphy's
precision debugging, :func:`search` finds them by bisection over the layers in execution order instead
of giving the whole model up to fp32:

1. every layer fp32 must pass (else the miss is not a per-layer precision problem: no fallback);
2. binary search for the shortest prefix of layers that, kept fp32, passes (its last layer is where
   the error starts to matter);
3. binary search for the latest start of a window ending there that still passes;
4. inside a window of at most ``SHRINK_LIMIT`` layers, drop each layer that is not needed.

Each trial swaps the chosen layers of the 16-bit graph for their fp32 twins (the same pipeline run at
fp32: the original fp32 weights, not 16-bit weights cast back) behind casts, and runs the validation
inputs. Monotonicity (more fp32 layers never hurt) is assumed, as Polygraphy does.

The int8 candidate's error is spread over every quantized layer rather than starting at one place, and
its build records each layer's own error (``optimize.quant.LayerQuantReport``), so it uses
:func:`search_ranked` instead: layers in order of that error, worst first; a galloping search (1, 2, 4,
... of the worst) for the shortest passing prefix, a bisection inside the last step, then each layer of
a prefix of at most ``SHRINK_LIMIT`` dropped when it is not needed. A fallback of k layers costs about
2 log2(k) + k trials, fewer than the execution-order bisection's 2 log2(n) when k is small, and it never
runs the all-float trial unless every smaller prefix fails.
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
    """The search's outcome: ``kept`` layers in higher precision (None: no set passes), the trials it ran.
    ``kept_as`` names that precision in the record ("fp32"; the int8 fallback's "float")."""

    layers: int
    kept: list[str] | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    kept_as: str = "fp32"

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, f"kept_{self.kept_as}": self.kept, "trials": len(self.trials),
                "note": self.note, "trial_log": self.trials[:MAX_TRIALS]}


class _Trials:
    """Memoized ``passes(kept)`` calls, logged in ``res.trials``, at most ``max_trials`` of them."""

    def __init__(self, res: Fallback, passes: Callable[[list[str]], tuple[bool, str]], max_trials: int) -> None:
        if not isinstance(max_trials, int) or max_trials < 1:
            raise ValueError(f"max_trials: expected an integer >= 1, got {max_trials!r}")
        self.res, self.passes, self.max_trials = res, passes, max_trials
        self.memo: dict[frozenset[str], bool] = {}

    def __call__(self, kept: list[str]) -> bool:
        key = frozenset(kept)  # the same set in another order is the same trial
        if key not in self.memo:
            if len(self.res.trials) >= self.max_trials:
                raise _OutOfTrials
            ok, why = self.passes(kept)
            self.memo[key] = ok
            self.res.trials.append({f"{self.res.kept_as}_layers": len(kept), "first": kept[0] if kept else None,
                                    "last": kept[-1] if kept else None, "passed": ok, "why": "" if ok else why})
        return self.memo[key]

    def prune(self) -> None:
        """Drop each kept layer that is not needed (windows of at most SHRINK_LIMIT layers)."""
        res = self.res
        if len(res.kept) <= SHRINK_LIMIT:
            for name in list(res.kept):
                fewer = [n for n in res.kept if n != name]
                if fewer and self(fewer):
                    res.kept = fewer

    def stopped(self) -> str:
        res = self.res
        return (f"stopped after {self.max_trials} trials" +
                (f" with {len(res.kept)} layers kept {res.kept_as} (not pruned further)" if res.kept else ""))


def _searched(n_layers: int, passes: Callable[[list[str]], tuple[bool, str]], max_trials: int, kept_as: str,
              empty_note: str, body: Callable[[Fallback, _Trials], None]) -> Fallback:
    """What the searches share: the result and its memoized trials; ``empty_note`` with no layer to search,
    else ``body(res, trial)`` (which sets ``res.kept`` and ``res.note``), cut short when the trials run out."""
    res = Fallback(layers=n_layers, kept=None, kept_as=kept_as)
    trial = _Trials(res, passes, max_trials)
    if not n_layers:
        res.note = empty_note
        return res
    try:
        body(res, trial)
    except _OutOfTrials:
        res.note = trial.stopped()
    return res


def search(layers: Sequence[str], passes: Callable[[list[str]], tuple[bool, str]],
           max_trials: int = MAX_TRIALS) -> Fallback:
    """The smallest set of ``layers`` found to pass when kept fp32 (see the module docstring).

    ``passes(kept)`` -> (within budget, why not); it is called at most ``max_trials`` times."""
    layers = list(layers)

    def body(res: Fallback, trial: _Trials) -> None:
        if not trial(layers):
            res.note = "still over budget with every layer fp32: not a per-layer precision problem"
            return
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
        trial.prune()
        res.note = (f"{len(res.kept)} of {len(layers)} layers kept fp32 "
                    f"({len(res.trials)} trials, bisection over execution order)")

    return _searched(len(layers), passes, max_trials, "fp32", "no layer with parameters to keep in fp32", body)


def search_ranked(ranked: Sequence[str], passes: Callable[[list[str]], tuple[bool, str]], *,
                  kept_as: str = "float", ranked_by: str = "per-layer error",
                  max_trials: int = MAX_TRIALS) -> Fallback:
    """The smallest set of ``ranked`` layers (most suspect first) found to pass when kept ``kept_as``:
    galloping then bisection for the shortest passing prefix, then pruning (see the module docstring).

    ``passes(kept)`` -> (within budget, why not); it is called at most ``max_trials`` times. The result
    keeps the layers in ``ranked`` order; ``ranked_by`` says in the note what the order was."""
    ranked = list(ranked)
    if len(set(ranked)) != len(ranked):
        raise ValueError(f"ranked: layer names must be distinct, got {ranked}")

    def body(res: Fallback, trial: _Trials) -> None:
        lo, k = 0, 1  # the prefixes of length <= lo fail; gallop k = 1, 2, 4, ... up to every layer
        while not trial(ranked[:k]):
            if k == len(ranked):
                res.note = (f"still over budget with all {len(ranked)} layers kept {kept_as}: not a per-layer "
                            "precision problem")
                return
            lo, k = k, min(2 * k, len(ranked))
        res.kept = ranked[:_bisect(trial, ranked, lo, k)]
        trial.prune()
        n = len(res.trials)
        res.note = (f"{len(res.kept)} of {len(ranked)} layers kept {kept_as} ({n} trial{'s' * (n != 1)}, "
                    f"galloping search over the layers ranked by {ranked_by})")

    return _searched(len(ranked), passes, max_trials, kept_as, f"no layer to keep {kept_as}", body)


class _OutOfTrials(Exception):
    pass


def _bisect(trial: Callable[[list[str]], bool], ranked: list[str], lo: int, hi: int) -> int:
    """The shortest passing prefix length of ``ranked`` in (lo, hi], by bisection: the prefixes of length lo
    or less fail (lo = -1: none known to), the one of length hi passes."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(ranked[:mid]):
            hi = mid
        else:
            lo = mid
    return hi


def shorten_prefix(kept: Sequence[str], passes: Callable[[list[str]], tuple[bool, str]], *,
                   kept_as: str = "float", max_trials: int = MAX_TRIALS) -> Fallback:
    """A shorter prefix of ``kept`` (a passing set, in ranked order) that passes under other ``passes``
    (another way to build the model, such as a bias-corrected calibration): the one-shorter prefix first,
    which ends the search when it fails (one trial: the other build does not help here), then bisection
    down to the empty prefix. ``kept`` of the result is None when no shorter prefix was found to pass."""
    kept = list(kept)

    def body(res: Fallback, trial: _Trials) -> None:
        if not trial(kept[:-1]):
            res.note = f"the first {len(kept) - 1} of the {len(kept)} layers kept {kept_as} did not pass"
            return
        hi = _bisect(trial, kept, -1, len(kept) - 1)
        res.kept = kept[:hi]
        n = len(res.trials)
        res.note = f"{hi} of the {len(kept)} layers kept {kept_as} ({n} trial{'s' * (n != 1)}, bisection)"

    return _searched(len(kept), passes, max_trials, kept_as, f"no layer kept {kept_as}: nothing to shorten", body)
