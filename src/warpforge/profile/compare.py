"""``warpforge profile --compare A.json B.json``: what moved between two profiles.

Operators are matched by (module, op), kernels by their full name, the time split field by field.
``ratio`` is B's time over A's (below 1: B is faster); the ``change`` labels say it in words ("B 1.09x
faster", "removed in B", "added in B"). A single profile carries no run-to-run spread, so changes under
``NOISE`` (3%) are marked as within noise rather than claimed. Profiles of different targets are
compared all the same (matched by name), with a warning first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NOISE = 0.03
SPLIT_KEYS = ("window_us", "busy_us", "compute_us", "memory_us", "comm_us", "idle_us", "idle_host_us",
              "idle_launch_us", "kernels", "short_kernels")


def load(p: Any) -> dict[str, Any]:
    """A profile dict from a report.json (or an older profile.json) or the --out directory holding it, a
    Profile, or a dict already loaded."""
    if isinstance(p, dict):
        d = p
    elif hasattr(p, "as_dict"):
        d = p.as_dict()
    else:
        path = Path(p)
        if path.is_dir():
            found = (path / n for n in ("report.json", "profile.json") if (path / n).is_file())
            path = next(found, path / "report.json")
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such profile (expected the report.json warpforge profile writes)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("tool") != "warpforge.profile":
        raise ValueError(f"{p}: not a warpforge profile (no tool: warpforge.profile)")
    return d


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None and a > 0 else None


def _change(a: float | None, b: float | None) -> str:
    """B against A in words: "B 1.09x faster" (A's time over B's), "B 1.30x slower", "removed in B", "added in B"."""
    if not a or not b:
        return "added in B" if b else ("removed in B" if a else "—")
    r = _ratio(a, b)
    if abs(r - 1) < NOISE:
        return "within noise"
    return f"B {1 / r:.2f}x faster" if r < 1 else f"B {r:.2f}x slower"


def _rows(a: list[dict], b: list[dict], key) -> list[dict[str, Any]]:
    ia = {key(r): r for r in a}
    ib = {key(r): r for r in b}
    out = []
    for k in list(ia) + [k for k in ib if k not in ia]:
        ra, rb = ia.get(k), ib.get(k)
        ta = ra["time_us"] if ra else 0.0
        tb = rb["time_us"] if rb else 0.0
        out.append({"name": (rb or ra)["name"], "a_us": ta, "b_us": tb, "delta_us": tb - ta, "ratio": _ratio(ta, tb),
                    "change": _change(ta, tb), "a_fraction": ra.get("fraction") if ra else None,
                    "b_fraction": rb.get("fraction") if rb else None})
    return sorted(out, key=lambda r: -abs(r["delta_us"]))


def compare(a: Any, b: Any, *, top: int = 15) -> dict[str, Any]:
    """What moved from profile ``a`` to profile ``b`` (paths, dicts or Profiles)."""
    da, db = load(a), load(b)
    wa, wb = da["timing"]["window_ms"], db["timing"]["window_ms"]
    split = {}
    for k in SPLIT_KEYS:
        va, vb = da["split"].get(k), db["split"].get(k)
        if va is not None or vb is not None:
            split[k] = {"a": va, "b": vb, "ratio": _ratio(va, vb), "change": _change(va, vb)}
    ops = _rows(da["ops"], db["ops"], key=lambda r: (r.get("module"), r["op"]))
    kernels = _rows(da.get("kernels", []), db.get("kernels", []), key=lambda r: r["op"])
    fa = {f["kind"] for f in da.get("findings", []) if f.get("severity", 0) > 0}
    fb = {f["kind"] for f in db.get("findings", []) if f.get("severity", 0) > 0}
    out = {
        "a": {"target": da.get("target"), "device": da["meta"].get("device"), "time": da["meta"].get("time"),
              "verdict": da.get("verdict")},
        "b": {"target": db.get("target"), "device": db["meta"].get("device"), "time": db["meta"].get("time"),
              "verdict": db.get("verdict")},
        "window": {"a_ms": wa, "b_ms": wb, "ratio": _ratio(wa, wb), "change": _change(wa, wb)},
        "split": split, "ops": ops[:top], "kernels": kernels[:top],
        "findings": {"new": sorted(fb - fa), "gone": sorted(fa - fb)},
        "same_target": da.get("target") == db.get("target"),
    }
    out["summary"] = _summary(out, da, db)
    return out


def _summary(c: dict[str, Any], da: dict, db: dict) -> list[str]:
    w = c["window"]
    lines = []
    if da.get("target") != db.get("target"):
        lines.append(f"warning: A and B profile different targets ({da.get('target')} vs {db.get('target')}); "
                     "operators are matched by module and name only")
    lines.append(f"window: {w['a_ms']:.3f} ms -> {w['b_ms']:.3f} ms per iteration ({w['change']})")
    if da["meta"].get("device") != db["meta"].get("device"):
        lines.append(f"different devices: {da['meta'].get('device')} vs {db['meta'].get('device')}")
    if c["a"]["verdict"] != c["b"]["verdict"]:
        lines.append(f"verdict: {c['a']['verdict']} -> {c['b']['verdict']}")
    moved = [r for r in c["ops"] if r["change"] not in ("within noise", "—")][:3]
    for r in moved:
        lines.append(f"{r['name']}: {r['a_us']:.1f} -> {r['b_us']:.1f} us per iteration ({r['change']})")
    if c["findings"]["gone"]:
        lines.append("resolved: " + ", ".join(c["findings"]["gone"]))
    if c["findings"]["new"]:
        lines.append("new findings: " + ", ".join(c["findings"]["new"]))
    return lines
