"""Row-wise argmax of a wide matrix (the greedy sampler's [B, vocab] logits) in two small kernels.

``torch.argmax`` over one 128k-wide row runs one block, so one SM reads Llama's 128,256-entry vocabulary
each decode step (its time is in the 1B step profile's record). Here each program
takes a 4096-wide chunk of a row (first index of the chunk's max), and a second kernel reduces each
row's chunk winners; the whole row is read once, by every SM at once.

Ties go to the first index, like ``torch.argmax``; NaN counts as larger than any number (torch's
rule too), except that between a NaN and a +inf in the same row the earlier one wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from warpforge.kernels._dispatch import INTERPRET, pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.activation import check_float, rows_view

CHUNK = 4096  # row entries per program (16 KiB of fp32)


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, N, stride_m, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row.to(tl.int64) * stride_m + offs, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks above every number
    pdl_release(PDL)
    m = tl.max(x, 0)
    first = tl.min(tl.where((x == m) & ok, offs, 2147483647), 0)  # 2**31 - 1: no column
    tl.store(val_ptr + row * n_chunks + chunk, m)
    tl.store(idx_ptr + row * n_chunks + chunk, first)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < n_chunks
    v = tl.load(val_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * n_chunks + c, mask=ok, other=2147483647)
    pdl_release(PDL)
    m = tl.max(v, 0)
    best = tl.min(tl.where((v == m) & ok, i, 2147483647), 0)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(x: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """Index of the largest entry of each row: x [..., N] (fp16/bf16/fp32) -> int64 [...]."""
    check_float(x, "x")
    x2 = rows_view(x, "x")  # [M, N]
    m, n = x2.shape
    if n == 0:
        raise ValueError("x: argmax of an empty row (last dimension 0)")
    if not use_triton(x):
        return x.argmax(dim=-1)
    block = chunk or (256 if INTERPRET else CHUNK)
    if block < 16 or block & (block - 1):
        raise ValueError(f"chunk: expected a power of two >= 16, got {chunk}")
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return out.view(x.shape[:-1])
    n_chunks = triton.cdiv(n, block)
    vals = torch.empty((m, n_chunks), dtype=torch.float32, device=x.device)
    idxs = torch.empty((m, n_chunks), dtype=torch.int32, device=x.device)
    p = pdl(x2)
    _argmax_chunk_kernel[(m, n_chunks)](x2, vals, idxs, n, x2.stride(0), n_chunks, BLOCK=block, PDL=p,
                                        launch_pdl=p > 0, num_warps=8 if block >= 2048 else 4)
    _argmax_rows_kernel[(m,)](vals, idxs, out, n_chunks, BLOCK_C=max(16, triton.next_power_of_2(n_chunks)),
                              PDL=p, launch_pdl=p > 0, num_warps=1)
    return out.view(x.shape[:-1])


__all__ = ["argmax_rows"]
