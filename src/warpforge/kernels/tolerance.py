"""One table of accuracy tolerances, keyed by dtype, used by kernel tests and benchmark checks.

The measure is the relative Frobenius error ``||out - ref|| / ||ref||`` against a reference computed
in float64 (float32 where float64 is not supported). Each value carries the reason for its size.
"""

from __future__ import annotations

import torch

# dtype -> (relative tolerance, why it is this loose)
REL_TOL: dict[torch.dtype, tuple[float, str]] = {
    torch.float64: (1e-10, "float64 arithmetic; only summation order differs"),
    torch.float32: (1e-4, "Triton's fp32 dot uses tf32 on Hopper unless told not to (~3e-4 worst case "
                          "on long K); fp32 elementwise code lands near 1e-6"),
    torch.float16: (2e-3, "fp16 has a 10-bit mantissa (2^-11 = 4.9e-4 unit roundoff); "
                          "the output rounding alone is ~3e-4 relative"),
    torch.bfloat16: (1e-2, "bf16 has a 7-bit mantissa (2^-8 = 3.9e-3 unit roundoff)"),
    torch.float8_e4m3fn: (7e-2, "e4m3 has a 3-bit mantissa (2^-4 = 6.25e-2 unit roundoff on each input)"),
}

# paged_decode with DecodeConfig(qk_fp8=True) against the reference with the query as given (the e4m3
# pages are the reference's too, so only the query's rounding counts).
FP8_QUERY_TOL = (2.5e-2, "q rounded to e4m3 per head (3 mantissa bits: each element within 2^-4 of itself) "
                         "moves the logits by ~1% of their spread: 0.9-1.1% output error at unit-variance "
                         "logits (torch emulation, D 64/128, softcap on/off, contexts 1-4097), twice that at "
                         "twice the spread; 2.5x margin for the kernel's fp16 P.V rounding")

# Stricter bound where fp32 code does no tf32 matrix math (elementwise, norms, reductions).
FP32_ELEMENTWISE_TOL = (2e-6, "fp32 elementwise/reduction: rounding only")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or Inf anywhere in ``out`` gives inf."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: out {tuple(o.shape)} vs ref {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return float("inf")
    denom = r.norm().item()
    num = (o - r).norm().item()
    return num / denom if denom > 0 else num


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for results computed in ``dtype``."""
    try:
        return REL_TOL[dtype][0]
    except KeyError:
        raise ValueError(f"no tolerance defined for dtype {dtype}") from None


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, tol: float | None = None) -> dict:
    """{'rel_err': e, 'tol': t, 'ok': e <= t} for a benchmark record or a test assertion."""
    t = tol if tol is not None else tolerance(dtype or out.dtype)
    e = rel_err(out, ref)
    return {"rel_err": e, "tol": t, "ok": bool(e <= t)}
