"""What the analysis (profile/analysis.py) returns: a row per operator or kernel, the window's Analysis,
and the launch cost it was judged against. Data only: the findings (profile/findings.py) read these,
and the analysis, which calls the findings, fills them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from warpforge.profile.timeline import TimeSplit


@dataclass(frozen=True)
class LaunchCost:
    """Host cost of one eager kernel launch: kernels shorter than this cannot keep the GPU fed."""

    us: float
    source: str

    def __post_init__(self) -> None:
        if not (self.us > 0 and math.isfinite(self.us)):
            raise ValueError(f"LaunchCost.us must be a finite number > 0, got {self.us!r}")


@dataclass
class Row:
    """One operator (module, op) or one kernel, per iteration of the window."""

    name: str  # "layer3.1.conv2 / aten::conv2d" or the kernel's name
    module: str | None
    op: str
    kind: str
    calls: float
    time_us: float  # device time on a GPU run, host time on a CPU run
    share: float  # of all rows' time
    host_us: float = 0.0
    flops: float | None = None
    bytes: float | None = None
    ceiling: str | None = None
    intensity: float | None = None  # FLOP per byte
    tflops: float | None = None
    GBps: float | None = None
    floor_us: float | None = None
    fraction: float | None = None  # floor / measured, of the roof that binds
    bound: str | None = None  # "memory" | "compute"
    graph: bool = False
    launched: list[str] = field(default_factory=list)  # kernels (op rows) or operators (kernel rows)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Analysis:
    device_type: str
    iterations: int
    ops: list[Row]
    kernels: list[Row]
    split: TimeSplit
    totals: dict[str, Any]
    launch: LaunchCost | None
    ceilings: dict[str, Any] | None
    findings: list[dict[str, Any]]
    verdict: str
    notes: list[str]
    uncounted: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "iterations": self.iterations, "verdict": self.verdict,
                "totals": self.totals, "split": self.split.as_dict(),
                "launch": asdict(self.launch) if self.launch else None, "ceilings": self.ceilings,
                "findings": self.findings, "ops": [r.as_dict() for r in self.ops],
                "kernels": [r.as_dict() for r in self.kernels], "notes": self.notes, "uncounted": self.uncounted}


__all__ = ["Analysis", "LaunchCost", "Row"]
