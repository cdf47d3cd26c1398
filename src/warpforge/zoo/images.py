"""Real photographs for classifier accuracy checks: the RGB images bundled in scikit-image and scikit-learn.

Nothing is downloaded: ``skimage.data`` and ``sklearn.datasets`` ship these files inside their wheels.
Each image is resized (shorter side to ``resize``, bilinear with antialiasing), cropped to ``size``
(the centre by default, the usual ImageNet evaluation transform) and normalised with the mean and std
the weights were trained with. :func:`views` turns the nine natural photos into a few hundred
validation inputs: three scales x five crops (centre and corners) x mirrored, 270 in all.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from collections.abc import Callable

from torch import nn

from warpforge.zoo._common import (EXAMPLE_SEED, VAL_SEEDS, calibrate_batchnorm, generator, move, random_images,
                                     random_inputs, require, seeded)
from warpforge.zoo.registry import ModelSpec

# Photos of ImageNet-like subjects, in the order ``val_inputs()`` returns them.
VAL_IMAGES = ("chelsea", "coffee", "astronaut", "rocket", "stereo_motorcycle", "clock", "camera")
# Every photo scikit-image 0.26 ships inside its wheel (the others in skimage.data are fetched by pooch).
PHOTOS = VAL_IMAGES + ("cat", "coins", "colorwheel", "hubble_deep_field", "immunohistochemistry", "retina")
# The two photos scikit-learn ships (sklearn.datasets.load_sample_image): a temple and a flower.
SKLEARN_PHOTOS = ("china", "flower")
# The natural photos the validation views are made of (PHOTOS' others are calibration material: micrographs,
# a colour wheel, coins, deep space; "cat" is "chelsea" again).
VAL_PHOTOS = VAL_IMAGES + SKLEARN_PHOTOS
# Crops of a resized photo (views()): the centre and the four corners, as in ten-crop evaluation.
CROPS = ("center", "top-left", "top-right", "bottom-left", "bottom-right")
VIEW_RESIZES = (256, 288, 320)  # shorter side before cropping 224: three scales

# The torchvision / Caffe2 convention (mean and std of ImageNet's RGB pixels in [0, 1]).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The TensorFlow EfficientNet-Lite convention: (pixel - 127) / 128 on [0, 255].
TF_LITE_MEAN = (127.0 / 255.0,) * 3
TF_LITE_STD = (128.0 / 255.0,) * 3


@functools.cache
def load(name: str) -> np.ndarray:
    """The bundled image ``name`` as read-only uint8 RGB [H, W, 3] (grey images repeated to three channels)."""
    if name in SKLEARN_PHOTOS:
        datasets = require("sklearn.datasets", "scikit-learn", "Real validation images")
        img = datasets.load_sample_image(f"{name}.jpg")
    elif name in PHOTOS:
        data = require("skimage.data", "scikit-image", "Real validation images")
        img = getattr(data, name)()
    else:
        raise ValueError(f"name: expected a photo bundled in scikit-image or scikit-learn, one of "
                         f"{list(PHOTOS + SKLEARN_PHOTOS)}, got {name!r}")
    if isinstance(img, tuple):  # stereo pairs: the left view
        img = img[0]
    img = np.asarray(img)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=-1)
    img = np.ascontiguousarray(img[..., :3]).astype(np.uint8)  # a copy: the cached array is ours alone
    img.setflags(write=False)
    return img


def preprocess(img: np.ndarray, *, size: int = 224, resize: int = 256, mean=IMAGENET_MEAN,
               std=IMAGENET_STD, crop: str = "center") -> torch.Tensor:
    """uint8 RGB [H, W, 3] -> normalised float32 [1, 3, size, size] (resize shorter side, then ``crop``:
    one of ``CROPS``)."""
    if resize < size:
        raise ValueError(f"resize: expected >= size ({size}), got {resize}")
    if crop not in CROPS:
        raise ValueError(f"crop: expected one of {list(CROPS)}, got {crop!r}")
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 255.0  # [1, 3, H, W]
    h, w = x.shape[-2:]
    scale = resize / min(h, w)
    x = F.interpolate(x, size=(max(size, round(h * scale)), max(size, round(w * scale))), mode="bilinear",
                      antialias=True, align_corners=False)
    spare_h, spare_w = x.shape[-2] - size, x.shape[-1] - size
    top = spare_h // 2 if crop == "center" else (0 if crop.startswith("top") else spare_h)
    left = spare_w // 2 if crop == "center" else (0 if crop.endswith("left") else spare_w)
    x = x[..., top:top + size, left:left + size]
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def imagenet_batch(names=VAL_IMAGES, **kw) -> torch.Tensor:
    """The named images, preprocessed and stacked: [len(names), 3, size, size]."""
    return torch.cat([preprocess(load(n), **kw) for n in names])


def views(names=VAL_PHOTOS, *, size: int = 224, resizes=VIEW_RESIZES, crops=CROPS, flips: bool = True,
          **norm) -> torch.Tensor:
    """Each photo at each resize and crop, and mirrored: [len(names) * len(resizes) * len(crops) * (1 + flips),
    3, size, size], photo-major (then resize, then crop); the mirrored copies follow the plain ones. With the
    defaults: the nine natural photos, 270 views. ``norm``: the weights' ``mean`` / ``std``."""
    if not names or not resizes or not crops:
        raise ValueError("views: names, resizes and crops must each name at least one")
    x = torch.cat([preprocess(load(n), size=size, resize=r, crop=c, **norm) for n in names for r in resizes
                   for c in crops])
    return torch.cat([x, x.flip(-1)]) if flips else x


def num_views(names=VAL_PHOTOS, *, resizes=VIEW_RESIZES, crops=CROPS, flips: bool = True) -> int:
    """How many samples :func:`views` returns for these arguments (270 with the defaults)."""
    return len(names) * len(resizes) * len(crops) * (2 if flips else 1)


def in_batches(x: torch.Tensor, batch: int, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor]]:
    """``x`` [N, ...] in input tuples of ``batch`` samples each, cycling through it to fill the last one (the
    repeats are not new samples: count ``len(x)``)."""
    if batch < 1:
        raise ValueError(f"batch: expected >= 1, got {batch}")
    n = x.shape[0]
    count = -(-n // batch)
    idx = torch.arange(count * batch) % n
    return [(x[idx[i * batch:(i + 1) * batch]].to(device=device, dtype=dtype),) for i in range(count)]


def val_batches(batch: int, device: torch.device, dtype: torch.dtype, **kw) -> list[tuple[torch.Tensor]]:
    """The validation :func:`views` (270 with the defaults) in input tuples of ``batch`` each, cycling to fill
    the last. ``kw``: :func:`views`' arguments (``mean``/``std`` among them)."""
    return in_batches(views(**kw), batch, device, dtype)


def classifier_spec(name: str, build: Callable[[], nn.Module], load_weights: Callable[[nn.Module], None],
                    weights_package: str, *, batch: int, device: torch.device, dtype: torch.dtype, pretrained: bool,
                    **normalize) -> ModelSpec:
    """The spec of an ImageNet classifier on 224x224 inputs: real weights and photos (``normalize``:
    the weights' mean/std) when ``pretrained``, else seeded random weights with BatchNorms calibrated
    on one random batch (identity BatchNorms would shrink activations layer by layer) and random
    validation inputs."""
    make = random_images(batch, 3, 224, 224)
    with seeded(0):
        model = build()
    if pretrained:
        load_weights(model)
    else:
        with seeded(0):
            calibrate_batchnorm(model, random_images(1, 3, 224, 224)(generator(0)))
    model = model.to(device=device, dtype=dtype).eval()

    def val() -> list[tuple[torch.Tensor, ...]]:
        if pretrained:
            return val_batches(batch, device, dtype, **normalize)
        return random_inputs(make, VAL_SEEDS, device, dtype)

    return ModelSpec(name=name, model=model, example_inputs=move(make(generator(EXAMPLE_SEED)), device, dtype),
                     kind="classifier", weights=f"ImageNet (package {weights_package})" if pretrained else "random",
                     val_inputs=val)
