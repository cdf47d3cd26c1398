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
    cases: Callable[[bool], list[Case | EndToEndCase]] = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"suite name must be a non-empty string, got {self.name!r}")
        if not callable(self.cases):
            raise ValueError(f"suite {self.name!r}: cases must be a callable quick -> list[Case]")

    def build(self, quick: bool = False) -> list[Case | EndToEndCase]:
        """The suite's cases, checked: each a Case or an EndToEndCase, names unique."""
        cases = list(self.cases(quick))
        seen: set[str] = set()
        for c in cases:
            if not isinstance(c, (Case, EndToEndCase)):
                raise ValueError(f"suite {self.name!r}: cases() returned {type(c).__name__}, "
                                 "expected Case or EndToEndCase")
            if c.name in seen:
                raise ValueError(f"suite {self.name!r}: duplicate case name {c.name!r}")
            seen.add(c.name)
        return cases


# ---- end-to-end cases: whole runs timed by wall clock, with their own figures --------------------

# "tok/s": output tokens over wall time, higher is better (ratio = ours / peer);
# "ms": a time the case measures (e.g. mean time to first token), lower is better (ratio = peer / ours).
E2E_METRICS = ("tok/s", "ms")


@dataclass
class Run:
    """One timed end-to-end run of ours or a peer (the callable synchronizes the device before timing)."""

    ms: float  # the measured time: the run's wall clock, or what the case says it times (mean TTFT)
    tokens: int  # output tokens the tok/s figure counts (useful tokens only: never padding)
    output: Any = None  # what the correctness check compares (e.g. greedy ids of request 0); not recorded
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-able: ttft_ms, peak_mem_GB, wall_ms, ...
    work: dict[str, float] = field(default_factory=dict)  # {"flops", "bytes"} of the whole run (MFU, MBU)
    # What the run did, when a case's callables may run different work (e.g. {"requests": 64, ...}): the
    # ratio rule compares it (with the tokens) between ours and each peer; different work gets no ratio.
    ran: dict[str, Any] | None = None


RunFn = Callable[[torch.device, int], list[Run]]  # (device, rep) -> rep timed runs; loads, warms up, frees


@dataclass
class EndToEndCase:
    """A whole generation (or serving run) per call, measured by wall clock; ours against named peers.

    Each callable loads its model, warms up, returns ``rep`` timed :class:`Run` s and frees what it
    holds, so peers never share memory with ours. ``check(ours_output, peer_output)`` returns
    ``{"ok", "rel_err", "tol", ...}`` (extra keys, e.g. the matched token count, go into the record);
    with ``check_against`` None it gets ``(ours_output, None)`` and checks ours on its own (every
    request completed with its token count). ``peers`` may be empty only when ``baseline`` says what
    the row is judged against instead (a published figure). A peer is recorded as the baseline (correct
    by definition) unless its runs report their own check in ``Run.extra["correct"]`` (e.g. an fp16 peer
    checked against the fp32 reference in the same run).
    """

    name: str
    params: dict[str, Any]
    ours: RunFn
    peers: dict[str, RunFn]
    check: Callable[[Any, Any], dict[str, Any]]
    dtype: torch.dtype  # the precision of the compute ceiling (MFU)
    check_against: str | None = None  # a peer name, or None: check ours alone
    metric: str = "tok/s"
    rep: int = 1
    baseline: str = ""  # what the row is judged against, in words
    target: dict[str, Any] | None = None  # the issue's bar, e.g. {"ratio": {"hf": 10.0}} or {"mbu": 0.85}
    # How the callables measure Run.ms, for the record's "timing" (method, warmup, rep, interleaved); None:
    # each run's device-synchronized wall clock, one callable after another.
    timing: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        where = f"case {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"case name must be a non-empty string, got {self.name!r}")
        for attr in ("params", "target", "timing"):
            v = getattr(self, attr)
            if v is None and attr != "params":
                continue
            if not isinstance(v, dict):
                raise ValueError(f"{where}: {attr} must be a dict")
            try:
                json.dumps(v, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {attr} must be JSON-serializable ({e})") from None
        if not callable(self.ours) or not callable(self.check):
            raise ValueError(f"{where}: ours and check must be callable")
        if not isinstance(self.peers, dict) or not all(isinstance(n, str) and n and n not in RESERVED_PEER_NAMES
                                                       and callable(f) for n, f in self.peers.items()):
            raise ValueError(f"{where}: peers must be a dict name -> callable")
        if not self.peers and not self.baseline:
            raise ValueError(f"{where}: without a peer, baseline must say what the case is judged against")
        if self.check_against is not None and self.check_against not in self.peers:
            raise ValueError(f"{where}: check_against {self.check_against!r} is not a peer")
        if self.metric not in E2E_METRICS:
            raise ValueError(f"{where}: metric must be one of {E2E_METRICS}, got {self.metric!r}")
        if isinstance(self.rep, bool) or not isinstance(self.rep, int) or self.rep < 1:
            raise ValueError(f"{where}: rep must be an integer >= 1, got {self.rep!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{where}: dtype must be a torch.dtype, got {self.dtype!r}")

    def figure(self, run_ms: float, tokens: int) -> float:
        return tokens / (run_ms * 1e-3) if self.metric == "tok/s" else run_ms
