"""Argument checks shared by the configs and launchers of every part (standard library only, so torch-free
configs such as serve.config use them): one line naming the argument, what it takes and what it got."""

from __future__ import annotations


def check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    """ValueError unless ``value`` is an int (not a bool) in [lo, hi] (hi None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected an integer {rng}, got {value!r}")


__all__ = ["check_int"]
