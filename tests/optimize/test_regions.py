"""Regions: a model whose whole forward does not capture (data-dependent post-processing) gets its capturable
submodules optimized, the rest eager, each part's reason reported; the detector's boxes, scores and labels on
real photos stay those of fp32 eager; the optimized model saves and reloads."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch
from torch import nn

from warpforge.optimize import load, optimize
from warpforge.optimize.backends import all_candidates, op_coverage
from warpforge.optimize.capture import FX
from warpforge.optimize.regions import Region, build_regions, plan_regions
from warpforge.optimize.report import to_html, to_json
from warpforge.optimize.runtime import strict_fp32

from .nets import DataDependent, SmallNet, conv_bn_act, image, make

FAST = dict(queries=3, warmup=1, offline_calls=1)
PHOTOS = (("astronaut", "coffee"), ("chelsea", "rocket"), ("stereo_motorcycle", "china"))


class Neck(nn.Module):
    """Its own forward branches on a value (FX and export refuse it); its two children capture."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a, self.b = conv_bn_act(c, c), conv_bn_act(c, c)

    def forward(self, x):
        y = self.a(x)
        if y.mean() > -1e9:  # always true, but only the data says so
            y = self.b(y)
        return y


class Head(nn.Module):
    def __init__(self, c: int, out: int = 5) -> None:
        super().__init__()
        self.out_channels = out
        self.conv = conv_bn_act(c, out)

    def forward(self, x, scale=None):
        return self.conv(x) * scale


class Refine(nn.Module):
    """Captures by FX only (export refuses the branch in ``odd``), with ``odd`` left eager inside: the conv in
    ``odd`` becomes a region nested in this one."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.odd, self.tail = DataDependent(c), conv_bn_act(c, c)

    def forward(self, x):
        return self.tail(self.odd(x))


class Toy(nn.Module):
    """stem -> neck (splits) -> a shared head called at two scales with keyword arguments -> data-dependent
    selection in the root's own code, which reads an attribute of the head."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = conv_bn_act(3, c, 3, 2)
        self.neck = Neck(c)
        self.refine = Refine(c)
        self.pool = nn.MaxPool2d(2)
        self.head = Head(c)
        self.unused = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        y = self.refine(self.neck(self.stem(x)))
        outs = [self.head(x=f, scale=self.gain) for f in (y, self.pool(y))]
        flat = torch.cat([o.flatten(2) for o in outs], 2)  # [B, out_channels, P]
        assert flat.shape[1] == self.head.out_channels
        if flat.max() > 1e9:  # a data-dependent branch in the root: nothing captures the whole model
            return flat
        return flat, flat[flat > 0]  # and a data-dependent shape


def _toy():
    model, x = make(Toy()), image(n=2, hw=16)
    with torch.no_grad():
        want = model(x)
    return model, x, want


def test_plan_splits_fails_down_to_the_capturable_children_and_says_why_for_the_rest():
    model, x, _ = _toy()
    plan = plan_regions(model, (x,), "auto", "whole-model reason")
    assert [r.path for r in plan.regions] == ["stem", "neck.a", "neck.b", "refine", "refine.odd.conv", "head"]
    refine = next(r for r in plan.regions if r.path == "refine")
    assert refine.captured_by == FX and list(refine.leaves) == ["odd"]
    head = next(r for r in plan.regions if r.path == "head")
    assert len(head.calls) == 2 and [c.args[0].shape[-1] for c in head.calls] == [8, 4]  # both scales
    assert len(head.calls[0].args) == 2  # keyword arguments bound to their positions (x, scale)
    why = {e["path"]: e["reason"] for e in plan.eager}
    assert set(why) == {"(root)", "neck", "refine.odd", "pool", "unused"}
    assert "inside region refine" in why["refine.odd"]
    assert "whole-model reason" in why["(root)"]
    assert "does not capture" in why["neck"] and "children are tried" in why["neck"]
    assert "no parameters" in why["pool"] and "not called" in why["unused"]


def test_build_regions_matches_eager_and_keeps_attributes_and_keywords():
    model, x, want = _toy()
    shell, details = build_regions(model, (x,), torch.float32, "auto", None, "whole-model reason", op_coverage)
    assert isinstance(shell.head, Region) and isinstance(shell.neck.a, Region) and not isinstance(shell.neck, Region)
    nested = shell.refine.inner.inner.odd.conv  # inside the FX graph of region refine, in its eager leaf
    assert isinstance(nested, Region) and nested.path == "refine.odd.conv"
    assert shell.head.out_channels == 5  # the root reads it
    x2 = image(n=3, hw=16, seed=5)  # another batch than the example
    with torch.no_grad():
        got, got2, want2 = shell(x), shell(x2), model(x2)
    for a, b in zip(want + want2, got + got2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    buf = io.BytesIO()  # pickled and loaded (what save/load does): nested regions and attributes come back
    torch.save(shell, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert again.head.out_channels == 5 and isinstance(again.refine.inner.inner.odd.conv, Region)
    with torch.no_grad():
        for a, b in zip(got2, again(x2), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    reg = details["regions"]
    assert [r["path"] for r in reg["regions"] if r["nested"]] == ["refine.odd.conv"]
    assert reg["params_optimized"] + 1 + 12 == reg["params_total"]  # the root's gain and the unused Linear
    folded = next(p for p in details["passes"] if p["name"] == "fold_bn")
    assert folded["counts"]["folded"] == 5 and all("." in c["where"] for c in folded["changes"])
    # stem, neck.a, neck.b, refine.tail, head.conv fused; refine.odd.conv is a bare conv (no epilogue to fuse)
    assert details["coverage"]["warpforge_ops"]["FusedConv2d"] == 5
    assert details["capture"]["method"] == "regions"


def test_whole_model_that_captures_takes_the_whole_model_path():
    wf = next(c for c in all_candidates(torch.device("cpu")) if c.name == "warpforge-fp32")
    built = wf.build(make(SmallNet()), (image(),))
    assert "regions" not in built.details and built.details["capture"]["method"] != "regions"


class NothingCaptures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.act = nn.ReLU()

    def forward(self, x):
        if x.sum() > 0:
            return self.act(x * self.w[:, None, None])
        return x


def test_nothing_captures_fails_the_candidate_with_each_reason():
    with pytest.raises(ValueError, match=r"no submodule does either: act: no parameters"):
        build_regions(NothingCaptures(), (image(),), torch.float32, "auto", None, "the root branches")


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32's 10-bit mantissa (to nearest), as the tensor cores read it."""
    return ((t.contiguous().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def _cudnn_like(self: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """nn.Conv2d as cuDNN runs it on an Ampere or later GPU: TF32 operands whenever torch allows it."""
    if torch.backends.cudnn.allow_tf32:
        x, weight = _tf32(x), _tf32(weight)
    return torch.nn.functional.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


def test_regions_are_checked_in_strict_fp32_where_eager_convs_may_run_tf32(monkeypatch):
    """On a GPU torch runs eager fp32 convs through cuDNN as TF32 by default and warpforge's fp32 kernels
    multiply in full fp32: a reference recorded under TF32 is ~1e-3 off a correct region, far past the
    reproduction check's 1e-5 (an H100 refused the FCOS backbone so). Here nn.Conv2d rounds as cuDNN
    does (FX keeps it a leaf, so eager and the captured graph both do) and the fused convs the passes put in
    its place run the fp32 torch reference, as the kernels do on the GPU: the check holds both sides to
    strict fp32, and the caller's TF32 setting comes back after."""
    monkeypatch.setattr(nn.Conv2d, "_conv_forward", _cudnn_like)
    model, x = make(Toy()), image(n=2, hw=16)
    with torch.no_grad():
        allowed = model(x)
        with strict_fp32():
            want = model(x)
    assert (allowed[0] - want[0]).abs().max() > 1e-4 * want[0].abs().max()  # TF32 as emulated: past the check's 1e-5
    shell, _ = build_regions(model, (x,), torch.float32, "fx", None, "whole-model reason")
    assert isinstance(shell.stem, Region) and torch.backends.cudnn.allow_tf32  # built, and the setting is back
    with torch.no_grad(), strict_fp32():
        got = shell(x)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


# --- the zoo detector on real photos -------------------------------------------------------------------------

def _detector():
    images = pytest.importorskip("warpforge.zoo.images")
    pytest.importorskip("skimage", reason="the photos ship with scikit-image")
    pytest.importorskip("sklearn", reason="one photo ships with scikit-learn")
    from warpforge.zoo import fcos

    c = fcos.FcosConfig(image_size=(160, 160), widths=(16, 32, 64, 128), fpn_dim=32, classes=20)
    batches = [(images.imagenet_batch(names, size=160, resize=160),) for names in PHOTOS]
    return fcos.build(c), batches


def _detections_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() == {"boxes", "scores", "labels"}
        assert len(w["labels"]) > 10  # the photos give detections: the comparison is not vacuous
        assert torch.equal(g["labels"], w["labels"])
        # fold_bn and the fused convs round differently from eager (~1e-7 relative): same boxes, same order
        torch.testing.assert_close(g["boxes"], w["boxes"], rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(g["scores"], w["scores"], rtol=1e-4, atol=1e-6)


def test_fcos_backbone_fpn_head_optimized_post_processing_eager_on_real_photos(tmp_path):
    from warpforge.optimize.cli import print_table

    model, batches = _detector()
    opt = optimize(model, batches[0], val=batches[:2], backends=["warpforge"], precisions=["fp32"], **FAST)
    assert opt.name == "warpforge-fp32"
    rep = opt.report
    rec = next(r for r in rep["candidates"] if r["name"] == "warpforge-fp32")
    assert rec["status"] == "passed", rec["reason"]
    # Judged as detections (matched by label, box and score), every one of them matched.
    assert rep["model"]["kind"] == "detection" and rec["accuracy"]["detections"] == 1.0
    reg = rep["regions"]
    assert [r["path"] for r in reg["regions"]] == ["backbone", "fpn", "head"]
    assert next(r for r in reg["regions"] if r["path"] == "head")["calls"] == 3  # one per pyramid level
    eager = {e["path"]: e["reason"] for e in reg["eager"]}
    assert list(eager) == ["(root)"] and "did not capture" in eager["(root)"]
    assert reg["params_total"] - reg["params_optimized"] == 3  # FCOS's per-level scales, read by the post-processing
    assert rep["coverage"]["warpforge_ops"]["FusedConv2d"] > 20
    share = reg["time_share"]
    assert 0 < share["regions_ms"] < share["call_ms"] and 0 < share["share"] < 1
    held_out = batches[2]  # photos neither the gate nor the example saw
    with torch.no_grad():
        want = model(*held_out)
    _detections_equal(opt(*held_out), want)
    # The report says it: JSON, HTML, and the CLI's table.
    assert json.loads(to_json(rep))["regions"]["regions"][0]["path"] == "backbone"
    assert "Regions (warpforge-fp32)" in to_html(rep)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=300)
    print_table(rep, console)
    text = console.file.getvalue()
    assert "of a call's time in them" in text and "detections" in text
    for line in ("optimized  backbone", "optimized  fpn", "optimized  head", "eager      (root)"):
        assert line in text, text
    # Saved and loaded: the regions inside the eager shell come back.
    opt.save(tmp_path)
    loaded = load(tmp_path)
    _detections_equal(loaded(*held_out), want)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="torchvision is not installed: its detection models cannot be built here")
def test_torchvision_fcos_regions():
    from torchvision.models.detection import fcos_resnet50_fpn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # score_thresh 0: random weights score every box near the 0.01 prior; the default 0.2 would keep none
        model = fcos_resnet50_fpn(weights=None, weights_backbone=None, min_size=128, max_size=128,
                                  score_thresh=0.0, topk_candidates=100, detections_per_img=50).eval()
    x = image(n=1, hw=128, seed=3).clamp(-2, 2) * 0.2 + 0.5
    opt = optimize(model, (x,), val=[(x,)], backends=["warpforge"], precisions=["fp32"], **FAST)
    paths = [r["path"] for r in opt.report["regions"]["regions"]]
    assert "head" in paths and any(p.startswith("backbone") for p in paths)
    assert "head.classification_head.conv" in paths  # nested in the head's eager per-level loop
    with torch.no_grad():
        want = model(x)
    _detections_equal(opt(x), want)


@pytest.mark.gpu
def test_gpu_regions_replay_cuda_graphs():
    model, batches = _detector()
    model = model.cuda()
    batches = [tuple(t.cuda() for t in b) for b in batches]
    opt = optimize(model, batches[0], val=batches[:2], backends=["warpforge"], precisions=["fp32"], **FAST)
    regions = [m for m in opt.module.modules() if isinstance(m, Region)]
    assert len(regions) == 3 and all(r._graphs for r in regions)
    assert len(next(r for r in regions if r.path == "head")._graphs) == 3  # one graph per pyramid level
    with torch.no_grad(), strict_fp32():  # fp32 eager: by default cuDNN would run its convs as TF32
        want = model(*batches[2])
    _detections_equal(opt(*batches[2]), want)
