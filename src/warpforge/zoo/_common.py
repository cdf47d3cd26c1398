"""Helpers the zoo's model files share: seeded building, BatchNorm calibration, optional packages."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TypeVar

import torch
from torch import nn

VISION_EXTRA = "pip install 'warpforge[vision]'"

M = TypeVar("M", bound=nn.Module)


def require(module: str, pip_name: str, what: str, install: str = VISION_EXTRA) -> ModuleType:
    """Import an optional package or raise an ImportError that names the pip package and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs the PyPI package {pip_name!r} (module {module!r}): {install}") from e


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build under a fixed CPU seed without disturbing the caller's global RNG.

    Module constructors draw their default initialisation from the global generator; forking it
    makes a zoo model the same on every call and leaves the caller's random stream where it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(seed: int) -> torch.Generator:
    """A fresh CPU generator: inputs are drawn on CPU and moved, so they match on every device."""
    return torch.Generator().manual_seed(seed)


def move(inputs: tuple[torch.Tensor, ...], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Floating tensors to ``dtype`` and ``device``; integer and bool tensors keep their dtype."""
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs)


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Set every BatchNorm's running statistics to the batch statistics of one forward pass.

    A randomly initialised BatchNorm in eval mode (mean 0, var 1) is the identity, so activations
    drift by the gain of every conv before it and residual sums grow without bound. Trained networks
    keep each BatchNorm's output near unit scale; one pass in batch-statistics mode reproduces that,
    so random-weight models see activations of the scale a trained one would.
    """
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average: after one batch, exactly that batch's statistics
        bn.train()
    model(*inputs)
    for bn in norms:
        bn.momentum = 0.1
        bn.eval()


def random_images(*shape: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    """A vision model's input maker: one standard-normal batch of ``shape`` ([B, 3, H, W]; a multi-camera model
    [B, cams, 3, H, W]) from the generator it is given."""
    return lambda g: (torch.randn(*shape, generator=g),)


def build_calibrated(make: Callable[[], M], example: Callable[[torch.Generator], tuple[torch.Tensor, ...]],
                     seed: int = 0) -> M:
    """``make()`` under ``seed`` (:func:`seeded`), its BatchNorm statistics set from one input drawn by ``example``
    at that seed (:func:`calibrate_batchnorm`), in eval mode: a random-weight zoo model, the same on every call."""
    with seeded(seed):
        model = make()
        calibrate_batchnorm(model, example(generator(seed)))
    return model


def random_inputs(make: Callable[[torch.Generator], tuple[torch.Tensor, ...]], seeds: range,
                  device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """One input tuple per seed, from ``make(generator)``, moved to ``device``/``dtype``."""
    return [move(make(generator(s)), device, dtype) for s in seeds]


EXAMPLE_SEED = 1
VAL_SEEDS = range(100, 104)


def random_spec(name: str, kind: str, model: nn.Module, make: Callable[[torch.Generator], tuple[torch.Tensor, ...]],
                device: torch.device, dtype: torch.dtype):
    """The ModelSpec of a random-weight model (no weights reachable offline): ``model`` in eval mode on
    device/dtype, example inputs from ``make`` at EXAMPLE_SEED, validation inputs at VAL_SEEDS."""
    from warpforge.zoo.registry import ModelSpec

    return ModelSpec(name=name, model=model.to(device=device, dtype=dtype).eval(),
                     example_inputs=move(make(generator(EXAMPLE_SEED)), device, dtype), kind=kind, weights="random",
                     val_inputs=lambda: random_inputs(make, VAL_SEEDS, device, dtype))
