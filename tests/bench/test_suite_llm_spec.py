"""Suite ``llm``'s speculative rows: the full rows' settings, and a --quick run on the CPU (identical
output with and without drafts, so a ratio on the same work, and the drafts' counts in the record)."""

from __future__ import annotations

import torch

from warpforge.results.record import validate_record


def _suite():
    from warpforge.bench.runner import load_suite

    return load_suite("llm")


def test_full_rows():
    cases = {c.params["row"]: c for c in _suite().build(quick=False) if c.params["row"].startswith("spec-")}
    assert set(cases) == {"spec-ngram-b1", "spec-self-b1", "spec-draft-b1"}
    for c in cases.values():
        assert c.params["preset"] == "gemma3-270m" and c.params["batch"] == 1 and "plain" in c.peers
    assert cases["spec-ngram-b1"].target == {"ratio": {"plain": 1.8}}
    assert cases["spec-self-b1"].params["speculative"]["draft_layers"] == 12


def test_passages_come_from_hamlet():
    from warpforge.bench.suites._llm_spec import passages

    ps = passages(4, 500)
    assert len(ps) == 4 and len(set(ps)) == 4 and all(100 < len(p) <= 500 for p in ps)


def test_quick_rows_on_cpu():
    from warpforge.bench.runner import run_suite

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = run_suite(_suite(), quick=True, device="cpu", case_filter="speculative")
    finally:
        torch.set_num_threads(prev)
    assert {r["params"]["row"] for r in records} == {"spec-ngram-b1", "spec-self-b1", "spec-draft-b1"}
    for r in records:
        validate_record(r)
        assert r["correct"]["ok"] and r["correct"]["same"] == 1.0, r["correct"]
        assert r["ratio"]["plain"] > 0 and "ratio_null" not in r  # identical output: the same work
        spec = r["ours"]["speculative"]
        assert spec["num_draft_tokens"] > 0 and 0.0 <= spec["acceptance_rate"] <= 1.0
        assert r["ours"]["tokens"] == r["peers"]["plain"]["tokens"] > 0
