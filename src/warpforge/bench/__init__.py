"""Timing harness, suites, side-by-side comparison with peers, records and the results store."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Timing": "timing", "time_fn": "timing", "time_interleaved": "timing", "time_stable": "timing",
    "same_work_ratio": "ratio", "figure_violations": "record", "check_host": "host",
    "Case": "suite", "Suite": "suite",
    "run_suite": "runner", "load_suite": "runner", "list_suites": "runner",
    "validate_record": "record", "read_jsonl": "record", "write_jsonl": "record",
    "Store": "store", "StoreError": "store",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"warpforge.bench.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.bench' has no attribute {name!r}")
