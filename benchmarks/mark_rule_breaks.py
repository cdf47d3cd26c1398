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

from warpforge.results.ratio import FRACTION_MAX, RATIO_RTOL, entry_side, put_ratio, same_work_ratio

ROOT = Path(__file__).resolve().parents[1]
# What is known of why a figure broke a rule (benchmarks/notes/harness.md, 2026-12-05), by (suite, field).
CAUSES = {
    ("kernels", "roofline"): "the compute ceiling was the probed cuBLAS rate, below what ran; the ceiling is now "
                             "the larger of the datasheet's dense peak and the probe",
    ("llm", "ours.mfu"): "the flop count included prefix-cached prompt tokens, which are not computed",
}


# Records whose commit does not say what was measured, by (results folder/file, git as stored): the commit they
# should name, or None where the repository holds no commit of that tree, and why.
PROVENANCE = {
    ("h100/splat.jsonl", "097d3d7cbffddc724d20e3f2344bcc35e0d23134"): (
        "097d3d7cbffddc724d20e3f2344bcc35e0d23134-dirty",
        "measured with the one-Gaussian-at-a-time blend kernels selected, which became the default only in the "
        "next commit (623e205): the sent tree differed from 097d3d7"),
    ("h200/vision.jsonl", "d0c3f5e"): (
        None, "d0c3f5e was a commit of a session whose work did not land: the repository holds no such tree "
              "(benchmarks/NOTES.md, the residual-epilogue entry, describes that call)"),
}


def mark_git(rec: dict[str, Any], where: str) -> list[str]:
    """Correct the commit of a record listed in PROVENANCE; the stored value stays in ``withdrawn["git"]``."""
    fix = PROVENANCE.get((where, rec.get("git")))
    if fix is None or "git" in (rec.get("withdrawn") or {}):
        return []
    new, why = fix
    _withdraw(rec, "git", rec["git"], why)
    rec["git"] = new
    return [f"git {fix and rec['withdrawn']['git']['value']} -> {new}: {why}"]


def _withdraw(rec: dict[str, Any], where: str, value: Any, why: str) -> None:
    rec.setdefault("withdrawn", {})[where] = {"value": value, "why": why}


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _relabel(rec: dict[str, Any], c: dict[str, Any], against: str) -> str:
    old = c.get("against")
    c["against"] = against
    c.pop("compared_with", None)
    c["relabelled"] = f"against: {old} -> {against} (what the check compared with; the verdict is unchanged)"
    return c["relabelled"]


def mark_checks(rec: dict[str, Any]) -> list[str]:
    """The rules for a check (record.check_violations) on a stored record: a verdict that could not fail is
    withdrawn (ok false, the old verdict kept in ``withdrawn``); a check labelled "self" gets the label of
    what it compared with; a peer judged more strictly than ours against the same reference is
    judged again at ours' tolerance from its stored rel_err (the old verdict kept)."""
    done: list[str] = []
    peers = rec.get("peers") or {}
    sides = [("correct.ok", rec.get("correct"))]
    sides += [(f"peers.{n}.correct", p.get("correct")) for n, p in peers.items() if isinstance(p, dict)]
    for key, c in sides:
        if not isinstance(c, dict):
            continue
        tol = c.get("tol")
        if c.get("ok") and _num(tol) and tol >= 1.0:
            why = (f"tol {tol:g}: the relative error it bounds cannot exceed it, so the check could not fail "
                   "(the row's check is now the next-token logits against bf16 within a budget below 1)")
            _withdraw(rec, key, {k: c[k] for k in ("ok", "rel_err", "tol") if k in c}, why)
            c["ok"], c["note"] = False, "withdrawn: the check could not fail"
            done.append(f"{key} withdrawn: {why}")
        if c.get("against") == "self":
            if c.get("note") == "the peer is the baseline":
                target = "baseline"
            elif c.get("compared_with"):
                target = str(c["compared_with"])
            elif rec.get("suite") == "vision":
                target = "reference:eager-fp32"
            else:  # a completion check: every request finished with the tokens it asked for
                target = "completion"
            done.append(f"{key}: {_relabel(rec, c, target)}")
    ours_c = rec.get("correct") if isinstance(rec.get("correct"), dict) else {}
    for n, p in peers.items():
        c = p.get("correct") if isinstance(p, dict) else None
        if not isinstance(c, dict) or c.get("against") != ours_c.get("against") or not c.get("against"):
            continue
        if _num(c.get("tol")) and _num(ours_c.get("tol")) and c["tol"] < ours_c["tol"] \
                and not math.isclose(c["tol"], ours_c["tol"]):
            old = {k: c[k] for k in ("ok", "rel_err", "tol") if k in c}
            why = (f"judged at tol {c['tol']:.4g} while ours was judged at {ours_c['tol']:.4g} against the same "
                   "reference: judged again at ours' tolerance from its stored rel_err")
            _withdraw(rec, f"peers.{n}.correct", old, why)
            c["tol"] = ours_c["tol"]
            c["ok"] = _num(c.get("rel_err")) and c["rel_err"] <= c["tol"]
            (rec.get("ratio_null") or {}).pop(n, None)  # the ratio rule decides again below
            gone = (rec.get("withdrawn") or {}).pop(f"ratio.{n}", None)
            if gone is not None:  # its earlier withdrawal rested on the unequal verdict: kept beside that verdict
                rec["withdrawn"][f"peers.{n}.correct"]["ratio_withdrawn_before"] = gone
            done.append(f"peers.{n}.correct re-judged: ok {old.get('ok')} -> {c['ok']} ({why})")
    return done


def mark_bench(rec: dict[str, Any]) -> list[str]:
    """Mark one bench record in place; returns what was marked (empty: nothing broke a rule)."""
    ours, peers = rec.get("ours"), rec.get("peers") or {}
    if not isinstance(ours, dict):
        return []
    done: list[str] = mark_checks(rec)
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
        done += mark_git(rec, f"{path.parent.name}/{path.name}")
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
