"""Benchmark records in DESIGN.md's format: build, validate, read and write JSON lines.

A record (one per case) carries the keys DESIGN.md shows, plus a few that make it self-describing:
``metric``, ``work`` (the explicit flop and byte counts), ``seed`` (the per-case input draw) and
``timing`` (method, warm-up, repeats). Non-finite numbers never enter a record: a NaN/Inf output
gives ``rel_err: null`` with ``ok: false``, so every record is strict JSON.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warpforge import settings

if TYPE_CHECKING:  # torch stays unimported for `warpforge results`, which only reads and validates
    import torch

    from warpforge.bench.compare import CaseResult, Outcome
    from warpforge.bench.timing import Timing

REQUIRED = ("suite", "case", "params", "device", "git", "time", "ours", "peers", "ratio", "roofline", "correct")
BOUNDS = ("compute", "memory")


class RecordError(ValueError):
    """A record that does not follow the schema; the message lists every problem found."""


# ---- environment: device, git, time --------------------------------------------------------------

def _driver_version() -> str | None:
    # /proc is instant; nvidia-smi is the fallback where /proc/driver is not mounted (containers).
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        for tok in text.split():
            if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
                return tok
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def knobs() -> dict[str, str]:
    """The settings set in the environment that change what runs (e.g. WARPFORGE_AUTOTUNE=0): a record says
    which ones it ran under (:func:`warpforge.settings.knobs`)."""
    return settings.knobs()


def device_info(device: torch.device) -> dict[str, Any]:
    """What ran the case (with ``knobs`` when a setting that changes what runs is set). On CPU ``name`` is "cpu": the
    figures are then the torch reference path's."""
    import torch

    base = {"torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda}
    if knobs():
        base["knobs"] = knobs()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "driver": _driver_version(), **base, "sms": props.multi_processor_count,
                "cc": f"{props.major}.{props.minor}"}
    return {"name": "cpu", "driver": None, **base, "sms": None, "model": _cpu_model(),
            "threads": torch.get_num_threads()}


@functools.lru_cache(maxsize=1)
def git_version() -> str | None:
    """HEAD of the checkout warpforge is imported from, "-dirty" if tracked files changed; None if none.

    ``WARPFORGE_GIT`` names the revision where the code runs from a copy without .git (a GPU box
    that received the working tree).
    """
    if settings.current().git:
        return settings.current().git
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + "-dirty" if dirty else sha) if sha else None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---- building ------------------------------------------------------------------------------------

def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _timed(t: Timing, figure: float, metric: str) -> dict[str, Any]:
    return {"ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms, "iqr_ms": t.iqr_ms, metric: figure}


def _correct(c: dict[str, Any] | None) -> dict[str, Any]:
    if c is None:
        return {"rel_err": None, "ok": False, "note": "no reference or peer output to check against"}
    out = {"rel_err": _finite(c["rel_err"]), "tol": c.get("tol"), "ok": bool(c["ok"]), "against": c["against"]}
    if out["rel_err"] is None:
        out["ok"], out["note"] = False, "non-finite output"
    return out


def _peer(o: Outcome, result: CaseResult) -> dict[str, Any]:
    if o.error is not None or o.timing is None:
        return {"error": o.error or "not timed"}
    return {**_timed(o.timing, result.case.figure(o.timing.median_ms), result.case.metric),
            "correct": _correct(o.correct)}


def roofline_for(result: CaseResult, ceil: Any) -> dict[str, Any] | None:
    """Floor over measured time against the device's ceilings; None when either is unknown."""
    if ceil is None or result.ours.timing is None:
        return None
    try:
        from warpforge.hw.roofline import roofline

        r = roofline(result.case.flops, result.case.bytes, result.case.dtype, result.ours.timing.median_ms, ceil)
    except Exception:  # noqa: BLE001 - an unknown ceiling for this dtype: record null, never a guess
        return None
    keys = ("floor_ms", "fraction", "bound", "compute_ms", "memory_ms")
    out = {k: r[k] for k in keys if k in r}
    if not all(isinstance(out.get(k), (int, float)) and math.isfinite(out[k]) for k in ("floor_ms", "fraction")):
        return None
    out["ceilings"] = getattr(ceil, "source", None)
    return out


def build_record(result: CaseResult, *, suite: str, device: dict[str, Any], git: str | None,
                 ceil: Any = None, time: str | None = None) -> dict[str, Any]:
    """One record for one case result (see the module docstring for the keys)."""
    case = result.case
    if result.ours.error is not None or result.ours.timing is None:
        ours: dict[str, Any] = {"error": result.ours.error or "not timed"}
        correct = {"rel_err": None, "ok": False, "note": "ours failed to run"}
    else:
        ours = _timed(result.ours.timing, case.figure(result.ours.timing.median_ms), case.metric)
        correct = _correct(result.ours.correct)
    timings = [o.timing for o in [result.ours, *result.peers.values()] if o.timing is not None]
    rec = {
        "suite": suite, "case": case.name, "params": case.params, "device": device, "git": git,
        "time": time or now_iso(),
        "ours": ours,
        "peers": {name: _peer(o, result) for name, o in result.peers.items()},
        "ratio": result.ratio,
        "roofline": roofline_for(result, ceil),
        "correct": correct,
        "metric": case.metric,
        "work": {"flops": case.flops, "bytes": case.bytes, "dtype": str(case.dtype).removeprefix("torch.")},
        "seed": result.seed,
        "timing": {"method": timings[0].method if timings else None, "warmup": result.warmup, "rep": result.rep,
                   "interleaved": result.interleaved},
    }
    validate_record(rec)
    return rec


# ---- validation ----------------------------------------------------------------------------------

def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_timed(d: Any, where: str, metric: str | None, problems: list[str]) -> None:
    if not isinstance(d, dict):
        problems.append(f"{where}: expected an object, got {type(d).__name__}")
        return
    if "error" in d:
        if not isinstance(d["error"], str):
            problems.append(f"{where}.error: expected a string")
        return
    bad = [k for k in ("ms", "p20_ms", "p80_ms", "iqr_ms") if not _num(d.get(k)) or d[k] < 0]
    problems.extend(f"{where}.{k}: expected a finite number >= 0, got {d.get(k)!r}" for k in bad)
    if not bad and not d["p20_ms"] <= d["ms"] <= d["p80_ms"]:
        problems.append(f"{where}: expected p20_ms <= ms <= p80_ms")
    if metric is not None and not _num(d.get(metric)):
        problems.append(f"{where}.{metric}: expected a finite number (the hardware figure)")


def _check_correct(c: Any, where: str, problems: list[str]) -> None:
    if not isinstance(c, dict) or not isinstance(c.get("ok"), bool):
        problems.append(f"{where}: expected an object with a boolean 'ok'")
    elif c.get("rel_err") is not None and (not _num(c["rel_err"]) or c["rel_err"] < 0):
        problems.append(f"{where}.rel_err: expected null or a finite number >= 0")
    elif c.get("rel_err") is None and c["ok"]:
        problems.append(f"{where}: ok is true without a rel_err")


def validate_record(d: Any) -> None:
    """Raise RecordError listing every way ``d`` departs from the record schema."""
    if not isinstance(d, dict):
        raise RecordError(f"a record is a JSON object, got {type(d).__name__}")
    problems = [f"missing key {k!r}" for k in REQUIRED if k not in d]
    if problems:
        raise RecordError("; ".join(problems))
    for k in ("suite", "case", "time"):
        if not isinstance(d[k], str) or not d[k]:
            problems.append(f"{k}: expected a non-empty string")
    try:
        datetime.fromisoformat(d["time"])
    except (TypeError, ValueError):
        problems.append(f"time: expected ISO 8601, got {d['time']!r}")
    if not isinstance(d["params"], dict):
        problems.append("params: expected an object")
    dev = d["device"]
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or "torch" not in dev:
        problems.append("device: expected an object with 'name' and 'torch'")
    if d["git"] is not None and not isinstance(d["git"], str):
        problems.append("git: expected a string or null")
    metric = d.get("metric")
    _check_timed(d["ours"], "ours", metric, problems)
    peers = d["peers"]
    if not isinstance(peers, dict):
        problems.append("peers: expected an object")
        peers = {}
    for name, p in peers.items():
        _check_timed(p, f"peers.{name}", metric, problems)
        if isinstance(p, dict) and "error" not in p:
            _check_correct(p.get("correct"), f"peers.{name}.correct", problems)
    ratio = d["ratio"]
    if not isinstance(ratio, dict):
        problems.append("ratio: expected an object")
    else:
        for name, r in ratio.items():
            if not _num(r) or r <= 0:
                problems.append(f"ratio.{name}: expected a positive number, got {r!r}")
            if name not in peers or "error" in peers[name]:
                problems.append(f"ratio.{name}: no timed peer of that name")
        if isinstance(d["ours"], dict) and "error" in d["ours"] and ratio:
            problems.append("ratio: must be empty when ours failed")
    roof = d["roofline"]
    if roof is not None:
        if not isinstance(roof, dict) or not _num(roof.get("floor_ms")) or not _num(roof.get("fraction")):
            problems.append("roofline: expected null or an object with finite floor_ms and fraction")
        elif roof.get("bound") not in BOUNDS:
            problems.append(f"roofline.bound: expected one of {BOUNDS}, got {roof.get('bound')!r}")
    _check_correct(d["correct"], "correct", problems)
    if isinstance(d["ours"], dict) and "error" in d["ours"] and isinstance(d["correct"], dict) and d["correct"].get("ok"):
        problems.append("correct.ok: cannot be true when ours failed")
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        problems.append(f"not strict JSON: {e}")
    if problems:
        raise RecordError(f"record {d.get('suite')!r}/{d.get('case')!r}: " + "; ".join(problems))


# ---- JSON lines ----------------------------------------------------------------------------------

def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=False, separators=(", ", ": "))


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]], *, append: bool = False) -> int:
    """Write (or append) records, one JSON object per line; each is validated first. Returns the count."""
    records = list(records)
    for r in records:
        validate_record(r)
    p = Path(path)
    if p.parent != Path("."):
        p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a" if append else "w", encoding="utf-8") as f:
        for r in records:
            f.write(dumps(r) + "\n")
    return len(records)


def read_jsonl(path: str | os.PathLike, *, validate: bool = True) -> list[dict[str, Any]]:
    """Records from a JSON-lines file; a bad line raises RecordError naming the file and line."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if validate:
                    validate_record(rec)
            except (json.JSONDecodeError, RecordError) as e:
                raise RecordError(f"{path}:{i}: {e}") from None
            out.append(rec)
    return out
