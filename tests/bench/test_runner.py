"""Suite discovery and the runner's loop (on CPU, with toy suites)."""

from __future__ import annotations

import pytest
import torch

from warpforge.results.record import validate_record
from warpforge.bench.runner import UnknownSuiteError, list_suites, load_suite, run_suite
from warpforge.bench.suite import Case, Suite


def test_memory_suite_is_discovered_and_loads():
    assert "memory" in list_suites()
    assert all(not n.startswith("_") for n in list_suites())
    s = load_suite("memory")
    names = [c.name for c in s.build(quick=True)]
    assert len(names) == 6 and names[0].startswith("copy fp32")
    assert all(c.metric == "GBps" and c.bytes > 0 for c in s.build(quick=True))


def test_unknown_suite_lists_available():
    with pytest.raises(UnknownSuiteError, match=r"unknown suite 'nope'; available: .*memory"):
        load_suite("nope")
    with pytest.raises(UnknownSuiteError):
        load_suite("../memory")


def _toy_suite(raise_in_inputs: bool = False) -> Suite:
    def make(gen, device):
        if raise_in_inputs:
            raise RuntimeError("out of memory")
        return (torch.randn(64, generator=gen, device=device),)

    def cases(quick):
        return [Case(name=f"neg {n}", params={"n": n}, make_inputs=make, ours=torch.neg,
                     peers={"torch": lambda x: -x}, reference=lambda x: -x.double(), flops=n, bytes=8 * n,
                     dtype=torch.float32) for n in (1, 2, 3)]

    return Suite(name="toy", description="negation", cases=cases)


def test_run_suite_filters_reports_progress_and_emits_valid_records():
    seen = []
    recs = run_suite(_toy_suite(), quick=True, case_filter="neg 2", progress=lambda *a: seen.append(a),
                     device="cpu")
    assert [r["case"] for r in recs] == ["neg 2"]
    assert seen == [(0, 1, "neg 2"), (1, 1, "")]
    for r in recs:
        validate_record(r)
        assert r["suite"] == "toy" and r["correct"]["ok"] and r["timing"]["rep"] == 15


def test_a_filter_of_alternatives_runs_each_named_case():
    recs = run_suite(_toy_suite(), quick=True, case_filter="neg 1 | neg 3", device="cpu")
    assert [r["case"] for r in recs] == ["neg 1", "neg 3"]


def test_a_case_that_cannot_build_inputs_fails_alone():
    recs = run_suite(_toy_suite(raise_in_inputs=True), quick=True, device="cpu")
    assert len(recs) == 3
    assert all("out of memory" in r["ours"]["error"] and not r["correct"]["ok"] for r in recs)
