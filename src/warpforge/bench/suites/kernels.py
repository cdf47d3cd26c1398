"""Suite `kernels`: the Triton kernel library I against cuBLAS/cuDNN/torch.

Cases come from two files: ``_kernels_matmul`` (matmul, fp8, decode GEMV, weight-only int8/int4/fp8)
and ``_kernels_fused`` (ResNet-50 convs, norms, RoPE, gated activations, softmax).
"""

from __future__ import annotations

from warpforge.bench.suite import Suite
from warpforge.bench.suites import _kernels_fused, _kernels_matmul

SUITE = Suite(
    name="kernels",
    description="matmul/fp8/GEMV/weight-only linear vs cuBLAS; conv2d vs cuDNN; fused norm/rope/act/softmax "
                "vs torch eager and torch.compile",
    cases=lambda quick: _kernels_matmul.cases(quick) + _kernels_fused.cases(quick),
)
