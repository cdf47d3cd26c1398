"""Helpers for bench tests: records built through the real builder from synthetic timings."""

from __future__ import annotations

import pytest
import torch

from warpforge.bench.compare import CaseResult, Outcome, build_record
from warpforge.bench.suite import Case
from warpforge.timing import Timing


def fake_record(case: str = "c", ms: float = 1.0, iqr: float = 0.01, suite: str = "s", ok: bool = True,
                peer_ms: float = 2.0) -> dict:
    """A schema-valid record with chosen timings (no tensors run)."""
    c = Case(name=case, params={"n": 1}, make_inputs=lambda g, d: (), ours=lambda: None,
             peers={"torch": lambda: None}, reference=None, flops=0, bytes=1e6, dtype=torch.float32)

    def t(m: float) -> Timing:
        return Timing(median_ms=m, p20_ms=m - iqr / 2, p80_ms=m + iqr / 2, iqr_ms=iqr, min_ms=m - iqr, n=20,
                      method="host")

    good = {"rel_err": 0.0 if ok else 0.5, "tol": 1e-4, "ok": ok, "against": "reference"}
    res = CaseResult(case=c, seed=7, device=torch.device("cpu"), ours=Outcome(timing=t(ms), correct=good),
                     peers={"torch": Outcome(timing=t(peer_ms), correct={**good, "ok": True, "rel_err": 0.0})},
                     warmup=1, rep=20)
    return build_record(res, suite=suite, device={"name": "cpu", "torch": torch.__version__}, git=None)


@pytest.fixture
def make_record():
    return fake_record
