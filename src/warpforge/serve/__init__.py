"""warpforge.serve: the OpenAI-compatible HTTP server over :class:`warpforge.llm.AsyncLLM`.

>>> from warpforge.serve import ServeConfig, create_app
>>> app = create_app(AsyncLLM("path/to/checkpoint"), ServeConfig(model="path/to/checkpoint"))

``warpforge serve MODEL`` runs it under uvicorn (``server.serve``). Names load on first use, so
``import warpforge.serve`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"ServeConfig": "config", "create_app": "app", "serve": "server", "build_llm": "server"}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"warpforge.serve.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.serve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
