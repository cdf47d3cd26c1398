"""Where warpforge keeps things on disk: :mod:`warpforge.settings` (which reads the environment) has them;
these names stay importable from here."""

from __future__ import annotations

from warpforge.settings import cache_dir, data_dir, default_store_url

__all__ = ["cache_dir", "data_dir", "default_store_url"]
