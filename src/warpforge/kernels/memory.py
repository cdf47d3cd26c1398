"""Bandwidth kernels: copy, fill and sum over contiguous fp32/fp16/bf16 tensors.

These are the yardsticks of device memory: ``warpforge probe`` times them for the HBM read
(sum), write (fill) and copy figures, and the memory benchmark suite sets them against torch.
Every program moves the same number of BYTES whatever the dtype (BLOCK elements = block_bytes /
element size), so each thread issues several 16-byte vector accesses per step and enough bytes
are in flight per SM to cover DRAM latency (Little's law: ~4.8 TB/s x ~0.8 us ~ 4 MB over 132
SMs ~ 29 KiB per SM; we keep ~8 programs x 16 KiB resident per SM).

Full blocks take an unmasked path: a mask over an odd-sized tensor would make Triton fall back to
scalar accesses for the whole kernel; only the one ragged block pays for the mask.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels._checks import check_pow2
from warpforge.kernels._dispatch import use_triton
from warpforge.kernels.reference import copy_ref, fill_ref, sum_ref

import triton  # noqa: E402  (after _dispatch, which may set TRITON_INTERPRET)
import triton.language as tl  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MemoryConfig:
    """Launch shape of the memory kernels. ``block_bytes`` per program per step."""

    block_bytes: int
    num_warps: int
    programs_per_sm: int  # sum's persistent grid: resident programs per SM

    def __post_init__(self) -> None:
        check_pow2(self, "block_bytes", "num_warps", "programs_per_sm")
        if self.block_bytes < 16 * 32 * self.num_warps and self.num_warps > 1:
            raise ValueError(f"block_bytes={self.block_bytes} leaves threads of {self.num_warps} warps "
                             "without a 16-byte vector each")


# GPU: 16 KiB per program with 4 warps = 8 x 16 B vectors per thread per step.
GPU_CONFIG = MemoryConfig(block_bytes=16384, num_warps=4, programs_per_sm=8)
# Interpreter: tiny blocks so small test tensors still span many programs and a ragged tail.
INTERPRETER_CONFIG = MemoryConfig(block_bytes=256, num_warps=1, programs_per_sm=1)
_INTERPRETER_PROGRAMS = 3  # sum: a few programs, each looping over several blocks


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _config(device: torch.device) -> MemoryConfig:
    return INTERPRETER_CONFIG if (_dispatch.INTERPRET or device.type != "cuda") else GPU_CONFIG


def _sum_programs(device: torch.device, cfg: MemoryConfig) -> int:
    """Size of sum's persistent grid: enough resident programs per SM to saturate DRAM."""
    if _dispatch.INTERPRET or device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * cfg.programs_per_sm


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK  # int64: 2^31 elements is only 4 GiB of fp16
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
    else:
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    # value arrives as fp32 and is exactly representable (the launcher rounds it to out's dtype first).
    v = (tl.zeros([BLOCK], dtype=tl.float32) + value).to(out_ptr.dtype.element_ty)
    if start + BLOCK <= n:
        tl.store(out_ptr + offs, v)
    else:
        tl.store(out_ptr + offs, v, mask=offs < n)


@triton.jit
def _sum_partials_kernel(x_ptr, partials_ptr, n, num_full, tail_start, BLOCK: tl.constexpr):
    # Persistent grid: program p accumulates full blocks p, p + P, p + 2P, ... in an fp32 vector
    # (no atomics: the result does not depend on scheduling), the last program also takes the
    # ragged tail; one fp32 partial per program.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * BLOCK  # int64 offsets, advanced by the grid stride
    stride = nprog.to(tl.int64) * BLOCK
    for _ in range(pid, num_full, nprog):
        acc += tl.load(x_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
        start += stride
    if pid == nprog - 1:
        offs = tail_start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _sum_finish_kernel(partials_ptr, out_ptr, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    p = tl.load(partials_ptr + offs, mask=offs < m, other=0.0)
    tl.store(out_ptr, tl.sum(p, axis=0))


def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (strides {tuple(x.stride())} for shape "
                         f"{tuple(x.shape)}); call .contiguous() first")


def _device_ctx(device: torch.device) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def copy(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[...] = src`` for a contiguous fp32/fp16/bf16 tensor; allocates ``out`` when None.

    ``out`` must have src's shape, dtype and device, be contiguous, and not partly overlap src.
    """
    _check_input(src, "src")
    if out is None:
        out = torch.empty_like(src, memory_format=torch.contiguous_format)
    else:
        _check_input(out, "out")
        if out.shape != src.shape or out.dtype != src.dtype or out.device != src.device:
            raise ValueError(f"out: expected shape {tuple(src.shape)}, dtype {src.dtype} on {src.device}, "
                             f"got shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}")
    n = src.numel()
    if n == 0:
        return out
    if use_triton(src, out):
        cfg = _config(src.device)
        block = cfg.block_bytes // src.element_size()
        with _device_ctx(src.device):
            _copy_kernel[(triton.cdiv(n, block),)](src, out, n, BLOCK=block, num_warps=cfg.num_warps)
        return out
    return copy_ref(src, out)


def fill(out: torch.Tensor, value: float) -> torch.Tensor:
    """Set every element of contiguous fp32/fp16/bf16 ``out`` to ``value`` (rounded to its dtype); returns out."""
    _check_input(out, "out")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"value: expected a Python number, got {type(value).__name__}")
    n = out.numel()
    if n == 0:
        return out
    if use_triton(out):
        cfg = _config(out.device)
        block = cfg.block_bytes // out.element_size()
        # Round once on the host exactly as torch does (double -> dtype); the kernel's fp32 -> dtype
        # cast is then exact, so no double rounding differs from torch.fill_.
        v = float(torch.tensor(float(value), dtype=torch.float64).to(out.dtype).item())
        with _device_ctx(out.device):
            _fill_kernel[(triton.cdiv(n, block),)](out, v, n, BLOCK=block, num_warps=cfg.num_warps)
        return out
    return fill_ref(out, value)


def sum(x: torch.Tensor) -> torch.Tensor:  # noqa: A001  (the op's name; builtins.sum is not used here)
    """Sum of all elements of contiguous fp32/fp16/bf16 ``x``, accumulated in fp32: a 0-d float32 tensor."""
    _check_input(x, "x")
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    if not use_triton(x):
        return sum_ref(x)
    cfg = _config(x.device)
    block = cfg.block_bytes // x.element_size()
    num_full = n // block
    nprog = max(1, min(triton.cdiv(n, block), _sum_programs(x.device, cfg)))
    partials = torch.empty(nprog, dtype=torch.float32, device=x.device)
    out = torch.empty((), dtype=torch.float32, device=x.device)
    with _device_ctx(x.device):
        _sum_partials_kernel[(nprog,)](x, partials, n, num_full, num_full * block, BLOCK=block,
                                       num_warps=cfg.num_warps)
        _sum_finish_kernel[(1,)](partials, out, nprog, BLOCK=max(triton.next_power_of_2(nprog), 16),
                                 num_warps=1 if nprog <= 1024 else 4)
    return out
