"""Torch references for every Triton kernel in warpforge.kernels.

Each function's docstring names the kernel it checks. References compute in float32 or float64 and
return the kernel's output dtype only when asked; tests compare against them with the tolerances
in :mod:`warpforge.kernels.tolerance`. On CPU tensors the public launchers run these directly.

Sections below belong to kernel families; keep each family's functions inside its section.
"""

from __future__ import annotations

import torch

# ---- memory (copy, fill, sum): kernels/memory.py --------------------------------------------

# ---- matmul family (matmul, matmul_fp8, gemv/linear, quant_linear): kernels/{matmul,gemv,quant_linear}.py

# ---- fused ops (conv2d, norms, rope, activations, softmax): kernels/{conv,norm,rope,activation}.py

# ---- attention (flash prefill, paged decode, kv cache): kernels/attention/ --------------------
