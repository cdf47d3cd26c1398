"""Per-layer precision fallback: the bisection finds the layers a 16-bit graph must keep fp32, and the
fp32 twins are swapped in without touching the 16-bit graph."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from warpforge.optimize.precision import layer_names, search, with_fp32_layers
from warpforge.optimize.runtime import CastIO


def oracle(needed: set[str]):
    calls = []

    def passes(kept):
        calls.append(list(kept))
        missing = needed - set(kept)
        return not missing, f"missing {sorted(missing)}"
    return passes, calls


def test_bisection_finds_a_small_set_in_few_trials():
    layers = [f"L{i}" for i in range(40)]
    passes, calls = oracle({"L17", "L21"})
    res = search(layers, passes)
    assert res.kept == ["L17", "L21"] and res.layers == 40
    assert len(calls) <= 20 and len(res.trials) == len(calls)  # ~2 log2(40) + the window's pruning
    assert "2 of 40 layers kept fp32" in res.note


def test_no_fallback_when_all_fp32_fails_and_a_trial_cap():
    res = search(["a", "b"], lambda kept: (False, "over budget"))
    assert res.kept is None and "every layer fp32" in res.note and len(res.trials) == 1
    passes, _ = oracle({"L3", "L30"})
    capped = search([f"L{i}" for i in range(40)], passes, max_trials=4)
    assert "stopped after 4 trials" in capped.note and len(capped.trials) == 4
    assert search([], passes).kept is None


class Fragile(nn.Linear):
    """Right in fp32, off by 10 in any 16-bit dtype: a stand-in for a precision-sensitive layer."""

    def forward(self, x):
        y = super().forward(x)
        return y if x.dtype == torch.float32 else y + 10


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, Fragile) or super().is_leaf_module(m, name)


def _trace(model):
    return fx.GraphModule(model, _Tracer().trace(model))


def test_fp32_twins_fix_the_fragile_layer_and_leave_the_16_bit_graph_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Fragile(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    low = torch.bfloat16
    gm32, gm16 = _trace(model), _trace(copy.deepcopy(model).to(low))
    x = torch.randn(5, 8)
    ref = model(x)
    names = layer_names(gm16)
    assert names == ["0", "2", "4"]

    def passes(kept):
        out = CastIO(with_fp32_layers(gm16, gm32, kept, low), low)(x)
        err = float((out - ref).abs().max() / ref.abs().max())
        return err < 0.05, f"max_rel {err:.3f}"

    assert not passes([])[0]
    res = search(names, passes)
    assert res.kept == ["2"]
    assert type(gm16.get_submodule("2")) is Fragile and gm16.get_submodule("2").weight.dtype == low
    fixed = with_fp32_layers(gm16, gm32, ["2"], low)
    assert isinstance(fixed.get_submodule("2"), CastIO) and fixed.get_submodule("2").inner.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="GraphModule"):
        layer_names(model)


def test_optimize_gate_keeps_the_fragile_layer_fp32_and_passes(monkeypatch):
    """optimize()'s gate on a 16-bit warpforge candidate over budget: the fallback finds the layer, the
    rebuilt candidate passes and goes live, the record carries the search; off, it stays rejected."""
    from warpforge.optimize import api, pipeline
    from warpforge.optimize.backends import Built, Candidate
    from warpforge.optimize.gate import Budget

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Fragile(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    low = torch.bfloat16
    gm32, gm16 = _trace(model), _trace(copy.deepcopy(model).to(low))
    monkeypatch.setattr(pipeline, "optimize_graph", lambda base, inputs, passes=None, device=None, dtype=None,
                        capture=None: (gm32, {}))

    def build(m, inputs):
        mod = CastIO(gm16, low).eval()
        return Built(fn=mod, module=mod, save_format="pickle", details={"layers": []})

    cand = Candidate(name="warpforge-bf16", family="warpforge", precision="bf16", build=build)
    val = [(torch.randn(6, 8),) for _ in range(3)]
    with torch.no_grad():
        ref = [model(*v) for v in val]
    budget, cpu = Budget(max_rel=0.05), torch.device("cpu")
    live: dict = {}
    rec = api._try(cand, model, val[0], val, ref, "generic", budget, cpu, live, None)
    assert rec["status"] == "passed", rec.get("reason")
    assert "1 of 3 layers kept fp32" in rec["reason"] and rec["precision_fallback"]["kept_fp32"] == ["2"]
    assert rec["accuracy"]["max_rel"] < 0.05 < rec["accuracy_all_low_precision"]["max_rel"]
    fixed = live["warpforge-bf16"][1]
    assert fixed.module.inner.get_submodule("2").inner.weight.dtype == torch.float32
    assert {f["what"] for f in fixed.details["fallbacks"]} == {"2"}
    assert any(layer["dtype"] == "float32" for layer in fixed.details["layers"])
    off = api._try(cand, model, val[0], val, ref, "generic", budget, cpu, {}, None, precision_fallback=False)
    assert off["status"] == "rejected" and "precision_fallback" not in off
