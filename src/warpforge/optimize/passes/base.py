"""What every pass shares: the context it runs in, the change records it writes, the protocol it meets.

A pass is ``apply(model, ctx) -> model`` (docs/design.md). It may rewrite the model in place (capture hands the
pipeline a private copy) and appends one :class:`Change` per thing it did or deliberately did not do, so the
report can say "folded 3 BatchNorm2d, skipped 1 (conv output has other users)" with module paths.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@dataclass(frozen=True)
class Change:
    """One thing a pass did (or skipped, with the reason in ``detail``) at one place in the model."""

    pass_name: str  # e.g. "fold_bn"
    action: str     # a verb counted in the summary: "folded", "fused", "skipped", "converted", ...
    where: str      # module path(s) / FX node name(s), e.g. "layer1.0.bn1 -> layer1.0.conv1"
    detail: str = ""

    def __str__(self) -> str:
        tail = f": {self.detail}" if self.detail else ""
        return f"[{self.pass_name}] {self.action} {self.where}{tail}"

    def as_dict(self) -> dict[str, str]:
        return {"pass": self.pass_name, "action": self.action, "where": self.where, "detail": self.detail}


@dataclass
class PassContext:
    """State every pass sees: where and in what precision the model will run, inputs to trace shapes
    with, and the running change log."""

    example_inputs: tuple[Any, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    changes: list[Change] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.example_inputs, tuple):
            raise ValueError(f"example_inputs must be a tuple, got {type(self.example_inputs).__name__}")
        self.device = torch.device(self.device)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")

    def record(self, pass_name: str, action: str, where: str, detail: str = "") -> Change:
        change = Change(pass_name, action, where, detail)
        self.changes.append(change)
        return change


@dataclass(frozen=True)
class PassResult:
    """What one pass of a pipeline did: its changes and their counts per action."""

    name: str
    changes: tuple[Change, ...]

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(c.action for c in self.changes))

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "counts": self.counts, "changes": [c.as_dict() for c in self.changes]}


@runtime_checkable
class Pass(Protocol):
    """A model rewrite. ``name`` labels its change records; ``apply`` returns the (possibly new) model."""

    name: str

    def apply(self, model: torch.fx.GraphModule | nn.Module, ctx: PassContext) -> torch.fx.GraphModule | nn.Module:
        ...


__all__ = ["Change", "Pass", "PassContext", "PassResult"]
