"""The committed records against the rules for a figure, and where each record came from.

Every bench record under benchmarks/results/ must pass the schema and ``figure_violations`` (no ratio against
a peer that failed its check or ran other work, every stored ratio equal to peer ms / ours ms, a reason for
each peer without one, no roofline fraction or mfu/mbu above 1.0); a figure of an older run that broke a
rule is kept under ``withdrawn`` with the reason, never in its field. The marking script is tested on
hand-made records that break each rule.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest

from warpforge.results.provenance import missing_provenance, provenance, split_git
from warpforge.results.record import RecordError, check_violations, figure_violations, validate_record

from .conftest import fake_record

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# Result files that are not bench records (offline compiler outputs: register counts, PTX hashes).
NOT_RECORDS = {"sm90-offline"}


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mark = _load(REPO / "benchmarks" / "mark_rule_breaks.py", "mark_rule_breaks")


def _committed() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(RESULTS.glob("*/*.jsonl")):
        if f.parent.name in NOT_RECORDS:
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                out.append((f"{f.relative_to(REPO)}:{i}", json.loads(line)))
    return out


COMMITTED = _committed()
BENCH = [(where, r) for where, r in COMMITTED if "ours" in r]
PROFILE = [(where, r) for where, r in COMMITTED if "ours" not in r]


def test_every_committed_line_is_a_bench_or_profile_record():
    assert len(BENCH) > 150, "the committed H200 records went missing"
    odd = [where for where, r in PROFILE if r.get("suite") != "profile"]
    assert not odd, f"lines that are neither bench records nor profile agreement lines: {odd}"


def test_committed_bench_records_follow_the_rules_for_a_figure():
    broken = []
    for where, r in BENCH:
        try:
            validate_record(r, figures=True)
        except RecordError as e:
            broken.append(f"{where}: {e}")
    assert not broken, "\n".join(broken) + "\n(mark older runs with benchmarks/mark_rule_breaks.py)"


def test_no_committed_fraction_above_one_nor_ratio_against_a_failed_peer():
    # Spelled out beside figure_violations, so a change to that function cannot quietly loosen these two.
    for where, r in BENCH:
        roof = r.get("roofline")
        assert roof is None or roof["fraction"] <= 1.0, f"{where}: roofline fraction {roof['fraction']}"
        for name, value in r["ratio"].items():
            p = r["peers"][name]
            assert p["correct"]["ok"] and r["correct"]["ok"], f"{where}: ratio vs {name} with a failed check"
            assert value == pytest.approx(p["ms"] / r["ours"]["ms"], rel=1e-6), f"{where}: ratio.{name}"
        for name in r["peers"]:
            assert name in r["ratio"] or (r.get("ratio_null") or {}).get(name), f"{where}: peers.{name} unexplained"


def test_committed_records_follow_the_rules_for_a_check():
    """No verdict that could not fail (tol >= 1, judged against itself) and no peer judged at another tolerance
    than ours against the same reference, unless withdrawn with its reason (benchmarks/mark_rule_breaks.py)."""
    broken = [f"{where}: {v}" for where, r in BENCH for v in check_violations(r)]
    assert not broken, "\n".join(broken)
    for where, r in BENCH:  # "self" is no reference; a baseline peer is the reference, shown as such
        for c in [r["correct"], *(p.get("correct") or {} for p in r["peers"].values())]:
            assert c.get("against") != "self", where


def test_every_committed_commit_is_in_the_repository():
    """A record names the exact commit it measured (with -dirty when the tree differed); a sha the repository
    does not hold is withdrawn with the reason, never left as provenance."""
    import subprocess

    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-dir"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True,
                             text=True).stdout.strip() == "true"
    if shallow:
        pytest.skip("a shallow clone lacks the history the records name")
    shas = {split_git(r.get("git"))[0] for _, r in COMMITTED} - {None}
    unknown = [s for s in sorted(shas) if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{s}^{{commit}}"],
                                                         capture_output=True).returncode]
    assert not unknown, f"records name commits the repository does not hold: {unknown}"


def test_mark_script_withdraws_checks_that_cannot_fail_and_rejudges_unequal_peers():
    r = fake_record("q", ms=1.0, peer_ms=2.0)
    r["correct"] = {"rel_err": 0.99, "tol": 1.0, "ok": True, "against": "peer:torch"}
    r["peers"]["torch"]["correct"] = {"rel_err": 0.0, "ok": True, "against": "self",
                                      "note": "the peer is the baseline"}
    assert check_violations(r) == ["correct: tol 1 >= 1, a check that cannot fail",
                                   "peers.torch.correct: judged against itself"]
    done = mark.mark_bench(r)
    assert check_violations(r) == [] and figure_violations(r) == [] and done
    assert r["correct"]["ok"] is False and r["withdrawn"]["correct.ok"]["value"]["ok"] is True
    assert "torch" not in r["ratio"] and r["withdrawn"]["ratio.torch"]["value"] == pytest.approx(2.0)
    assert r["peers"]["torch"]["correct"]["against"] == "baseline"
    validate_record(r, figures=True)
    # a peer judged more strictly than ours against the same reference is judged again at ours' tolerance
    u = fake_record("u", ms=1.0, peer_ms=2.0)
    u["correct"] = {"rel_err": 0.04, "tol": 0.07, "ok": True, "against": "peer:eager-fp32"}
    u["peers"]["torch"]["correct"] = {"rel_err": 0.037, "tol": 0.02, "ok": False, "against": "peer:eager-fp32"}
    u["ratio"] = {}
    u["ratio_null"] = {"torch": "the peer failed its correctness check: it is no baseline"}
    assert "unequal judging" in check_violations(u)[0]
    mark.mark_bench(u)
    assert u["peers"]["torch"]["correct"]["ok"] is True and u["ratio"]["torch"] == pytest.approx(2.0)
    assert u["withdrawn"]["peers.torch.correct"]["value"] == {"ok": False, "rel_err": 0.037, "tol": 0.02}
    assert check_violations(u) == [] and mark.mark_bench(u) == []


def test_withdrawn_figures_keep_their_value_and_reason():
    marked = [(where, r) for where, r in COMMITTED if r.get("withdrawn")]
    assert marked, "the committed records that broke the rules are marked (benchmarks/mark_rule_breaks.py)"
    for where, r in marked:
        for field, w in r["withdrawn"].items():
            assert w["why"] and "value" in w, f"{where}: withdrawn.{field}"
            if field.startswith("ratio."):
                name = field.removeprefix("ratio.")
                assert name not in r["ratio"] and r["ratio_null"][name], f"{where}: {field} still a ratio"
            if field == "roofline":
                assert r["roofline"] is None and w["value"]["fraction"] > 1.0


def test_profile_lines_are_consistent():
    assert PROFILE, "benchmarks/results/h200/profile.jsonl went missing"
    agree = _load(REPO / "benchmarks" / "profile_h200.py", "profile_h200").AGREE
    for where, r in PROFILE:
        prof, bench = r.get("profiler"), r.get("bench")
        if prof and bench:
            assert r["ratio"] == pytest.approx(prof["figure"] / bench["figure"], rel=1e-9), where
            assert r["agree"] == (abs(r["ratio"] - 1) <= agree), where
            assert prof["overhead"] is None or prof["overhead"] >= 0, f"{where}: a negative overhead is noise"


def test_every_committed_record_says_where_it_came_from():
    lacking = [f"{where}: {m}" for where, r in COMMITTED for m in missing_provenance(r)]
    assert not lacking, "\n".join(lacking)
    p = provenance(BENCH[0][1])
    assert p["commit"] and p["torch"] and p["triton"] and p["driver"] and p["dirty"] is False


def test_split_git():
    assert split_git("abc123") == ("abc123", False)
    assert split_git("abc123-dirty") == ("abc123", True)
    assert split_git("unknown") == (None, None) and split_git(None) == (None, None)
    assert missing_provenance({"git": None, "device": {"name": "NVIDIA H200", "torch": "2.11"}}) == [
        "git: no commit", "device.triton: missing", "device.driver: missing"]


# ---- the marking script on records that break each rule --------------------------------------------

def _broken_record() -> dict:
    r = fake_record("c", ms=1.0, peer_ms=2.0)
    r["peers"]["wrong"] = {**r["peers"]["torch"], "ms": 3.0, "p20_ms": 2.9, "p80_ms": 3.1,
                           "correct": {"rel_err": 0.05, "tol": r["correct"]["tol"], "ok": False,
                                       "against": "reference"}}
    r["ratio"]["wrong"] = 3.0  # against a peer that failed its check
    r["peers"]["fewer"] = {**r["peers"]["torch"], "ms": 0.5, "p20_ms": 0.49, "p80_ms": 0.51, "tokens": 10}
    r["ours"]["tokens"] = 40
    r["ratio"]["fewer"] = 0.5  # over different work
    r["peers"]["gone"] = {"error": "not installed"}  # neither a ratio nor a reason
    r["roofline"] = {"floor_ms": 1.09, "fraction": 1.09, "bound": "compute"}
    r["ours"]["mfu"] = 9.7
    r["meets"] = {"ratio.wrong": True}
    r["suite"] = "kernels"
    return r


def test_mark_script_withdraws_each_broken_figure_and_keeps_its_value():
    r = _broken_record()
    assert len(figure_violations(r)) == 5
    done = mark.mark_bench(r)
    assert len(done) == 5, done
    assert figure_violations(r) == []
    validate_record(r, figures=True)
    w = r["withdrawn"]
    assert w["ratio.wrong"]["value"] == 3.0 and "failed its correctness check" in w["ratio.wrong"]["why"]
    assert w["ratio.fewer"]["value"] == 0.5 and w["ratio.fewer"]["why"].startswith("different work")
    assert w["roofline"]["value"]["fraction"] == 1.09 and "probed cuBLAS rate" in w["roofline"]["why"]
    assert w["ours.mfu"]["value"] == 9.7 and r["ours"]["mfu"] is None
    assert w["meets.ratio.wrong"]["value"] is True and r["meets"]["ratio.wrong"] is None
    assert r["ratio_null"]["gone"] == "the peer did not run: not installed"
    assert r["ratio"] == {"torch": pytest.approx(2.0)}  # the valid ratio stays
    before = copy.deepcopy(r)
    assert mark.mark_bench(r) == [] and r == before  # idempotent


def test_mark_script_rewrites_only_broken_lines(tmp_path):
    good, bad = fake_record("good"), _broken_record()
    path = tmp_path / "kernels.jsonl"
    good_line = json.dumps(good, separators=(",", ":"))  # a layout the script must not touch
    path.write_text(good_line + "\n" + json.dumps(bad) + "\n")
    report = mark.mark_file(path)
    lines = path.read_text().splitlines()
    assert lines[0] == good_line and len(report) == 5 and all(":2 'c'" in x for x in report)
    fixed = json.loads(lines[1])
    assert figure_violations(fixed) == [] and fixed["withdrawn"]["ratio.wrong"]["value"] == 3.0
    assert mark.mark_file(path) == []


def test_mark_script_profile_overhead_below_noise():
    r = {"suite": "profile", "profiler": {"overhead": -0.2}}
    assert mark.mark_profile(r) and r["profiler"]["overhead"] is None
    assert r["withdrawn"]["profiler.overhead"]["value"] == -0.2
    assert mark.mark_profile({"suite": "profile", "profiler": {"overhead": 0.01}}) == []


def test_schema_rejects_a_malformed_withdrawn_block():
    r = fake_record()
    r["withdrawn"] = {"ratio.torch": {"value": 2.0}}  # no reason
    with pytest.raises(RecordError, match="withdrawn"):
        validate_record(r)
    r["withdrawn"] = {"ratio.torch": {"value": 2.0, "why": "x"}}  # withdrawn yet still shown
    with pytest.raises(RecordError, match="also in withdrawn"):
        validate_record(r)
    assert math.isfinite(r["ratio"]["torch"])
