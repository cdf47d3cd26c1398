#!/usr/bin/env python
"""Mark the committed records that break the rules for a figure; delete nothing.

Records measured before the rules were enforced (docs/design.md, "Rules for a figure") can hold a ratio against a
peer that failed its own check or ran other work, a peer with neither a ratio nor a reason, a roofline
fraction or an mfu/mbu above 1.0, or (profile lines) a negative profiler overhead. For each, this script:

* moves the figure out of the live field into ``withdrawn["<field>"] = {"value": <old>, "why": <reason>}``,
  so a table, the history and the gate never show it as a result, while the measured value stays on record;
* gives every peer without a ratio its reason in ``ratio_null`` (the ratio rule's own words);
* sets a target verdict that rested on a withdrawn ratio (``meets["ratio.<peer>"]``) to null, keeping the old
  verdict in ``withdrawn`` too.

It rewrites each file in place (one JSON object per line, keys in their order) and prints what it marked.
Idempotent: a second run marks nothing. Usage: ``python benchmarks/mark_rule_breaks.py [FILE_OR_DIR ...]``
(default benchmarks/results/h200).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from warpforge.bench.ratio import FRACTION_MAX, RATIO_RTOL, entry_side, put_ratio, same_work_ratio

ROOT = Path(__file__).resolve().parents[1]
# What is known of why a figure broke a rule (benchmarks/NOTES.md, 2026-12-05), by (suite, field).
CAUSES = {
    ("kernels", "roofline"): "the compute ceiling was the probed cuBLAS rate, below what ran; the ceiling is now "
                             "the larger of the datasheet's dense peak and the probe",
    ("llm", "ours.mfu"): "the flop count included prefix-cached prompt tokens, which are not computed",
}


def _withdraw(rec: dict[str, Any], where: str, value: Any, why: str) -> None:
    rec.setdefault("withdrawn", {})[where] = {"value": value, "why": why}


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def mark_bench(rec: dict[str, Any]) -> list[str]:
    """Mark one bench record in place; returns what was marked (empty: nothing broke a rule)."""
    done: list[str] = []
    ours, peers = rec.get("ours"), rec.get("peers") or {}
    if not isinstance(ours, dict):
        return done
    ours_side = entry_side(ours, rec.get("correct"))
    ratio = rec.setdefault("ratio", {})
    for name, p in peers.items():
        if not isinstance(p, dict):
            continue
        want = same_work_ratio(ours_side, entry_side(p, p.get("correct")))
        have = ratio.get(name)
        if have is not None:
            if want.value is not None and math.isclose(have, want.value, rel_tol=RATIO_RTOL):
                continue
            why = want.why or f"{have:.6g} is not peer ms / ours ms ({want.value:.6g})"
            _withdraw(rec, f"ratio.{name}", have, why)
            del ratio[name]
            (rec.get("ratio_interval") or {}).pop(name, None)
            meets = rec.get("meets")
            if isinstance(meets, dict) and meets.get(f"ratio.{name}") is not None:
                _withdraw(rec, f"meets.ratio.{name}", meets[f"ratio.{name}"], "rested on the withdrawn ratio")
                meets[f"ratio.{name}"] = None
            done.append(f"ratio.{name} {have:.4g} withdrawn: {why}")
        elif name in (rec.get("ratio_null") or {}):
            continue
        if want.value is not None:  # the stored times give a valid ratio: the rule's own value replaces it
            put_ratio(rec, name, want)
            done.append(f"ratio.{name} = {want.value:.4g} from the stored times")
        else:
            rec.setdefault("ratio_null", {})[name] = want.why or "no ratio"
            if have is None:
                done.append(f"peers.{name}: no ratio and no reason; ratio_null: {want.why}")
    if rec.get("ratio_interval") == {}:
        del rec["ratio_interval"]
    roof = rec.get("roofline")
    if isinstance(roof, dict) and _num(roof.get("fraction")) and roof["fraction"] > FRACTION_MAX:
        cause = CAUSES.get((rec.get("suite"), "roofline"), "a bug in a ceiling or a work count")
        why = f"fraction {roof['fraction']:.4g} > 1: {cause}; not a result"
        _withdraw(rec, "roofline", roof, why)
        rec["roofline"] = None
        done.append(f"roofline withdrawn: {why}")
    for where, e in [("ours", ours), *((f"peers.{n}", p) for n, p in peers.items())]:
        for k in ("mfu", "mbu"):
            v = e.get(k) if isinstance(e, dict) else None
            if _num(v) and v > FRACTION_MAX:
                cause = CAUSES.get((rec.get("suite"), f"{where}.{k}"), "a bug in a ceiling or a work count")
                why = f"{v:.4g} > 1: {cause}; not a result"
                _withdraw(rec, f"{where}.{k}", v, why)
                e[k] = None
                done.append(f"{where}.{k} withdrawn: {why}")
    return done


def mark_profile(rec: dict[str, Any]) -> list[str]:
    """A profile agreement line: a negative profiler overhead is below the noise, never a figure."""
    prof = rec.get("profiler")
    if isinstance(prof, dict) and _num(prof.get("overhead")) and prof["overhead"] < 0:
        why = "below the noise: the profiled window ran faster than the plain runs"
        _withdraw(rec, "profiler.overhead", prof["overhead"], why)
        prof["overhead"] = None
        return [f"profiler.overhead withdrawn: {why}"]
    return []


def mark_file(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, report = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            out.append(line)
            continue
        rec = json.loads(line)
        done = mark_bench(rec) if "ours" in rec else mark_profile(rec) if rec.get("suite") == "profile" else []
        report += [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{i} "
                   f"{rec.get('case')!r} (git {rec.get('git')}): {d}" for d in done]
        out.append(json.dumps(rec, allow_nan=False, separators=(", ", ": ")) if done else line)
    if report:
        path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return report


def main(argv: list[str]) -> int:
    targets = [Path(a) for a in argv] or [ROOT / "benchmarks" / "results" / "h200"]
    files = [f for t in targets for f in (sorted(t.glob("*.jsonl")) if t.is_dir() else [t])]
    report = [line for f in files for line in mark_file(f)]
    print("\n".join(report) if report else "nothing to mark")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
