"""What a benchmark suite is: a named list of cases, each ours against named peers on the same inputs.

A suite lives in ``warpforge/bench/suites/<name>.py`` and exposes ``SUITE = Suite(...)``. Cases are
built lazily by ``Suite.build(quick)`` so importing a suite (for ``bench --list``) allocates nothing.
Both dataclasses validate themselves: a malformed case fails when the suite is built, with a message
that names the case and the field, not halfway through a GPU run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

METRICS = ("tflops", "GBps")
# The record keeps ours under "ours"; a peer of that name would be ambiguous.
RESERVED_PEER_NAMES = frozenset({"ours"})


@dataclass
class Case:
    """One comparison: ours and every peer run on the same fresh inputs, checked, then timed.

    ``make_inputs(gen, device)`` returns a tuple of inputs drawn from ``gen`` (never zeros; output
    buffers pre-filled with NaN so that unwritten elements fail the check). ``ours``, each peer and
    ``reference`` take those inputs unpacked and return the result (a tensor or a tuple of tensors).
    """

    name: str  # unique in the suite, human-readable, carries the sizes
    params: dict[str, Any]  # JSON-able: what varies between cases (sizes, dtype, op)
    make_inputs: Callable[[torch.Generator, torch.device], tuple]
    ours: Callable[..., Any]
    peers: dict[str, Callable[..., Any]]
    reference: Callable[..., Any] | None  # higher precision; None: checked against the first peer
    flops: float  # explicit counts: the hardware figure and the roofline come from them
    bytes: float
    dtype: torch.dtype  # precision for the compute ceiling and the default tolerance
    metric: str = "GBps"  # "tflops" or "GBps"
    tol: float | None = None  # overrides tolerance(dtype); say why where it is set
    cuda_graph: bool = False  # time by CUDA-graph replay (launch-bound work)

    def __post_init__(self) -> None:
        where = f"case {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"case name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"{where}: params must be a dict, got {type(self.params).__name__}")
        try:
            json.dumps(self.params, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: params must be JSON-serializable ({e})") from None
        for attr in ("make_inputs", "ours"):
            if not callable(getattr(self, attr)):
                raise ValueError(f"{where}: {attr} must be callable")
        if self.reference is not None and not callable(self.reference):
            raise ValueError(f"{where}: reference must be callable or None")
        if not isinstance(self.peers, dict) or not self.peers:
            raise ValueError(f"{where}: peers must be a non-empty dict name -> callable (every case names its peer)")
        for peer, fn in self.peers.items():
            if not isinstance(peer, str) or not peer or peer in RESERVED_PEER_NAMES:
                raise ValueError(f"{where}: invalid peer name {peer!r}")
            if not callable(fn):
                raise ValueError(f"{where}: peer {peer!r} must be callable")
        if self.metric not in METRICS:
            raise ValueError(f"{where}: metric must be one of {METRICS}, got {self.metric!r}")
        for attr in ("flops", "bytes"):
            v = getattr(self, attr)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}: {attr} must be a finite number >= 0, got {v!r}")
        needed = "flops" if self.metric == "tflops" else "bytes"
        if getattr(self, needed) <= 0:
            raise ValueError(f"{where}: metric {self.metric!r} needs {needed} > 0")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{where}: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.tol is not None and (not isinstance(self.tol, (int, float)) or not self.tol >= 0):
            raise ValueError(f"{where}: tol must be a number >= 0 or None, got {self.tol!r}")

    def figure(self, ms: float) -> float:
        """The hardware figure for a time in ms: TFLOP/s or GB/s from the explicit counts."""
        seconds = ms * 1e-3
        return (self.flops / seconds / 1e12) if self.metric == "tflops" else (self.bytes / seconds / 1e9)


@dataclass
class Suite:
    """A named benchmark suite; ``cases(quick)`` returns its cases (smaller sizes when quick)."""

    name: str
    description: str
    cases: Callable[[bool], list[Case]] = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"suite name must be a non-empty string, got {self.name!r}")
        if not callable(self.cases):
            raise ValueError(f"suite {self.name!r}: cases must be a callable quick -> list[Case]")

    def build(self, quick: bool = False) -> list[Case]:
        """The suite's cases, checked: each a Case, names unique."""
        cases = list(self.cases(quick))
        seen: set[str] = set()
        for c in cases:
            if not isinstance(c, Case):
                raise ValueError(f"suite {self.name!r}: cases() returned {type(c).__name__}, expected Case")
            if c.name in seen:
                raise ValueError(f"suite {self.name!r}: duplicate case name {c.name!r}")
            seen.add(c.name)
        return cases
