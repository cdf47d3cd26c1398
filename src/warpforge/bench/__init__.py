"""Timing harness, suites, side-by-side comparison with peers, records and the results store."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # the timing primitives live at the bottom of the package (hw and optimize time with them too)
    "Timing": "warpforge.timing", "time_fn": "warpforge.timing", "time_interleaved": "warpforge.timing",
    "time_stable": "warpforge.timing",
    "same_work_ratio": "ratio", "figure_violations": "record", "check_host": "host",
    "Case": "suite", "Suite": "suite",
    "run_suite": "runner", "load_suite": "runner", "list_suites": "runner",
    "validate_record": "record", "read_jsonl": "record", "write_jsonl": "record",
    "Store": "store", "StoreError": "store",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = _LAZY[name]
        value = getattr(importlib.import_module(mod if "." in mod else f"warpforge.bench.{mod}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.bench' has no attribute {name!r}")
