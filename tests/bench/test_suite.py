"""Case and Suite validate themselves."""

from __future__ import annotations

import pytest
import torch

from warpforge.bench.suite import Case, Suite


def _case(**kw):
    base = dict(name="x", params={"n": 4}, make_inputs=lambda g, d: (torch.ones(4),), ours=lambda x: x,
                peers={"torch": lambda x: x}, reference=lambda x: x.double(), flops=0, bytes=32,
                dtype=torch.float32, metric="GBps")
    base.update(kw)
    return Case(**base)


def test_valid_case_and_figure():
    c = _case(bytes=2e9)
    assert c.figure(2.0) == pytest.approx(1000.0)  # 2 GB in 2 ms = 1000 GB/s
    m = _case(metric="tflops", flops=4e12)
    assert m.figure(1000.0) == pytest.approx(4.0)


@pytest.mark.parametrize("kw, match", [
    (dict(name=""), "name"),
    (dict(metric="GFLOPs"), "metric"),
    (dict(ours=None), "ours"),
    (dict(make_inputs="no"), "make_inputs"),
    (dict(peers={}), "peers"),
    (dict(peers={"torch": 3}), "peer 'torch'"),
    (dict(peers={"ours": lambda x: x}), "peer name"),
    (dict(reference=5), "reference"),
    (dict(params={"dtype": torch.float32}), "JSON"),
    (dict(bytes=-1), "bytes"),
    (dict(bytes=float("nan")), "bytes"),
    (dict(metric="tflops", flops=0), "flops > 0"),
    (dict(dtype="float32"), "dtype"),
    (dict(tol=-1e-3), "tol"),
])
def test_invalid_case_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        _case(**kw)


def test_suite_build_checks_unique_names_and_types():
    s = Suite(name="t", description="d", cases=lambda quick: [_case(name="a"), _case(name="a")])
    with pytest.raises(ValueError, match="duplicate case name 'a'"):
        s.build()
    s = Suite(name="t", description="d", cases=lambda quick: [_case(name="a"), "b"])
    with pytest.raises(ValueError, match="expected Case"):
        s.build()
    s = Suite(name="t", description="d", cases=lambda quick: [_case(name=f"n{int(quick)}")])
    assert [c.name for c in s.build(quick=True)] == ["n1"]


def test_suite_rejects_bad_fields():
    with pytest.raises(ValueError, match="name"):
        Suite(name=" ", description="d", cases=lambda q: [])
    with pytest.raises(ValueError, match="callable"):
        Suite(name="t", description="d", cases=[])
