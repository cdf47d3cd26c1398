"""The side-by-side: one case, ours and every peer, same fresh inputs, checked, then timed interleaved.

Order of work for a case:
1. the reference runs on a freshly drawn input set (seeded per case, so the draw is reproducible);
2. ours and then each peer run once, each on its OWN fresh draw from the same seed: identical values,
   but output buffers are newly poisoned, so a callable that leaves elements unwritten cannot pass
   on what a previous callable wrote; each result is checked against the reference right away;
3. everything that ran is timed round-robin on one shared input set, under the stability rule
   (``time_stable``: rounds that disagree, or a wide p80/p20, are re-timed, then marked noisy).

A peer that raises (torch.compile unavailable, an unsupported dtype) is recorded as an error and
gets no ratio; it never stops the run. If ours raises, the case is recorded as failed. Ratios come
from ``results.ratio.same_work_ratio`` only: a peer that fails its check is shown, never a baseline.
"""

from __future__ import annotations

import math
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from warpforge.results.ratio import Side, check_note, entry_side, put_ratio, same_work_ratio
from warpforge.bench.suite import Case
from warpforge.results.record import correct_entry, finish_record, now_iso
from warpforge.timing import Stable, Timing, time_stable
from warpforge.kernels.tolerance import check, tolerance

OURS = "ours"


@dataclass
class Outcome:
    """What happened to one callable (ours or a peer) in a case."""

    timing: Timing | None = None
    correct: dict[str, Any] | None = None  # {"rel_err", "tol", "ok", "against"}
    error: str | None = None  # set when the callable raised; timing is then None
    rounds_ms: list[float] = field(default_factory=list)  # per-round medians (the ratio's interval)

    def side(self) -> Side:
        """This outcome as the ratio rule sees it."""
        if self.error is not None or self.timing is None:
            return Side(error=self.error or "not timed")
        ok = self.correct.get("ok") if self.correct is not None else None
        return Side(ms=self.timing.median_ms, ok=ok if isinstance(ok, bool) else None,
                    rounds_ms=tuple(self.rounds_ms), check=check_note(self.correct))


@dataclass
class CaseResult:
    case: Case
    seed: int
    device: torch.device
    ours: Outcome
    peers: dict[str, Outcome] = field(default_factory=dict)
    warmup: int = 0
    rep: int = 0
    interleaved: bool = True  # False when interleaved timing failed and each was timed alone
    stability: dict[str, Any] | None = None  # the record's "stability" block (Stable.as_dict)

    @property
    def ratio(self) -> dict[str, float]:
        """peer_ms / ours_ms for each peer the ratio rule allows (above 1: ours is faster)."""
        ours = self.ours.side()
        got = {n: same_work_ratio(ours, o.side()) for n, o in self.peers.items()}
        return {n: r.value for n, r in got.items() if r.value is not None}


def case_seed(suite: str, case: str) -> int:
    """A stable seed per (suite, case): reruns draw the same inputs, different cases different ones."""
    return zlib.crc32(f"{suite}/{case}".encode()) & 0x7FFFFFFF


def _inputs(case: Case, seed: int, device: torch.device) -> tuple:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inputs = case.make_inputs(gen, device)
    if not isinstance(inputs, tuple):
        raise ValueError(f"case {case.name!r}: make_inputs must return a tuple, got {type(inputs).__name__}")
    return inputs


def _as_tensors(out: Any, who: str) -> list[torch.Tensor]:
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{who} must return a tensor or a tuple of tensors, got {type(out).__name__}")
    return items


def _check(out: Any, ref: list[torch.Tensor], case: Case, against: str, who: str) -> dict[str, Any]:
    outs = _as_tensors(out, who)
    if len(outs) != len(ref):
        raise ValueError(f"{who} returned {len(outs)} outputs, the reference {len(ref)}")
    tol = case.tol if case.tol is not None else tolerance(case.dtype)
    checks = [check(o, r, tol=tol) for o, r in zip(outs, ref)]
    worst = max(checks, key=lambda c: c["rel_err"])  # inf (non-finite output) sorts last
    return {"rel_err": worst["rel_err"], "tol": tol, "ok": all(c["ok"] for c in checks), "against": against}


def error_line(e: BaseException) -> str:
    """The exception as one line for a record or a table cell (its type and message, at most 500 characters)."""
    lines = traceback.format_exception_only(type(e), e)
    return lines[-1].strip()[:500]


def _run_checked(fn: Callable[..., Any], case: Case, seed: int, device: torch.device,
                 ref: list[torch.Tensor] | None, against: str, who: str) -> tuple[Outcome, Any]:
    """Run once on a fresh draw; check against ref (if any). Returns the outcome and the raw output."""
    try:
        out = fn(*_inputs(case, seed, device))
        _as_tensors(out, who)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # surface asynchronous kernel errors here, not later
        correct = _check(out, ref, case, against, who) if ref is not None else None
    except Exception as e:  # noqa: BLE001 - any failure of a callable is data for the record
        return Outcome(error=error_line(e)), None
    return Outcome(correct=correct), out


def compare_case(case: Case, *, suite: str, device: torch.device, warmup: int, rep: int,
                 flush_l2: bool = True) -> CaseResult:
    """Check ours and every peer against the reference, then time them interleaved."""
    seed = case_seed(suite, case.name)
    ref: list[torch.Tensor] | None = None
    against = "reference"
    if case.reference is not None:
        with torch.no_grad():
            ref = [t.detach() for t in _as_tensors(case.reference(*_inputs(case, seed, device)), "reference")]

    with torch.no_grad():
        peers: dict[str, Outcome] = {}
        if ref is None:
            # No reference: the first peer that runs stands in for it (its own check is trivially ok).
            for name, fn in case.peers.items():
                peers[name], out = _run_checked(fn, case, seed, device, None, against, f"peer {name!r}")
                if out is not None:
                    ref = [t.detach().to(torch.float64) for t in _as_tensors(out, name)]
                    against = f"peer:{name}"
                    peers[name].correct = {"rel_err": 0.0, "tol": None, "ok": True, "against": against}
                    break
        ours, _ = _run_checked(case.ours, case, seed, device, ref, against, "ours")
        for name, fn in case.peers.items():
            if name not in peers:
                peers[name], _ = _run_checked(fn, case, seed, device, ref, against, f"peer {name!r}")
        del ref

        result = CaseResult(case=case, seed=seed, device=device, ours=ours, peers=peers, warmup=warmup, rep=rep)
        runnable = ([OURS] if ours.error is None else []) + [n for n, o in peers.items() if o.error is None]
        if not runnable:
            return result
        inputs = _inputs(case, seed, device)
        fns = {n: _bind(case.ours if n == OURS else case.peers[n], inputs) for n in runnable}
        opts = dict(warmup=warmup, rep=rep, flush_l2=flush_l2, cuda_graph=case.cuda_graph, device=device)
        try:
            stable = time_stable(fns, **opts)
        except Exception:  # noqa: BLE001 - find who fails (e.g. graph capture) and time the rest alone
            result.interleaved = False
            alone: dict[str, Stable] = {}
            for n, fn in fns.items():
                try:
                    alone[n] = time_stable({n: fn}, **opts)
                except Exception as e:  # noqa: BLE001
                    (ours if n == OURS else peers[n]).error = f"timing failed: {error_line(e)}"
            stable = _merge(alone)
        if stable is not None:
            for n, t in stable.timings.items():
                o = ours if n == OURS else peers[n]
                o.timing, o.rounds_ms = t, stable.rounds_ms[n]
            result.stability = stable.as_dict()
    return result


def _merge(alone: dict[str, Stable]) -> Stable | None:
    """Callables timed one by one, as one :class:`Stable` (noisy if any was)."""
    if not alone:
        return None
    first = next(iter(alone.values()))
    return Stable(timings={n: s.timings[n] for n, s in alone.items()},
                  rounds_ms={n: s.rounds_ms[n] for n, s in alone.items()},
                  spread={n: s.spread[n] for n, s in alone.items()},
                  attempts=max(s.attempts for s in alone.values()), noisy=any(s.noisy for s in alone.values()),
                  bound=first.bound)


def _bind(fn: Callable[..., Any], inputs: tuple) -> Callable[[], Any]:
    return lambda: fn(*inputs)


# ---- the record of a case ----------------------------------------------------------------------

def _timed(t: Timing, figure: float, metric: str, rounds_ms: Sequence[float] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, "iqr_ms": t.iqr_ms,
                           metric: figure}
    if rounds_ms:
        out["rounds_ms"] = [float(x) for x in rounds_ms]
    return out


def _peer(o: Outcome, result: CaseResult) -> dict[str, Any]:
    if o.error is not None or o.timing is None:
        return {"error": o.error or "not timed"}
    return {**_timed(o.timing, result.case.figure(o.timing.median_ms), result.case.metric, o.rounds_ms),
            "correct": correct_entry(o.correct)}


def roofline_for(result: CaseResult, ceil: Any) -> dict[str, Any] | None:
    """Floor over measured time against the device's ceilings; None when either is unknown. A fraction
    above 1.0 raises :class:`warpforge.hw.roofline.CeilingError` (a bug: reported, never stored)."""
    if ceil is None or result.ours.timing is None:
        return None
    try:
        from warpforge.hw.roofline import CeilingError, roofline
    except ImportError:
        return None
    try:
        r = roofline(result.case.flops, result.case.bytes, result.case.dtype, result.ours.timing.median_ms, ceil,
                     strict=True)
    except CeilingError:
        raise
    except Exception:  # noqa: BLE001 - an unknown ceiling for this dtype: record null, never a guess
        return None
    keys = ("floor_ms", "fraction", "bound", "compute_ms", "memory_ms")
    out = {k: r[k] for k in keys if k in r}
    if not all(isinstance(out.get(k), (int, float)) and math.isfinite(out[k]) for k in ("floor_ms", "fraction")):
        return None
    out["ceilings"] = getattr(ceil, "source", None)
    return out


def build_record(result: CaseResult, *, suite: str, device: dict[str, Any], git: str | None,
                 ceil: Any = None, time: str | None = None, host: dict[str, Any] | None = None) -> dict[str, Any]:
    """One record for one case result (see the module docstring for the keys); ``host``: the
    :func:`warpforge.results.host.check_host` state the case was timed under."""
    case = result.case
    if result.ours.error is not None or result.ours.timing is None:
        ours: dict[str, Any] = {"error": result.ours.error or "not timed"}
        correct = {"rel_err": None, "ok": False, "note": "ours failed to run"}
    else:
        ours = _timed(result.ours.timing, case.figure(result.ours.timing.median_ms), case.metric,
                      result.ours.rounds_ms)
        correct = correct_entry(result.ours.correct)
    timings = [o.timing for o in [result.ours, *result.peers.values()] if o.timing is not None]
    figure_errors: list[str] = []
    try:
        roof = roofline_for(result, ceil)
    except ValueError as e:  # CeilingError: a fraction above 1.0
        roof = None
        figure_errors.append(str(e))
    rec: dict[str, Any] = {
        "suite": suite, "case": case.name, "params": case.params, "device": device, "git": git,
        "time": time or now_iso(),
        "ours": ours,
        "peers": {name: _peer(o, result) for name, o in result.peers.items()},
        "ratio": {},
        "roofline": roof,
        "correct": correct,
        "metric": case.metric,
        "work": {"flops": case.flops, "bytes": case.bytes, "dtype": str(case.dtype).removeprefix("torch.")},
        "seed": result.seed,
        "timing": {"method": timings[0].method if timings else None, "warmup": result.warmup, "rep": result.rep,
                   "interleaved": result.interleaved},
    }
    ours_side = entry_side(ours, correct)
    for name, entry in rec["peers"].items():
        put_ratio(rec, name, same_work_ratio(ours_side, entry_side(entry, entry.get("correct"))))
    if result.stability is not None:
        rec["stability"] = result.stability
    return finish_record(rec, host, figure_errors)
