"""FP8 (e4m3) linears (optimize/fp8.py) and the warpforge-fp8 candidates.

On CPU ``matmul_fp8`` runs its torch reference on the same e4m3 operands (the Triton interpreter has no fp8),
which checks the pass: which layers, which scales, the report, the errors. The candidates themselves are
skipped on CPU and on GPUs below compute capability 8.9; the GPU tests run them on the fp8 GEMM.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from warpforge.kernels.reference import FP8_E4M3_MAX
from warpforge.optimize import load, optimize
from warpforge.optimize.backends import select
from warpforge.optimize.fp8 import FP8Linear, quantize_fp8
from warpforge.optimize.report import to_html

from .nets import LinearHeavy, small_planner, tokens

FAST = dict(queries=4, warmup=1, offline_calls=2)


def _net() -> nn.Module:
    """embed K=10 (too small), fc1 64 -> 144 and fc2 144 -> 64 (fp8), head N=37 (not a multiple of 8), logit N=1."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LinearHeavy(width=64, hidden=144, out=37).eval()


def _manual(layer: FP8Linear, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the e4m3 GEMM computes, written out: e4m3 input at ``scale`` times the e4m3 weight, fp32 sums."""
    xq = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    w = layer.weight_q.float() * layer.weight_scale[:, None]
    return xq @ w.T + layer.bias


def test_static_scales_are_the_calibrated_input_maxima():
    model = _net()
    ref_model = copy.deepcopy(model)
    calib = [(tokens(b=4, t=9, seed=s),) for s in (11, 12)]
    seen: dict[str, float] = {}
    hooks = [getattr(ref_model, n).register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(a[0].abs().max())))) for n in ("fc1", "fc2")]
    with torch.no_grad():
        for (x,) in calib:
            ref_model(x)
    for h in hooks:
        h.remove()

    q, rep = quantize_fp8(model, calib)
    assert [r.name for r in rep.layers] == ["fc1", "fc2"]
    for name in ("fc1", "fc2"):
        layer = getattr(q, name)
        assert isinstance(layer, FP8Linear) and layer.weight_q.dtype == torch.float8_e4m3fn
        assert float(layer.act_scale) == pytest.approx(seen[name] / FP8_E4M3_MAX, rel=1e-6)
        r = next(r for r in rep.layers if r.name == name)
        assert r.observer == "max" and r.threshold == pytest.approx(seen[name], rel=1e-6)
        assert 0 < r.rel_err < 0.06 and r.cosine > 0.998  # 3 mantissa bits on both operands
    kept = {k.name: k.reason for k in rep.kept}
    assert set(kept) == {"embed", "head", "logit"}
    assert "N = 37 not a multiple of 8" in kept["head"] and "below 16 features" in kept["logit"]
    assert rep.output_rel_err is not None and 0 < rep.output_rel_err < 0.05

    x = tokens(b=3, t=5, seed=7)  # fresh inputs
    with torch.no_grad():
        xin = torch.randn(15, 64, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(q.fc1(xin), _manual(q.fc1, xin, q.fc1.act_scale), rtol=1e-5, atol=1e-5)
        (y, _), (y_ref, _) = q(x), ref_model(x)
        assert 0 < ((y - y_ref).norm() / y_ref.norm()).item() < 0.05
        big = q.fc1(100 * xin)  # beyond the calibrated range: saturates at +-448 steps, never inf or NaN
        assert bool(torch.isfinite(big).all())


def test_dynamic_scales_per_row_need_no_calibration():
    model = _net()
    ref_model = copy.deepcopy(model)
    q, rep = quantize_fp8(model, activations="dynamic")
    assert rep.activations == "dynamic" and [r.name for r in rep.layers] == ["fc1", "fc2"]
    assert all(r.act_scale is None and r.rel_err is None for r in rep.layers)  # nothing measured without calib
    assert q.fc1.act_scale is None and "dynamic per row" in repr(q.fc1)
    xin = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    xin[2] *= 1000  # one loud row does not cost the others their resolution
    row_scale = xin.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX
    with torch.no_grad():
        torch.testing.assert_close(q.fc1(xin), _manual(q.fc1, xin, row_scale), rtol=1e-5, atol=1e-5)
        ref = ref_model.fc1(xin)
        quiet = [0, 1, 3, 4, 5]
        assert ((q.fc1(xin)[quiet] - ref[quiet]).norm() / ref[quiet].norm()).item() < 0.06
    _, rep = quantize_fp8(copy.deepcopy(ref_model), [(tokens(),)], activations="dynamic")
    assert all(r.rel_err is not None for r in rep.layers)  # calib given: errors measured, scales still per row


def test_report_text_and_dict():
    q, rep = quantize_fp8(_net(), [(tokens(),)])
    text = str(rep)
    assert "fc1" in text and "(max)" in text and "kept float: N = 37 not a multiple of 8" in text
    assert "model output: rel_err" in text
    d = rep.as_dict()
    assert d["activations"] == "static" and [x["decision"] for x in d["layers"]] == ["fp8", "fp8"]
    assert {x["decision"] for x in d["kept"]} == {"float"}
    assert d["layers"][0]["in_features"] == 64 and d["layers"][0]["out_features"] == 144
    json.dumps(d)  # JSON-able as is


def test_layer_rules():
    seq = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40), nn.Linear(40, 24), nn.Linear(24, 8)).eval()
    q, rep = quantize_fp8(seq, activations="dynamic", skip=("1",))
    kept = {k.name: k.reason for k in rep.kept}
    assert [r.name for r in rep.layers] == ["0"]
    assert kept["1"] == "skipped by request"
    assert "K = 40 not a multiple of 16" in kept["2"]  # N = 24 is fine (a multiple of 8)
    assert "N = 8: below 16 features" in kept["3"]
    bare, rep = quantize_fp8(nn.Linear(64, 32), activations="dynamic")
    assert isinstance(bare, FP8Linear) and rep.layers[0].name == ""

    class Branchy(nn.Module):  # fc_b never runs on the calibration inputs: no static scale for it
        def __init__(self):
            super().__init__()
            self.fc_a, self.fc_b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.fc_a(x)

    q, rep = quantize_fp8(Branchy(), [(torch.randn(4, 32),)])
    assert [r.name for r in rep.layers] == ["fc_a"] and isinstance(q.fc_b, nn.Linear)
    assert "not called on the calibration inputs" in {k.name: k.reason for k in rep.kept}["fc_b"]


def test_quantized_model_pickles_with_its_scales(tmp_path):
    q, _ = quantize_fp8(_net(), [(tokens(),)])
    torch.save(q, tmp_path / "q.pt")
    back = torch.load(tmp_path / "q.pt", weights_only=False)
    assert float(back.fc1.act_scale) == float(q.fc1.act_scale)  # no re-calibration on load
    x = tokens(seed=3)
    with torch.no_grad():
        for a, b in zip(back(x), q(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="activations: expected one of"):
        quantize_fp8(_net(), activations="per-channel")
    with pytest.raises(ValueError, match="static fp8 input scales need calibration batches"):
        quantize_fp8(_net())
    with pytest.raises(ValueError, match="'mse' searches thresholds on the uniform int8 grid"):
        quantize_fp8(_net(), [(tokens(),)], observer="mse")
    with pytest.raises(ValueError, match="observer: expected one of"):
        quantize_fp8(_net(), [(tokens(),)], observer="minmax")
    with pytest.raises(ValueError, match=r"calib_inputs\[0\]: expected a tuple of model arguments"):
        quantize_fp8(_net(), [tokens()])
    with pytest.raises(ValueError, match=r"calib_inputs\[1\]: Linear '0' expects an input \[..., 32\], got \(4, 31\)"):
        quantize_fp8(nn.Sequential(nn.Linear(32, 48)), [(torch.randn(4, 32),), (torch.randn(4, 31),)])
    with pytest.raises(ValueError, match="model: expected an nn.Module"):
        quantize_fp8(lambda x: x, activations="dynamic")
    with pytest.raises(ValueError, match="linear: expected an nn.Linear"):
        FP8Linear(nn.Conv2d(3, 8, 1), None)
    with pytest.raises(ValueError, match="act_scale: expected a finite positive scale"):
        FP8Linear(nn.Linear(32, 32), 0.0)
    with pytest.raises(ValueError, match=r"x: expected \[..., 32\]"):
        FP8Linear(nn.Linear(32, 32), None)(torch.randn(2, 16))


def test_candidates_skipped_without_an_fp8_gpu(monkeypatch):
    model, inputs, _ = small_planner()
    rep = optimize(model, inputs, precisions=["fp32", "fp8"], backends=["warpforge"], **FAST).report
    for name in ("warpforge-fp8", "warpforge-fp8-dynamic"):
        rec = next(r for r in rep["candidates"] if r["name"] == name)
        assert rec["status"] == "skipped" and "compute capability >= 8.9" in rec["reason"]
        assert "no fp8 kernels on cpu" in rec["reason"]
    assert "calib" not in rep["settings"]  # nothing calibrated for a skipped candidate
    assert [n for n in rep["notes"] if not n.startswith("noisy timings")] == []
    default = optimize(model, inputs, backends=["warpforge"], **FAST).report  # opt-in: absent unless asked
    assert not any(r["precision"] == "fp8" for r in default["candidates"])

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))  # an Ampere card
    plan = dict((c.name, skip) for c, skip in select(torch.device("cuda"), ["fp32", "fp8"], ["warpforge"]))
    assert "e4m3 tensor-core matmul needs compute capability >= 8.9, this GPU has 8.6" == plan["warpforge-fp8"]


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fp8_linear_matches_its_reference(dtype):
    q, _ = quantize_fp8(LinearHeavy(width=256, hidden=1024, out=40).eval(), [(tokens(b=8, t=64),)])
    for name in ("fc1", "fc2", "head"):
        layer = getattr(q, name)
        xin = torch.randn(8 * 64, layer.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = _manual(layer, xin, layer.act_scale)  # CPU, the same e4m3 operands
            got = copy.deepcopy(layer).cuda()(xin.to("cuda", dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    # quantize a model already in dtype (.to(dtype) after quantizing would cast the e4m3 weights too)
    dyn, _ = quantize_fp8(LinearHeavy(width=256, hidden=1024, out=40).eval().to("cuda", dtype), activations="dynamic")
    x = tokens(b=8, t=64).to("cuda", dtype)
    with torch.no_grad():
        y = dyn(x)[0]
    assert y.dtype == dtype and bool(torch.isfinite(y).all())


@pytest.mark.gpu
def test_gpu_candidates_cuda_graph_and_round_trip(tmp_path):
    model, inputs, c = small_planner(dim=256, ffn=1024)
    inputs = tuple(x.cuda() for x in inputs)
    calib = [tuple(x.cuda() for x in small_planner(dim=256, ffn=1024)[1])]
    opt = optimize(model, inputs, calib=calib, device="cuda", precisions=["fp16", "fp8"], backends=["warpforge"],
                   queries=30, warmup=5)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    for name in ("warpforge-fp8", "warpforge-fp8-dynamic"):
        rec = next(r for r in opt.report["candidates"] if r["name"] == name)
        assert rec["status"] == "passed", rec
        assert rec["cuda_graph"], rec["details"].get("fallbacks")  # no host sync in the fp8 layers
        kept = {k["name"] for k in rec["details"]["fp8"]["kept"]}
        assert kept == {"agent_encoder.point.0", "map_encoder.point.0", "traj_head.2", "mode_head"}
        assert rec["details"]["coverage"]["warpforge_ops"]["FP8Linear"] == n_linear - 4
        assert rec["latency"]["p50_ms"] > 0
    assert "FP8 quantization" in to_html(opt.report)

    only = optimize(model, inputs, calib=calib, device="cuda", precisions=["fp8"], backends=["warpforge-fp8"],
                    queries=10, warmup=3)
    only.save(tmp_path)
    loaded = load(tmp_path)
    scales = lambda m: [float(x.act_scale) for x in m.modules() if isinstance(x, FP8Linear)]  # noqa: E731
    assert scales(loaded.module) == scales(only.module)  # saved, not re-calibrated
    for a, b in zip(loaded(*inputs), only(*inputs)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
