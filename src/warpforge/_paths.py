"""Where warpforge keeps things on disk (XDG locations, overridable by environment variables)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Re-creatable data: probe results per device, autotune choices. ``WARPFORGE_CACHE_DIR`` overrides."""
    env = os.environ.get("WARPFORGE_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "warpforge"
    base.mkdir(parents=True, exist_ok=True)
    return base


def data_dir() -> Path:
    """Data a user keeps: the results store. ``WARPFORGE_DATA_DIR`` overrides."""
    env = os.environ.get("WARPFORGE_DATA_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "warpforge"
    base.mkdir(parents=True, exist_ok=True)
    return base


def default_store_url() -> str:
    """``WARPFORGE_STORE`` (any SQLAlchemy URL) or an SQLite file in the data directory."""
    return os.environ.get("WARPFORGE_STORE") or f"sqlite:///{data_dir() / 'results.sqlite'}"
