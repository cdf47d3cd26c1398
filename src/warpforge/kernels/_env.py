"""On/off knobs read from the environment, one spelling everywhere (here, at the bottom layer: kernels import
only warpforge.kernels)."""

from __future__ import annotations

import os

TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")


def env_flag(name: str, default: bool = False) -> bool:
    """``name``'s value as a switch: 1/on/true/yes or 0/off/false/no (any case); unset or empty: ``default``.
    Anything else is a ValueError naming the variable, so a typo does not silently leave a knob off."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in TRUE + FALSE:
        raise ValueError(f"{name}: expected 1/on/true/yes or 0/off/false/no, got {value!r}")
    return value in TRUE
