"""The llm suite's quantized rows (quant_cases in bench/suites/llm.py): the full rows' parameters and targets, and a
--quick run of those rows alone on the CPU giving valid records with same-work ratios."""

from __future__ import annotations

import math

import pytest

from warpforge.results.record import validate_record


def test_full_rows_and_targets():
    from warpforge.bench.suites.llm import quant_cases

    cases = {c.params["row"]: c for c in quant_cases(quick=False)}
    assert cases["decode-b1-8b-int8"].target == {"ratio": {"bf16": 1.7}}
    assert cases["decode-b1-8b-int4"].target == {"ratio": {"bf16": 2.5}}
    assert cases["offline-256-8b-fp8"].target == {"ratio": {"bf16": 1.4}}
    assert all(c.params["preset"] == "llama-8b" and "bf16" in c.peers for c in cases.values())
    assert cases["offline-256-8b-fp8"].params["requests"] == 256


def test_the_logits_check_fails_past_its_budget():
    import torch

    from warpforge.bench.suites.llm import agreement_check

    ref = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ids = {"ids": [[1, 2, 3]], "want": [3]}
    near = agreement_check({**ids, "logits0": ref + 0.01 * ref.norm() / 1000 ** 0.5, "quantization": "int8"},
                           {**ids, "logits0": ref})
    far = agreement_check({**ids, "logits0": ref + 0.2 * torch.randn(1000), "quantization": "int8"},
                          {**ids, "logits0": ref})
    assert near["ok"] and near["rel_err"] < 0.02 and not far["ok"] and far["rel_err"] > near["tol"]


def test_quick_rows_on_cpu():
    pytest.importorskip("transformers")
    from warpforge.bench.runner import run_suite
    from warpforge.bench.suite import Suite
    from warpforge.bench.suites._llm_work import _shape, generation_work
    from warpforge.bench.suites.llm import quant_cases

    # The int4 row alone (the whole suite's --quick test, tests/bench/test_suite_llm.py, runs all three rows).
    pick = lambda quick: [c for c in quant_cases(quick) if c.params["row"] == "decode-b1-8b-int4"]  # noqa: E731
    records = run_suite(Suite(name="llm", description="quantized rows", cases=pick), quick=True, device="cpu")
    assert [r["params"]["row"] for r in records] == ["decode-b1-8b-int4"]
    for r in records:
        validate_record(r)
        assert r["correct"]["ok"], (r["case"], r["correct"])
        assert 0.0 <= r["correct"]["agreement_request0"] <= 1.0
        c = r["correct"]  # a check that can fail: the logits' error against a budget below 1
        assert c["against"] == "peer:bf16" and 0 < c["tol"] < 1 and 0 < c["rel_err"] <= c["tol"], c
        ours, peer = r["ours"], r["peers"]["bf16"]
        assert "error" not in ours and "error" not in peer, (ours, peer)
        assert ours["tokens"] == peer["tokens"] > 0 and "ratio_null" not in r
        assert math.isclose(r["ratio"]["bf16"], ours["tok/s"] / peer["tok/s"])
    # the int4 row counts the packed weight bytes: fewer than the fp32 engine's for the same work
    r = next(r for r in records if r["params"]["row"] == "decode-b1-8b-int4")
    full = generation_work(_shape("llama-tiny-g128"), 4, [r["params"]["prompt"]], [r["params"]["new"]])["bytes"]
    assert r["work"]["bytes"] < full
