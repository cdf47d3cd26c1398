"""The ratio rule: a ratio only between two sides that ran the same work and both passed their check;
otherwise null with the reason. Kernel cases, end-to-end cases and hand-made records alike."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from warpforge.bench.compare import CaseResult, Outcome, build_record, compare_case
from warpforge.bench.e2e import run_end_to_end
from warpforge.bench.suite import Case, EndToEndCase, Run
from warpforge.results.ratio import Side, same_work_ratio
from warpforge.results.record import RecordError, device_info, figure_violations, validate_record
from warpforge.timing import summarize
from warpforge.hw.roofline import Ceilings

CPU = torch.device("cpu")
DEV = {"name": "cpu", "torch": torch.__version__}


# ---- the function -----------------------------------------------------------------------------------

def test_same_work_and_both_correct_gives_peer_over_ours_with_its_round_interval():
    r = same_work_ratio(Side(ms=1.0, ok=True, rounds_ms=(1.0, 1.1, 0.9)),
                        Side(ms=2.0, ok=True, rounds_ms=(2.0, 2.0, 2.1)))
    assert r.value == pytest.approx(2.0) and r.why is None
    assert r.interval == pytest.approx((2.0 / 1.1, 2.1 / 0.9))
    assert r.interval[0] <= r.value <= r.interval[1]
    assert same_work_ratio(Side(ms=1.0, ok=True), Side(ms=3.0, ok=True)).interval is None  # one round: no range


@pytest.mark.parametrize("ours, peer, why", [
    (Side(error="boom"), Side(ms=1.0, ok=True), "ours did not run: boom"),
    (Side(ms=1.0, ok=True), Side(error="no torch.compile"), "the peer did not run: no torch.compile"),
    (Side(ms=1.0, ok=False, check="rel_err 0.5 > tol 0.02"), Side(ms=2.0, ok=True),
     "ours failed its correctness check (rel_err 0.5 > tol 0.02)"),
    (Side(ms=1.0, ok=True), Side(ms=2.0, ok=False, check="rel_err 0.3"),
     "the peer failed its correctness check (rel_err 0.3): it is no baseline"),
    (Side(ms=1.0, ok=True), Side(ms=2.0, ok=None), "the peer was not checked: it is no baseline"),
    (Side(ms=1.0, ok=True, ran={"requests": 256}), Side(ms=2.0, ok=True, ran={"requests": 64}),
     'different work: the peer ran {"requests": 64}, ours {"requests": 256}'),
    (Side(ms=1.0, ok=True, tokens=1000), Side(ms=2.0, ok=True, tokens=250),
     "different work: the peer produced 250 tokens, ours 1,000"),
    (Side(ms=0.0, ok=True), Side(ms=2.0, ok=True), "no positive finite times"),
])
def test_no_ratio_and_the_reason(ours, peer, why):
    r = same_work_ratio(ours, peer)
    assert r.value is None and why in r.why


# ---- kernel cases -----------------------------------------------------------------------------------

def _case(peers):
    return Case(name="x2 512", params={"n": 512}, make_inputs=lambda g, d: (torch.randn(512, generator=g, device=d),),
                ours=lambda x: x * 2, peers=peers, reference=lambda x: x.double() * 2, flops=512, bytes=4096,
                dtype=torch.float32)


def test_a_failing_peer_is_shown_with_its_error_and_gets_no_ratio():
    res = compare_case(_case({"good": lambda x: x + x, "wrong": lambda x: x * 2.5}), suite="t", device=CPU,
                       warmup=1, rep=6)
    rec = build_record(res, suite="t", device=device_info(CPU), git=None)
    assert set(rec["ratio"]) == {"good"} and set(rec["ratio_interval"]) == {"good"}
    assert rec["peers"]["wrong"]["ms"] > 0 and rec["peers"]["wrong"]["correct"]["ok"] is False  # shown
    assert "failed its correctness check" in rec["ratio_null"]["wrong"]
    assert "rel_err" in rec["ratio_null"]["wrong"] and "no baseline" in rec["ratio_null"]["wrong"]
    assert res.ratio.keys() == {"good"}


def test_ours_failing_its_check_takes_no_ratio_and_still_fails_the_case():
    case = dataclasses.replace(_case({"good": lambda x: x + x}), ours=lambda x: x * 3)
    res = compare_case(case, suite="t", device=CPU, warmup=1, rep=6)
    rec = build_record(res, suite="t", device=device_info(CPU), git=None)
    assert rec["correct"]["ok"] is False and rec["ratio"] == {}
    assert rec["ratio_null"]["good"].startswith("ours failed its correctness check")


def test_a_fraction_above_one_is_reported_never_stored():
    case = _case({"good": lambda x: x + x})
    t = summarize([1.0, 1.0, 1.0], "host")
    res = CaseResult(case=case, seed=0, device=CPU, ours=Outcome(timing=t, correct={"rel_err": 0.0, "tol": 1e-6,
                                                                                     "ok": True, "against": "r"}),
                     peers={"good": Outcome(timing=t, correct={"rel_err": 0.0, "tol": 1e-6, "ok": True,
                                                               "against": "r"})})
    # 4096 bytes in 1 ms is 4.1 MB/s: a ceiling of 1 MB/s is below what ran.
    low = Ceilings(device="toy", hbm_GBps=0.001, tflops={k: 1.0 for k in ("fp32", "tf32", "fp16", "bf16", "fp8",
                                                                          "int8")}, source="probe toy")
    rec = build_record(res, suite="t", device=DEV, git=None, ceil=low)
    assert rec["roofline"] is None
    assert len(rec["figure_errors"]) == 1 and "roofline fraction 4.096 > 1 against probe toy" in rec["figure_errors"][0]


# ---- end-to-end cases -------------------------------------------------------------------------------

def _runs(ms, tokens, ran=None, correct=None):
    def fn(device, rep):
        return [Run(ms=m, tokens=tokens, output={"ids": [1, 2]}, ran=ran,
                    extra={} if correct is None else {"correct": correct}) for m in ms]
    return fn


def _e2e(ours, peers, metric="tok/s"):
    return EndToEndCase(name="gen", params={}, ours=ours, peers=peers, check=lambda a, b: {"ok": True, "rel_err": 0.0},
                        check_against=next(iter(peers)), dtype=torch.float32, metric=metric, rep=3)


def test_e2e_mismatched_work_gives_a_null_ratio_with_what_each_ran():
    """The LLM offline rows divided 256 requests of ours by 64 of HF's: never again."""
    case = _e2e(_runs([100.0, 101.0, 99.0], 65536, ran={"requests": 256}),
                {"hf": _runs([900.0, 905.0, 899.0], 16384, ran={"requests": 64})})
    rec = run_end_to_end(case, suite="t", device=CPU, env_device=DEV, git=None)
    assert rec["ratio"] == {} and "different work" in rec["ratio_null"]["hf"]
    assert rec["peers"]["hf"]["ran"] == {"requests": 64} and rec["ours"]["ran"] == {"requests": 256}
    assert rec["meets"] == {}  # no target; and the tok/s of each side stay as figures
    assert rec["ours"]["tok/s"] > rec["peers"]["hf"]["tok/s"] > 0


def test_e2e_same_work_ratio_is_time_over_time_with_the_runs_as_rounds():
    case = _e2e(_runs([100.0, 110.0, 105.0], 1000), {"hf": _runs([400.0, 420.0, 410.0], 1000)})
    rec = run_end_to_end(case, suite="t", device=CPU, env_device=DEV, git=None)
    assert rec["ratio"]["hf"] == pytest.approx(410.0 / 105.0)
    assert rec["ratio"]["hf"] == pytest.approx(rec["ours"]["tok/s"] / rec["peers"]["hf"]["tok/s"])
    lo, hi = rec["ratio_interval"]["hf"]
    assert lo == pytest.approx(420.0 / 110.0) and hi == pytest.approx(400.0 / 100.0)
    assert rec["stability"]["noisy"] is False and rec["stability"]["rounds"] == 3
    assert "ran" not in rec["ours"] and "ran" not in rec["peers"]["hf"]


def test_e2e_peer_that_fails_its_own_check_is_no_baseline():
    bad = {"ok": False, "rel_err": 0.3, "tol": 0.02, "against": "peer:ref"}
    case = _e2e(_runs([1.0, 1.0, 1.0], 0), {"ref": _runs([3.0, 3.0, 3.0], 0),
                                            "eager-fp16": _runs([2.0, 2.0, 2.0], 0, correct=bad)}, metric="ms")
    rec = run_end_to_end(case, suite="t", device=CPU, env_device=DEV, git=None)
    assert set(rec["ratio"]) == {"ref"} and "no baseline" in rec["ratio_null"]["eager-fp16"]
    assert rec["peers"]["eager-fp16"]["ms"] == 2.0 and rec["peers"]["eager-fp16"]["correct"]["ok"] is False


def test_e2e_spread_runs_mark_the_case_noisy():
    case = _e2e(_runs([1.0, 1.0, 1.0], 0), {"ref": _runs([2.0, 4.0, 2.1], 0)}, metric="ms")
    rec = run_end_to_end(case, suite="t", device=CPU, env_device=DEV, git=None)
    assert rec["stability"]["noisy"] is True and rec["stability"]["spread"]["ref"]["rounds"] == pytest.approx(2.0)
    assert rec["ratio"]["ref"] == pytest.approx(2.1)  # kept, flagged, with its range
    assert rec["ratio_interval"]["ref"] == pytest.approx([2.0, 4.0])


def test_e2e_mfu_above_one_is_a_reported_bug():
    """An LLM record read "mfu 9.73": the flops counted prompt tokens the prefix cache never computed."""
    def ours(device, rep):
        return [Run(ms=10.0, tokens=10, output={}, work={"flops": 1e12, "bytes": 1e6})]
    case = EndToEndCase(name="g", params={}, ours=ours, peers={}, check=lambda a, b: {"ok": True, "rel_err": 0.0},
                        dtype=torch.float32, baseline="none", rep=1)
    ceil = Ceilings(device="toy", hbm_GBps=1000.0, tflops={k: 10.0 for k in ("fp32", "tf32", "fp16", "bf16", "fp8",
                                                                            "int8")}, source="probe toy")
    rec = run_end_to_end(case, suite="t", device=CPU, env_device=DEV, git=None, ceil=ceil)
    assert rec["ours"]["mfu"] is None and rec["ours"]["mbu"] == pytest.approx(1e-4)
    assert any("ours mfu 10 > 1" in e for e in rec["figure_errors"])


# ---- what a stored record may claim -------------------------------------------------------------------

def _clean():
    res = compare_case(_case({"good": lambda x: x + x}), suite="t", device=CPU, warmup=1, rep=6)
    return build_record(res, suite="t", device=DEV, git=None)


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r["peers"]["good"]["correct"].update(ok=False), "no baseline"),
    (lambda r: r["ratio"].update(good=r["ratio"]["good"] * 1.5), "is not peer ms / ours ms"),
    (lambda r: r.update(correct={**r["correct"], "ok": False}), "ours failed its correctness check"),
    (lambda r: r["peers"]["good"].update(ran={"requests": 64}), "different work"),
    (lambda r: (r["ratio"].pop("good"), r.pop("ratio_interval")), "neither a ratio nor a reason"),
    (lambda r: r.update(roofline={"floor_ms": 1.0, "fraction": 1.094, "bound": "compute"}), "fraction: 1.094 > 1"),
    (lambda r: r["ours"].update(mfu=9.73), "ours.mfu: 9.73 > 1"),
])
def test_figure_rules_catch_a_record_that_breaks_them(mutate, match):
    rec = _clean()
    assert figure_violations(rec) == []
    bad = copy.deepcopy(rec)
    mutate(bad)
    validate_record(bad)  # the schema alone still reads it (older runs in a store)
    assert any(match in v for v in figure_violations(bad))
    with pytest.raises(RecordError, match=match):
        validate_record(bad, figures=True)


def test_schema_of_the_new_keys():
    rec = _clean()
    for mutate, match in [(lambda r: r.update(ratio_null={"nope": "x"}), "no peer of that name"),
                          (lambda r: r.update(ratio_null={"good": ""}), "ratio_null"),
                          (lambda r: r["ratio_interval"].update(good=[2.0, 1.0]), "low <= high"),
                          (lambda r: r["ours"].update(rounds_ms=[]), "rounds_ms"),
                          (lambda r: r.update(stability={"noisy": "yes"}), "stability"),
                          (lambda r: r.update(figure_errors="x"), "figure_errors")]:
        bad = copy.deepcopy(rec)
        mutate(bad)
        with pytest.raises(RecordError, match=match):
            validate_record(bad)
