"""optimize(): the search picks a passing candidate, the gate rejects broken ones, bad input says why."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import warpforge
import warpforge.optimize.backends as backends
from warpforge.optimize import BadInputError, Budget, Built, Candidate, NoCandidateError, optimize

from .nets import SmallNet, image, make

FAST = dict(queries=8, warmup=1, offline_calls=2)  # 2 busy CPU cores: the protocol's shape, not its precision
# The candidates that run on a CPU by default: ONNX Runtime's joins when it is installed (the test extra has it).
CPU_DEFAULT = {"eager-fp32", "warpforge-fp32"} | (
    {"onnxruntime-cpu"} if importlib.util.find_spec("onnxruntime") is not None else set())
# Tests whose point is not the default candidate set or ONNX leave its export out (seconds per search on a CPU);
# the default search is test_small_convnet_on_cpu_picks_a_passing_candidate, and test_saved's
# test_onnxruntime_candidate_and_round_trip builds, gates, saves and reloads the ONNX candidate.
NO_ONNX = ["eager", "warpforge"]


def _rec(report, name):
    return next(r for r in report["candidates"] if r["name"] == name)


def test_small_convnet_on_cpu_picks_a_passing_candidate():
    model, x = make(SmallNet()), image()
    opt = optimize(model, (x,), **FAST)
    rep = opt.report
    assert rep["status"] == "ok" and rep["winner"] == opt.name
    assert opt.name in CPU_DEFAULT
    assert rep["model"]["kind"] == "classifier" and rep["model"]["kind_inferred"]
    assert {r["name"] for r in rep["candidates"] if r["status"] != "skipped"} == CPU_DEFAULT
    for name in sorted(CPU_DEFAULT):
        r = _rec(rep, name)
        assert r["status"] == "passed", r
        assert r["latency"]["n"] == 8 and r["latency"]["p50_ms"] > 0 and r["throughput"]["batch"] == 2
        assert r["accuracy"]["top1"] == 1.0 and r["accuracy"]["max_rel"] < 1e-5
        assert r["peak_memory_bytes"] is None  # CPU: not measured, not faked
        assert r["speedup_vs_compile"] is None  # no torch.compile candidate was measured
    assert _rec(rep, "eager-fp32")["speedup_vs_eager"] == 1.0
    wf = _rec(rep, "warpforge-fp32")
    assert [p["name"] for p in wf["details"]["passes"]] == ["fold_bn", "channels_last", "fuse_conv", "image_input",
                                                            "max_pool", "attention", "fuse_norm", "fuse_linear"]
    assert wf["details"]["coverage"]["warpforge_ops"] == {"FusedConv2d": 6, "FusedLinear": 1}
    for name in ("eager-fp16", "warpforge-bf16", "torch.compile-fp32"):
        assert _rec(rep, name)["status"] == "skipped"
    assert "CUDA only" in _rec(rep, "eager-fp16")["reason"]
    assert "backends=['torch.compile']" in _rec(rep, "torch.compile-fp32")["reason"]
    x2 = image(n=3, seed=9)  # another batch size than the example: still right
    with torch.no_grad():
        torch.testing.assert_close(opt(x2), model(x2), rtol=1e-5, atol=1e-5)
    assert model.training is False and not any(p.dtype != torch.float32 for p in model.parameters())


class _Noisy(nn.Module):
    """Wraps the reference and adds noise: the kind of 'fast but wrong' candidate the gate must stop."""

    def __init__(self, inner, scale=None, nan=False):
        super().__init__()
        self.inner, self.scale, self.nan = inner, scale, nan

    def forward(self, x):
        y = self.inner(x).clone()
        if self.nan:
            y[0, 0] = float("nan")
        else:
            y += self.scale * y.abs().max() * torch.randn_like(y)
        return y


def _broken(monkeypatch, *extra: Candidate) -> None:
    real = backends.all_candidates
    monkeypatch.setattr(backends, "all_candidates", lambda device: real(device) + list(extra))


def test_gate_rejects_broken_candidates(monkeypatch):
    def fails_to_build(model, inputs):
        raise RuntimeError("no kernel for this layer")

    _broken(monkeypatch,
            Candidate("noisy-fp32", "test", "fp32", lambda m, i: Built(fn=_Noisy(m, scale=1e-2), module=None)),
            Candidate("nan-fp32", "test", "fp32", lambda m, i: Built(fn=_Noisy(m, nan=True), module=None)),
            Candidate("crash-fp32", "test", "fp32", fails_to_build))
    opt = optimize(make(SmallNet()), image(), backends=[*NO_ONNX, "noisy-fp32", "nan-fp32", "crash-fp32"], **FAST)
    rep = opt.report
    noisy, nan, crash = _rec(rep, "noisy-fp32"), _rec(rep, "nan-fp32"), _rec(rep, "crash-fp32")
    assert noisy["status"] == "rejected" and "max_rel" in noisy["reason"] and "budget <= 0.001" in noisy["reason"]
    assert nan["status"] == "rejected" and "non-finite value(s) (NaN)" in nan["reason"]
    assert crash["status"] == "failed" and crash["reason"] == "build failed: RuntimeError: no kernel for this layer"
    assert "latency" not in noisy and "latency" not in nan  # rejected candidates are not timed
    assert opt.name in {"eager-fp32", "warpforge-fp32"}


def test_no_candidate_meets_the_budget():
    never = Budget(metric=lambda ref, cand: 0.0, metric_name="quality", metric_min=1.0)
    with pytest.raises(NoCandidateError, match="no candidate met the accuracy budget") as err:
        optimize(make(SmallNet()), image(), budget=never, backends=NO_ONNX, **FAST)
    rep = err.value.report
    assert rep["status"] == "no_candidate" and rep["winner"] is None
    tried = [r for r in rep["candidates"] if r["status"] != "skipped"]
    assert {r["name"] for r in tried} == {"eager-fp32", "warpforge-fp32"}
    assert all(r["status"] == "rejected" and "quality 0 (budget >= 1)" in r["reason"] for r in tried)


class _Fails(nn.Module):
    def forward(self, x):
        return x @ torch.ones(5, 5)  # wrong inner size for the example input


def test_bad_input_says_what_happened():
    with pytest.raises(BadInputError, match="does not run on its example inputs: RuntimeError") as err:
        optimize(_Fails(), torch.ones(2, 3), **FAST)
    assert err.value.report["status"] == "bad_input"
    with pytest.raises(BadInputError, match=r"val\[1\] argument 0 has shape \(2, 4, 12, 12\).*batch"):
        optimize(make(SmallNet()), image(), val=[image(), torch.zeros(2, 4, 12, 12)], **FAST)
    with pytest.raises(BadInputError, match="model must be a torch.nn.Module"):
        optimize(lambda x: x, torch.ones(1))
    with pytest.raises(BadInputError, match="backends must name"):
        optimize(make(SmallNet()), image(), backends=["tensorrt"])
    with pytest.raises(BadInputError, match="precisions"):
        optimize(make(SmallNet()), image(), precisions=["int4"])
    with pytest.raises(BadInputError, match="kind"):
        optimize(make(SmallNet()), image(), kind="detector")


class _DictHead(nn.Module):
    """Two outputs in a dict (a detector-like head), an integer input it ignores but takes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, ids):
        h = torch.relu(self.conv(x))
        return {"logits": self.fc(h.mean((2, 3))), "feat": h, "ids": ids * 2}


def test_dict_outputs_user_val_and_the_package_level_call():
    model = make(_DictHead())
    x, ids = image(n=2, hw=8), torch.tensor([3, 7])
    val = [(image(n=4, hw=8, seed=s), torch.tensor([1, 2, 3, 4])) for s in (2, 3)]
    opt = warpforge.optimize(model, (x, ids), val=val, kind="classifier", backends=NO_ONNX, **FAST)  # callable module
    rep = opt.report
    assert rep["settings"]["val"] == "2 user batch(es)" and rep["model"]["kind"] == "classifier"
    ref = _rec(rep, "eager-fp32")
    assert ref["accuracy"]["n_samples"] == 8 and ref["accuracy"]["top1"] == 1.0  # top-1 over the "logits" entry
    out = opt(x, ids)
    assert set(out) == {"logits", "feat", "ids"} and torch.equal(out["ids"], ids * 2)
    with torch.no_grad():
        torch.testing.assert_close(out["feat"], model(x, ids)["feat"], rtol=1e-5, atol=1e-5)


def test_progress_callback_counts_up():
    seen = []
    optimize(make(SmallNet(c=4)), image(n=1, hw=8), backends=["eager"],
             progress=lambda what, done, total: seen.append((what, done, total)), **FAST)
    assert seen[0] == ("building eager-fp32", 0, 2) and seen[-1] == ("done", 2, 2)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


@pytest.mark.gpu
def test_gpu_half_precision_candidates_and_cuda_graphs():
    model, x = make(SmallNet(c=16)), image(n=4, hw=32)
    opt = optimize(model, (x,), device="cuda", backends=["eager", "warpforge"], queries=50, warmup=5,
                   exhaustive=True)
    rep = opt.report
    for name in ("eager-fp16", "warpforge-fp32", "warpforge-fp16"):
        r = _rec(rep, name)
        assert r["status"] == "passed", r
        assert r["latency"]["method"] == "cuda_event+sync" and r["peak_memory_bytes"] > 0
    for name in ("eager-bf16", "warpforge-bf16"):  # 8 bits of mantissa over six convs: measured, may be near the bar
        assert _rec(rep, name)["status"] in ("passed", "rejected") and _rec(rep, name)["accuracy"]["max_rel"] < 0.2
    wf16 = _rec(rep, "warpforge-fp16")
    assert wf16["details"]["layers"][0]["dtype"] == "float16"
    assert wf16["cuda_graph"] and _rec(rep, "warpforge-fp32")["cuda_graph"]
    assert not _rec(rep, "eager-fp16")["cuda_graph"]
    y = opt(x.cuda())
    assert y.dtype == torch.float32 and y.is_cuda
    budget = Budget.for_precision(opt.precision)
    with torch.no_grad():
        want = model.cuda()(x.cuda())
    assert (y - want).abs().max().item() <= budget.max_rel * want.abs().max().item()


@pytest.mark.gpu
def test_gpu_dominated_candidates_are_not_built():
    """Default on CUDA: fp16 builds first; once it passes as built, warpforge-fp32 and -bf16 are skipped."""
    model, x = make(SmallNet(c=16)), image(n=4, hw=32)
    rep = optimize(model, (x,), device="cuda", backends=["eager", "warpforge"], precisions=["fp32", "fp16", "bf16"],
                   queries=20, warmup=2).report
    assert _rec(rep, "warpforge-fp16")["status"] == "passed"
    for name in ("warpforge-fp32", "warpforge-bf16"):
        r = _rec(rep, name)
        assert r["status"] == "skipped" and "not built: warpforge-fp16 passed the gate" in r["reason"], r
        assert "build_s" not in r
    assert _rec(rep, "eager-bf16")["status"] in ("passed", "rejected")  # eager is cheap: never pruned
    assert [r["name"] for r in rep["candidates"]][:3] == ["eager-fp32", "eager-fp16", "eager-bf16"]  # plan order kept


def test_dominance_rule_and_build_order():
    from warpforge.optimize.api import _build_order, _dominated

    def cand(name, fam, prec):
        return Candidate(name, fam, prec, lambda m, i: None)

    plan = [(cand("eager-fp32", "eager", "fp32"), None), (cand("warpforge-fp32", "warpforge", "fp32"), None),
            (cand("warpforge-fp16", "warpforge", "fp16"), None), (cand("warpforge-bf16", "warpforge", "bf16"), None),
            (cand("warpforge-int8", "warpforge", "int8"), None)]
    assert _build_order(plan, prune=False) == [0, 1, 2, 3, 4]
    assert _build_order(plan, prune=True) == [2, 4, 3, 0, 1]  # 16-bit (and int8) first, fp32 last, stable
    passed16 = {"name": "warpforge-fp16", "family": "warpforge", "precision": "fp16", "status": "passed"}
    assert _dominated(plan[1][0], [passed16]) == "warpforge-fp16"
    assert _dominated(plan[3][0], [passed16]) == "warpforge-fp16"
    assert _dominated(plan[4][0], [passed16]) is None  # int8 can be faster: always built
    assert _dominated(cand("torch.compile-fp32", "torch.compile", "fp32"), [passed16]) is None  # other family
    assert _dominated(plan[0][0], [passed16 | {"family": "eager"}]) is None  # the reference is always built
    assert _dominated(plan[1][0], [passed16 | {"status": "rejected"}]) is None
    # fp16 that passed only with layers kept fp32 does not rule out bf16 or fp32 (a clean bf16 may be faster)
    assert _dominated(plan[3][0], [passed16 | {"precision_fallback": {"kept_fp32": ["conv1"]}}]) is None
    bf = {"name": "warpforge-bf16", "family": "warpforge", "precision": "bf16", "status": "passed"}
    assert _dominated(plan[1][0], [bf]) == "warpforge-bf16" and _dominated(plan[3][0], [bf]) is None


@pytest.mark.gpu
def test_gpu_torch_compile_is_a_peer():
    model, x = make(SmallNet(c=16)), image(n=4, hw=32)
    opt = optimize(model, (x,), device="cuda", precisions=["fp16"],
                   backends=["eager", "warpforge", "torch.compile-fp16"], queries=50, warmup=5)
    rep = opt.report
    tc = _rec(rep, "torch.compile-fp16")
    assert tc["status"] == "passed", tc
    assert tc["speedup_vs_compile"] == pytest.approx(1.0)
    assert _rec(rep, "warpforge-fp16")["speedup_vs_compile"] > 0
