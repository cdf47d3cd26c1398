"""The model zoo's registry: ``names()`` and ``get(name)`` -> ``ModelSpec``.

Every model lives in its own file and exposes ``spec(batch, device, dtype, pretrained) -> ModelSpec``;
the registry imports that file only when the model is asked for, so ``import warpforge.zoo`` stays
cheap and a model whose weights come from an optional package fails only when it is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("classifier", "detector", "bev", "planner")

# name -> module under warpforge.zoo that builds it (its ``spec`` function).
_MODULES = {
    "mobilenet_v2": "mobilenet_v2",
    "efficientnet_lite0": "efficientnet_lite",
    "resnet50": "resnet",
    "vit_b16": "vit",
    "detr_small": "detr",
    "fcos_small": "fcos",
    "bev_lss": "bev_lss",
    "planner": "planner",
}

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class ModelSpec:
    """A built model with the inputs to run it on.

    ``example_inputs`` are random tensors of the shapes the model is meant for (fresh from a seeded
    generator: equal on every call). ``val_inputs()`` returns several input tuples for accuracy checks:
    real images for classifiers with real weights, else seeded random inputs of the example's shapes.
    ``weights`` says where the weights came from: "ImageNet (package <pip name>)" or "random".
    ``labels`` are class names when the weights' package ships them (none of ours does: None).
    """

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    kind: str
    weights: str
    val_inputs: Callable[[], list[tuple[torch.Tensor, ...]]]
    labels: list[str] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.example_inputs, tuple):
            raise TypeError(f"example_inputs: expected a tuple of tensors, got {type(self.example_inputs).__name__}")


def names() -> list[str]:
    """The names ``get`` accepts, in a stable order (vision, detection, BEV, planning)."""
    return list(_MODULES)


def get(name: str, *, batch: int = 1, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
        pretrained: bool = True) -> ModelSpec:
    """Build zoo model ``name`` in eval mode on ``device`` in ``dtype``, with its example inputs.

    ``pretrained=True`` loads real weights where a package ships them (mobilenet_v2,
    efficientnet_lite0: ImportError naming the pip package if it is missing); the other models have
    no public weights reachable offline and are always seeded random (``spec.weights == "random"``).
    ``pretrained=False`` gives seeded random weights for every model, with no optional package.
    """
    if name not in _MODULES:
        raise ValueError(f"name: expected one of {names()}, got {name!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected an int >= 1, got {batch!r}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: expected a floating dtype {_FLOAT_DTYPES}, got {dtype!r}")
    device = torch.device(device)
    module = importlib.import_module(f"warpforge.zoo.{_MODULES[name]}")
    spec = module.spec(batch=batch, device=device, dtype=dtype, pretrained=bool(pretrained))
    spec.model.eval()
    return spec
