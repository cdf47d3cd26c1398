"""The benchmark suites and their harness: cases, side-by-side comparison with peers, the runner and the load
generator. What a run leaves (records, the store, tables, history) is :mod:`warpforge.results`."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # the timing primitives live at the bottom of the package (hw and optimize time with them too)
    "Timing": "warpforge.timing", "time_fn": "warpforge.timing", "time_interleaved": "warpforge.timing",
    "time_stable": "warpforge.timing",
    "Case": "suite", "Suite": "suite",
    "run_suite": "runner", "load_suite": "runner", "list_suites": "runner",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = _LAZY[name]
        value = getattr(importlib.import_module(mod if "." in mod else f"warpforge.bench.{mod}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.bench' has no attribute {name!r}")
