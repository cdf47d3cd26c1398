"""``path/to/file.py:factory`` and ``package.module:factory`` specs, shared by the CLIs that take a
user's model (``warpforge optimize``, ``warpforge profile``)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import keyword
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


# module name -> the file it was imported from, for every factory file imported here (load_factory).
_FILE_MODULES: dict[str, Path] = {}


def import_file(name: str, path: Path) -> ModuleType:
    """Import the Python file ``path`` as module ``name`` (registered in sys.modules, removed again if running
    it fails). Its folder is on sys.path while it runs, so ``import helper`` finds a ``helper.py`` beside it
    as it would for ``python path``. ImportError: not loadable as a module; anything the file raises propagates."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a loadable Python module")
    mod = importlib.util.module_from_spec(spec)
    folder = str(Path(path).resolve().parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return mod


def file_modules() -> dict[str, Path]:
    """The factory files imported in this process by path: module name -> file."""
    return dict(_FILE_MODULES)


def _own_name(path: Path) -> str | None:
    """The file's stem when importing it under that name shadows nothing: no other module of that name is
    loaded or importable here (the same file importable by that name is fine)."""
    stem = path.stem
    if not stem.isidentifier() or keyword.iskeyword(stem) or stem in sys.builtin_module_names:
        return None
    here = path.resolve()
    loaded = sys.modules.get(stem)
    if loaded is not None:
        return stem if _FILE_MODULES.get(stem) == here or _same_file(getattr(loaded, "__file__", None), here) else None
    try:
        found = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        return None
    return stem if found is None or _same_file(found.origin, here) else None


def _same_file(a: str | None, b: Path) -> bool:
    try:
        return a is not None and Path(a).resolve() == b
    except OSError:
        return False


def load_factory(where: str, attr: str, error: type[Exception], module_prefix: str) -> Callable[..., Any]:
    """The callable ``attr`` of a Python file (``where`` ends in .py or holds a path separator) or of
    an importable module; ``error`` (a ValueError subclass of the caller's) names what was wrong.

    A file is imported under its own name (``mymodels`` for ``path/mymodels.py``), as ``import mymodels``
    would, unless that name belongs to another module here; then under a stable name made of
    ``module_prefix`` and its path. Either way it is recorded (:func:`file_modules`), so a saved model
    whose classes it defines can carry the file and import it under the same name in another process.
    """
    if not attr.isidentifier():
        raise error(f"{where}:{attr}: {attr!r} is not a function name")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise error(f"{where}: no such file")
        name = _own_name(path) or module_prefix + re.sub(r"[^A-Za-z0-9_]+", "_", str(path.resolve())).strip("_")[-80:]
        try:
            mod = import_file(name, path)
        except Exception as e:  # an ImportError too: its message (which module, which name) is what to fix
            raise error(f"{where}: importing it failed: {type(e).__name__}: {e}") from e
        _FILE_MODULES[name] = path.resolve()
    else:
        try:
            mod = importlib.import_module(where)
        except ImportError as e:
            raise error(f"{where}: cannot import module ({e})") from e
    factory = getattr(mod, attr, None)
    if not callable(factory):
        public = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == mod.__name__)
        raise error(f"{where}: no function {attr!r}" + (f" (it defines: {', '.join(public[:12])})" if public else ""))
    return factory


def call_factory(factory: Callable[..., Any], offered: dict[str, Any], spec: str,
                 error: type[Exception]) -> tuple[Any, dict[str, Any]]:
    """(what ``factory`` returns, the keyword arguments it got): it is called with those of ``offered`` it takes
    (:func:`accepts`); whatever it raises becomes ``error`` naming ``spec``."""
    kwargs = {k: v for k, v in offered.items() if accepts(factory, k)}
    try:
        return factory(**kwargs), kwargs
    except Exception as e:
        raise error(f"{spec}: the factory raised {type(e).__name__}: {e}") from e


def accepts(fn: Callable, name: str) -> bool:
    """Does ``fn`` take a keyword argument ``name`` (by name or through **kwargs)?"""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
