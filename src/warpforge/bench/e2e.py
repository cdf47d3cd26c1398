"""End-to-end cases (``EndToEndCase``): whole runs timed by wall clock, turned into records.

Order of work for a case: ours runs (it loads, warms up, returns ``rep`` timed runs, frees), then each
peer; a callable that raises is recorded as an error and the rest go on. Correctness is checked in the
same run on the outputs of the first timed run (``case.check``). The record keeps the kernel cases'
keys (ours / peers / ratio / roofline / correct) and adds per-callable figures: ``tokens``,
``mbu`` (bytes the run read / wall time / the HBM read bandwidth), ``mfu`` (flops / wall time / the
compute ceiling of ``case.dtype``), and whatever the run reports (``ttft_ms``, ``peak_mem_GB``, ...).
Ratios come from ``results.ratio.same_work_ratio`` only: peer ms / ours ms when both ran the same work
(the same ``Run.ran`` and the same output tokens) and both passed their check; for "tok/s" that is ours /
peer, so above 1 still means ours is better (docs/design.md). Otherwise the ratio is null and ``ratio_null``
says why, and a peer that ran other work carries ``ran`` (ours too). A peer is the baseline
(``correct.ok`` by definition) unless its runs carry their own check in ``Run.extra["correct"]``;
``case.timing`` replaces the record's wall-clock timing note when the callables measure ``Run.ms`` another
way (e.g. the bench harness, interleaved).

Each run is a round: the runs' spread (max / min, p80 / p20) against ``warpforge.timing.NOISE_BOUND`` marks the
case noisy (whole runs are not re-timed here; a callable that re-times itself says so in
``Run.extra["attempts"]``). An mfu, mbu or roofline fraction above 1.0 is not stored: the record's
``figure_errors`` says which, and ``warpforge bench`` fails the run.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from warpforge.bench.compare import case_seed, error_line
from warpforge.results.ratio import Side, check_note, put_ratio, same_work_ratio
from warpforge.results.record import correct_entry, finish_record, finite_or_none, now_iso
from warpforge.bench.suite import EndToEndCase, Run
from warpforge.timing import NOISE_BOUND, spread_of, summarize

METHOD = "wall"  # device-synchronized perf_counter around each whole run (timed_wall)
T = TypeVar("T")


def mbu(bytes_read: float, ms: float, hbm_GBps: float) -> float:
    """Memory-bandwidth utilisation: bytes read over the time, as a fraction of the HBM bandwidth.

    For decode this is tokens/s x bytes read per token / bandwidth (the issue's definition).
    """
    if not (ms > 0 and hbm_GBps > 0):
        raise ValueError(f"mbu needs ms > 0 and hbm_GBps > 0, got {ms}, {hbm_GBps}")
    return bytes_read / (ms * 1e-3) / (hbm_GBps * 1e9)


def mfu(flops: float, ms: float, tflops: float) -> float:
    """Model-flops utilisation: flops over the time, as a fraction of the compute ceiling."""
    if not (ms > 0 and tflops > 0):
        raise ValueError(f"mfu needs ms > 0 and tflops > 0, got {ms}, {tflops}")
    return flops / (ms * 1e-3) / (tflops * 1e12)



# ---- what the callables time a run with -------------------------------------------------------------------

def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_wall(device: torch.device, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and its wall time in ms, the device synchronized on both sides so its queued work counts; the
    device's peak memory counts from the start of the call (:func:`peak_allocated_gb`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, (time.perf_counter() - t0) * 1e3


def peak_allocated_gb(device: torch.device) -> float | None:
    """The most device memory allocated since the last :func:`timed_wall`, in GB; None on the CPU."""
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def release_memory(device: torch.device) -> None:
    """Collect what a finished callable dropped and return its cached blocks, so the next one loads into a clean
    device (call after the last reference to the model is gone)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "bf16")


def _median_run(runs: list[Run], median_ms: float) -> Run:
    return min(runs, key=lambda r: abs(r.ms - median_ms))


def _utilisation(what: str, value: float, ceil: Any, errors: list[str] | None) -> float | None:
    """value when it is a finite fraction <= 1; above 1 it is a bug (a ceiling or a work count): noted
    in ``errors`` and not stored."""
    from warpforge.hw.roofline import CeilingError, check_fraction

    v = finite_or_none(value)
    if v is None:
        return None
    try:
        return check_fraction(v, what, getattr(ceil, "source", None) or "the device's ceilings")
    except CeilingError as e:
        if errors is not None:
            errors.append(str(e))
        return None


def _timed(case: EndToEndCase, runs: list[Run], ceil: Any, errors: list[str] | None = None,
           who: str = "ours") -> dict[str, Any]:
    if not runs:
        raise ValueError("a run callable returned no runs")
    for r in runs:
        if not isinstance(r, Run) or not (math.isfinite(r.ms) and r.ms > 0) or r.tokens < 0:
            raise ValueError(f"bad run {r!r}: expected a Run with ms > 0 and tokens >= 0")
    t = summarize([r.ms for r in runs], METHOD)
    mid = _median_run(runs, t.median_ms)
    out: dict[str, Any] = {"ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, "iqr_ms": t.iqr_ms,
                           case.metric: case.figure(t.median_ms, mid.tokens), "tokens": mid.tokens,
                           "mbu": None, "mfu": None}
    if len(runs) >= 2:
        out["rounds_ms"] = [r.ms for r in runs]
    if ceil is not None and mid.work:
        wall = mid.extra.get("wall_ms") or mid.ms  # utilisation over the whole run, even when ms is a TTFT
        if mid.work.get("bytes"):
            out["mbu"] = _utilisation(f"{who} mbu", mbu(mid.work["bytes"], wall, ceil.hbm_GBps), ceil, errors)
        peak = ceil.tflops.get(_dtype_key(case.dtype))
        if mid.work.get("flops") and peak:
            out["mfu"] = _utilisation(f"{who} mfu", mfu(mid.work["flops"], wall, peak), ceil, errors)
    for k, v in mid.extra.items():
        out[k] = finite_or_none(v) if isinstance(v, float) else v
    return out


def _roofline(case: EndToEndCase, runs: list[Run], median_ms: float, ceil: Any,
              errors: list[str] | None = None) -> dict[str, Any] | None:
    mid = _median_run(runs, median_ms)
    if ceil is None or not mid.work or case.metric != "tok/s":
        return None
    try:
        from warpforge.hw.roofline import CeilingError, roofline

        r = roofline(mid.work.get("flops", 0.0), mid.work.get("bytes", 0.0), case.dtype, mid.ms, ceil, strict=True)
    except CeilingError as e:  # a fraction above 1.0: reported as a bug, never stored
        if errors is not None:
            errors.append(str(e))
        return None
    except Exception:  # noqa: BLE001 - unknown ceiling: null, never a guess
        return None
    out = {k: r[k] for k in ("floor_ms", "fraction", "bound", "compute_ms", "memory_ms") if k in r}
    if not all(isinstance(out.get(k), (int, float)) and math.isfinite(out[k]) for k in ("floor_ms", "fraction")):
        return None
    out["ceilings"] = getattr(ceil, "source", None)
    return out


def stability(entries: dict[str, dict[str, Any]], attempts: int = 1, bound: float = NOISE_BOUND) -> dict[str, Any]:
    """The record's ``stability`` block from each timed entry's runs (``rounds_ms``): noisy when any
    callable's runs spread beyond ``bound``; with one run each there is no spread to judge."""
    spread: dict[str, Any] = {}
    noisy = False
    for name, e in entries.items():
        rounds = e.get("rounds_ms")
        if "error" in e or not rounds:
            continue
        sp, _ = spread_of(rounds, len(rounds))
        spread[name] = sp.as_dict()
        noisy = noisy or not sp.within(bound)
    out: dict[str, Any] = {"bound": bound, "rounds": max((len(e.get("rounds_ms") or [1]) for e in entries.values()
                                                          if "error" not in e), default=0),
                           "attempts": attempts, "noisy": noisy, "spread": spread}
    if not spread:
        out["note"] = "one run per callable: no spread measured"
    return out


def _check(case: EndToEndCase, ours: Any, peer: Any, against: str) -> dict[str, Any]:
    try:
        c = dict(case.check(ours, peer))
    except Exception as e:  # noqa: BLE001 - a failing check is a failed check, not a crashed run
        return {"rel_err": None, "ok": False, "note": f"check failed: {error_line(e)}"}
    extra = {k: v for k, v in c.items() if k not in ("rel_err", "tol", "ok", "against")}
    # A case checked without a peer names what its check compared with ("completion", a peer run inside the
    # session); "self" is never a verdict's reference.
    out = correct_entry({"rel_err": c.get("rel_err"), "tol": c.get("tol"), "ok": bool(c.get("ok")),
                    "against": c.get("against") or against})
    return {**out, **extra}


def meets_target(target: dict[str, Any] | None, ours: dict[str, Any], ratio: dict[str, float]) -> dict[str, Any]:
    """Each numeric bar of the target against what was measured: True/False, or None when the figure is
    unknown (no ceilings on this device, a peer that failed). Non-numeric entries (notes) are skipped."""
    out: dict[str, Any] = {}
    for key, bar in (target or {}).items():
        if key == "ratio" and isinstance(bar, dict):
            for peer, r in bar.items():
                out[f"ratio.{peer}"] = None if peer not in ratio else ratio[peer] >= r
        elif key in ("mbu", "mfu", "tok/s") and isinstance(bar, (int, float)):
            got = ours.get(key)
            out[key] = None if not isinstance(got, (int, float)) else got >= bar
        elif key == "completes" and bar is True:
            out[key] = "error" not in ours
        elif key == "max_ms" and isinstance(bar, (int, float)):  # lower-is-better cases: an upper bound on ms
            got = ours.get("ms")
            out[key] = None if not isinstance(got, (int, float)) else got <= bar
        elif key == "max" and isinstance(bar, dict):  # upper bounds on other figures of ours, e.g. a p99
            for name, b in bar.items():
                got = ours.get(name)
                out[f"max.{name}"] = None if not isinstance(got, (int, float)) else got <= b
    return out


# The peer ours is checked against: the reference of the check, not a passed check of its own (tables show
# "baseline"); ok stays True so that a ratio against it can be formed.
BASELINE = {"rel_err": None, "tol": None, "ok": True, "against": "baseline", "note": "the peer is the baseline"}


def _peer_correct(own: Any) -> dict[str, Any]:
    """A peer's correctness: the check its run reported (``Run.extra["correct"]``), else the baseline's."""
    if not isinstance(own, dict):
        return dict(BASELINE)
    extra = {k: v for k, v in own.items() if k not in ("rel_err", "tol", "ok", "against")}
    return {**correct_entry({"rel_err": own.get("rel_err"), "tol": own.get("tol"), "ok": bool(own.get("ok")),
                        "against": own.get("against", "reference")}), **extra}


def run_end_to_end(case: EndToEndCase, *, suite: str, device: torch.device, env_device: dict[str, Any],
                   git: str | None, ceil: Any = None, host: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ours and every peer, check, and return the case's validated record."""
    results: dict[str, list[Run] | str] = {}
    broken: str | None = None  # a sticky CUDA error: every later CUDA call on this context fails too
    for name, fn in [("ours", case.ours), *case.peers.items()]:
        if broken is not None:
            results[name] = f"not run: {broken}"
            continue
        try:
            results[name] = list(fn(device, case.rep))
            _timed(case, results[name], None)  # shape check before anything is recorded
        except Exception as e:  # noqa: BLE001 - a failure of a callable is data for the record
            results[name] = error_line(e)
            # where it failed goes to stderr (the record keeps the message): a kernel fault needs the frames
            print(f"{case.name}: {name} failed:\n{traceback.format_exc(limit=-12)}", file=sys.stderr)
        if device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a kernel faulted: record what ran, skip what cannot
                broken = f"the CUDA context failed after {name!r} ran ({error_line(e)})"
                if not isinstance(results[name], str):
                    results[name] = broken
    ours_runs = results["ours"]
    errors: list[str] = []
    if isinstance(ours_runs, str):
        ours: dict[str, Any] = {"error": ours_runs}
        correct = {"rel_err": None, "ok": False, "note": "ours failed to run"}
    else:
        ours = _timed(case, ours_runs, ceil, errors)
        if case.check_against is None:
            correct = _check(case, ours_runs[0].output, None, "unnamed")
        elif isinstance(results[case.check_against], str):
            correct = {"rel_err": None, "ok": False, "note": f"peer {case.check_against!r} failed: nothing to check "
                                                             "against"}
        else:
            correct = _check(case, ours_runs[0].output, results[case.check_against][0].output,  # type: ignore[index]
                             f"peer:{case.check_against}")
    ours_ran = None if isinstance(ours_runs, str) else _median_run(ours_runs, ours["ms"]).ran
    ours_side = _side(ours, correct, ours_ran)
    peers: dict[str, Any] = {}
    ran: dict[str, Any] = {}
    rec: dict[str, Any] = {"ratio": {}}
    for name in case.peers:
        got = results[name]
        if isinstance(got, str):
            peers[name] = {"error": got}
            put_ratio(rec, name, same_work_ratio(ours_side, Side(error=got)))
            continue
        timed = _timed(case, got, ceil, errors, who=name)
        timed["correct"] = _peer_correct(timed.pop("correct", None))
        peers[name] = timed
        ran[name] = _median_run(got, timed["ms"]).ran
        put_ratio(rec, name, same_work_ratio(ours_side, _side(timed, timed["correct"], ran[name])))
    if any(r != ours_ran for r in ran.values()):  # what each ran, beside ours, where any differs
        for name, r in [("ours", ours_ran), *ran.items()]:
            entry = ours if name == "ours" else peers[name]
            if "error" not in entry:
                entry["ran"] = r if r is not None else "the case's workload"
    ratio = rec["ratio"]
    runs_all = [r for v in results.values() if not isinstance(v, str) for r in v]
    attempts = max((int(r.extra.get("attempts", 1)) for r in runs_all), default=1)
    roof = None if isinstance(ours_runs, str) else _roofline(case, ours_runs, ours["ms"], ceil, errors)
    rec = {
        "suite": suite, "case": case.name, "params": case.params, "device": env_device, "git": git,
        "time": now_iso(), "ours": ours, "peers": peers, "ratio": ratio,
        **{k: rec[k] for k in ("ratio_null", "ratio_interval") if k in rec},
        "roofline": roof,
        "correct": correct, "metric": case.metric, "baseline": case.baseline, "target": case.target,
        "meets": meets_target(case.target, ours, ratio),
        "work": {"dtype": str(case.dtype).removeprefix("torch."),
                 **({} if isinstance(ours_runs, str) else _median_run(ours_runs, ours["ms"]).work)},
        "seed": case_seed(suite, case.name),
        "timing": case.timing or {"method": METHOD, "warmup": 1, "rep": case.rep, "interleaved": False},
        "stability": stability({"ours": ours, **peers}, attempts),
    }
    return finish_record(rec, host, errors)


def _side(entry: dict[str, Any], correct: dict[str, Any], ran: Any) -> Side:
    """An end-to-end entry as the ratio rule sees it: its time, its check, what it ran, its tokens."""
    if "error" in entry:
        return Side(error=entry["error"])
    ok = correct.get("ok")
    return Side(ms=entry["ms"], ok=ok if isinstance(ok, bool) else None, ran=ran,
                rounds_ms=tuple(entry.get("rounds_ms") or ()), check=check_note(correct), tokens=entry.get("tokens"))
