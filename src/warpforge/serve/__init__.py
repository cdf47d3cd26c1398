"""warpforge.serve: the OpenAI-compatible HTTP server over :class:`warpforge.llm.AsyncLLM`.

>>> from warpforge.serve import ServeConfig, create_app
>>> app = create_app(AsyncLLM("path/to/checkpoint"), ServeConfig(model="path/to/checkpoint"))

``warpforge serve MODEL`` runs it under uvicorn (``server.serve``). Names load on first use, so
``import warpforge.serve`` stays cheap.
"""

from __future__ import annotations

from warpforge._lazy import lazy_exports

_LAZY = {"ServeConfig": "config", "create_app": "app", "serve": "server", "build_llm": "server"}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
