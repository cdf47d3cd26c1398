"""Real photographs for classifier accuracy checks: the RGB images bundled in scikit-image.

Nothing is downloaded: ``skimage.data`` ships these files inside the wheel. Each image is resized
(shorter side to ``resize``, bilinear with antialiasing), centre-cropped to ``size`` and normalised
with the mean and std the weights were trained with, the usual ImageNet evaluation transform.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from collections.abc import Callable

from torch import nn

from warpforge.models._common import (EXAMPLE_SEED, VAL_SEEDS, calibrate_batchnorm, generator, move, random_inputs,
                                     require, seeded)
from warpforge.models.registry import ModelSpec

# Photos of ImageNet-like subjects, in the order ``val_inputs()`` returns them.
VAL_IMAGES = ("chelsea", "coffee", "astronaut", "rocket", "stereo_motorcycle", "clock", "camera")
# Every photo scikit-image 0.26 ships inside its wheel (the others in skimage.data are fetched by pooch).
PHOTOS = VAL_IMAGES + ("cat", "coins", "colorwheel", "hubble_deep_field", "immunohistochemistry", "retina")

# The torchvision / Caffe2 convention (mean and std of ImageNet's RGB pixels in [0, 1]).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The TensorFlow EfficientNet-Lite convention: (pixel - 127) / 128 on [0, 255].
TF_LITE_MEAN = (127.0 / 255.0,) * 3
TF_LITE_STD = (128.0 / 255.0,) * 3


@functools.cache
def load(name: str) -> np.ndarray:
    """The bundled image ``name`` as read-only uint8 RGB [H, W, 3] (grey images repeated to three channels)."""
    if name not in PHOTOS:
        raise ValueError(f"name: expected a photo bundled in scikit-image, one of {list(PHOTOS)}, got {name!r}")
    data = require("skimage.data", "scikit-image", "Real validation images")
    img = getattr(data, name)()
    if isinstance(img, tuple):  # stereo pairs: the left view
        img = img[0]
    img = np.asarray(img)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=-1)
    img = np.ascontiguousarray(img[..., :3]).astype(np.uint8)  # a copy: the cached array is ours alone
    img.setflags(write=False)
    return img


def preprocess(img: np.ndarray, *, size: int = 224, resize: int = 256, mean=IMAGENET_MEAN,
               std=IMAGENET_STD) -> torch.Tensor:
    """uint8 RGB [H, W, 3] -> normalised float32 [1, 3, size, size] (resize shorter side, centre crop)."""
    if resize < size:
        raise ValueError(f"resize: expected >= size ({size}), got {resize}")
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 255.0  # [1, 3, H, W]
    h, w = x.shape[-2:]
    scale = resize / min(h, w)
    x = F.interpolate(x, size=(max(size, round(h * scale)), max(size, round(w * scale))), mode="bilinear",
                      antialias=True, align_corners=False)
    top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
    x = x[..., top:top + size, left:left + size]
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def imagenet_batch(names=VAL_IMAGES, **kw) -> torch.Tensor:
    """The named images, preprocessed and stacked: [len(names), 3, size, size]."""
    return torch.cat([preprocess(load(n), **kw) for n in names])


def val_batches(batch: int, device: torch.device, dtype: torch.dtype, **kw) -> list[tuple[torch.Tensor]]:
    """``VAL_IMAGES`` in input tuples of ``batch`` images each, cycling through the list to fill the last."""
    x = imagenet_batch(**kw)
    n = len(VAL_IMAGES)
    count = -(-n // batch)
    idx = torch.arange(count * batch) % n
    return [(x[idx[i * batch:(i + 1) * batch]].to(device=device, dtype=dtype),) for i in range(count)]


def classifier_spec(name: str, build: Callable[[], nn.Module], load_weights: Callable[[nn.Module], None],
                    weights_package: str, *, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool,
                    **normalize) -> ModelSpec:
    """The spec of an ImageNet classifier on 224x224 inputs: real weights and photos (``normalize``:
    the weights' mean/std) when ``pretrained``, else seeded random weights with BatchNorms calibrated
    on one random batch (identity BatchNorms would shrink activations layer by layer) and random
    validation inputs."""
    def make(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch, 3, 224, 224, generator=g),)

    with seeded(0):
        model = build()
    if pretrained:
        load_weights(model)
    else:
        with seeded(0):
            calibrate_batchnorm(model, (torch.randn(1, 3, 224, 224, generator=generator(0)),))
    model = model.to(device=device, dtype=dtype).eval()

    def val() -> list[tuple[torch.Tensor, ...]]:
        if pretrained:
            return val_batches(batch, device, dtype, **normalize)
        return random_inputs(make, VAL_SEEDS, device, dtype)

    return ModelSpec(name=name, model=model, example_inputs=move(make(generator(EXAMPLE_SEED)), device, dtype),
                     kind="classifier", weights=f"ImageNet (package {weights_package})" if pretrained else "random",
                     val_inputs=val)
