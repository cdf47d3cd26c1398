"""Triton kernels that measure the memory hierarchy: a working-set bandwidth sweep and a pointer chase.

Both do all their work in ONE launch, so what is timed is the memory system, not the launch path.

* Sweep: a persistent grid streams a working set of ``ws_bytes`` again and again; program p reads
  tiles p, p + P, p + 2P, ... (mod the tile count), so every pass touches the whole set and
  neighbouring programs read neighbouring tiles. Loads are ``.cg`` (cache at L2, not L1): with the
  set in L2 it measures L2 bandwidth, past the L2 size the stream comes from HBM, and the step
  between the two is the L2 cliff.
* Chase: one program follows ``idx = next[idx]`` through a random single cycle, each load waiting
  for the previous one, so the time per hop is the load-to-use latency of wherever the chain lives.
  Timed inside the kernel with ``%clock64`` (SM cycles) and ``%globaltimer`` (ns) read around the
  chain, with an untimed warm-up lap first: L1 is per SM, so only a warm-up in the same program
  finds the chain in ITS L1, and the in-kernel timers exclude launch cost without needing chains
  of seconds. The closing timer reads take the final index as an (unused) operand so the compiler
  cannot hoist them above the chain. Under the interpreter (no PTX) the timers are compiled out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import warpforge.kernels  # noqa: F401  (the package chooses the interpreter before any @jit)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SWEEP_TILE = 2048  # fp32 elements per program per step: 8 KiB, 4 x 16 B vectors per thread at 4 warps
SWEEP_WARPS = 4
SWEEP_PROGRAMS_PER_SM = 8  # 8 x 8 KiB in flight per SM: well past L2 and HBM latency x bandwidth


# Not specialized on the sizes: one compiled kernel serves the whole sweep (a recompile costs ~1 s).
@triton.jit(do_not_specialize=["num_tiles", "iters"])
def _sweep_read_kernel(x_ptr, out_ptr, num_tiles, iters, TILE: tl.constexpr, CACHE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t = pid % num_tiles
    step = nprog % num_tiles
    acc = tl.zeros([TILE], dtype=tl.float32)
    for _ in range(iters):
        acc += tl.load(x_ptr + t * TILE + tl.arange(0, TILE), cache_modifier=CACHE)
        t += step  # t, step < num_tiles, so one conditional subtract replaces a modulo
        t = tl.where(t >= num_tiles, t - num_tiles, t)
    # Stored so the loads are live; the host never needs the value except in the tests.
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _clock64(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _globaltimer(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["start", "warm", "steps"])
def _chase_kernel(next_ptr, out_ptr, start, warm, steps, CACHE: tl.constexpr, TIMED: tl.constexpr):
    # out: [final index, cycles, ns] (int64)
    idx = tl.load(next_ptr + start, cache_modifier=CACHE)
    for _ in range(warm - 1):
        idx = tl.load(next_ptr + idx, cache_modifier=CACHE)
    if TIMED:
        c0 = _clock64(idx)
        g0 = _globaltimer(idx)
    for _ in range(steps):
        idx = tl.load(next_ptr + idx, cache_modifier=CACHE)
    if TIMED:
        c1 = _clock64(idx)
        g1 = _globaltimer(idx)
        tl.store(out_ptr + 1, c1 - c0)
        tl.store(out_ptr + 2, g1 - g0)
    tl.store(out_ptr, idx.to(tl.int64))


def sweep_launcher(buf: torch.Tensor, ws_bytes: int, bytes_per_launch: int, programs: int,
                   tile: int = SWEEP_TILE, num_warps: int = SWEEP_WARPS) -> tuple[Callable[[], torch.Tensor], int]:
    """A callable that reads the first ``ws_bytes`` of ``buf`` (fp32, contiguous) about
    ``bytes_per_launch`` bytes in one launch, and the exact bytes it reads per call."""
    if buf.dtype != torch.float32 or not buf.is_contiguous():
        raise ValueError(f"buf: expected a contiguous float32 tensor, got {buf.dtype}, "
                         f"contiguous={buf.is_contiguous()}")
    tile_bytes = tile * 4
    num_tiles = ws_bytes // tile_bytes
    if num_tiles < 1 or num_tiles * tile > buf.numel():
        raise ValueError(f"ws_bytes: {ws_bytes} must be >= one tile ({tile_bytes} B) and <= the buffer "
                         f"({buf.numel() * 4} B)")
    if num_tiles * tile >= 2**31:
        raise ValueError(f"ws_bytes: {ws_bytes} exceeds the int32 offsets of the sweep kernel")
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    iters = max(1, -(-bytes_per_launch // (programs * tile_bytes)))
    out = torch.empty(programs, dtype=torch.float32, device=buf.device)

    def run() -> torch.Tensor:
        _sweep_read_kernel[(programs,)](buf, out, num_tiles, iters, TILE=tile, CACHE=".cg", num_warps=num_warps)
        return out

    return run, programs * iters * tile_bytes


def sweep_expected(buf: torch.Tensor, ws_bytes: int, programs: int, iters: int, tile: int) -> torch.Tensor:
    """What the sweep kernel stores per program (float64), for the tests: the tile walk made explicit."""
    num_tiles = ws_bytes // (tile * 4)
    tiles = buf[: num_tiles * tile].to(torch.float64).view(num_tiles, tile).sum(dim=1)
    return torch.stack([tiles[[(p + i * programs) % num_tiles for i in range(iters)]].sum() for p in range(programs)])


@dataclass(frozen=True)
class Chain:
    """A random single cycle through ``slots`` slots ``stride`` int32 elements apart."""

    next: torch.Tensor  # [slots * stride] int32; next[slot * stride] = following slot * stride
    order: torch.Tensor  # [slots] int64: slot indices in cycle order (on the chain's device)
    stride: int


def make_chain(ws_bytes: int, stride_bytes: int, device: torch.device, gen: torch.Generator) -> Chain:
    """A pointer-chase chain over ``ws_bytes`` with one hop per ``stride_bytes``, in random order
    (a random cycle defeats every prefetcher and spreads hops over DRAM pages and L2 slices)."""
    if stride_bytes % 4 or stride_bytes < 4:
        raise ValueError(f"stride_bytes must be a positive multiple of 4, got {stride_bytes}")
    stride = stride_bytes // 4
    slots = ws_bytes // stride_bytes
    if slots < 2:
        raise ValueError(f"ws_bytes={ws_bytes} holds fewer than 2 slots of {stride_bytes} B")
    if slots * stride >= 2**31:
        raise ValueError(f"ws_bytes={ws_bytes} exceeds int32 indices")
    order = torch.randperm(slots, generator=gen, device=gen.device).to(device)
    nxt = torch.zeros(slots * stride, dtype=torch.int32, device=device)
    nxt[order * stride] = (torch.roll(order, -1) * stride).to(torch.int32)
    return Chain(next=nxt, order=order, stride=stride)


def chase(chain: Chain, start_slot: int, warm: int, steps: int, *, cache: str, timed: bool) -> dict:
    """Follow the chain from ``start_slot``: ``warm`` untimed hops (>= 1), then ``steps`` timed hops.

    Returns {"final": index after warm + steps hops, "cycles", "ns"} (per-hop cycles and ns only
    when ``timed``; they need PTX, so not under the interpreter).
    """
    if warm < 1 or steps < 1:
        raise ValueError(f"warm and steps must be >= 1, got warm={warm}, steps={steps}")
    if cache not in ("", ".ca", ".cg", ".cv"):
        raise ValueError(f"cache must be one of '', .ca, .cg, .cv; got {cache!r}")
    out = torch.zeros(3, dtype=torch.int64, device=chain.next.device)
    _chase_kernel[(1,)](chain.next, out, start_slot * chain.stride, warm, steps, CACHE=cache, TIMED=timed,
                        num_warps=1, num_stages=1)
    final, cycles, ns = (int(v) for v in out.tolist())
    res = {"final": final}
    if timed:
        res.update(cycles=cycles / steps, ns=ns / steps)
    return res


def walk(chain: Chain, start_slot: int, hops: int) -> int:
    """The index ``hops`` loads after ``start_slot`` by walking the cycle order (what chase must return)."""
    order = chain.order.tolist()
    pos = order.index(start_slot)
    return order[(pos + hops) % len(order)] * chain.stride
