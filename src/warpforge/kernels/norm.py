"""``rms_norm`` and ``layer_norm`` with an optional fused residual add and fp8 (e4m3) output.

One kernel serves both norms: each program owns ``block_m`` whole rows (``block_n`` >= the row width,
so a row is read once and kept in registers), statistics in fp32.

Residual convention (vLLM's fused_add_rms_norm): with ``residual`` the function computes
``s = x + residual``, stores ``s`` rounded to the input dtype as the new residual, and normalizes that
stored ``s``, so the next layer's residual and this layer's input agree bit for bit. It returns
``(out, new_residual)``; pass ``residual_out=residual`` to update the residual stream in place.

fp8 convention: ``quant_fp8=True`` returns e4m3 values and a float32 scale such that
``out.float() * scale ~= y``. With ``fp8_scale=None`` the scale is dynamic, one per row (per token),
``max(absmax(row), 1e-12) / 448``, shaped [..., 1]; with a given scalar ``fp8_scale`` (a static,
calibrated per-tensor scale) that scale is used and returned.

Return value: ``out``, then ``scale`` when quant_fp8, then ``new_residual`` when residual; a single
tensor when there is only ``out``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._dispatch import pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.activation import FLOAT_DTYPES, RowConfig, check_float, check_out, row_config, rows_view

MAX_WIDTH = 65536  # the row lives in registers: up to 32768 compiles spill-free for sm_90, 65536 spills a little
FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, scale_ptr,
                 M, N, stride_xm, stride_rm, stride_om, stride_rom, eps, w_offset,
                 IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                 QUANT: tl.constexpr,  # 0: none, 1: dynamic per-row fp8 scale (written), 2: static scale (read)
                 FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    # x, residual, out, residual_out [M, N]; weight, bias [N]; scale [M] (QUANT 1) or [1] (QUANT 2)
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rows64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows64[:, None] * stride_rom + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)  # normalize exactly what the next layer will read as its residual
    if IS_RMS:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        y = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)  # two-pass variance from registers: no cancellation
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        y = xc * rstd[:, None]
    pdl_release(PDL)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + w_offset
        y = y * w[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if QUANT == 1:
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)
        scale = tl.maximum(amax, MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        y = tl.clamp(y / scale[:, None], -FP8_MAX, FP8_MAX)
    elif QUANT == 2:
        inv = 1.0 / tl.load(scale_ptr).to(tl.float32)
        y = tl.clamp(y * inv, -FP8_MAX, FP8_MAX)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def norm_config(m: int, n: int) -> RowConfig:
    """Default tiling: one row per program for wide rows, several narrow rows (e.g. q/k norms) per program."""
    return row_config(m, n, target=4096)


def _check_vec(t: torch.Tensor | None, name: str, n: int, device: torch.device) -> None:
    if t is None:
        return
    check_float(t, name)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}] (the normalized dim), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like x, got {t.device}")
    if t.stride(0) != 1 and n > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _norm(is_rms: bool, x, weight, bias, eps, residual, out_dtype, quant_fp8, fp8_scale, weight_offset,
          out, residual_out, config):
    check_float(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dimension [..., N]")
    n = x.shape[-1]
    if n > MAX_WIDTH:
        raise ValueError(f"x rows must be at most {MAX_WIDTH} wide (kept in registers), got {n}")
    x2 = rows_view(x, "x")  # [M, N]
    _check_vec(weight, "weight", n, x.device)
    _check_vec(bias, "bias", n, x.device)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    r2 = None
    if residual is not None:
        check_float(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}); got "
                             f"{tuple(residual.shape)}, {residual.dtype}, {residual.device}")
        r2 = rows_view(residual, "residual")
    elif residual_out is not None:
        raise ValueError("residual_out is only meaningful with residual")
    if quant_fp8:
        if out_dtype not in (None, FP8_DTYPE):
            raise ValueError(f"out_dtype must be None or {FP8_DTYPE} with quant_fp8=True, got {out_dtype}")
        out_dtype = FP8_DTYPE
        if fp8_scale is not None:
            if (not isinstance(fp8_scale, torch.Tensor) or fp8_scale.numel() != 1
                    or fp8_scale.dtype != torch.float32 or fp8_scale.device != x.device):
                raise ValueError(f"fp8_scale must be a 1-element float32 tensor on {x.device}")
    else:
        if fp8_scale is not None:
            raise ValueError("fp8_scale is only meaningful with quant_fp8=True")
        out_dtype = out_dtype or x.dtype
        if out_dtype not in FLOAT_DTYPES:
            raise ValueError(f"out_dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")

    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    o2 = check_out(out, "out", x.shape, out_dtype, x.device)
    ro2 = None
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = check_out(residual_out, "residual_out", x.shape, x.dtype, x.device)
    scale = None
    if quant_fp8:
        scale = fp8_scale if fp8_scale is not None else torch.empty((*x.shape[:-1], 1), dtype=torch.float32,
                                                                   device=x.device)

    if not use_triton(x):
        _norm_torch(is_rms, x, weight, bias, eps, residual, weight_offset, fp8_scale, out, residual_out, scale)
    elif x2.shape[0] > 0 and n > 0:
        m = x2.shape[0]
        cfg = config or norm_config(m, n)
        if cfg.block_n < n:
            raise ValueError(f"config.block_n={cfg.block_n} must cover the row width {n}")
        if cfg.looped or cfg.persistent:
            raise ValueError(f"config: looped / programs_per_sm are softmax-only tilings, got {cfg}")
        quant = 0 if not quant_fp8 else (1 if fp8_scale is None else 2)
        dummy = x2
        _norm_kernel[(triton.cdiv(m, cfg.block_m),)](
            x2, r2 if r2 is not None else dummy, weight if weight is not None else dummy,
            bias if bias is not None else dummy, o2, ro2 if ro2 is not None else dummy,
            scale if scale is not None else dummy,
            m, n, x2.stride(0), r2.stride(0) if r2 is not None else 0, o2.stride(0),
            ro2.stride(0) if ro2 is not None else 0, float(eps), float(weight_offset),
            IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            QUANT=quant, FP8_MAX=ref.FP8_E4M3_MAX, MIN_AMAX=ref.FP8_MIN_AMAX,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PDL=pdl(x2), launch_pdl=pdl(x2) > 0, num_warps=cfg.num_warps)
    result = (out,) + ((scale,) if quant_fp8 else ()) + ((residual_out,) if residual is not None else ())
    return result[0] if len(result) == 1 else result


def _norm_torch(is_rms, x, weight, bias, eps, residual, weight_offset, fp8_scale, out, residual_out, scale):
    """CPU path: the reference with the kernel's roundings (stored residual, fp8 epilogue)."""
    if residual is not None:
        residual_out.copy_(x.float() + residual.float())
        x = residual_out  # normalize the stored sum, as the kernel does
    if is_rms:
        y = ref.rms_norm_reference(x, weight, eps, weight_offset=weight_offset)
    else:
        y = ref.layer_norm_reference(x, weight, bias, eps, weight_offset=weight_offset)
    if scale is None:
        out.copy_(y)
        return
    q, s = ref.quant_fp8_rows_reference(y, fp8_scale)
    out.copy_(q)
    if fp8_scale is None:
        scale.copy_(s)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             quant_fp8: bool = False, fp8_scale: torch.Tensor | None = None, weight_offset: float = 0.0,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             config: RowConfig | None = None):
    """RMSNorm over the last dim of x [..., N]: ``s / rms(s) * (weight + weight_offset)``, s = x (+ residual).

    ``weight_offset=1.0`` gives Gemma's ``(1 + weight)``. Returns ``out`` [..., N] (dtype ``out_dtype``,
    default x.dtype), then the fp8 ``scale`` if ``quant_fp8``, then ``new_residual`` if ``residual``
    (see the module docstring for both conventions).
    """
    return _norm(True, x, weight, None, eps, residual, out_dtype, quant_fp8, fp8_scale, weight_offset,
                 out, residual_out, config)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               quant_fp8: bool = False, fp8_scale: torch.Tensor | None = None, weight_offset: float = 0.0,
               out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
               config: RowConfig | None = None):
    """LayerNorm over the last dim of x [..., N]: ``(s - mean) / std * (weight + weight_offset) + bias``.

    Same residual, fp8 and return conventions as :func:`rms_norm`.
    """
    return _norm(False, x, weight, bias, eps, residual, out_dtype, quant_fp8, fp8_scale, weight_offset,
                 out, residual_out, config)


__all__ = ["layer_norm", "norm_config", "rms_norm"]
