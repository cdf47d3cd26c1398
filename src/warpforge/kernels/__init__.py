"""Triton kernels: matmul, GEMV, quantized linear, conv, fused norms/RoPE/activations, attention.

Each kernel is a private ``@triton.jit`` function, a public launcher that validates its inputs,
and a torch reference in :mod:`warpforge.kernels.reference`. Imports torch and triton only.
"""

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._dispatch import force_triton, use_triton

__all__ = ["force_triton", "use_triton"]
