"""Where a kernel call runs: the Triton kernel on CUDA tensors, the torch reference on CPU.

Kernel tests force the Triton path on CPU tensors (through Triton's interpreter) so CI checks the
kernels' own code. The interpreter must be chosen before any ``@triton.jit`` runs, so this module
is imported first by every module that defines Triton kernels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    # Without a GPU the only way to execute a Triton kernel is its interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_forced = False


@contextlib.contextmanager
def force_triton() -> Iterator[None]:
    """Run Triton kernels even on CPU tensors (through the interpreter). For kernel tests."""
    global _forced
    if not INTERPRET and not torch.cuda.is_available():
        raise RuntimeError("force_triton on CPU needs TRITON_INTERPRET=1 before triton kernels load")
    prev, _forced = _forced, True
    try:
        yield
    finally:
        _forced = prev


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these tensors (all CUDA, or forced on CPU)."""
    if _forced:
        return True
    return all(t.is_cuda for t in tensors if t is not None)
