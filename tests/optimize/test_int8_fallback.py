"""Per-layer float fallback of the int8 candidate: the ranked search (``precision.search_ranked``) and
``optimize``'s gate keeping the quantized layers that put warpforge-int8 over budget in float, on tiny
conv nets (the int8 convs run their exact int32-sum references on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warpforge.optimize import NoCandidateError, optimize
from warpforge.optimize.gate import DEFAULT_BUDGETS, Budget, compare
from warpforge.optimize.precision import search_ranked

from .test_precision_fallback import oracle  # a pass/fail oracle that needs a given set of layers kept


def test_ranked_search_finds_the_needed_layers_even_when_ranked_late():
    layers = [f"L{i}" for i in range(20)]
    passes, calls = oracle({"L1", "L5"})  # L5 ranked 6th: the galloping step must reach 8, then come back
    res = search_ranked(layers, passes)
    assert res.kept == ["L1", "L5"] and res.layers == 20 and res.kept_as == "float"
    assert [len(c) for c in calls[:4]] == [1, 2, 4, 8]  # galloping before any bisection
    assert len(calls) == len(res.trials) <= 12 and max(len(c) for c in calls) == 8  # never every layer
    assert res.as_dict()["kept_float"] == ["L1", "L5"] and "2 of 20 layers kept float" in res.note


def test_ranked_search_one_trial_when_the_worst_layer_is_the_one():
    passes, calls = oracle({"L0"})
    res = search_ranked([f"L{i}" for i in range(35)], passes)
    assert res.kept == ["L0"] and calls == [["L0"]]


def test_ranked_search_rejects_clearly_when_no_set_passes_and_caps_trials():
    res = search_ranked(["a", "b", "c"], lambda kept: (False, "over budget"))
    assert res.kept is None and "still over budget with all 3 layers kept float" in res.note
    assert [t["float_layers"] for t in res.trials] == [1, 2, 3]
    passes, _ = oracle({"L30"})
    capped = search_ranked([f"L{i}" for i in range(40)], passes, max_trials=3)
    assert capped.kept is None and "stopped after 3 trials" in capped.note and len(capped.trials) == 3
    assert "no layer to keep float" in search_ranked([], passes).note
    with pytest.raises(ValueError, match="ranked"):
        search_ranked(["a", "a"], passes)
    with pytest.raises(ValueError, match="max_trials"):
        search_ranked(["a"], passes, max_trials=0)


def sensitive_net() -> nn.Sequential:
    """Four int8-able layers; the second (3x3 conv) reads a tensor whose channel 0 is 1e4x louder than the
    rest but ignores that channel: its per-tensor input scale, set by the loud channel, rounds the quiet
    channels it does read to a few steps. Kept float, the net is within the int8 budget."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 32, 1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 32, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    with torch.no_grad():
        net[0].weight[0] *= 1e4
        net[2].weight[:, 0] = 0
    return net.eval()


def _data():
    g = torch.Generator().manual_seed(1)
    val = [(torch.randn(4, 16, 8, 8, generator=g),) for _ in range(3)]
    calib = [(torch.randn(4, 16, 8, 8, generator=g),) for _ in range(2)]
    return val, calib


def _int8(net, val, calib, budget=None, **kw):
    opt = optimize(net, val[0], val=val, calib=calib, precisions=["int8"], backends=["warpforge-int8"],
                   kind="generic", budget=budget, queries=1, warmup=0, offline_calls=1, **kw)
    return opt, next(r for r in opt.report["candidates"] if r["name"] == "warpforge-int8")


def test_the_sensitive_layer_is_the_one_kept_float_and_the_rest_stay_int8():
    net = sensitive_net()
    val, calib = _data()
    opt, rec = _int8(net, val, calib)
    assert rec["status"] == "passed", rec["reason"]
    fb = rec["precision_fallback"]
    assert fb["kept_float"] == ["2_fused"] and fb["layers"] == 4 and fb["float_dtype"] == "float32"
    assert "1 of 4 int8 layers kept float32" in rec["reason"]
    bar = DEFAULT_BUDGETS["int8"].max_rel
    assert rec["accuracy_all_low_precision"]["max_rel"] > bar > rec["accuracy"]["max_rel"]
    quant = rec["details"]["quant"]
    assert sorted(layer["name"] for layer in quant["layers"]) == ["0_fused", "4_fused", "8"]
    kept = {k["name"]: k["reason"] for k in quant["kept"]}
    assert "accuracy fallback" in kept["2_fused"]
    assert any(f["what"] == "2_fused" and "accuracy fallback" in f["reason"] for f in rec["details"]["fallbacks"])
    assert rec["details"]["coverage"]["warpforge_ops"] == {"QuantConv2d": 2, "FusedConv2d": 1, "QuantLinearW8A8": 1}
    # what optimize returns is the model the gate passed
    with torch.no_grad():
        ref, got = [net(*v) for v in val], [opt(*v) for v in val]
    assert compare(ref, got, batched=True).max_rel == pytest.approx(rec["accuracy"]["max_rel"])

    with pytest.raises(NoCandidateError) as e:
        _int8(net, val, calib, precision_fallback=False)
    off = next(r for r in e.value.report["candidates"] if r["name"] == "warpforge-int8")
    assert off["status"] == "rejected" and "max_rel" in off["reason"] and "precision_fallback" not in off


@pytest.mark.parametrize("max_rel", [0.2, 0.02, 0.005, 0.001, 1e-9])
def test_the_fallback_never_returns_a_candidate_over_budget(max_rel):
    """Tighter bars need more layers float, down to bars no int8 layer meets: whatever comes back passed
    is within the budget when run again, and a rejection says why."""
    net = sensitive_net()
    val, calib = _data()
    budget = Budget(max_rel=max_rel, min_cosine=0.95)
    try:
        opt, rec = _int8(net, val, calib, budget={"int8": budget})
    except NoCandidateError as e:
        rec = next(r for r in e.report["candidates"] if r["name"] == "warpforge-int8")
        print(f"\nmax_rel <= {max_rel}: rejected, {rec['precision_fallback']['note']}")
        fb = rec["precision_fallback"]
        assert rec["status"] == "rejected" and "max_rel" in rec["reason"] and fb["trials"] >= 1
        # over budget with every layer float, or within it only so: no int8 layer would be left
        assert fb["kept_float"] is None or len(fb["kept_float"]) == 4, fb
        assert "every int8 layer kept" in fb["note"] or "still over budget" in fb["note"]
        return
    print(f"\nmax_rel <= {max_rel}: {rec['reason']}; kept {rec['precision_fallback']['kept_float']}")
    assert rec["status"] == "passed" and rec["precision_fallback"]["kept_float"]
    with torch.no_grad():
        ref, got = [net(*v) for v in val], [opt(*v) for v in val]
    assert compare(ref, got, batched=True).passes(budget)[0]
    n_float = len(rec["precision_fallback"]["kept_float"])
    assert len(rec["details"]["quant"]["layers"]) == 4 - n_float


def test_a_budget_no_set_of_float_layers_meets_is_a_clear_rejection():
    net = sensitive_net()
    val, calib = _data()
    never = Budget(max_rel=0.2, metric=lambda ref, out: 0.0, metric_name="never_met", metric_min=1.0)
    with pytest.raises(NoCandidateError) as e:
        _int8(net, val, calib, budget={"int8": never})
    rec = next(r for r in e.value.report["candidates"] if r["name"] == "warpforge-int8")
    fb = rec["precision_fallback"]
    assert rec["status"] == "rejected" and "never_met" in rec["reason"]
    assert fb["kept_float"] is None and "still over budget with all 4 layers kept float" in fb["note"]
    assert fb["trial_log"][-1]["float_layers"] == 4 and not any(t["passed"] for t in fb["trial_log"])


def test_a_trial_ends_once_the_budget_is_missed_for_certain():
    from warpforge.optimize.api import _already_over
    from warpforge.optimize.gate import Accuracy

    bars = Budget(max_rel=0.2, min_cosine=0.95, min_top1=0.99)
    fine = dict(max_rel=0.1, min_cosine=0.99)
    assert _already_over(Accuracy(max_rel=0.3, min_cosine=0.99, top1=1.0, n_samples=30), bars, 261)
    assert _already_over(Accuracy(max_rel=0.1, min_cosine=0.9, top1=1.0, n_samples=30), bars, 261)
    assert _already_over(Accuracy(errors=["out: NaN"]), bars, 261)
    # 261 decisive samples at 0.99 allow 2 misses in all: 2 in the first batches may still pass, 3 never
    assert not _already_over(Accuracy(**fine, top1=28 / 30, n_samples=30), bars, 261)
    assert _already_over(Accuracy(**fine, top1=27 / 30, n_samples=30), bars, 261)
    mean = Budget(max_rel=0.2, metric=lambda r, c: 0.0, metric_min=1.0)  # a mean can recover: never early
    assert not _already_over(Accuracy(**fine, metric=0.0), mean, 261)

    net = sensitive_net()
    val, calib = _data()
    opt, rec = _int8(net, val, calib, budget={"int8": Budget(max_rel=0.005)})
    log = rec["precision_fallback"]["trial_log"]
    failed = [t["why"] for t in log if not t["passed"]]
    assert any("stopped after 1 of 3 val batches" in why for why in failed), log  # the rest failed on the last


def test_shorten_prefix_one_trial_when_the_shorter_prefix_fails_then_bisection():
    from warpforge.optimize.precision import shorten_prefix

    kept = [f"L{i}" for i in range(6)]
    passes, calls = oracle(set(kept))  # every layer needed: the one-shorter prefix fails, and that ends it
    res = shorten_prefix(kept, passes)
    assert res.kept is None and calls == [kept[:5]] and "did not pass" in res.note
    passes, calls = oracle({"L0", "L1"})
    res = shorten_prefix(kept, passes)
    assert res.kept == ["L0", "L1"] and calls[0] == kept[:5] and len(calls) <= 4
    assert all(len(c) < 6 for c in calls) and "2 of the 6 layers kept float" in res.note
    passes, calls = oracle(set())  # none needed: down to the empty prefix
    assert shorten_prefix(kept, passes).kept == []
    assert shorten_prefix(["a"], oracle(set())[0]).kept == [] and shorten_prefix([], passes).kept is None
    assert "stopped after 1 trials" in shorten_prefix(kept, oracle({"L0"})[0], max_trials=1).note


def bias_net() -> nn.Sequential:
    """A 1x1 conv whose every weight sits 0.45 of a quantization step above its grid point, on inputs with
    a mean of ~1: rounding shifts each output by the same amount, which bias correction cancels (every
    layer int8 on CPU: max_rel 0.070 plain, 0.005 bias-corrected)."""
    net = nn.Sequential(nn.Conv2d(64, 8, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        n = torch.randint(-60, 61, (8, 64), generator=g).float() + 0.45
        n[:, 0] = 127.0  # the per-channel scale: max |w| = 127 steps
        net[0].weight.copy_((n * 0.01)[:, :, None, None])
        net[0].bias.zero_()
        torch.manual_seed(4)
        net[4].reset_parameters()
    return net.eval()


def _bias_data():
    gen = torch.Generator().manual_seed(2)
    batches = [((1.0 + 0.05 * torch.randn(4, 64, 8, 8, generator=gen)).relu(),) for _ in range(5)]
    return batches[2:], batches[:2]


def test_bias_correction_lets_the_fallback_keep_fewer_layers_float():
    """Over budget with every layer int8 and the plain search keeping the conv float: the bias-corrected
    rebuild of the shorter prefix (none float) passes, and that build is what optimize returns; the trials
    are recorded."""
    val, calib = _bias_data()
    budget = {"int8": Budget(max_rel=0.02, min_cosine=0.95)}
    opt, rec = _int8(bias_net(), val, calib, budget=budget)
    assert rec["status"] == "passed" and "bias-corrected" in rec["reason"], rec["reason"]
    fb = rec["precision_fallback"]
    assert rec["accuracy_all_low_precision"]["max_rel"] > 0.02 > rec["accuracy"]["max_rel"]
    assert fb["kept_float"] == [] and fb["bias_correction"]["chosen"] and fb["bias_correction"]["trials"] == 1
    assert rec["details"]["quant"]["bias_correction"] is True and len(rec["details"]["quant"]["layers"]) == 2
    net = bias_net()
    with torch.no_grad():
        assert compare([net(*v) for v in val], [opt(*v) for v in val], batched=True).passes(budget["int8"])[0]
    # the plain search had kept a layer float; the correction is what let it go int8
    plain, corrected = fb["note"].split("; with bias correction ")
    assert plain.startswith("1 of 2 ") and corrected, fb["note"]
