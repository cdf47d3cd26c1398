"""Cheap package imports: a package's public names load from their submodules on first use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose names load on first use: ``where`` maps each
    public name to the submodule defining it (``{"LLM": "engine"}``: ``package.engine.LLM``). A loaded name
    is kept on the package, so later uses skip ``__getattr__``."""

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
