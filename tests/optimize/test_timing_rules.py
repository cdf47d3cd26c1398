"""The optimizer's timing under the bench rules: speedups only between candidates that passed their gate,
with their range across rounds; noisy timings re-timed then flagged; a busy machine warned about."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from warpforge.optimize import api, latency
from warpforge.optimize.backends import Built, Candidate


def _cand(name: str, family: str) -> Candidate:
    return Candidate(name, family, "fp32", build=lambda m, x: None)


def _records(*rows: tuple[str, str, str]) -> list[dict]:
    return [{"name": n, "family": f, "precision": "fp32", "status": s, "eligible": True} for n, f, s in rows]


def _fake_timer(samples_per_attempt, calls):
    def fake(fns, inputs, *, queries, warmup, rounds, device):
        samples = samples_per_attempt[min(len(calls), len(samples_per_attempt) - 1)]
        calls.append(1)
        return {n: latency.summarize(samples[n], warmup, "host", rounds=rounds) for n in fns}
    return fake


def _live(*names):
    return {n: (_cand(n, n.split("-")[0]), Built(fn=lambda x: x, module=None)) for n in names}


def test_speedups_are_ratios_of_passing_candidates_with_their_range(monkeypatch):
    calls = []
    attempt = {"eager-fp32": [10.0, 10.2, 9.8, 10.1] * 5, "warpforge-fp32": [2.0, 2.02, 1.98, 2.01] * 5,
               "torch.compile-fp32": [4.0, 4.04, 3.96, 4.02] * 5}
    monkeypatch.setattr(latency, "single_stream_interleaved", _fake_timer([attempt], calls))
    records = _records(("eager-fp32", "eager", "passed"), ("warpforge-fp32", "warpforge", "passed"),
                       ("torch.compile-fp32", "torch.compile", "passed"))
    attempts = api._time(_live("eager-fp32", "warpforge-fp32", "torch.compile-fp32"), records, (torch.zeros(2),),
                         torch.device("cpu"), queries=20, warmup=0, offline_calls=2)
    w = records[1]
    assert attempts == 1 and len(calls) == 1 and not w["latency"]["noisy"]
    assert w["speedup_vs_eager"] == pytest.approx(10.05 / 2.005, rel=1e-3)
    assert w["speedup_vs_compile"] == pytest.approx(4.01 / 2.005, rel=1e-3)
    lo, hi = w["speedup_vs_eager_range"]
    assert lo <= w["speedup_vs_eager"] <= hi and len(w["latency"]["rounds_ms"]) == 10


def test_noisy_timings_are_retimed_then_flagged_never_a_bare_313x(monkeypatch):
    """Eager's p50 at 113 ms against a 0.49 ms minimum (a busy machine) printed "313.98x eager-fp32"."""
    calls = []
    busy = {"eager-fp32": [0.49] * 10 + [113.0] * 10, "warpforge-fp32": [0.36] * 20}
    monkeypatch.setattr(latency, "single_stream_interleaved", _fake_timer([busy, busy], calls))
    records = _records(("eager-fp32", "eager", "passed"), ("warpforge-fp32", "warpforge", "passed"))
    attempts = api._time(_live("eager-fp32", "warpforge-fp32"), records, (torch.zeros(2),), torch.device("cpu"),
                         queries=20, warmup=0, offline_calls=2)
    eager, ours = records
    assert attempts == 2 and len(calls) == 2  # timed, then timed again
    assert eager["latency"]["noisy"] and eager["latency"]["spread"]["rounds"] > 100
    lo, hi = ours["speedup_vs_eager_range"]
    assert lo == pytest.approx(0.49 / 0.36) and hi == pytest.approx(113.0 / 0.36)  # the range says what it is


def test_a_baseline_that_did_not_pass_its_gate_is_no_baseline():
    records = _records(("eager-fp32", "eager", "passed"), ("torch.compile-fp32", "torch.compile", "rejected"))
    records[1].update(latency={"p50_ms": 1.0, "rounds_ms": [1.0]}, reason="max_rel 0.3 > 0.02")
    records[0]["latency"] = {"p50_ms": 2.0, "rounds_ms": [2.0]}
    from warpforge.results.ratio import same_work_ratio

    r = same_work_ratio(api._side(records[0]), api._side(records[1]))
    assert r.value is None and "max_rel 0.3 > 0.02" in r.why and "no baseline" in r.why


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def test_optimize_on_a_busy_machine_warns_and_keeps_it_in_the_report(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (31.0, 30.0, 30.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.manual_seed(0)
    opt = api.optimize(_Tiny(), torch.randn(2, 8), backends=["eager"], device="cpu", queries=4, warmup=1,
                       offline_calls=2)
    rep = opt.report
    assert rep["settings"]["host"]["busy"] is True and rep["settings"]["host"]["load1"] == 31.0
    assert any(n.startswith("busy machine: load average 31.0 on 2 cores") for n in rep["notes"])
    from rich.console import Console

    from warpforge.optimize.cli import print_table

    console = Console(record=True, width=200)
    print_table(rep, console)
    assert console.export_text().count("busy machine: load average 31.0") == 1
