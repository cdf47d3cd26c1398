"""Triton kernels: matmul, GEMV, quantized linear, conv, fused norms/RoPE/activations, attention.

Each kernel is a private ``@triton.jit`` function, a public launcher that validates its inputs,
and a torch reference in :mod:`warpforge.kernels.reference`. Imports torch and triton only.
"""

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._checks import check_tensor_as
from warpforge.kernels._dispatch import INTERPRET, force_triton, programmatic_launch, use_triton

# INTERPRET: whether Triton kernels run in its interpreter (no GPU), for kernels outside this package that
# take another code path there. check_tensor_as: the launchers' shape/dtype/device check of a tensor, for
# those kernels' launchers too (one wording for the same mistake).
__all__ = ["INTERPRET", "check_tensor_as", "force_triton", "programmatic_launch", "use_triton"]

# Kernels are imported from their modules (``from warpforge.kernels.matmul import matmul``): several
# functions share their module's name (matmul, gemv, rope), so re-exporting them here would make
# ``warpforge.kernels.matmul`` mean the function or the module depending on import order.
