"""Save and load: the reloaded model reproduces the saved one, in this process and in a fresh one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

import warpforge
from warpforge.optimize import load, optimize

from .nets import SmallNet, WithEager, image, make

FAST = dict(queries=4, warmup=1, offline_calls=2)


def test_warpforge_winner_round_trip(tmp_path):
    model, x = make(SmallNet()), image()
    opt = optimize(model, (x,), backends=["warpforge"], **FAST)
    assert opt.name == "warpforge-fp32"  # eager-fp32 is measured as the baseline but was not asked for
    opt.save(tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["winner"] == opt.name and man["precision"] == "fp32" and man["device"] == "cpu"
    assert man["inputs"] == [{"shape": [2, 3, 12, 12], "dtype": "float32"}]
    assert man["versions"]["torch"] == torch.__version__ and man["versions"]["warpforge"] == warpforge.__version__
    assert man["accuracy"]["max_rel"] < 1e-5 and man["budget"]["max_rel"] == 1e-3
    assert man["format"] == "pickle" and "fused modules" in man["format_note"]
    assert [p["name"] for p in man["passes"]] == ["fold_bn", "channels_last", "fuse_conv", "image_input", "max_pool",
                                                "attention", "fuse_norm", "fuse_linear"]
    for f in ("check.pt", "report.json", "report.html", man["file"]):
        assert (tmp_path / f).is_file()
    loaded = load(tmp_path)
    x2 = image(n=3, seed=4)
    torch.testing.assert_close(loaded(x2), opt(x2), rtol=0, atol=0)


def test_eager_winner_is_an_exported_program_and_reloads_in_a_fresh_process(tmp_path):
    """No original code on the path there: the tests package is not importable from tmp_path."""
    model, x = make(SmallNet()), image()
    opt = optimize(model, (x,), backends=["eager"], **FAST)
    assert opt.name == "eager-fp32"
    opt.save(tmp_path / "m")
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert man["format"] == "export" and man["file"] == "model.pt2" and man["format_note"] is None
    x3 = image(n=5, seed=6)  # the exported program keeps a dynamic batch
    torch.save({"x": x3, "y": opt(x3)}, tmp_path / "probe.pt")
    code = ("import torch, warpforge; m = warpforge.optimize.load('m'); p = torch.load('probe.pt');"
            "torch.testing.assert_close(m(p['x']), p['y'], rtol=1e-6, atol=1e-6); print('ok', m)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok Loaded('eager-fp32', format='export')" in out.stdout


def test_graph_with_eager_leaf_round_trip(tmp_path):
    model, x = make(WithEager()), image()
    opt = optimize(model, (x,), backends=["warpforge"], **FAST)
    opt.save(tmp_path)
    loaded = load(tmp_path)
    for sign in (1.0, -1.0):  # both branches of the eager leaf's data-dependent control flow
        xs = sign * x.abs()
        torch.testing.assert_close(loaded(xs), opt(xs), rtol=0, atol=0)
    assert any(f["what"] == "odd" for f in opt.report["fallbacks"])


def test_load_refuses_a_model_that_no_longer_matches(tmp_path):
    opt = optimize(make(SmallNet(c=4)), image(n=1, hw=8), backends=["eager"], **FAST)
    opt.save(tmp_path)
    check = torch.load(tmp_path / "check.pt")
    check["outputs"] = check["outputs"] + 1.0  # as if the weights had changed under the manifest
    torch.save(check, tmp_path / "check.pt")
    with pytest.raises(ValueError, match="does not reproduce its saved outputs"):
        load(tmp_path)
    assert load(tmp_path, verify=False) is not None
    with pytest.raises(ValueError, match="no manifest.json"):
        load(tmp_path / "nowhere")


def test_eager_winner_optimized_at_batch_1_takes_other_batches(tmp_path):
    """torch.export specializes a batch of 1; the save exports at batch 2 so the reload takes any batch."""
    opt = optimize(make(SmallNet(c=4)), image(n=1, hw=8), backends=["eager"], **FAST)
    opt.save(tmp_path)
    loaded = load(tmp_path)
    assert loaded.manifest["format"] == "export" and loaded.manifest["format_note"] is None
    for n in (1, 3):
        x = image(n=n, hw=8, seed=n)
        torch.testing.assert_close(loaded(x), opt(x), rtol=1e-6, atol=1e-6)


class FixedBatch(torch.nn.Module):
    """Runs at a batch of 1 only (the reshape fixes it): export can keep no dim free."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x):  # [1, 12]
        return self.fc(x.reshape(1, -1))


def test_an_exported_program_with_a_fixed_batch_refuses_another_in_one_line(tmp_path):
    x = torch.randn(1, 12)
    opt = optimize(FixedBatch().eval(), (x,), backends=["eager"], **FAST)
    opt.save(tmp_path)
    loaded = load(tmp_path)
    assert loaded.manifest["format"] == "export" and "static shapes" in loaded.manifest["format_note"]
    torch.testing.assert_close(loaded(x), opt(x))
    with pytest.raises(ValueError) as e:  # ShapeError, not torch's "Guard failed: args_0.size()[0] == 1"
        loaded(torch.randn(4, 12))
    msg = str(e.value)
    assert type(e.value).__name__ == "ShapeError" and "\n" not in msg
    assert msg.startswith("input x (argument 0) has shape [4, 12]: dim 0 is 4, but the saved model was exported "
                          "for [1, 12]"), msg


@pytest.mark.gpu
def test_gpu_fp16_winner_round_trip(tmp_path):
    model, x = make(SmallNet(c=16)), image(n=4, hw=32).cuda()
    opt = optimize(model, (x,), device="cuda", precisions=["fp16"], backends=["warpforge"], queries=20, warmup=3)
    opt.save(tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    loaded = load(tmp_path)
    if man["winner"] == "warpforge-fp16":
        assert man["cuda_graph"] is True and man["format"] == "pickle"
    x2 = image(n=4, hw=32, seed=3).cuda()
    torch.testing.assert_close(loaded(x2), opt(x2), rtol=1e-2, atol=1e-2)


def test_onnxruntime_candidate_and_round_trip(tmp_path):
    """Only where onnxruntime (and an ONNX exporter) is installed: it is optional, detected at run time."""
    pytest.importorskip("onnxruntime")
    model, x = make(SmallNet()), image()
    opt = optimize(model, (x,), backends=["onnxruntime"], **FAST)
    rec = next(r for r in opt.report["candidates"] if r["family"] == "onnxruntime")
    if (rec["status"] == "failed" and "export failed" in rec["reason"]
            and importlib.util.find_spec("onnxscript") is None):
        pytest.skip(f"no working ONNX exporter here: {rec['reason']}")
    assert opt.family == "onnxruntime", rec
    assert isinstance(rec["details"]["input_shapes"][0][0], str), rec["details"]  # the batch dim stayed symbolic
    opt.save(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["format"] == "onnx"
    loaded = load(tmp_path)
    torch.testing.assert_close(loaded(x), opt(x), rtol=1e-6, atol=1e-6)
    x3 = image(n=3, seed=11)  # another batch size than the example's: served, and right
    with torch.no_grad():
        torch.testing.assert_close(loaded(x3), model(x3), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"dim 2 is 16, but the model was captured at \[2, 3, 12, 12\] and dim 2 "
                                         r"is not declared dynamic"):
        opt(image(n=2, hw=16, seed=12))  # a fixed dim differs: a clear error, not ONNX Runtime's
    with pytest.raises(ValueError, match=r"exported for shape \['[^']+', 3, 12, 12\]"):
        opt.built.fn(image(n=2, hw=16, seed=12))  # the runner's own check, under the declared-shape one
