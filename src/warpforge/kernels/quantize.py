"""``quantize_int8``: float -> int8 with one static (per-tensor) scale, in one pass.

    symmetric (zero_point 0):   q = clamp(round(x * (1 / scale)), -127, 127)         x ~= scale * q
    unsigned (zero_point -128): q = clamp(round(x * (1 / scale)) - 128, -128, 127)   x ~= scale * (q + 128)

Rounding is half to even, as ``torch.round``. 1 / scale is one IEEE fp32 division per program, x times it
one fp32 multiply (bit-identical to the reference's ``x * torch.reciprocal(scale)``). A division per
element (``div_rn``) made the quantizer and every int8-out conv epilogue instruction-bound, several times
slower than the same work with fp16 out (benchmarks/notes/optimize.md).

The unsigned form spends all 256 codes on [0, 255 * scale]: one more bit for data known to be >= 0 (the
output of a ReLU), where the symmetric form leaves the negative half unused. Symmetric never produces
-128, so -q is always representable.

The activation quantizer of the W8A8 layers (``conv2d_int8``'s x_q, ``QuantLinearW8A8``'s input). The
scale is a device tensor read by the kernel, never by the host, so a quantized model captures in a CUDA
graph. x may be any dense layout (contiguous, channels_last, ...): the kernel walks the storage, and q
gets x's strides.

``round_to_int8`` is the jit helper shared with the conv epilogue (kernels/conv_epilogue.py, ``out_scale=``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._dispatch import use_triton

INT8_MAX = 127
ZERO_POINTS = (0, -128)  # symmetric, unsigned
QUANT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024


# Conversions without the conversion unit. On sm_90 an int32 <-> fp32 conversion (I2F, F2I) issues at 16
# per clock per SM, an FADD or IADD at 64-128: an int8 conv epilogue converting the int32 sum, the int8
# residual and the requantized result spends more cycles there than on its bytes (the int8 1x1 +res convs
# ran well below the memory bandwidth). Adding 1.5 * 2^23 = 0x4B400000 puts an integer v with
# |v| < 2^22 in the low mantissa bits of a float whose exponent is fixed, so both directions are one
# integer add and one float add, exactly (the float add rounds half to even).
MAGIC_I: tl.constexpr = tl.constexpr(0x4B400000)  # the bits of 12582912.0
MAGIC_F: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def i2f_exact(v):
    """int32 v, |v| < 2^22 -> fp32 v exactly (no I2F)."""
    return (v + MAGIC_I).to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def f2i_rn(y):
    """fp32 y, |y| < 2^22 -> int32 round(y), half to even (no F2I)."""
    return (y + MAGIC_F).to(tl.int32, bitcast=True) - MAGIC_I


@triton.jit
def round_to_int8(y, scale, ZERO: tl.constexpr):
    """fp32 ``y`` -> int8 clamp(round(y * (1 / scale)) + ZERO, lo, 127), lo = -127 (ZERO 0) or -128 (ZERO -128);
    1 / scale an IEEE division (of the one scale), round half to even."""
    q = y * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if ZERO == 0:
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    else:  # [0, 255] before the shift
        q = tl.minimum(tl.maximum(q, -128.0 - ZERO), 127.0 - ZERO)
    return (f2i_rn(q) + ZERO).to(tl.int8)  # |q| <= 255


@triton.jit
def _quantize_int8_kernel(x_ptr, q_ptr, s_ptr, n, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    # x and q share strides: element i of the storage walk is the same tensor element in both.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, round_to_int8(x, tl.load(s_ptr), ZERO), mask=mask)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense in one of the layouts torch keeps through empty_like."""
    if t.is_contiguous():
        return True
    return (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def check_scale(name: str, scale, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as a one-element fp32 tensor on ``device`` (a float is converted; a tensor is
    checked, not read: its value stays on the device)."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (scale > 0 and scale < float("inf")):
            raise ValueError(f"{name} must be a finite positive scale, got {scale}")
        return torch.tensor([float(scale)], dtype=torch.float32, device=device)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{name} must be a positive float or a one-element float32 tensor, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    if scale.device != device:
        raise ValueError(f"{name} must be on {device} (x's device), got {scale.device}")
    return scale.reshape(1)


def check_zero_point(name: str, zero_point) -> None:
    if isinstance(zero_point, bool) or zero_point not in ZERO_POINTS:
        raise ValueError(f"{name} must be 0 (symmetric) or -128 (unsigned data), got {zero_point!r}")


def quantize_int8(
    x: torch.Tensor,  # [...] fp16/bf16/fp32, dense (contiguous or channels_last)
    scale: torch.Tensor | float,  # one value, fp32 (a device tensor keeps the call free of host syncs)
    *,
    zero_point: int = 0,  # 0: symmetric; -128: unsigned (x >= 0)
    out: torch.Tensor | None = None,  # int8, x's shape and strides
) -> torch.Tensor:  # int8 [...], x's layout
    """Static int8 quantization: ``clamp(round(x * (1 / scale)) + zero_point, -127 or -128, 127)``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in QUANT_DTYPES:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if not _dense(x):
        raise ValueError(f"x must be dense (contiguous or channels_last), got shape {tuple(x.shape)} strides "
                         f"{tuple(x.stride())}")
    s = check_scale("scale", scale, x.device)
    check_zero_point("zero_point", zero_point)
    if out is None:
        out = torch.empty_like(x, dtype=torch.int8)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.int8 or out.shape != x.shape
          or out.stride() != x.stride() or out.device != x.device):
        raise ValueError(f"out must be int8 with x's shape {tuple(x.shape)}, strides {tuple(x.stride())} and device "
                         f"{x.device}, got {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}")
    if not use_triton(x, s, out):
        return out.copy_(ref.quantize_int8_reference(x, s, zero_point))
    n = x.numel()
    if n:
        _quantize_int8_kernel[(triton.cdiv(n, BLOCK),)](x, out, s, n, ZERO=zero_point, BLOCK=BLOCK, num_warps=4)
    return out


__all__ = ["INT8_MAX", "ZERO_POINTS", "check_scale", "check_zero_point", "f2i_rn", "i2f_exact", "quantize_int8",
           "round_to_int8"]
