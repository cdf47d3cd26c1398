"""``warpforge.profile`` end to end on CPU: a real tiny CNN gives rows, hand-counted FLOPs and a report."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from warpforge.profile import Profile, ProfileError, profile

# Hand counts for TinyCNN on a [2, 3, 8, 8] input (one multiply-add = 2 FLOPs):
CONV = 2 * (2 * 8 * 8 * 8) * (3 * 3 * 3)  # each of 1,024 outputs: 27 multiply-adds
BN = 1024 * 4  # inference batch norm: subtract, scale, weight, bias
RELU = 1024
POOL = 1024  # adaptive average to 1x1: one add per input element
FC = 2 * 2 * 8 * 10


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.act = torch.nn.ReLU()
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.pool(self.act(self.bn(self.conv(x)))).flatten(1))


@pytest.fixture(scope="module")
def tiny() -> tuple[TinyCNN, torch.Tensor]:
    torch.manual_seed(0)
    return TinyCNN().eval(), torch.randn(2, 3, 8, 8)


@pytest.fixture(scope="module")
def prof(tiny) -> Profile:
    m, x = tiny
    return profile(m, x, warmup=1, iters=3, name="TinyCNN")


def test_rows_and_hand_counted_flops(prof):
    by = {r.name: r for r in prof.analysis.ops}
    want = {"conv / aten::conv2d": CONV, "bn / aten::batch_norm": BN, "act / aten::relu": RELU,
            "pool / aten::adaptive_avg_pool2d": POOL, "fc / aten::linear": FC}
    for name, flops in want.items():
        assert by[name].flops == flops, name
        assert by[name].calls == 1 and by[name].time_us > 0
    assert prof.counts.flops == CONV + BN + RELU + POOL + FC
    assert prof.analysis.totals["flops"] == prof.counts.flops
    assert sum(r.share for r in prof.analysis.ops) == pytest.approx(1.0)
    # conv output write + input + weight + bias, at fp32
    assert by["conv / aten::conv2d"].bytes == (2 * 3 * 64 + 8 * 27 + 8 + 2 * 8 * 64) * 4


def test_cpu_run_omits_the_roofline_and_says_so(prof):
    a = prof.analysis
    assert a.device_type == "cpu" and a.ceilings is None and a.kernels == []
    assert all(r.fraction is None for r in a.ops)
    assert a.verdict.startswith("CPU run")
    assert any("roofline is omitted" in n for n in a.notes)
    assert prof.window_ms > 0 and prof.plain_ms is not None


def test_module_spans_cover_the_measured_iterations_only(prof):
    mods = {m["module"]: m for m in prof.modules}
    assert mods[""]["type"] == "TinyCNN"
    assert mods["conv"]["calls"] == 1  # the profiler's warm-up call is not in the window
    assert mods["conv"]["span_us"] >= mods["conv"]["op_time_us"] * 0.5
    assert mods["fc"]["flops"] == FC


def test_write_json_html_and_trace(prof, tmp_path):
    paths = prof.write(tmp_path / "out", trace=True)
    d = json.loads(paths["json"].read_text())
    assert d["tool"] == "warpforge.profile" and d["schema"] == 1
    assert d["counts"]["flops"] == prof.counts.flops and d["timing"]["iters"] == 3
    assert {r["name"] for r in d["ops"]} >= {"conv / aten::conv2d", "fc / aten::linear"}
    html = paths["html"].read_text()
    assert html.startswith("<!DOCTYPE html>") and 'id="no-roofline"' in html and "TinyCNN" in html
    with gzip.open(paths["trace"], "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"module:conv", "module:(TinyCNN)", "warpforge:iter", "aten::conv2d"} <= names


def test_inference_mode_by_default_and_grad_on_request(tiny):
    seen = []

    def f(x):
        seen.append(torch.is_inference_mode_enabled())
        return x * 2

    x = tiny[1]
    profile(f, x, warmup=1, iters=1, measure_overhead=False)
    assert all(seen)
    seen.clear()
    profile(f, x, warmup=1, iters=1, grad=True, measure_overhead=False)
    assert not any(seen)


def test_bound_method_and_explicit_module_name_operators(tiny):
    m, x = tiny
    p = profile(lambda a: m(a), x, module=m, warmup=0, iters=1, measure_overhead=False)
    assert "fc / aten::linear" in {r.name for r in p.analysis.ops}
    q = profile(m.forward, x, warmup=0, iters=1, measure_overhead=False)
    assert "conv / aten::conv2d" in {r.name for r in q.analysis.ops}


def test_counting_failure_costs_only_the_flops(tiny):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    def shy(x):  # refuses to run under any dispatch mode (as some compiled regions do)
        if _get_current_dispatch_mode() is not None:
            raise RuntimeError("no modes here")
        return torch.relu(x)

    p = profile(shy, tiny[1], warmup=1, iters=2, measure_overhead=False)
    assert p.counts.error and "no modes here" in p.counts.error
    assert any("FLOP counting stopped early" in n for n in p.analysis.notes)
    assert [r.op for r in p.analysis.ops] == ["aten::relu"] and p.analysis.ops[0].flops is None


def test_a_model_that_fails_is_reported(tiny):
    def broken(x):
        raise RuntimeError("boom")

    with pytest.raises(ProfileError, match="failed during warm-up: RuntimeError: boom"):
        profile(broken, tiny[1], warmup=1, iters=1)

    calls = []

    def fails_later(x):
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("ran out")
        return x + 1

    with pytest.raises(ProfileError, match="failed in the measured window: ValueError: ran out"):
        profile(fails_later, tiny[1], warmup=1, iters=5, measure_overhead=False)


def test_empty_window_and_bad_settings(tiny):
    with pytest.raises(ProfileError, match="empty window"):
        profile(lambda: None, warmup=1, iters=2, measure_overhead=False)
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        profile(tiny[0], tiny[1], iters=0)
    with pytest.raises(ValueError, match="fn: expected a callable"):
        profile(42)


def test_public_api_imports():
    import warpforge.profile as wp

    for name in wp.__all__:
        assert hasattr(wp, name), f"warpforge.profile.{name} is exported but missing"
