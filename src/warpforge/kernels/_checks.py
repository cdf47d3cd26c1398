"""Checks shared by kernel families: the tiling configs' fields, index values a kernel would read memory with,
and the dtypes the Triton interpreter cannot compute.

Index values (positions, page ids, sequence lengths) live in tensors; on the GPU reading them costs
a host sync, which CUDA-graph capture forbids. The public launchers therefore check them by default
(``check_values=None``) except while a graph is being captured, and callers that build the indices
themselves and have tested that (the LLM engine on the GPU) pass ``check_values=False``.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from warpforge.kernels._dispatch import INTERPRET


NUM_WARPS = (1, 2, 4, 8, 16)


def check_pow2(config: Any, *names: str, lo: int = 1, hi: int | None = None) -> None:
    """Fields ``names`` of a tiling config: each a power of two in [lo, hi] (Triton's block shapes must be), else a
    ValueError naming the config class, the field and the value."""
    for name in names:
        v = getattr(config, name)
        if not (isinstance(v, numbers.Integral) and v >= max(lo, 1) and v & (v - 1) == 0 and (hi is None or v <= hi)):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{type(config).__name__}.{name} must be a power of two {bounds}, got {v!r}")


def check_range(config: Any, name: str, lo: int, hi: int) -> None:
    """Field ``name`` of a tiling config in [lo, hi], else a ValueError naming it."""
    v = getattr(config, name)
    if not lo <= v <= hi:
        raise ValueError(f"{type(config).__name__}.{name} must be in [{lo}, {hi}], got {v}")


def check_num_warps(config: Any, allowed: tuple[int, ...] = NUM_WARPS) -> None:
    if config.num_warps not in allowed:
        raise ValueError(f"{type(config).__name__}.num_warps must be one of {allowed}, got {config.num_warps}")


def check_tensor_as(t: Any, name: str, shape: tuple, dtype: torch.dtype, device: torch.device, like: str = "") -> None:
    """``t`` is a torch.Tensor of exactly this shape, dtype and device (an ``out=`` buffer, or an input that must
    match another), else a one-line ValueError naming what differs: ``like`` names where the device came from
    ("means2d" gives "... must be on cuda:0 like means2d, got cpu")."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}{f' like {like}' if like else ''}, got {t.device}")


def resolve_check_values(check_values: bool | None, device: torch.device) -> bool:
    """``check_values`` with None resolved: check, unless a CUDA graph is being captured on ``device``'s
    stream (its values cannot be read then; the eager call before capture is where they are checked)."""
    if check_values is not None:
        return bool(check_values)
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def refuse_interpreted_bf16(name: str, *tensors: torch.Tensor | None) -> None:
    """The Triton interpreter keeps bfloat16 as raw 16-bit integers (numpy has no bf16), and its tl.dot
    multiplies those integers: a kernel that dots bf16 operands there returns garbage (relative error
    ~1e9). Refuse instead; kernels that convert bf16 to fp32 before any arithmetic are unaffected."""
    if INTERPRET and any(t is not None and t.dtype == torch.bfloat16 for t in tensors):
        raise ValueError(f"{name}: bfloat16 is not supported through the Triton interpreter (no GPU: its bf16 "
                         f"dot products are wrong); use float16 or float32 here, or run on a CUDA GPU")


__all__ = ["NUM_WARPS", "check_num_warps", "check_pow2", "check_range", "check_tensor_as", "refuse_interpreted_bf16",
           "resolve_check_values"]
