"""optimize()'s warpforge-int8 candidate: opt-in, calibrated on calib (else val, else the example), gated with
the int8 budget, reported layer by layer, saved and reloaded. CPU: the int8 kernels run their references."""

from __future__ import annotations

import json

import pytest
import torch

from warpforge.optimize import BadInputError, candidate_names, load, optimize
from warpforge.optimize.gate import DEFAULT_BUDGETS
from warpforge.optimize.report import to_html, to_json

from .nets import SmallNet, image, make

FAST = dict(queries=4, warmup=1, offline_calls=2)


def _rec(report, name):
    return next(r for r in report["candidates"] if r["name"] == name)


def test_int8_candidate_on_cpu():
    model, x = make(SmallNet(c=16)), image(n=4, hw=16)
    calib = [image(n=8, hw=16, seed=s) for s in (11, 12, 13)]
    # not ONNX's point here (test_saved builds and reloads it): the warpforge family (fp32 and int8) and eager
    opt = optimize(model, (x,), calib=calib, precisions=["fp32", "int8"], backends=["eager", "warpforge"], **FAST)
    rep = opt.report
    rec = _rec(rep, "warpforge-int8")
    assert rec["status"] == "passed", rec
    assert rec["budget"] == DEFAULT_BUDGETS["int8"].as_dict() and rec["precision"] == "int8"
    acc = rec["accuracy"]
    assert 0 < acc["max_rel"] < 0.05 and acc["min_cosine"] > 0.999 and acc["top1"] == 1.0
    assert rep["settings"]["calib"] == "3 user calibration batch(es)"
    # CPU timings of a tiny model can be noisy on a shared runner; that note is the stability check working
    assert [n for n in rep["notes"] if not n.startswith("noisy timings")] == []
    d = rec["details"]
    assert d["coverage"]["warpforge_ops"] == {"FusedConv2d": 2, "QuantConv2d": 4, "QuantLinearW8A8": 1}
    assert d["quant"]["float_dtype"] == "float32" and d["quant"]["calib_batches"] == 3  # CPU: float parts fp32
    assert {k["name"] for k in d["quant"]["kept"]} == {"stem_0_fused", "dw_0_fused"}
    assert {f["what"] for f in d["fallbacks"]} == {"stem_0_fused", "dw_0_fused"}
    assert all(f["reason"].startswith("kept float32: ") for f in d["fallbacks"])
    dtypes = {layer["layer"]: layer["dtype"] for layer in d["layers"]}
    assert dtypes["pw_0_fused"] == "int8" and dtypes["fc"] == "int8" and dtypes["dw_0_fused"] == "float32"
    assert rep["quant"]["candidate"] == "warpforge-int8" and len(rep["quant"]["layers"]) == 5
    html = to_html(rep)
    assert "INT8 quantization (warpforge-int8)" in html and "depthwise (16 groups)" in html and "image stem" in html
    assert json.loads(to_json(rep))["quant"]["kept"][0]["decision"] == "float"
    assert "latency" in rec and rec["speedup_vs_eager"] > 0
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0.05, atol=0.05 * model(x).abs().max().item())


def test_int8_is_opt_in():
    assert "warpforge-int8" in candidate_names("cpu")
    rep = optimize(make(SmallNet(c=4)), image(n=1, hw=8), backends=["warpforge"], **FAST).report
    assert "warpforge-int8" not in {r["name"] for r in rep["candidates"]}
    assert "calib" not in rep["settings"]


def test_int8_calibration_source_is_reported():
    model, x = make(SmallNet(c=16)), image(n=2, hw=16)
    val = [image(n=4, hw=16, seed=s) for s in (5, 6)]
    rep = optimize(model, (x,), val=val, precisions=["int8"], backends=["warpforge-int8"], **FAST).report
    assert rep["settings"]["calib"] == "the 2 val batch(es) (no calib given)"
    assert any("calibrated on the validation batches" in n for n in rep["notes"])
    assert _rec(rep, "warpforge-int8")["details"]["quant"]["calib_batches"] == 2
    rep = optimize(model, (x,), precisions=["int8"], backends=["warpforge-int8"], **FAST).report
    assert rep["settings"]["calib"] == "the example inputs (no calib or val given)"
    assert any("calibrated on the example inputs alone" in n for n in rep["notes"])
    with pytest.raises(BadInputError, match=r"calib\[0\] argument 0 has shape \(2, 4, 16, 16\)"):
        optimize(model, (x,), calib=[torch.zeros(2, 4, 16, 16)], precisions=["int8"], **FAST)
    with pytest.raises(BadInputError, match="calib is empty"):
        optimize(model, (x,), calib=[], precisions=["int8"], **FAST)


def test_int8_winner_round_trip(tmp_path):
    model, x = make(SmallNet(c=16)), image(n=2, hw=16)
    calib = [image(n=8, hw=16, seed=21)]
    opt = optimize(model, (x,), calib=calib, precisions=["int8"], backends=["warpforge-int8"], **FAST)
    assert opt.name == "warpforge-int8" and opt.precision == "int8"
    opt.save(tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["precision"] == "int8" and man["format"] == "pickle"
    loaded = load(tmp_path)
    x2 = image(n=3, hw=16, seed=4)
    torch.testing.assert_close(loaded(x2), opt(x2), rtol=0, atol=0)  # the scales and int8 weights come back as saved


@pytest.mark.gpu
def test_gpu_int8_candidate_and_cuda_graph():
    model, x = make(SmallNet(c=32)), image(n=8, hw=32).cuda()
    calib = [image(n=16, hw=32, seed=s).cuda() for s in (11, 12)]
    opt = optimize(model, (x,), calib=calib, device="cuda", precisions=["fp16", "int8"], backends=["warpforge"],
                   queries=50, warmup=5)
    rec = _rec(opt.report, "warpforge-int8")
    assert rec["status"] == "passed", rec
    assert rec["cuda_graph"], rec["details"].get("fallbacks")  # no host sync anywhere in the int8 layers
    assert rec["details"]["quant"]["float_dtype"] == "float16"
    assert rec["details"]["coverage"]["warpforge_ops"]["QuantConv2d"] == 4
    assert rec["latency"]["p50_ms"] > 0 and rec["accuracy"]["min_cosine"] > 0.99
