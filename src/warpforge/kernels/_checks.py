"""Launcher checks shared by kernel families: index values a kernel would read memory with, and the
dtypes the Triton interpreter cannot compute.

Index values (positions, page ids, sequence lengths) live in tensors; on the GPU reading them costs
a host sync, which CUDA-graph capture forbids. The public launchers therefore check them by default
(``check_values=None``) except while a graph is being captured, and callers that build the indices
themselves and have tested that (the LLM engine on the GPU) pass ``check_values=False``.
"""

from __future__ import annotations

import torch

from warpforge.kernels._dispatch import INTERPRET


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


__all__ = ["refuse_interpreted_bf16", "resolve_check_values"]
