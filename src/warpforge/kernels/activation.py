"""Gated MLP activations (``silu_and_mul``, ``gelu_and_mul``) and ``softmax`` along the last dim.

Memory-bound kernels: one pass over the data with wide contiguous loads, math in fp32, one rounding
at the store. Rows are addressed through a row stride, so a row-strided 2-D view (a slice of a
wider buffer) is served without a copy; the last dim must be contiguous.

The ``apply_activation`` jit helper is shared with the conv epilogue (kernels/conv.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._dispatch import pdl, pdl_enter, pdl_release, use_triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Activation codes understood by ``apply_activation`` (constexpr ints keep the kernels specialized).
ACTIVATIONS: dict[str | None, int] = {None: 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4, "relu6": 5}


@triton.jit
def _erfc_pos(z):
    """erfc(z) for z >= 0, fractional error < 1.2e-7 (Chebyshev fit, Numerical Recipes' erfcc)."""
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    return t * tl.exp(-z * z - 1.26551223 + t * p)


@triton.jit
def apply_activation(x, ACT: tl.constexpr):
    """fp32 ``x`` -> act(x); ACT is a code from ``ACTIVATIONS``."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = x / (1.0 + tl.exp(-x))
    elif ACT == 3:
        # gelu = x * Phi(x) = 0.5 * x * erfc(-x / sqrt 2). 1 + erf(z) cancels catastrophically for
        # x << 0 (torch's fp32 formula loses most digits there); erfc of |z| does not.
        e = _erfc_pos(tl.abs(x) * 0.7071067811865476)
        x = 0.5 * x * tl.where(x >= 0, 2.0 - e, e)
    elif ACT == 4:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation in the negative tail, no NaN at overflow.
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x / (1.0 + tl.exp(-2.0 * u))
    elif ACT == 5:
        x = tl.minimum(tl.maximum(x, 0.0), 6.0)
    return x


# ---- shared launcher helpers -----------------------------------------------------------------

def rows_view(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` [..., W] as a 2-D view [M, W] with a unit last stride, or a ValueError naming ``name``."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d tensor")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {tuple(x.stride())}")
    if x.numel() == 0:
        return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} with shape {tuple(x.shape)} and strides {tuple(x.stride())} is not "
                         "row-contiguous: its leading dims must flatten to rows without a copy") from None


def check_float(x: torch.Tensor, name: str, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")


def check_out(out: torch.Tensor, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Validate a caller-given output buffer; returns its 2-D row view."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{name} must be on {device}, got {out.device}")
    return rows_view(out, name)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class RowConfig:
    """Tiling of a row-wise kernel: ``block_m`` rows x ``block_n`` columns per program."""

    block_m: int
    block_n: int
    num_warps: int
    looped: bool = False  # softmax only: stream the row in block_n chunks (rows wider than registers)

    def __post_init__(self) -> None:
        for f in ("block_m", "block_n"):
            v = getattr(self, f)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RowConfig.{f} must be a power of two >= 1, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"RowConfig.num_warps must be a power of two in [1, 32], got {self.num_warps}")


# Elements per program the heuristics aim for: enough bytes in flight per SM without spilling.
TARGET_ELEMS = 4096
SOFTMAX_MAX_SINGLE = 32768  # widest row softmax keeps whole in registers; wider rows are streamed


def row_config(m: int, n: int, *, target: int = TARGET_ELEMS, max_block_n: int | None = None) -> RowConfig:
    """Default tiling: a power-of-two row chunk, several rows per program when rows are narrow."""
    bn = _pow2(n) if max_block_n is None else min(_pow2(n), max_block_n)
    bm = max(1, min(_pow2(m), target // bn))
    warps = min(32 if bn > 8192 else 16, max(1, bm * bn // 256))
    return RowConfig(block_m=bm, block_n=bn, num_warps=_pow2(warps))


# ---- gated activations -------------------------------------------------------------------------

@triton.jit
def _gated_kernel(x_ptr, out_ptr, M, D, stride_xm, stride_om,
                  ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    # x [M, 2*D] (first half activated, second half the gate multiplier), out [M, D]
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    xp = x_ptr + rows64[:, None] * stride_xm + cols[None, :]
    a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xp + D, mask=mask, other=0.0).to(tl.float32)
    pdl_release(PDL)
    y = apply_activation(a, ACT) * b
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(x: torch.Tensor, act: str, out: torch.Tensor | None, config: RowConfig | None) -> torch.Tensor:
    check_float(x, "x")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dim [..., 2*d], got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    x2 = rows_view(x, "x")  # [M, 2d]
    shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    out2 = check_out(out, "out", shape, x.dtype, x.device)  # [M, d]
    if not use_triton(x):
        ref_fn = ref.silu_and_mul_reference if act == "silu" else ref.gelu_and_mul_reference
        kw = {} if act == "silu" else {"approximate": "tanh" if act == "gelu_tanh" else "none"}
        out.copy_(ref_fn(x, **kw))
        return out
    m = x2.shape[0]
    if m == 0 or d == 0:
        return out
    cfg = config or row_config(m, d, max_block_n=1024)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(d, cfg.block_n))
    p = pdl(x2)
    _gated_kernel[grid](x2, out2, m, d, x2.stride(0), out2.stride(0), ACT=ACTIVATIONS[act], PDL=p, launch_pdl=p > 0,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    return out


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None,
                 config: RowConfig | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x [..., 2*d] -> [..., d] (vLLM's SiluAndMul), fp32 math."""
    return _gated(x, "silu", out, config)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None,
                 config: RowConfig | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` for x [..., 2*d] -> [..., d]; approximate "none" (erf) or "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _gated(x, "gelu" if approximate == "none" else "gelu_tanh", out, config)


# ---- softmax ---------------------------------------------------------------------------------

@triton.jit
def _softmax_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # x, out [M, N]; the whole row chunk [BLOCK_M, BLOCK_N >= N] stays in registers: one read, one write.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    # Rows past M are all -inf; a finite stand-in max keeps their (unstored) lanes free of NaN.
    mx = tl.max(x, axis=1)
    mx = tl.where(mx == -float("inf"), 0.0, mx)
    e = tl.exp(x - mx[:, None])
    inv = 1.0 / tl.sum(e, axis=1)
    y = e * inv[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_looped_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om, BLOCK_N: tl.constexpr):
    # One row per program, streamed in BLOCK_N chunks. Pass 1 keeps a running max and rescaled sum per
    # lane (online softmax); pass 2 re-reads the row (mostly from L2) and writes exp(x - max) / sum.
    row = tl.program_id(0).to(tl.int64)
    xr = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK_N)
    # Finite initial max: exp(m_old - m_new) stays defined for lanes that only ever saw -inf.
    m_vec = tl.full([BLOCK_N], -3.4028234663852886e38, tl.float32)
    s_vec = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(xr + start + cols, mask=start + cols < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(x - m_new)
        m_vec = m_new
    mx = tl.max(m_vec, axis=0)
    inv = 1.0 / tl.sum(s_vec * tl.exp(m_vec - mx), axis=0)
    orow = out_ptr + row * stride_om
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(xr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(orow + start + cols, (tl.exp(x - mx) * inv).to(out_ptr.dtype.element_ty), mask=mask)


def softmax_config(m: int, n: int) -> RowConfig:
    """Default softmax tiling: whole rows in registers up to SOFTMAX_MAX_SINGLE, streamed beyond."""
    if n > SOFTMAX_MAX_SINGLE:
        return RowConfig(block_m=1, block_n=4096, num_warps=16, looped=True)
    return row_config(m, n)


def softmax(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None,
            config: RowConfig | None = None) -> torch.Tensor:
    """Softmax of x [..., N] along the last dim, fp32 math, output in x's dtype (or ``out``)."""
    check_float(x, "x")
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"dim must be the last dim (-1 or {x.dim() - 1}); got {dim}")
    x2 = rows_view(x, "x")  # [M, N]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out2 = check_out(out, "out", x.shape, x.dtype, x.device)
    if not use_triton(x):
        out.copy_(ref.softmax_reference(x))
        return out
    m, n = x2.shape
    if m == 0 or n == 0:
        return out
    cfg = config or softmax_config(m, n)
    if cfg.looped:
        _softmax_looped_kernel[(m,)](x2, out2, m, n, x2.stride(0), out2.stride(0),
                                     BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    else:
        if cfg.block_n < n:
            raise ValueError(f"config.block_n={cfg.block_n} must cover the row width {n} (or set looped=True)")
        _softmax_kernel[(triton.cdiv(m, cfg.block_m),)](x2, out2, m, n, x2.stride(0), out2.stride(0),
                                                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                                        num_warps=cfg.num_warps)
    return out


__all__ = ["ACTIVATIONS", "RowConfig", "apply_activation", "gelu_and_mul", "silu_and_mul", "softmax",
           "softmax_config"]
