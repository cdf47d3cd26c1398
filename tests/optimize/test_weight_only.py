"""Weight-only int8 / int4 linears (optimize/weight_only.py) and the warpforge-w8 / -w4 candidates.

CPU: ``kernels.gemv.linear`` runs its torch reference (dequantize, then the float product); one test drives
the Triton kernel itself through the interpreter (fp32 and fp16). GPU tests run the same on CUDA in fp16/bf16.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from warpforge.optimize import load, optimize
from warpforge.optimize.gate import DEFAULT_BUDGETS
from warpforge.optimize.report import to_html, to_json
from warpforge.optimize.weight_only import WeightOnlyLinear, quantize_weights

from .nets import LinearHeavy, SmallNet, image, make, small_planner, tokens

FAST = dict(queries=4, warmup=1, offline_calls=2)


def _rec(report, name):
    return next(r for r in report["candidates"] if r["name"] == name)


def _error_bound(layer: WeightOnlyLinear, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y_q - y| per output <= sum_k |x_k| * (the most a weight w[n, k] can move): int8 rounds to the nearest
    level (half a step; scales are the row absmax / 127, nothing clipped); an int4 group's levels may span a
    clipped part of its range, so a weight moves by half a step or by its distance to the levels, at most."""
    step = layer.weight_scale.float()  # [N] (int8) or [N, Kp/128] (int4)
    if step.dim() == 1:
        half = step[:, None].expand(-1, layer.in_features) / 2
    else:
        g, k = layer.group, layer.in_features
        lo_level = layer.weight_min.float()
        hi_level = lo_level + 15 * step
        wp = torch.nn.functional.pad(w.float(), (0, step.shape[1] * g - k)).reshape(w.shape[0], -1, g)
        out_lo, out_hi = (lo_level[..., None] - wp).clamp_min(0), (wp - hi_level[..., None]).clamp_min(0)
        half = torch.maximum((step / 2)[..., None], torch.maximum(out_lo, out_hi)).reshape(w.shape[0], -1)[:, :k]
    return x.abs().reshape(-1, layer.in_features) @ half.T  # [M, N]


@pytest.mark.parametrize("precision", ["w8", "w4"])
def test_linears_replaced_and_within_the_rounding_bound(precision):
    model = LinearHeavy().eval()
    ref_model = copy.deepcopy(model)
    q, rep = quantize_weights(model, precision)
    assert q is model  # in place
    scheme = {"w8": "int8", "w4": "int4_g128"}[precision]
    assert {r.name for r in rep.layers} == {"fc1", "fc2", "head"}
    assert all(isinstance(getattr(q, n), WeightOnlyLinear) and getattr(q, n).scheme == scheme for n in ("fc1", "fc2",
                                                                                                        "head"))
    kept = {k.name: k.reason for k in rep.kept}
    assert set(kept) == {"embed", "logit"} and "K = 10, N = 129: below 16 features" in kept["embed"]
    assert isinstance(q.embed, nn.Linear) and isinstance(q.logit, nn.Linear)

    x = tokens(b=3, t=5, seed=7)  # fresh inputs, not the ones any scale was chosen on
    with torch.no_grad():
        for name in ("fc1", "fc2", "head"):
            layer, float_layer = getattr(q, name), getattr(ref_model, name)
            xin = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(3))
            err = (layer(xin) - float_layer(xin)).abs().reshape(-1, layer.out_features)
            bound = _error_bound(layer, xin, float_layer.weight)
            assert bool((err <= bound * 1.001 + 1e-5).all()), f"{name}: {(err - bound).max()}"
            assert err.max() > 0  # it is quantized, not the float layer
        (y, logit), (y_ref, _) = q(x), ref_model(x)
    rel = ((y - y_ref).norm() / y_ref.norm()).item()
    assert rel < (0.01 if precision == "w8" else 0.1), rel
    assert y.shape == (3, 5, 37) and logit.shape == (3, 5, 1)

    r = next(r for r in rep.layers if r.name == "fc1")
    assert (r.in_features, r.out_features, r.scheme) == (129, 200, scheme)
    assert r.bytes_float == 129 * 200 * 4
    # int8: N*K bytes + N fp32 scales; int4 g128: K padded to 256, half a byte each, a scale and minimum per group
    assert r.bytes_packed == (200 * 129 + 200 * 4 if precision == "w8" else 200 * 128 + 200 * 2 * (4 + 4))
    assert 0 < r.weight_rel_err < (0.01 if precision == "w8" else 0.1)
    d = rep.as_dict()
    assert d["precision"] == precision and d["scheme"] == scheme and d["float_dtype"] == "float32"
    assert d["layers"][0]["decision"] == scheme and d["kept"][0]["decision"] == "float"
    assert d["bytes_packed"] == rep.bytes_packed < rep.bytes_float
    text = str(rep)
    assert "fc1" in text and "kept float32: K = 10" in text and "quantized weights:" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "int4_g128"])
def test_module_drives_the_triton_kernel(triton_on_cpu, device, scheme, dtype):
    """The weight-streaming kernel itself (on CPU through the interpreter) on the module's packed buffers (odd K, N)."""
    lin = nn.Linear(129, 37).to(device, dtype)
    layer = WeightOnlyLinear(lin, scheme)
    x = torch.randn(2, 3, 129, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    w = layer.packed().dequantize().float()
    want = x.float() @ w.T + lin.bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, 3, 37)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: the kernel's output is rounded to fp16
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_skip_multihead_attention_and_bare_layer():
    class WithMHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
            self.proj = nn.Linear(32, 32)
            self.proj2 = self.proj  # shared: replaced once, everywhere it is held

        def forward(self, x):
            return self.proj2(self.proj(self.attn(x, x, x)[0]))

    m = WithMHA().eval()
    x = torch.randn(2, 5, 32)
    want = m(x)
    q, rep = quantize_weights(m, "w8", skip=("nothing",))
    kept = {k.name: k.reason for k in rep.kept}
    assert "nn.MultiheadAttention" in kept["attn.out_proj"]
    assert [r.name for r in rep.layers] == ["proj"] and q.proj is q.proj2
    torch.testing.assert_close(q(x), want, rtol=0.02, atol=0.02)
    q, rep = quantize_weights(WithMHA(), "w4", skip=("proj",))
    assert not rep.layers and {k.name: k.reason for k in rep.kept}["proj"] == "skipped by request"

    bare, rep = quantize_weights(nn.Linear(64, 48), "w4")
    assert isinstance(bare, WeightOnlyLinear) and rep.layers[0].name == ""


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match=r"precision: expected one of \['w8', 'w4'\], got 'w3'"):
        quantize_weights(LinearHeavy(), "w3")
    with pytest.raises(ValueError, match="model: expected an nn.Module"):
        quantize_weights(lambda x: x, "w8")
    with pytest.raises(ValueError, match="dtype: expected float16, bfloat16 or float32"):
        quantize_weights(LinearHeavy(), "w8", dtype=torch.int8)
    with pytest.raises(ValueError, match="min_features: expected an integer >= 1"):
        quantize_weights(LinearHeavy(), "w8", min_features=0)
    with pytest.raises(ValueError, match="linear: expected an nn.Linear, got Conv2d"):
        WeightOnlyLinear(nn.Conv2d(3, 8, 3), "int8")
    with pytest.raises(ValueError, match="scheme: expected one of"):
        WeightOnlyLinear(nn.Linear(32, 32), "int4_g100")
    layer = WeightOnlyLinear(nn.Linear(32, 16), "int8")
    with pytest.raises(ValueError, match=r"x: expected \[..., 32\], got \(4, 31\)"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="contains NaN or Inf"):
        bad = nn.Linear(32, 16)
        bad.weight.data[0, 0] = float("nan")
        WeightOnlyLinear(bad, "int4_g128")


@pytest.mark.parametrize("precision", ["w8", "w4"])
def test_candidate_on_the_zoo_planner(precision):
    model, inputs, c = small_planner()
    opt = optimize(model, inputs, precisions=["fp32", precision], backends=["warpforge"], **FAST)
    rep = opt.report
    name = f"warpforge-{precision}"
    rec = _rec(rep, name)
    assert rec["status"] == "passed", rec
    assert rec["precision"] == precision and rec["budget"] == DEFAULT_BUDGETS[precision].as_dict()
    acc = rec["accuracy"]  # example inputs + 3 fresh random scenes against the fp32 planner
    assert 0 < acc["max_rel"] < (0.05 if precision == "w8" else 0.3) and acc["min_cosine"] > 0.95
    d = rec["details"]
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    kept = {k["name"]: k["reason"] for k in d["weight_only"]["kept"]}
    # the 10- and 6-feature point layers and the 10- and 1-output heads stay float
    assert set(kept) == {"agent_encoder.point.0", "map_encoder.point.0", "traj_head.2", "mode_head"}
    assert d["coverage"]["warpforge_ops"] == {"WeightOnlyLinear": n_linear - 4}
    assert len(d["weight_only"]["layers"]) == n_linear - 4 and d["weight_only"]["float_dtype"] == "float32"
    assert {f["what"] for f in d["fallbacks"]} >= set(kept)
    dtypes = {x["layer"]: x["dtype"] for x in d["layers"]}
    assert dtypes["encoder.0.attn.q"] == ("int8" if precision == "w8" else "int4_g128")
    assert dtypes["mode_head"] == "float32"
    assert rep["weight_only"]["candidate"] == name
    html = to_html(rep)
    assert "Weight-only quantization" in html and "too small for a quantized kernel to pay" in html
    assert json.loads(to_json(rep))["weight_only"]["kept"][0]["decision"] == "float"
    assert "calib" not in rep["settings"]  # no calibration


def test_weight_only_is_opt_in():
    model, inputs, _ = small_planner()
    rep = optimize(model, inputs, backends=["warpforge"], **FAST).report
    assert not {"warpforge-w8", "warpforge-w4"} & {r["name"] for r in rep["candidates"]}
    assert rep["weight_only"] is None


@pytest.mark.parametrize("precision", ["w8", "w4"])
def test_saved_and_reloaded(tmp_path, precision):
    model, inputs, c = small_planner()
    name = f"warpforge-{precision}"
    opt = optimize(model, inputs, precisions=[precision], backends=[name], **FAST)
    assert opt.name == name
    opt.save(tmp_path / "m")
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert man["precision"] == precision and man["format"] == "pickle"
    loaded = load(tmp_path / "m")
    from warpforge.zoo.planner import scene

    x2 = scene(torch.Generator().manual_seed(8), 3, c)  # another batch size than the saved check set
    for a, b in zip(loaded(*x2), opt(*x2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # packed weights and scales come back as saved
    if precision == "w4":  # and in a fresh process, from the saved files alone
        torch.save({"x": x2, "y": opt(*x2)}, tmp_path / "probe.pt")
        code = ("import torch, warpforge; m = warpforge.optimize.load('m'); p = torch.load('probe.pt');"
                "[torch.testing.assert_close(a, b, rtol=0, atol=0) for a, b in zip(m(*p['x']), p['y'])];"
                "print('ok', m, type(m.module.inner.encoder.get_submodule('0.attn.q')).__name__)")
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "ok Loaded('warpforge-w4', format='pickle') WeightOnlyLinear" in out.stdout


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("precision", ["w8", "w4"])
def test_gpu_module_in_half_precision(precision, dtype):
    model = LinearHeavy(width=257, hidden=512, out=37).cuda().eval()
    q, rep = quantize_weights(copy.deepcopy(model).to(dtype), precision, dtype=dtype)
    assert rep.float_dtype == str(dtype).removeprefix("torch.") and len(rep.layers) == 3
    x = tokens(b=4, t=33, seed=2).cuda()
    with torch.no_grad():
        for name in ("fc1", "fc2", "head"):
            layer = getattr(q, name)
            xin = torch.randn(4, 33, layer.in_features, device="cuda", dtype=dtype)
            want = xin.float() @ layer.packed().dequantize().float().T + layer.bias.float()
            got = layer(xin)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        (y, _), (y_ref, _) = q(x.to(dtype)), model(x)
    rel = ((y.float() - y_ref).norm() / y_ref.norm()).item()
    assert rel < (0.02 if precision == "w8" else 0.1), rel


@pytest.mark.gpu
def test_gpu_candidates_cuda_graph_and_round_trip(tmp_path):
    model, inputs, c = small_planner(dim=256, ffn=1024)
    inputs = tuple(x.cuda() for x in inputs)
    opt = optimize(model, inputs, device="cuda", precisions=["fp16", "w8", "w4"], backends=["warpforge"],
                   queries=30, warmup=5)
    for name in ("warpforge-w8", "warpforge-w4"):
        rec = _rec(opt.report, name)
        assert rec["status"] == "passed", rec
        assert rec["cuda_graph"], rec["details"].get("fallbacks")
        assert rec["details"]["weight_only"]["float_dtype"] == "float16"
        assert rec["latency"]["p50_ms"] > 0
    opt.save(tmp_path)
    loaded = load(tmp_path)
    for a, b in zip(loaded(*inputs), opt(*inputs)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_a_model_without_a_linear_to_quantize_fails_its_build():
    rep = optimize(make(SmallNet(c=4)), image(n=1, hw=8), precisions=["fp32", "w8"], backends=["warpforge"],
                   **FAST).report
    rec = _rec(rep, "warpforge-w8")
    assert rec["status"] == "failed"
    assert "no linear layer could be quantized: fc: K = 8, N = 5: below 16 features" in rec["reason"]


def test_layers_pickled_in_the_integer_zero_point_format():
    """A w4 layer pickled before the float group minimum (a uint8 ``weight_zero``) is refused in one line; a w8
    layer of that time (``weight_zero`` None, nothing else different) loads and gives the same outputs."""
    import io
    import pickle

    def old(scheme):
        layer = WeightOnlyLinear(nn.Linear(64, 8), scheme)
        buf = layer._buffers
        zero = None if scheme == "int8" else torch.zeros(8, 1, dtype=torch.uint8)
        layer._buffers = {("weight_zero" if k == "weight_min" else k): (zero if k == "weight_min" else v)
                          for k, v in buf.items()}
        return layer, io.BytesIO(pickle.dumps(layer))

    _, blob = old("int4_g128")
    with pytest.raises(ValueError,
                       match=r"^WeightOnlyLinear: saved in the older int4 format .* `warpforge optimize` again"):
        pickle.load(blob)
    layer, blob = old("int8")
    again = pickle.load(blob)
    assert again.weight_min is None and "weight_zero" not in again._buffers
    x = torch.randn(3, 64)
    layer._buffers["weight_min"] = layer._buffers.pop("weight_zero")
    assert torch.equal(again(x), layer(x))
