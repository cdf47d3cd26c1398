"""GEMV and GEMM straight from GGUF blocks (Q8_0, Q5_0, Q4_K, Q6_K) as llama.cpp's files store them.

A :class:`GGUFWeight` is the file's bytes of one [N, K] weight, one row of blocks per output row
(``raw`` uint8 [N, K / QK * block_bytes]); nothing is repacked, so the bytes a decode step reads
are the file's own. Block layouts (little-endian, ggml's order):

======  ======  =======  ======================================================================
type    values  bytes    layout
======  ======  =======  ======================================================================
Q8_0    32      34       fp16 d; int8 q[32];                        w = d * q
Q5_0    32      22       fp16 d; uint32 qh; 16 bytes of nibbles;    w = d * ((nibble | bit << 4) - 16)
                         values 0..15 low nibbles, 16..31 high; value j's 5th bit is bit j of qh
Q4_K    256     144      fp16 d, fp16 dmin; 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32;
                         128 bytes of nibbles, each 32 bytes holding 64 values (low, then high)
                         w = d * scale[s] * q - dmin * min[s]
Q6_K    256     210      128 bytes low nibbles; 64 bytes of 2-bit highs; int8 scale[16] (one per 16
                         values); fp16 d;                             w = d * scale[j / 16] * (q - 32)
======  ======  =======  ======================================================================

Two paths, chosen by the number of rows M of x:

* decode (M <= ``GEMV_MAX_M``): ``_gemv_kernel``, one program per (tile of BLOCK_N output rows, row
  of x); it walks K one block at a time, dequantizes the [BLOCK_N, QK] tile in registers from the
  bytes and accumulates x . w in fp32. Weight bytes read: the file's, once per row of x (the other
  rows of a small batch hit L2).
* prefill (M > ``GEMV_MAX_M``): dequantize-then-matmul. ``_dequant_kernel`` writes the dense [N, K]
  weight in x's dtype, and a dense matmul (cuBLAS through torch) consumes it: at prefill sizes the
  matmul's FLOPs dwarf one extra write and read of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warpforge.kernels import _dispatch  # noqa: F401  (selects the interpreter before any @jit)
from warpforge.kernels import reference
from warpforge.kernels.matmul import FLOAT_DTYPES, check_tensor

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

Q8_0, Q5_0, Q4_K, Q6_K = 8, 6, 12, 14  # ggml's type ids
BLOCKS = reference.GGUF_BLOCKS  # type id -> (values per block, bytes per block)
NAMES = reference.GGUF_NAMES
GEMV_MAX_M = 8  # above this, dequantize-then-matmul (each extra row of x re-reads the blocks in the GEMV)


@dataclass(frozen=True)
class GGUFWeight:
    """One [N, K] weight as GGUF blocks: ``raw`` uint8 [N, K / QK * block_bytes], ``qtype`` ggml's id."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]  # (N, K)

    def __post_init__(self) -> None:
        if self.qtype not in BLOCKS:
            raise ValueError(f"qtype: expected one of {', '.join(f'{t} ({n})' for t, n in NAMES.items())}, "
                             f"got {self.qtype}")
        n, k = self.shape
        qk, nbytes = BLOCKS[self.qtype]
        if n < 1 or k < 1 or k % qk:
            raise ValueError(f"shape: {NAMES[self.qtype]} needs K a positive multiple of {qk}, got {self.shape}")
        check_tensor("raw", self.raw, dtypes=(torch.uint8,), shape=(n, k // qk * nbytes))
        if not self.raw.is_contiguous():
            raise ValueError(f"raw: expected a contiguous tensor, got strides {self.raw.stride()}")

    @property
    def name(self) -> str:
        return NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks: what one pass over the weight reads."""
        return self.raw.numel()

    def to(self, device: torch.device | str) -> GGUFWeight:
        return GGUFWeight(self.raw.to(device), self.qtype, self.shape)


# ---- in-register dequantization -----------------------------------------------------------------


@triton.jit
def _u8(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, off, mask):
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(w_ptr, rows, row_mask, blk, ROW_BYTES, QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr):
    """float32 [BLOCK_N, QK]: block ``blk`` (QK values in BB bytes) of each row in ``rows`` (rows past N
    read as zero)."""
    j = tl.arange(0, QK)[None, :]
    base = (rows.to(tl.int64) * ROW_BYTES + blk * BB)[:, None]  # [BLOCK_N, 1]
    m = row_mask[:, None]
    if QTYPE == 8:
        q = _u8(w_ptr, base + 2 + j, m)
        w = _f16(w_ptr, base, m) * (q - ((q >> 7) << 8)).to(tl.float32)
    elif QTYPE == 6:
        nib = (_u8(w_ptr, base + 6 + (j % 16), m) >> ((j // 16) * 4)) & 15
        bit = (_u8(w_ptr, base + 2 + j // 8, m) >> (j % 8)) & 1
        w = _f16(w_ptr, base, m) * ((nib | (bit << 4)) - 16).to(tl.float32)
    elif QTYPE == 12:
        sub = j // 32  # sub-block: its 6-bit scale and min
        lo4 = sub < 4
        s_j = _u8(w_ptr, base + 4 + sub, m)  # scales[sub]
        s_j4 = _u8(w_ptr, base + 8 + sub, m)  # scales[sub + 4]
        s_jm4 = _u8(w_ptr, base + 4 + (sub + 4) % 8, m)  # scales[sub - 4] where sub >= 4
        sc = tl.where(lo4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
        mn = tl.where(lo4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        q = (_u8(w_ptr, base + 16 + 32 * (j // 64) + j % 32, m) >> (4 * (sub % 2))) & 15
        w = (_f16(w_ptr, base, m) * sc.to(tl.float32) * q.to(tl.float32)
             - _f16(w_ptr, base + 2, m) * mn.to(tl.float32))
    else:
        half = j // 128
        g = (j % 128) // 32
        lane = j % 32
        lo = (_u8(w_ptr, base + 64 * half + 32 * (g % 2) + lane, m) >> (4 * (g // 2))) & 15
        hi = (_u8(w_ptr, base + 128 + 32 * half + lane, m) >> (2 * g)) & 3
        sc = _u8(w_ptr, base + 192 + j // 16, m)
        sc = sc - ((sc >> 7) << 8)
        w = _f16(w_ptr, base + 208, m) * sc.to(tl.float32) * ((lo | (hi << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, ROW_BYTES, stride_xm, stride_om,
                 QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs = tl.arange(0, QK)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    for blk in range(0, K // QK):
        x = tl.load(x_row + blk * QK + offs).to(tl.float32)
        w = _dequant_tile(w_ptr, rows, row_mask, blk, ROW_BYTES, QTYPE, QK, BB)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, ROW_BYTES, stride_on,
                    QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = tl.program_id(1)
    row_mask = rows < N
    w = _dequant_tile(w_ptr, rows, row_mask, blk, ROW_BYTES, QTYPE, QK, BB)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_on + blk * QK + tl.arange(0, QK)[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _block_n(qtype: int) -> int:
    return 16 if BLOCKS[qtype][0] == 256 else 64  # ~4k values per tile either way


# ---- launchers -----------------------------------------------------------------------------------


def gguf_dequantize(w: GGUFWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype`` (Triton on CUDA, :func:`reference.gguf_dequantize_ref` on CPU)."""
    if not isinstance(w, GGUFWeight):
        raise ValueError(f"w: expected a GGUFWeight, got {type(w).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
    n, k = w.shape
    if not _dispatch.use_triton(w.raw):
        return reference.gguf_dequantize_ref(w.raw, w.qtype, k).to(dtype)
    out = torch.empty(n, k, dtype=dtype, device=w.raw.device)
    (qk, bb), bn = BLOCKS[w.qtype], _block_n(w.qtype)
    _dequant_kernel[(triton.cdiv(n, bn), k // qk)](w.raw, out, n, w.raw.shape[1], out.stride(0),
                                                  QTYPE=w.qtype, QK=qk, BB=bb, BLOCK_N=bn)
    return out


def gguf_linear(x: torch.Tensor,  # [..., K]
                w: GGUFWeight, *, out: torch.Tensor | None = None) -> torch.Tensor:  # [..., N], x's dtype
    """``x @ dequantize(w).T`` from the blocks: the in-register GEMV for M <= GEMV_MAX_M rows of x,
    dequantize-then-matmul above. ``out`` may be a strided view (a column slice of a fused output)."""
    if not isinstance(w, GGUFWeight):
        raise ValueError(f"w: expected a GGUFWeight, got {type(w).__name__}")
    n, k = w.shape
    check_tensor("x", x, dtypes=FLOAT_DTYPES, device=w.raw.device)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] (the weight's K), got {tuple(x.shape)}")
    lead = x.shape[:-1]
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), shape=(*lead, n), device=x.device)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if out is None:
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n) if out.dim() != 2 else out
    if m == 0:
        return out
    if out2.stride(-1) != 1:
        raise ValueError(f"out: expected unit stride along N, got strides {tuple(out.stride())}")
    if not _dispatch.use_triton(x, w.raw):
        out2.copy_(reference.gguf_linear_ref(x2, w.raw, w.qtype, k))
        return out
    if m > GEMV_MAX_M:
        dense = gguf_dequantize(w, x.dtype)
        if out2.is_contiguous():
            torch.matmul(x2, dense.T, out=out2)
        else:
            out2.copy_(x2 @ dense.T)
        return out
    x2 = x2.contiguous() if x2.stride(-1) != 1 else x2
    (qk, bb), bn = BLOCKS[w.qtype], _block_n(w.qtype)
    _gemv_kernel[(triton.cdiv(n, bn), m)](x2, w.raw, out2, n, k, w.raw.shape[1], x2.stride(0), out2.stride(0),
                                          QTYPE=w.qtype, QK=qk, BB=bb, BLOCK_N=bn)
    return out
