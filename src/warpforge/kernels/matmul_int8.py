"""INT8 (W8A8) matmul with per-tensor or per-row/per-column scales and exact int32 accumulation.

``out = activation((a @ b) * scale_a * scale_b + bias) + residual``: int8 operands, an int32
accumulator (exact: no rounding inside the K loop), converted to fp32 once before the epilogue. It
launches the kernels of :mod:`warpforge.kernels.matmul` (persistent TMA kernel on Hopper, reaching
the s8 wgmma) with ``INT_ACC=True``; the scales are applied to the converted accumulator.

Layout: as for fp8, Hopper's 8-bit wgmma reads both operands K-major, so ``a`` is row-major [M, K]
and ``b`` column-major [K, N] (``b = w.t()`` of a row-major int8 [N, K] weight). The TMA path also
needs 16-byte aligned rows, i.e. K % 16 == 0; other K run on the pointer kernel.

``quantize_rows_int8`` makes the activation operand (torch ops, not a fused kernel yet).
"""

from __future__ import annotations

import torch

from warpforge.kernels import reference
from warpforge.kernels._autotune import Tuner
from warpforge.kernels.matmul import MatmulConfig, _ptr_configs, _tma_configs, check_tensor
from warpforge.kernels.matmul_fp8 import scaled_gemm

INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never produced, so -q is always representable

# int8 has fp8's element size: fp8's candidates (the bf16 lists with block_k 128). Compiled for sm_90
# with int8 operands (tests/kernels/sm90_compile.py --all): all reach wgmma and fit shared memory; with the
# bias+gelu epilogue and fp16 out the two (128, 256, 128) tiles spill a little, as their bf16/fp8 twins do;
# test_matmul_int8_every_candidate_gpu checks every candidate on the GPU.
INT8_CONFIGS = _tma_configs(128) + _ptr_configs(128)
INT8_TUNER = Tuner("matmul_int8", INT8_CONFIGS, MatmulConfig)
INT8_INTERPRET_CONFIG = MatmulConfig(32, 32, 32, 2, 4, 1)


def matmul_int8(
    a: torch.Tensor,  # [M, K] int8, row-major
    b: torch.Tensor,  # [K, N] int8, column-major (b.T contiguous: w.t() of an int8 [N, K] weight)
    scale_a: torch.Tensor,  # fp32: one value, or [M] / [M, 1] per row of a
    scale_b: torch.Tensor,  # fp32: one value, or [N] / [1, N] per column of b (per output channel)
    *,
    bias: torch.Tensor | None = None,  # [N] fp16/bf16/fp32
    activation: str | None = None,  # None | "relu" | "gelu" | "gelu_tanh" | "silu"
    residual: torch.Tensor | None = None,  # [M, N], added after the activation
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,  # [M, N] of out_dtype
    config: MatmulConfig | None = None,  # fixed launch config (skips autotuning; for sweeps and tests)
) -> torch.Tensor:  # [M, N] out_dtype
    """W8A8 matmul: ``activation(float(a @ b) * scale_a * scale_b + bias) + residual``, a @ b in int32."""
    return scaled_gemm(a, b, scale_a, scale_b, bias=bias, activation=activation, residual=residual,
                       out_dtype=out_dtype, out=out, config=config, dtype=torch.int8, what="int8", min_cc=(8, 0),
                       ref=reference.matmul_int8_ref, tuner=INT8_TUNER, interpret_config=INT8_INTERPRET_CONFIG)


def quantize_rows_int8(
    x: torch.Tensor,  # [..., K] floating point
    scale: torch.Tensor | float | None = None,  # static per-tensor scale (one value), or None: per row
) -> tuple[torch.Tensor, torch.Tensor]:  # q [..., K] int8 (contiguous), scale fp32 ([] static, [..., 1] dynamic)
    """Symmetric int8 quantization, q = clamp(round(x / scale), -127, 127) (round half to even).

    Static (``scale`` given): one scale for the whole tensor, returned as a 0-d fp32 tensor.
    Dynamic (``scale`` None): one scale per row, max(absmax(row), 1e-12) / 127, shape [..., 1].
    ``x ~= q.float() * scale`` in both cases.
    """
    check_tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a 0-d tensor")
    xf = x.float()
    if scale is None:
        s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / INT8_MAX
    else:
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if s.numel() != 1:
            raise ValueError(f"scale: expected one value (a per-tensor scale), got shape {tuple(s.shape)}")
        s = s.reshape(())
        if not bool(torch.isfinite(s)) or float(s) <= 0:
            raise ValueError(f"scale: expected a finite positive value, got {float(s)}")
    q = torch.round(xf / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous()
    return q, s
