"""Weight-only quantization: packed formats, ``quantize_weight``, and the in-register dequantization.

Schemes (weight [N, K], one row per output channel):

=============  =====================================  ==============================  ==========================
scheme         data                                   scales                          mins
=============  =====================================  ==============================  ==========================
``int8``       int8 [N, K], symmetric                 fp32 [N]                        --
``fp8``        float8_e4m3fn [N, K]                   fp32 [N]                        --
``int4_gG``    uint8 [N, Kp/2], two per byte: even k  weight dtype [N, Kp/G]          weight dtype [N, Kp/G]
               low nibble, odd k high nibble;         (one per group of G columns)    (the group's lowest level)
               asymmetric: w = q * scale + min
=============  =====================================  ==============================  ==========================

G is 32, 64 or 128; Kp is K rounded up to a multiple of G (the padding columns are never read against
a nonzero activation). An int4 group's 16 levels are ``min, min + scale, ..., min + 15 scale`` with a
float minimum (as Q4_K and AWQ store them): the range is the group's own, it need not include 0, and a
constant group is exact (scale 0). ``quantize_weight`` picks each group's (scale, min) by a small
search of clipped ranges that minimises the group's squared error (see :func:`fit_int4`); nothing is
calibrated. ``linear()`` in :mod:`warpforge.kernels.gemv` accepts the packed :class:`QuantizedWeight`;
its kernel calls :func:`_load_weight_tile` below, which turns a packed tile into a [BLOCK_N, BLOCK_K]
tile of the activation dtype in registers, so the bytes read from memory are 1/2 (int8, fp8) or ~1/4
(int4) of bf16. Per-channel scales (int8, fp8) factor out of the K sum and are applied once in the
epilogue; int4 group scales and minimums are applied per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warpforge.kernels import _dispatch  # noqa: F401  (selects the interpreter before any @jit)
from warpforge.kernels import reference
from warpforge.kernels.matmul import FLOAT_DTYPES, check_tensor

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SCHEMES = ("int8", "int4_g32", "int4_g64", "int4_g128", "fp8")
# Weight formats as the kernel sees them (constexpr FORMAT).
FMT_DENSE, FMT_INT8, FMT_INT4, FMT_FP8 = 0, 1, 2, 3
FORMAT_NAMES = {FMT_DENSE: "dense", FMT_INT8: "int8", FMT_INT4: "int4", FMT_FP8: "fp8"}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _scheme_group(scheme: str) -> int | None:
    return int(scheme.split("_g")[1]) if scheme.startswith("int4_g") else None


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed weight for ``linear()``; see the module table for each scheme's tensors."""

    scheme: str
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None  # int4: each group's lowest level, in the weight dtype; None for int8 / fp8
    group: int | None
    shape: tuple[int, int]  # (N, K) of the original weight
    dtype: torch.dtype  # the original weight's dtype; dequantize() returns it

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {SCHEMES}, got {self.scheme!r}")
        if self.group != _scheme_group(self.scheme):
            raise ValueError(f"group: scheme {self.scheme} needs group {_scheme_group(self.scheme)}, got {self.group}")
        n, k = self.shape
        dev = self.data.device
        if self.scheme == "int8" or self.scheme == "fp8":
            dt = torch.int8 if self.scheme == "int8" else torch.float8_e4m3fn
            check_tensor("data", self.data, dtypes=(dt,), shape=(n, k))
            check_tensor("scales", self.scales, dtypes=(torch.float32,), shape=(n,), device=dev)
            if self.mins is not None:
                raise ValueError(f"mins: scheme {self.scheme} is symmetric, expected None")
        else:
            kp = -(-k // self.group) * self.group
            check_tensor("data", self.data, dtypes=(torch.uint8,), shape=(n, kp // 2))
            check_tensor("scales", self.scales, dtypes=FLOAT_DTYPES, shape=(n, kp // self.group), device=dev)
            if self.mins is None:
                raise ValueError(f"mins: scheme {self.scheme} needs a group minimum tensor [{n}, {kp // self.group}]")
            check_tensor("mins", self.mins, dtypes=(self.scales.dtype,), shape=(n, kp // self.group), device=dev)
        for name in ("data", "scales", "mins"):
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype}")

    @property
    def format(self) -> int:
        return {"int8": FMT_INT8, "fp8": FMT_FP8}.get(self.scheme, FMT_INT4)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def k_stored(self) -> int:
        """Columns held per row (K rounded up to the group for int4)."""
        return self.data.shape[1] * 2 if self.format == FMT_INT4 else self.data.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams: data, scales and group minimums."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:  # [N, K] in self.dtype
        return reference.dequantize_ref(self.scheme, self.data, self.scales, self.mins, self.group, self.shape,
                                        self.dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.scheme, move(self.data), move(self.scales), move(self.mins), self.group,
                               self.shape, self.dtype)


def packed_view(cached: QuantizedWeight | None, scheme: str, data: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor | None, group: int | None, shape: tuple[int, int],
                dtype: torch.dtype) -> QuantizedWeight:
    """A layer's buffers as a QuantizedWeight: ``cached`` while it still wraps these very tensors, else a new
    one (validated once, after ``.to()`` or a state-dict load replaced the buffers), so a call costs no check."""
    if cached is not None and cached.data is data and cached.scales is scales:
        return cached
    return QuantizedWeight(scheme, data, scales, mins, group, shape, dtype)


def quantize_weight(w: torch.Tensor, scheme: str,
                    importance: torch.Tensor | None = None,  # [K] >= 0, int4 only
                    ) -> QuantizedWeight:
    """Quantize a [N, K] weight (rows = output channels, like nn.Linear.weight) to ``scheme``.

    ``importance`` (int4): a weight per input column for the range search, which then minimises
    sum_k importance[k] * (w[n, k] - w_q[n, k])^2 per group instead of the plain squared error. With
    importance = mean(x_k^2) over a layer's inputs x that sum is the expected squared output error
    of a group's part of the product (the cross terms dropped), so ranges clip where inputs are small.
    """
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"w: expected a non-empty [N, K] weight, got shape {tuple(w.shape)}")
    if importance is not None:
        if not scheme.startswith("int4"):
            raise ValueError(f"importance: only the int4 schemes search a range, got scheme {scheme!r}")
        check_tensor("importance", importance, dtypes=FLOAT_DTYPES, shape=(k,), device=w.device)
        if not (torch.isfinite(importance).all() and (importance >= 0).all()):
            raise ValueError("importance: expected finite values >= 0")
    wf = w.detach().to(torch.float32)
    if not torch.isfinite(wf).all():
        raise ValueError("w: contains NaN or Inf")
    if scheme in ("int8", "fp8"):
        qmax = 127.0 if scheme == "int8" else _FP8_MAX
        amax = wf.abs().amax(dim=1)
        scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # an all-zero row gets scale 1
        y = wf / scales[:, None]
        data = y.round().clamp(-127, 127).to(torch.int8) if scheme == "int8" \
            else y.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(scheme, data.contiguous(), scales.contiguous(), None, None, (n, k), w.dtype)

    group = _scheme_group(scheme)
    q, scales, mins = fit_int4(wf, group, w.dtype, None if importance is None else importance.float())
    return pack_int4(q, scales, mins, (n, k), w.dtype)


def pack_int4(q: torch.Tensor,  # uint8 [N, Kp] codes 0..15, Kp a multiple of the group
              scales: torch.Tensor, mins: torch.Tensor,  # [N, Kp / G] in the weight dtype
              shape: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
    """An int4 QuantizedWeight of codes chosen elsewhere (``fit_int4``'s, or GPTQ's against the same grid):
    two codes a byte, even column in the low nibble."""
    group = q.shape[1] // scales.shape[1]
    data = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight(f"int4_g{group}", data.contiguous(), scales.contiguous(), mins.contiguous(), group,
                           shape, dtype)


# Clipped ranges tried per int4 group: the range shrunk to each fraction of [min, max], placed at each
# offset from the bottom (as a share of the range given up). Plain [min, max] is the first candidate, so
# the search never ends above it; 45 candidates cut the Frobenius error by ~10% on LLM weights.
_RANGE_FRACTIONS = (1.0, 0.95, 0.9, 0.85, 0.8)
_RANGE_OFFSETS = tuple(i / 10 for i in range(11))
_FIT_CHUNK = 1 << 22  # weights per pass of the search (bounds its temporaries to a few [chunk] tensors)


def fit_int4(wf: torch.Tensor,  # [N, K] float32, finite
              group: int, dtype: torch.dtype,
              importance: torch.Tensor | None = None,  # [K] float32 >= 0: column weights of the error
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, Kp], scales [N, Kp/G], mins [N, Kp/G] in ``dtype``) minimising each group's (weighted)
    squared error over the candidate ranges. Each candidate is scored with its scale and minimum rounded to
    ``dtype``, as the kernel reads them; padding columns (K..Kp) take no part in the fit and dequantize to the
    minimum."""
    n, k = wf.shape
    kp = -(-k // group) * group
    g = kp // group
    wp = torch.nn.functional.pad(wf, (0, kp - k)).reshape(n, g, group)
    valid = (torch.arange(kp, device=wf.device) < k).reshape(1, g, group)
    # error weight per column: 1 (plain squared error) or the importance; 0 on the padding
    cw = valid.float() if importance is None else \
        torch.nn.functional.pad(importance, (0, kp - k)).reshape(1, g, group)
    q_all = torch.empty((n, g, group), dtype=torch.uint8, device=wf.device)
    s_all = torch.empty((n, g), dtype=dtype, device=wf.device)
    m_all = torch.empty((n, g), dtype=dtype, device=wf.device)
    rows = max(1, _FIT_CHUNK // kp)
    for r0 in range(0, n, rows):
        w = wp[r0:r0 + rows]
        lo = torch.where(valid, w, torch.inf).amin(2)
        rng = torch.where(valid, w, -torch.inf).amax(2) - lo
        if not torch.isfinite(rng).all() or not torch.isfinite((rng / 15).to(dtype)).all():
            raise ValueError(f"w: a group's range overflows {dtype} scales; quantize a float32 copy instead")
        best_err = best_s = best_m = None
        for frac in _RANGE_FRACTIONS:
            for off in _RANGE_OFFSETS if frac < 1.0 else (0.0,):
                s = (rng * (frac / 15)).to(dtype).float()
                m = (lo + rng * ((1.0 - frac) * off)).to(dtype).float()
                q = ((w - m[..., None]) / torch.where(s > 0, s, 1.0)[..., None]).round_().clamp_(0, 15)
                err = q.mul_(s[..., None]).add_(m[..., None]).sub_(w).square_().mul_(cw).sum(2)
                if best_err is None:
                    best_err, best_s, best_m = err, s, m
                else:
                    better = err < best_err
                    best_err = torch.where(better, err, best_err)
                    best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        q = ((w - best_m[..., None]) / torch.where(best_s > 0, best_s, 1.0)[..., None]).round_().clamp_(0, 15)
        q_all[r0:r0 + rows] = torch.where(valid, q, 0.0).to(torch.uint8)
        s_all[r0:r0 + rows] = best_s.to(dtype)
        m_all[r0:r0 + rows] = best_m.to(dtype)
    return q_all.reshape(n, kp), s_all, m_all


# ---- device code: packed tile -> activation-dtype tile in registers ------------------------------
@triton.jit
def _nibbles_to_float(q, DT: tl.constexpr):
    """Small unsigned ints (< 16) to DT exactly, without int->float converts for fp16/bf16.

    OR-ing q into the mantissa of 1024.0 (fp16 0x6400) or 128.0 (bf16 0x4300), where one mantissa
    step is 1.0, gives the float 1024 + q or 128 + q by a bit operation; subtracting the offset
    leaves q exactly.
    """
    if DT == tl.float16:
        return (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    elif DT == tl.bfloat16:
        return (q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        return q.to(tl.float32)


@triton.jit
def _load_weight_tile(w_ptr, s_ptr, m_ptr, rows, k0, K_w, stride_wn, stride_sn,
                      FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, DT: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at rows ``rows`` (int64, in range), columns k0.. as DT.

    K_w: stored columns (multiple of GROUP for int4). Columns >= K_w read as 0. Per-channel scales
    (int8, fp8) are left to the epilogue; int4 group scales and minimums are applied here
    (``q * scale + min``; stride_sn is the row stride of both [N, K_w / GROUP] tensors).
    """
    if FORMAT == 2:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed bytes of this tile
        p_ptrs = w_ptr + rows[:, None] * stride_wn + offs_b[None, :]
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_off = rows[:, None] * stride_sn + offs_g[None, :]
        if EVEN_K:
            p = tl.load(p_ptrs)
            s = tl.load(s_ptr + g_off)
            m = tl.load(m_ptr + g_off)
        else:
            p = tl.load(p_ptrs, mask=offs_b[None, :] < K_w // 2, other=0)
            s = tl.load(s_ptr + g_off, mask=offs_g[None, :] < K_w // GROUP, other=0.0)
            m = tl.load(m_ptr + g_off, mask=offs_g[None, :] < K_w // GROUP, other=0.0)
        q = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_N, BLOCK_K))  # [BN, BK/2, 2] -> k = 2j + {0, 1}
        qf = tl.reshape(_nibbles_to_float(q, DT), (BLOCK_N, BLOCK_K // GROUP, GROUP))
        w = tl.reshape(qf * s.to(DT)[:, :, None] + m.to(DT)[:, :, None], (BLOCK_N, BLOCK_K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=offs_k[None, :] < K_w, other=0)
        if FORMAT == 3:  # e4m3 bytes arrive as uint8 (a masked fp8 load needs an fp8 `other`)
            w = w.to(tl.float8e4nv, bitcast=True)
        w = w.to(DT)  # int8 and e4m3 convert exactly to fp16/bf16/fp32
    return w
