"""The record schema (docs/design.md): produced records validate, broken ones are rejected."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from warpforge.bench.compare import build_record, compare_case, roofline_for
from warpforge.bench.suite import Case
from warpforge.results.record import RecordError, device_info, git_version, read_jsonl, validate_record, write_jsonl

CPU = torch.device("cpu")


def _real_record():
    case = Case(name="add 1000", params={"n": 1000, "dtype": "float32"},
                make_inputs=lambda g, d: (torch.randn(1000, generator=g, device=d),),
                ours=lambda x: x + 1, peers={"torch": lambda x: torch.add(x, 1)},
                reference=lambda x: x.double() + 1, flops=1000, bytes=8000, dtype=torch.float32)
    res = compare_case(case, suite="toy", device=CPU, warmup=1, rep=5)
    return build_record(res, suite="toy", device=device_info(CPU), git=git_version())


def test_produced_record_has_design_keys():
    r = _real_record()
    validate_record(r)
    for k in ("suite", "case", "params", "device", "git", "time", "ours", "peers", "ratio", "roofline", "correct"):
        assert k in r
    assert r["device"]["name"] == "cpu" and r["device"]["torch"] == torch.__version__
    assert set(r["ours"]) == {"ms", "p20_ms", "p80_ms", "iqr_ms", "GBps", "rounds_ms"}
    assert len(r["ours"]["rounds_ms"]) == 3 and r["stability"]["rounds"] == 3
    assert r["ours"]["GBps"] == pytest.approx(8000 / (r["ours"]["ms"] * 1e-3) / 1e9)
    assert r["ratio"]["torch"] == pytest.approx(r["peers"]["torch"]["ms"] / r["ours"]["ms"])
    assert r["roofline"] is None  # no ceilings given: null, never a guess
    assert r["time"].endswith("+00:00")
    assert r["timing"]["method"] == "host" and r["seed"] >= 0
    json.dumps(r, allow_nan=False)


def _broken(mutate):
    r = _real_record()
    mutate(r)
    return r


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("ours"), "missing key 'ours'"),
    (lambda r: r.update(time="yesterday"), "ISO 8601"),
    (lambda r: r["ours"].update(ms=float("nan")), "ours.ms"),
    (lambda r: r["ours"].update(p20_ms=r["ours"]["ms"] * 2), "p20_ms <= ms"),
    (lambda r: r["ours"].pop("GBps"), "hardware figure"),
    (lambda r: r["ratio"].update(cublas=1.2), "no timed peer"),
    (lambda r: r["ratio"].update(torch=-1.0), "positive"),
    (lambda r: r.update(correct={"rel_err": 0.1}), "boolean 'ok'"),
    (lambda r: r.update(correct={"rel_err": None, "ok": True}), "without a rel_err"),
    (lambda r: r.update(roofline={"floor_ms": 1.0, "fraction": 0.5, "bound": "latency"}), "bound"),
    (lambda r: r.update(roofline={"floor_ms": 1.0}), "roofline"),
    (lambda r: r.update(device="H200"), "device"),
    (lambda r: r["params"].update(x=float("inf")), "strict JSON"),
    (lambda r: r.update(ours={"error": "boom"}), "ratio: must be empty"),
])
def test_broken_records_rejected(mutate, match):
    with pytest.raises(RecordError, match=match):
        validate_record(_broken(mutate))


def test_validate_rejects_non_object():
    with pytest.raises(RecordError):
        validate_record([1, 2])


def test_jsonl_round_trip_and_bad_line(tmp_path):
    a, b = _real_record(), _real_record()
    p = tmp_path / "sub" / "r.jsonl"
    assert write_jsonl(p, [a]) == 1
    write_jsonl(p, [b], append=True)
    assert read_jsonl(p) == [a, b]
    with p.open("a") as f:
        f.write('{"suite": "x"}\n')
    with pytest.raises(RecordError, match=r"r.jsonl:3: missing key"):
        read_jsonl(p)
    bad = copy.deepcopy(a)
    bad["ours"]["ms"] = -1
    with pytest.raises(RecordError):
        write_jsonl(tmp_path / "x.jsonl", [bad])


@pytest.mark.parametrize("flops, ms, floor, bound", [
    (0, 4.0, 2.0, "memory"),  # 2 GB at 1000 GB/s = 2 ms
    (1e12, 20.0, 10.0, "compute"),  # 1 TFLOP at 100 TFLOP/s = 10 ms > 2 ms of memory
])
def test_roofline_math_in_record(flops, ms, floor, bound):
    from warpforge.bench.compare import CaseResult, Outcome
    from warpforge.timing import summarize
    from warpforge.hw.roofline import Ceilings

    ceil = Ceilings(device="toy", hbm_GBps=1000.0, source="datasheet toy",
                    tflops={k: 100.0 for k in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")})
    case = Case(name="w", params={}, make_inputs=lambda g, d: (), ours=lambda: None, peers={"p": lambda: None},
                reference=None, flops=flops, bytes=2e9, dtype=torch.float32)
    res = CaseResult(case=case, seed=0, device=CPU, ours=Outcome(timing=summarize([ms], "host")))
    r = roofline_for(res, ceil)
    assert r["floor_ms"] == pytest.approx(floor) and r["bound"] == bound
    assert r["fraction"] == pytest.approx(floor / ms) and r["ceilings"] == "datasheet toy"
    assert roofline_for(res, None) is None


def test_git_version_is_this_checkout():
    g = git_version()
    assert g is None or (len(g.removesuffix("-dirty")) == 40 and all(c in "0123456789abcdef" for c in g[:40]))
