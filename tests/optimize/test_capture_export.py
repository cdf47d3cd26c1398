"""Capture by torch.export: every zoo model exports, its raised graph computes what the model computes,
and the passes report on it exactly what they report on the FX capture; what export cannot take falls
back to FX with the reason, and the report says which method ran."""

import copy
import io
import json

import pytest
import torch
from torch import nn

from warpforge import zoo
from warpforge.optimize import FoldBatchNorm, FuseConvEpilogue, PassContext, Pipeline, capture, optimize
from warpforge.optimize.capture import EXPORT, FX, METHODS
from warpforge.optimize.passes import ChannelsLast, ReplaceAttention
from warpforge.optimize.report import to_html

from .nets import SmallNet, WithEager, image, make, tiny_zoo


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _passes():
    # Attention on CPU too, at the tiny models' head dims (8, 16): a replaced site runs the kernel's reference.
    return [FoldBatchNorm(), ChannelsLast(), FuseConvEpilogue(), ReplaceAttention(head_dims=(8, 16, 32, 64))]


def _without_identities(gm):
    """The graph with its nn.Identity calls dropped: an exported program has no op for them (and in FX an
    Identity call between a conv and its residual add keeps fuse_conv from matching the add)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Identity):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def _pass_reports(gm, inputs):
    ctx = PassContext(example_inputs=inputs)
    gm, results = Pipeline(_passes()).run(gm, ctx)
    return gm, [r.as_dict() for r in results]


# fcos_small's post-processing is data-dependent: the whole model does not export (test_regions covers it).
@pytest.mark.parametrize("name", [n for n in zoo.names() if n != "fcos_small"])
def test_zoo_model_exports_and_the_passes_see_what_they_see_in_the_fx_graph(name):
    model, inputs = tiny_zoo(name)
    exported, traced = capture(model, inputs), capture(model, inputs, method="fx")
    assert exported.method == EXPORT, exported.export_error
    cov = exported.coverage()
    assert cov["eager_modules"] == {} and cov["traced_fraction"] == 1.0
    assert sum(cov["aten_ops"].values()) > sum(cov["aten_kept"].values())
    # Modules at their original paths, as FX calls them.
    fx_graph = _without_identities(traced.module)
    assert [n.target for n in exported.module.graph.nodes if n.op == "call_module"] == \
        [n.target for n in fx_graph.graph.nodes if n.op == "call_module"]
    with torch.no_grad():
        want = _tuple(model(*inputs))
        for a, b in zip(want, _tuple(exported.module(*inputs)), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    gm_export, report_export = _pass_reports(exported.module, inputs)
    _, report_fx = _pass_reports(fx_graph, inputs)
    assert report_export == report_fx
    assert any(p["changes"] for p in report_export)
    with torch.no_grad():
        for a, b in zip(want, _tuple(gm_export(*inputs)), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # fold_bn and fusion round differently


def test_raised_graph_pickles_deepcopies_and_serves_other_batch_sizes():
    model, x = make(SmallNet()), image()
    cap = capture(model, (x,))
    assert cap.method == EXPORT
    gm, _ = _pass_reports(cap.module, (x,))
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    for m in (torch.load(buf, weights_only=False), copy.deepcopy(gm)):
        for n in (1, 5):
            x2 = image(n=n, seed=n)
            with torch.no_grad():
                torch.testing.assert_close(m(x2), model(x2), rtol=1e-4, atol=1e-4)


class _InPlace(nn.Module):
    """In-place ops the graph must keep (on a view: its base changes) or may raise (on a fresh tensor), a
    plain tensor attribute (a constant of the exported program) and a tensor made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(4, 4), nn.ReLU(inplace=True)
        self.scale = torch.tensor([2.0, 1.0, 0.5, 3.0])

    def forward(self, x):
        y = self.lin(x)
        self.act(y[:, :2])  # mutates y through the view
        z = y * self.scale
        z.add_(1.0)
        return z + torch.ones(4) * 0.5


def test_in_place_ops_and_constants_survive_the_raise_and_the_passes():
    model, x = _InPlace().eval(), torch.randn(3, 4)
    cap = capture(model, (x,))
    assert cap.method == EXPORT, cap.export_error
    assert cap.aten_kept.get("aten.relu_.default") == 1  # on the view: stays an ATen op dead-code removal keeps
    gm, _ = _pass_reports(cap.module, (x,))
    x5 = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(gm(x5), model(x5), rtol=0, atol=0)


def test_data_dependent_control_flow_falls_back_to_fx_with_the_reason():
    model, x = make(WithEager()), image()
    cap = capture(model, (x,))
    assert cap.method == FX and list(cap.eager) == ["odd"]
    assert "data-dependent" in cap.export_error and "nets.py" in cap.export_error
    assert cap.coverage()["export_error"] == cap.export_error
    with pytest.raises(ValueError, match="torch.export cannot capture"):
        capture(model, (x,), method="export")


class _BatchBranch(nn.Module):
    """Python branching on the batch size: export takes one branch for every batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        if (x.shape[0] == 1) if self.how == "one" else (x.shape[0] > 3):
            return self.conv(x) * 2
        return self.conv(x)


class _Wrap(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.stem, self.branch = nn.Conv2d(3, 3, 3, padding=1), _BatchBranch(how)

    def forward(self, x):
        return self.branch(self.stem(x))


@pytest.mark.parametrize("how, why", [("one", "does not reproduce the model's outputs at batch 1"),
                                      ("range", "bounded the batch")])
def test_a_graph_valid_only_for_some_batch_sizes_is_not_returned(how, why):
    model, x = make(_Wrap(how)), image()
    cap = capture(model, (x,))
    assert cap.method == FX and why in cap.export_error
    for n in (1, 4):
        x2 = image(n=n, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(cap.module(x2), model(x2))


def test_training_mode_goes_to_fx_and_capture_checks_its_method():
    cap = capture(make(SmallNet()).train(), (image(),))
    assert cap.method == FX and "training mode" in cap.export_error
    assert capture(make(SmallNet()), (image(),), method="fx").export_error is None
    with pytest.raises(ValueError, match="method"):
        capture(make(SmallNet()), (image(),), method="dynamo")


def test_report_and_manifest_name_the_capture_method(tmp_path):
    from warpforge.cli import optimize as cli_optimize
    from warpforge.optimize import load

    assert {p.name: p for p in cli_optimize.params}["capture"].type.choices == METHODS
    model, x = make(SmallNet()), image()
    opt = optimize(model, x, precisions=["fp32"], backends=["warpforge"], queries=3, warmup=0, offline_calls=2)
    cap = opt.report["capture"]
    assert opt.name == "warpforge-fp32" and cap["method"] == EXPORT and cap["export_error"] is None
    assert cap["aten_ops"]["aten.conv2d.default"] == 6
    page = to_html(opt.report)
    assert "<b>torch.export</b>" in page and "aten.conv2d.default" in page
    saved = opt.save(tmp_path / "m")
    assert json.loads((saved / "manifest.json").read_text())["capture"] == EXPORT
    loaded = load(saved)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-4)
    fell = optimize(make(WithEager()), x, precisions=["fp32"], backends=["warpforge"], queries=3, warmup=0,
                    offline_calls=2, capture="auto")
    assert fell.report["capture"]["method"] == FX
    assert any(f["what"] == "torch.export" and "data-dependent" in f["reason"] for f in fell.report["fallbacks"])
    assert "torch.export was not used" in to_html(fell.report)
