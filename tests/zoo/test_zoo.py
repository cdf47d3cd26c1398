"""Every zoo model builds, runs on its example inputs with the documented output shapes, and traces with fx.

Full-size models run once each (cached across tests). Tracing is checked two ways: the full model
traces and its graph holds the op the optimizer looks for; a small configuration of the same code
traced and run gives exactly the eager result, at a cost the CPU test budget allows.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx

from warpforge import zoo
from warpforge.zoo import bev_lss, detr, efficientnet_lite, mobilenet_v2, planner, resnet, vit
from warpforge.zoo._common import calibrate_batchnorm

# name -> (kind, example input shapes, output shapes) at batch 1.
EXPECTED = {
    "mobilenet_v2": ("classifier", [(1, 3, 224, 224)], [(1, 1000)]),
    "efficientnet_lite0": ("classifier", [(1, 3, 224, 224)], [(1, 1000)]),
    "resnet50": ("classifier", [(1, 3, 224, 224)], [(1, 1000)]),
    "vit_b16": ("classifier", [(1, 3, 224, 224)], [(1, 1000)]),
    "detr_small": ("detector", [(1, 3, 384, 640)], [(1, 100, 92), (1, 100, 4)]),
    "bev_lss": ("bev", [(1, 6, 3, 128, 352)], [(1, 4, 128, 128)]),
    "planner": ("planner", [(1, 64, 11, 10), (1, 256, 20, 6)], [(1, 64, 6, 12, 2), (1, 64, 6)]),
}


@functools.cache
def _spec(name: str) -> zoo.ModelSpec:
    # pretrained=False: the shape and tracing checks need no weights package (test_pretrained covers those).
    return zoo.get(name, pretrained=False)


@functools.cache
def _outputs(name: str) -> tuple[torch.Tensor, ...]:
    spec = _spec(name)
    with torch.no_grad():
        out = spec.model(*spec.example_inputs)
    return out if isinstance(out, tuple) else (out,)


# Detectors whose post-processing is data-dependent (per-image lists of boxes; no whole-model trace): their
# own tests (tests/optimize/test_regions.py) run them; here they are built and run at their full size.
DATA_DEPENDENT = {"fcos_small": ("detector", [(1, 3, 640, 640)])}


def test_expected_covers_the_registry():
    assert sorted([*EXPECTED, *DATA_DEPENDENT]) == sorted(zoo.names())


def test_fcos_small_runs_and_returns_detections_per_image():
    spec = _spec("fcos_small")
    kind, in_shapes = DATA_DEPENDENT["fcos_small"]
    assert spec.kind == kind and [tuple(t.shape) for t in spec.example_inputs] == in_shapes
    with torch.no_grad():
        (det,) = spec.model(*spec.example_inputs)
    n = det["labels"].numel()
    assert 0 < n <= spec.model.config.max_det and det["boxes"].shape == (n, 4) and det["scores"].shape == (n,)
    assert det["labels"].dtype == torch.int64 and (det["scores"][:-1] >= det["scores"][1:]).all()
    assert (det["boxes"] >= 0).all() and (det["boxes"][:, 2:] <= 640).all()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builds_and_runs_with_documented_shapes(name):
    kind, in_shapes, out_shapes = EXPECTED[name]
    spec = _spec(name)
    assert spec.name == name and spec.kind == kind and spec.weights == "random"
    assert not spec.model.training
    assert [tuple(t.shape) for t in spec.example_inputs] == in_shapes
    outs = _outputs(name)
    assert [tuple(o.shape) for o in outs] == out_shapes
    for o in outs:
        assert o.dtype == torch.float32
        assert torch.isfinite(o).all(), f"{name}: non-finite outputs"
        # Random weights at a realistic scale: outputs neither collapse to a constant nor blow up.
        assert 1e-3 < o.float().std() < 1e3, f"{name}: output std {o.float().std():.3g}"


def test_detr_boxes_are_normalised():
    _, boxes = _outputs("detr_small")
    assert (boxes > 0).all() and (boxes < 1).all()


# The op each full model's graph must contain: the patterns the optimizer rewrites.
GRAPH_OPS = {
    "mobilenet_v2": {"conv2d"}, "efficientnet_lite0": {"conv2d", "pad"}, "resnet50": {"conv2d"},
    "vit_b16": {"scaled_dot_product_attention"}, "detr_small": {"scaled_dot_product_attention"},
    "bev_lss": {"index_add", "softmax"}, "planner": {"softmax", "matmul"},
}


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    names = set()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            names.add(node.target if isinstance(node.target, str) else getattr(node.target, "__name__", ""))
        elif node.op == "call_module":
            names.add(type(gm.get_submodule(node.target)).__name__.lower())
    return names


@pytest.mark.parametrize("name", list(EXPECTED))
def test_full_model_traces_with_fx(name):
    gm = torch.fx.symbolic_trace(_spec(name).model)
    missing = GRAPH_OPS[name] - _ops(gm)
    assert not missing, f"{name}: traced graph lacks {missing}"


# Small configurations of the same code, for running traced graphs and batch checks cheaply.
def _small(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    img = torch.randn(2, 3, 64, 64, generator=g)
    if name in ("mobilenet_v2", "efficientnet_lite0", "resnet50"):
        model = {"mobilenet_v2": mobilenet_v2.MobileNetV2, "efficientnet_lite0": efficientnet_lite.EfficientNetLite,
                 "resnet50": resnet.ResNet}[name]()
        # Uncalibrated random BatchNorms shrink activations into float32 denormals, which CPUs run slowly.
        calibrate_batchnorm(model, (img,))
        return model, (img,)
    if name == "vit_b16":
        return vit.VisionTransformer(image_size=64, dim=64, depth=2, heads=4, hidden=128, num_classes=10), (img,)
    if name == "detr_small":
        c = detr.DetrConfig(image_size=(64, 96), widths=(8, 16, 32, 64), dim=32, heads=4, ffn=64, encoder_layers=1,
                            decoder_layers=1, queries=10, classes=5)
        return detr.build(c), (torch.randn(2, 3, 64, 96, generator=g),)
    if name == "bev_lss":
        c = _small_lss()
        return bev_lss.build(c), (torch.randn(2, c.cameras, 3, *c.image_size, generator=g),)
    if name == "planner":
        c = planner.PlannerConfig(agents=4, history=3, polylines=8, points=4, dim=32, heads=4, ffn=64,
                                  encoder_layers=1, decoder_layers=1, modes=3, horizon=5)
        return planner.build(c), planner.scene(g, 2, c)
    raise AssertionError(name)


def _small_lss() -> bev_lss.LSSConfig:
    return bev_lss.LSSConfig(image_size=(32, 64), focal=50.0, principal=(32.0, 12.0), widths=(8, 16, 32, 32),
                             depth=(4.0, 24.0, 4.0), context=8, grid=(-20.0, 20.0, 2.5), bev_width=8, classes=3)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_small_traced_graph_matches_eager(name):
    model, inputs = _small(name)
    model.eval()
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        for a, b in zip(_as_tuple(model(*inputs)), _as_tuple(gm(*inputs)), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_samples_in_a_batch_are_independent(name):
    """Batch 2 gives each sample's batch-1 result: no reshape mixes samples, cameras or agents."""
    model, inputs = _small(name)
    model.eval()
    with torch.no_grad():
        both = _as_tuple(model(*inputs))
        for i in range(2):
            one = _as_tuple(model(*(t[i:i + 1] for t in inputs)))
            for a, b in zip(one, both, strict=True):
                # Batched and single convolutions take different kernel paths: float32 rounding through ~50
                # layers differs by ~1e-4 on O(1) outputs; a sample mixed with another would differ by O(1).
                torch.testing.assert_close(b[i:i + 1], a, rtol=1e-3, atol=1e-3)


def test_config_errors():
    with pytest.raises(ValueError, match="image_size: expected multiples of the backbone stride 32"):
        detr.DetrConfig(image_size=(100, 640))
    with pytest.raises(ValueError, match="dim: expected an even multiple of heads=8"):
        planner.PlannerConfig(dim=100)
    with pytest.raises(ValueError, match="agents: expected >= 1"):
        planner.PlannerConfig(agents=0)
    with pytest.raises(ValueError, match="image_size: expected a multiple of patch=16"):
        vit.VisionTransformer(image_size=100)
    from warpforge.zoo.layers import Attention
    with pytest.raises(ValueError, match="heads: expected a divisor of dim=10"):
        Attention(10, 3)
