"""Argument checks shared by the configs and launchers of every part (standard library only, so torch-free
configs such as serve.config use them): one line naming the argument, what it takes and what it got."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """A refused argument: ``field`` names it and ``problem`` says what it takes and what it got; the message is
    ``"field: problem"``. A caller that calls the field by another name (a server's API) renames it from these
    attributes, never by parsing the text."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    """FieldError unless ``value`` is an int (not a bool) in [lo, hi] (hi None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(name, f"expected an integer {rng}, got {value!r}")


def from_dict(name: str, cls: type[T], value: dict[str, Any]) -> T:
    """The dataclass ``cls`` from a dict of its fields; a key that is not one is refused in one line naming the
    unknown keys and the fields it takes (the constructor's TypeError would name only the first)."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise FieldError(name, f"unknown settings {unknown}; expected some of {sorted(known)}")
    return cls(**value)


__all__ = ["FieldError", "check_int", "from_dict"]
