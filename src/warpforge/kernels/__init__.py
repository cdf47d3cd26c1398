"""Triton kernels: matmul, GEMV, quantized linear, conv, fused norms/RoPE/activations, attention.

Each kernel is a private ``@triton.jit`` function, a public launcher that validates its inputs,
and a torch reference in :mod:`warpforge.kernels.reference`. Imports torch and triton only.
Kernel modules load on first use of one of their names, so ``import warpforge.kernels`` stays cheap.
The memory kernels (``copy``, ``fill``, ``sum``) live in :mod:`warpforge.kernels.memory` so their
names do not shadow builtins here.
"""

from __future__ import annotations

import importlib
from typing import Any

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._dispatch import force_triton, use_triton

_LAZY = {
    "matmul": "matmul", "MatmulConfig": "matmul",
    "matmul_fp8": "matmul_fp8",
    "linear": "gemv", "gemv": "gemv", "LinearConfig": "gemv",
    "quantize_weight": "quant_linear", "QuantizedWeight": "quant_linear",
    "conv2d": "conv", "prepare_conv_weight": "conv", "ConvConfig": "conv",
    "rms_norm": "norm", "layer_norm": "norm",
    "rope": "rope", "rope_cache": "rope",
    "silu_and_mul": "activation", "gelu_and_mul": "activation", "softmax": "activation",
    "flash_attention": "attention", "paged_decode": "attention", "chunked_prefill": "attention",
    "store_kv": "attention", "PagedKVCache": "attention",
}

__all__ = ["force_triton", "use_triton", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"warpforge.kernels.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'warpforge.kernels' has no attribute {name!r}")
