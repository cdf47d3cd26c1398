"""The side-by-side on CPU: correctness in the same run, errors recorded, ratios from medians."""

from __future__ import annotations

import pytest
import torch

from warpforge.bench.compare import build_record, case_seed, compare_case
from warpforge.bench.suite import Case
from warpforge.results.record import device_info

CPU = torch.device("cpu")


def _inputs(gen, device):
    x = torch.randn(257, generator=gen, device=device)
    out = torch.full((257,), float("nan"), device=device)
    return x, out


def _case(ours, peers=None, reference=lambda x, out: (x * 2).double(), **kw):
    return Case(name=kw.pop("name", "double 257"), params={"n": 257}, make_inputs=_inputs, ours=ours,
                peers=peers or {"torch": lambda x, out: torch.mul(x, 2, out=out)},
                reference=reference, flops=257, bytes=2 * 257 * 4, dtype=torch.float32, **kw)


def _run(case):
    return compare_case(case, suite="t", device=CPU, warmup=1, rep=3)


def test_correct_ours_passes_and_ratio_is_peer_over_ours():
    r = _run(_case(lambda x, out: torch.mul(x, 2, out=out)))
    assert r.ours.error is None and r.ours.correct["ok"] and r.ours.correct["rel_err"] == 0.0
    assert r.peers["torch"].correct["ok"]
    assert r.ratio["torch"] == pytest.approx(r.peers["torch"].timing.median_ms / r.ours.timing.median_ms)
    assert r.seed == case_seed("t", "double 257")


def test_wrong_ours_is_marked_failed():
    r = _run(_case(lambda x, out: torch.mul(x, 2.01, out=out)))
    assert r.ours.correct["ok"] is False and r.ours.correct["rel_err"] == pytest.approx(0.005, rel=1e-3)
    rec = build_record(r, suite="t", device=device_info(CPU), git=None)
    assert rec["correct"]["ok"] is False and rec["ours"]["ms"] > 0  # timed and shown, never hidden


def test_unwritten_output_is_caught_by_the_poison():
    # Writes only the first half: the NaN poison in the rest must fail the check, even though the
    # reference and a correct peer ran before on their own (identical) draws.
    def half(x, out):
        out[:128] = x[:128] * 2
        return out

    r = _run(_case(half))
    assert r.ours.correct["ok"] is False
    rec = build_record(r, suite="t", device=device_info(CPU), git=None)
    assert rec["correct"]["rel_err"] is None and "non-finite" in rec["correct"]["note"]


def test_raising_peer_is_recorded_not_fatal():
    def broken(x, out):
        raise RuntimeError("torch.compile is not available here")

    r = _run(_case(lambda x, out: torch.mul(x, 2, out=out),
                   peers={"torch": lambda x, out: torch.mul(x, 2, out=out), "torch.compile": broken}))
    assert "not available" in r.peers["torch.compile"].error
    assert set(r.ratio) == {"torch"}
    rec = build_record(r, suite="t", device=device_info(CPU), git=None)
    assert rec["peers"]["torch.compile"] == {"error": "RuntimeError: torch.compile is not available here"}
    assert "torch.compile" not in rec["ratio"] and rec["correct"]["ok"]


def test_raising_ours_fails_the_case():
    def broken(x, out):
        raise ValueError("x: expected contiguous")

    r = _run(_case(broken))
    rec = build_record(r, suite="t", device=device_info(CPU), git=None)
    assert "expected contiguous" in rec["ours"]["error"]
    assert rec["correct"]["ok"] is False and rec["ratio"] == {}
    assert rec["peers"]["torch"]["ms"] > 0


def test_without_reference_the_first_peer_stands_in():
    r = _run(_case(lambda x, out: torch.mul(x, 3, out=out), reference=None))
    assert r.ours.correct["against"] == "peer:torch" and r.ours.correct["ok"] is False
    r = _run(_case(lambda x, out: torch.mul(x, 2, out=out), reference=None))
    assert r.ours.correct["ok"] and r.peers["torch"].correct["ok"]


def test_device_info_names_the_knobs_it_ran_under(monkeypatch):
    """A setting such as WARPFORGE_AUTOTUNE changes the code measured: the record's device block says which
    were set (where results go and the revision are not knobs)."""
    from warpforge.results.record import device_info

    for k in [k for k in __import__("os").environ if k.startswith("WARPFORGE_")]:
        monkeypatch.delenv(k)
    assert "knobs" not in device_info(CPU)
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "0")
    monkeypatch.setenv("WARPFORGE_PDL", "1")
    monkeypatch.setenv("WARPFORGE_STORE", "sqlite:///x.db")
    monkeypatch.setenv("WARPFORGE_GIT", "abc")
    assert device_info(CPU)["knobs"] == {"WARPFORGE_AUTOTUNE": "0", "WARPFORGE_PDL": "1"}
