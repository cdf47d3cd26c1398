"""What benchmark runs leave, and what is read from it: the record format and its rules (the same-work ratio),
the results store, committed records over git history, tables, the HTML report, and the host's state a
figure was timed under. Product-free and torch-free on import: `warpforge results` only reads and validates,
and the optimizer and profiler take their ratios and host checks from here."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "same_work_ratio": "ratio", "figure_violations": "record", "check_host": "host",
    "validate_record": "record", "read_jsonl": "record", "write_jsonl": "record",
    "Store": "store", "StoreError": "store",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"warpforge.results.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.results' has no attribute {name!r}")
