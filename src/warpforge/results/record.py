"""Benchmark records in warpforge's record format (docs/design.md): validate, read and write JSON lines (the
harness builds them: ``bench.compare.build_record``, ``bench.e2e``).

A record (one per case) carries the keys docs/design.md shows, plus a few that make it self-describing:
``metric``, ``work`` (the explicit flop and byte counts), ``seed`` (the per-case input draw),
``timing`` (method, warm-up, repeats), ``stability`` (rounds, spreads, ``noisy``), ``host`` (the machine's
load when it was timed), per peer ``ran`` when it ran other work than ours, and ``withdrawn`` (a figure of
an older run that broke a rule below, moved out of its field: ``{"<field>": {"value": ..., "why": ...}}``).
Non-finite numbers never enter a record: a NaN/Inf output gives ``rel_err: null`` with ``ok: false``, so every
record is strict JSON.

**Ratios.** Every ratio in a record comes from ``results.ratio.same_work_ratio``: ``peer_ms / ours_ms`` when both ran
the same work and both passed their correctness check, else no ratio and the reason, in ``ratio_null``.
``ratio_interval`` gives the lowest and highest per-round ratio (rounds are paired: the same round of
ours and of the peer). :func:`figure_violations` lists what in a record breaks these rules (and a roofline
fraction or a utilisation above 1.0, which is a bug in a ceiling or a work count, never a result);
records built here are checked with it.
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
from typing import TYPE_CHECKING, Any, TypeGuard

from warpforge import settings
from warpforge.results.ratio import FRACTION_MAX, RATIO_RTOL, Side, entry_side, same_work_ratio

if TYPE_CHECKING:  # torch stays unimported for `warpforge results`, which only reads and validates
    import torch

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

    base: dict[str, Any] = {"torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda}
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


# ---- pieces of a record the harness builds ---------------------------------------------------------

def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def correct_entry(c: dict[str, Any] | None) -> dict[str, Any]:
    if c is None:
        return {"rel_err": None, "ok": False, "note": "no reference or peer output to check against"}
    out = {"rel_err": finite_or_none(c["rel_err"]), "tol": c.get("tol"), "ok": bool(c["ok"]), "against": c["against"]}
    if out["rel_err"] is None:
        out["ok"], out["note"] = False, "non-finite output"
    return out


def finish_record(rec: dict[str, Any], host: dict[str, Any] | None, figure_errors: list[str] | None
                  ) -> dict[str, Any]:
    """``rec`` with the host's state and the figures that failed, when there are any, checked (figures too)."""
    if host is not None:
        rec["host"] = host
    if figure_errors:
        rec["figure_errors"] = figure_errors
    validate_record(rec, figures=True)
    return rec


# ---- validation ----------------------------------------------------------------------------------

def _num(x: Any) -> TypeGuard[float]:
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
    elif c.get("rel_err") is None and c["ok"] and c.get("against") != BASELINE_AGAINST:
        problems.append(f"{where}: ok is true without a rel_err")


# The reference a baseline peer's output is: ours is checked against it, it is not checked itself.
BASELINE_AGAINST = "baseline"
# What a check must never be judged against: itself (a verdict that cannot fail).
SELF_AGAINST = "self"
# Labels of verdicts that say the run completed, not that its output is right: shown as such, never as "ok".
COMPLETION_AGAINST = "completion"


def check_violations(d: dict[str, Any]) -> list[str]:
    """What in a record breaks the rules for a check (docs/design.md, "Rules for a figure"): a tolerance of 1
    or more (a relative error that cannot exceed it), an "ok" judged against the record itself, and a peer
    judged against the same reference as ours more strictly than ours (unequal judging: a handicapped peer).
    A verdict withdrawn (``withdrawn["correct.ok"]``, ``withdrawn["peers.<name>.correct"]``) is not held
    against the record."""
    out: list[str] = []
    withdrawn = raw if isinstance(raw := d.get("withdrawn"), dict) else {}
    sides = [("correct", "correct.ok", d.get("correct"))]
    sides += [(f"peers.{n}.correct", f"peers.{n}.correct", p.get("correct")) for n, p in (d.get("peers") or {}).items()
              if isinstance(p, dict) and "error" not in p]
    for where, key, c in sides:
        if not isinstance(c, dict) or not c.get("ok") or key in withdrawn:
            continue
        tol = c.get("tol")
        if _num(tol) and tol >= 1.0:
            out.append(f"{where}: tol {tol:g} >= 1, a check that cannot fail")
        if c.get("against") == SELF_AGAINST:
            out.append(f"{where}: judged against itself")
    ours = raw if isinstance(raw := d.get("correct"), dict) else {}
    for n, p in (d.get("peers") or {}).items():
        c = p.get("correct") if isinstance(p, dict) else None
        if not isinstance(c, dict) or f"peers.{n}.correct" in withdrawn:
            continue
        if c.get("against") and c.get("against") == ours.get("against") and _num(c.get("tol")) \
                and _num(ours.get("tol")) and c["tol"] < ours["tol"] and not math.isclose(c["tol"], ours["tol"]):
            out.append(f"peers.{n}.correct: judged at tol {c['tol']:.4g} against {c['against']}, more strictly than "
                       f"ours at {ours['tol']:.4g}: unequal judging")
    return out


def _check_extras(d: dict[str, Any], peers: dict[str, Any], problems: list[str]) -> None:
    """The optional keys: ratio_null, ratio_interval, rounds_ms, ran, stability, host, figure_errors."""
    nulls = d.get("ratio_null", {})
    ratio = d["ratio"] if isinstance(d["ratio"], dict) else {}
    if not isinstance(nulls, dict) or not all(isinstance(v, str) and v for v in nulls.values()):
        problems.append("ratio_null: expected an object peer -> reason (a non-empty string)")
    else:
        problems.extend(f"ratio_null.{n}: no peer of that name" for n in nulls if n not in peers)
        problems.extend(f"ratio.{n}: also in ratio_null" for n in nulls if n in ratio)
    intervals = d.get("ratio_interval", {})
    if not isinstance(intervals, dict):
        problems.append("ratio_interval: expected an object")
        intervals = {}
    for n, iv in intervals.items():
        if not (isinstance(iv, list) and len(iv) == 2 and all(_num(x) and x > 0 for x in iv) and iv[0] <= iv[1]):
            problems.append(f"ratio_interval.{n}: expected [low, high] of positive numbers, low <= high")
        elif n not in ratio:
            problems.append(f"ratio_interval.{n}: no ratio of that name")
    for where, e in [("ours", d["ours"]), *((f"peers.{n}", p) for n, p in peers.items())]:
        if isinstance(e, dict) and "rounds_ms" in e:
            r = e["rounds_ms"]
            if not (isinstance(r, list) and r and all(_num(x) and x >= 0 for x in r)):
                problems.append(f"{where}.rounds_ms: expected a non-empty list of finite numbers >= 0")
    stab = d.get("stability")
    if stab is not None and not (isinstance(stab, dict) and isinstance(stab.get("noisy"), bool)
                                 and _num(stab.get("bound"))):
        problems.append("stability: expected an object with a boolean 'noisy' and a numeric 'bound'")
    host = d.get("host")
    if host is not None and not (isinstance(host, dict) and isinstance(host.get("busy"), bool)):
        problems.append("host: expected an object with a boolean 'busy'")
    errs = d.get("figure_errors")
    if errs is not None and not (isinstance(errs, list) and all(isinstance(x, str) and x for x in errs)):
        problems.append("figure_errors: expected a list of messages")
    gone = d.get("withdrawn")
    if gone is not None and not (isinstance(gone, dict) and all(
            isinstance(v, dict) and "value" in v and isinstance(v.get("why"), str) and v["why"]
            for v in gone.values())):
        problems.append("withdrawn: expected an object field -> {value, why} (why a non-empty string)")
    elif gone:
        problems.extend(f"ratio.{n}: also in withdrawn" for n in ratio if f"ratio.{n}" in gone)


def figure_violations(d: dict[str, Any]) -> list[str]:
    """What in a (schema-valid) record breaks the rules for a figure (docs/design.md, "Rules for a figure"):
    a ratio that :func:`same_work_ratio` would not give (a failed or unchecked side, different work, a
    value that is not peer ms / ours ms), a peer with neither a ratio nor a reason, a roofline fraction or
    an mfu/mbu above 1.0. Empty when the record is clean."""
    out: list[str] = []
    ours, peers, ratio = d["ours"], d["peers"], d["ratio"]
    nulls = raw if isinstance(raw := d.get("ratio_null"), dict) else {}
    ours_side = entry_side(ours, d["correct"]) if isinstance(ours, dict) else Side(error="malformed")
    for name, value in ratio.items():
        p = peers.get(name)
        if not isinstance(p, dict):
            continue  # the schema check reports it
        want = same_work_ratio(ours_side, entry_side(p, p.get("correct")))
        if want.value is None:
            out.append(f"ratio.{name}: {want.why}")
        elif _num(value) and not math.isclose(value, want.value, rel_tol=RATIO_RTOL):
            out.append(f"ratio.{name}: {value:.6g} is not peer ms / ours ms ({want.value:.6g})")
    out.extend(f"peers.{n}: neither a ratio nor a reason in ratio_null" for n in peers
               if n not in ratio and n not in nulls)
    roof = d.get("roofline")
    if isinstance(roof, dict) and _num(roof.get("fraction")) and roof["fraction"] > FRACTION_MAX:
        out.append(f"roofline.fraction: {roof['fraction']:.4g} > 1")
    for where, e in [("ours", ours), *((f"peers.{n}", p) for n, p in peers.items())]:
        for k in ("mfu", "mbu"):
            v = e.get(k) if isinstance(e, dict) else None
            if _num(v) and v > FRACTION_MAX:
                out.append(f"{where}.{k}: {v:.4g} > 1")
    return out


def validate_record(d: Any, *, figures: bool = False) -> None:
    """Raise RecordError listing every way ``d`` departs from the record schema; with ``figures`` also every
    rule for a figure it breaks (:func:`figure_violations`: what records built here are held to; stored
    records of older runs are read with the schema alone)."""
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
    if (isinstance(d["ours"], dict) and "error" in d["ours"] and isinstance(d["correct"], dict)
            and d["correct"].get("ok")):
        problems.append("correct.ok: cannot be true when ours failed")
    _check_extras(d, peers, problems)
    try:
        json.dumps(d, allow_nan=False)
    except (TypeError, ValueError) as e:
        problems.append(f"not strict JSON: {e}")
    if figures and not problems:
        problems.extend(figure_violations(d))
        problems.extend(check_violations(d))
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
