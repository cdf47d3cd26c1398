"""FP8 (e4m3) matmul with per-tensor or per-row/per-column scales, like ``torch._scaled_mm``.

``out = activation((a @ b) * scale_a * scale_b + bias) + residual`` with fp32 accumulation. It
launches the kernels of :mod:`warpforge.kernels.matmul` (persistent TMA kernel on Hopper) with
e4m3 operands; the scales are applied to the fp32 accumulator in the epilogue.

Layout: Hopper's fp8 tensor-core instructions read both operands K-major, so ``a`` must be
row-major [M, K] and ``b`` column-major [K, N] (``b.T`` contiguous), which is also what
``torch._scaled_mm`` requires. Other layouts are rejected rather than silently transposed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from warpforge.kernels import reference
from warpforge.kernels._autotune import Tuner
from warpforge.kernels._dispatch import use_triton
from warpforge.kernels.matmul import (
    SCALE_TENSOR, SCALE_VECTOR, MatmulConfig, _ptr_configs, _tma_configs, activation_code,
    check_epilogue_operands, check_out_dtype, check_tensor, launch_gemm,
)
from warpforge.kernels.reference import FP8_E4M3_MAX, FP8_MIN_AMAX

FP8_DTYPE = torch.float8_e4m3fn

# e4m3 tiles hold twice the K of bf16 ones for the same bytes: the bf16 lists with block_k 128.
FP8_CONFIGS = _tma_configs(128) + _ptr_configs(128)
FP8_TUNER = Tuner("matmul_fp8", FP8_CONFIGS, MatmulConfig)
FP8_INTERPRET_CONFIG = MatmulConfig(32, 32, 32, 2, 4, 1)


# Multiples that keep every row 16-byte aligned for TMA descriptors: K e4m3 bytes (both operands are K-major),
# N 16-bit output values.
K_ALIGN, N_ALIGN = 16, 8


def to_e4m3(x: torch.Tensor,  # [M, K] float
            scale: torch.Tensor | None,  # fp32 [1] (static), or None: one scale per row (dynamic)
            ) -> tuple[torch.Tensor, torch.Tensor]:  # e4m3 [M, K], fp32 scale [1] or [M, 1]
    """``x ~= q.float() * scale`` with q in e4m3, values beyond +-448 * scale clamped (saturated, not inf).

    Dynamic: scale = max(absmax(row), 1e-12) / 448, the convention of the norm kernels' fp8 output
    (kernels/norm.py), so a fused norm can hand a layer its operand directly. No host sync: the
    quantized model captures in a CUDA graph.
    """
    xf = x.float()
    if scale is None:
        scale = xf.abs().amax(-1, keepdim=True).clamp_min(FP8_MIN_AMAX) / FP8_E4M3_MAX  # [M, 1]
    q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def _scale_mode(name: str, scale, length: int, vector_shapes: tuple, device) -> int:
    """Per-tensor (one value) or per-row/column (``length`` values) fp32 scale; returns the epilogue mode."""
    check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() == 1 and scale.dim() <= 2:
        return SCALE_TENSOR
    if tuple(scale.shape) in vector_shapes:
        if not scale.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {scale.stride()}")
        return SCALE_VECTOR
    raise ValueError(f"{name}: expected one value (shape (), (1,) or (1, 1)) or {length} values "
                     f"(shape {' or '.join(str(s) for s in vector_shapes)}), got {tuple(scale.shape)}")


def check_scaled_gemm(a, b, dtype: torch.dtype, scale_a, scale_b, *, bias, activation, residual, out_dtype, out,
                      config) -> tuple[int, int, int, int, int]:
    """Validate a scaled GEMM's operands (fp8 and int8: a row-major [M, K], b column-major [K, N] of
    ``dtype``, fp32 scales per tensor or per row/column); returns (M, N, scale_a mode, scale_b mode,
    activation code)."""
    check_tensor("a", a, dtypes=(dtype,), ndim=2)
    device = a.device
    check_tensor("b", b, dtypes=(dtype,), ndim=2, device=device)
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: expected shape ({K}, N) to match a {tuple(a.shape)}, got {tuple(b.shape)}")
    N = b.shape[1]
    if a.stride(1) != 1 and K > 1:
        raise ValueError(f"a: expected row-major [M, K] (a.stride(1) == 1), got strides {a.stride()}; "
                         "pass a.contiguous()")
    if b.stride(0) != 1 and K > 1:
        raise ValueError(f"b: expected column-major [K, N] (b.stride(0) == 1, like torch._scaled_mm), got strides "
                         f"{b.stride()}; pass w.t() for a row-major [N, K] weight w, or b.t().contiguous().t()")
    sa_mode = _scale_mode("scale_a", scale_a, M, ((M,), (M, 1)), device)
    sb_mode = _scale_mode("scale_b", scale_b, N, ((N,), (1, N)), device)
    act = activation_code(activation)
    check_out_dtype(out_dtype)
    check_epilogue_operands(M, N, device, bias, residual, out, out_dtype, (a, b))
    if config is not None and not isinstance(config, MatmulConfig):
        raise ValueError(f"config: expected a MatmulConfig, got {type(config).__name__}")
    return M, N, sa_mode, sb_mode, act


def scaled_gemm(a, b, scale_a, scale_b, *, bias, activation, residual, out_dtype, out, config, dtype: torch.dtype,
                what: str, min_cc: tuple[int, int], ref: Callable, tuner: Tuner,
                interpret_config: MatmulConfig) -> torch.Tensor:
    """The launcher of matmul_fp8 and matmul_int8 (``dtype`` operands, named ``what`` in errors): check the
    arguments, run ``ref`` off the Triton path, refuse a GPU below ``min_cc``, allocate, launch."""
    M, N, sa_mode, sb_mode, act = check_scaled_gemm(a, b, dtype, scale_a, scale_b, bias=bias, activation=activation,
                                                    residual=residual, out_dtype=out_dtype, out=out, config=config)
    device = a.device
    if not use_triton(a, b, scale_a, scale_b, bias, residual, out):
        y = ref(a, b, scale_a, scale_b, bias, activation, residual, out_dtype)
        return out.copy_(y) if out is not None else y
    if a.is_cuda and torch.cuda.get_device_capability(device) < min_cc:
        raise ValueError(f"a: {what} tensor-core matmul needs compute capability >= {min_cc[0]}.{min_cc[1]}, "
                         f"device {device} has {torch.cuda.get_device_capability(device)}")
    if out is None:
        out = torch.empty((M, N), device=device, dtype=out_dtype)
    launch_gemm(a, b, out, scale_a=scale_a, scale_b=scale_b, scale_a_mode=sa_mode, scale_b_mode=sb_mode,
                bias=bias, activation=act, residual=residual, config=config, tuner=tuner,
                interpret_config=interpret_config)
    return out


def matmul_fp8(
    a: torch.Tensor,  # [M, K] float8_e4m3fn, row-major
    b: torch.Tensor,  # [K, N] float8_e4m3fn, column-major (b.T contiguous)
    scale_a: torch.Tensor,  # fp32: one value, or [M] / [M, 1] per row of a
    scale_b: torch.Tensor,  # fp32: one value, or [N] / [1, N] per column of b
    *,
    bias: torch.Tensor | None = None,  # [N]
    activation: str | None = None,
    residual: torch.Tensor | None = None,  # [M, N]
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,  # [M, N] of out_dtype
    config: MatmulConfig | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """Scaled e4m3 matmul: ``activation((a @ b) * scale_a * scale_b + bias) + residual``."""
    return scaled_gemm(a, b, scale_a, scale_b, bias=bias, activation=activation, residual=residual,
                       out_dtype=out_dtype, out=out, config=config, dtype=FP8_DTYPE, what="e4m3", min_cc=(8, 9),
                       ref=reference.matmul_fp8_ref, tuner=FP8_TUNER, interpret_config=FP8_INTERPRET_CONFIG)

