"""Gated MLP activations (``silu_and_mul``, ``gelu_and_mul``) and ``softmax`` along the last dim.

Memory-bound kernels: one pass over the data with wide contiguous loads, math in fp32, one rounding
at the store. Rows are addressed through a row stride, so a row-strided 2-D view (a slice of a
wider buffer) is served without a copy; the last dim must be contiguous.

Tilings (``RowConfig``) are tuned per shape bucket on the GPU (kernels/_autotune.py); the first
candidate of each list is the heuristic default. softmax has four kernels: whole rows in registers
(one read), the same on a persistent grid, rows streamed in chunks (two reads; the second should
hit L2), and streamed rows on a persistent grid, which bounds the rows in flight so that it does.

The ``apply_activation`` jit helper is shared with the conv epilogue (kernels/conv_epilogue.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels._checks import check_num_warps, check_pow2, check_tensor_as
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
    check_tensor_as(out, name, tuple(shape), dtype, device)
    return rows_view(out, name)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class RowConfig:
    """Tiling of a row-wise kernel: ``block_m`` rows x ``block_n`` columns per program.

    softmax only: ``looped`` streams each row in ``block_n`` chunks (rows wider than registers, two
    reads of x); ``programs_per_sm`` > 0 makes the grid persistent: num_SMs x programs_per_sm programs,
    program p serving rows (row blocks) p, p + grid, ..., with the next chunk's loads issued before the
    current chunk's math. Only grid rows are in flight at once, so a looped row's second read stays in L2.
    ``l2_hints`` (looped and persistent only): pass 1's reads marked evict_last, pass 2's reads and the
    stores evict_first, so that the output and the rows already done leave L2 before rows awaiting pass 2.
    """

    block_m: int
    block_n: int
    num_warps: int
    looped: bool = False
    programs_per_sm: int = 0
    l2_hints: bool = False

    def __post_init__(self) -> None:
        check_pow2(self, "block_m", "block_n")
        check_num_warps(self, (1, 2, 4, 8, 16, 32))
        if not 0 <= self.programs_per_sm <= 32:
            raise ValueError(f"RowConfig.programs_per_sm must be in [0, 32] (0: not persistent), "
                             f"got {self.programs_per_sm}")
        if self.l2_hints and not (self.looped and self.programs_per_sm):
            raise ValueError("RowConfig.l2_hints needs looped=True and programs_per_sm > 0 (the persistent "
                             "streamed softmax)")
        if self.looped and self.block_m != 1:
            raise ValueError(f"RowConfig.block_m must be 1 when looped (one row streamed at a time), "
                             f"got {self.block_m}")

    @property
    def persistent(self) -> bool:
        return self.programs_per_sm > 0


# Elements per program the heuristics aim for: enough bytes in flight per SM without spilling.
TARGET_ELEMS = 4096
SOFTMAX_MAX_SINGLE = 32768  # widest row softmax keeps whole in registers; wider rows are streamed


def row_config(m: int, n: int, *, target: int = TARGET_ELEMS, max_block_n: int | None = None) -> RowConfig:
    """Default tiling: a power-of-two row chunk, several rows per program when rows are narrow."""
    bn = _pow2(n) if max_block_n is None else min(_pow2(n), max_block_n)
    bm = max(1, min(_pow2(m), target // bn))
    warps = min(32 if bn > 8192 else 16, max(1, bm * bn // 256))
    return RowConfig(block_m=bm, block_n=bn, num_warps=_pow2(warps))


# ---- tuning -------------------------------------------------------------------------------------
# Each launcher's untuned default is a function of the shape (row_config / softmax_config), and the
# Tuner's configs[0] is its default, so there is one Tuner per default: candidates = [default, *the
# width class's alternatives]. WARPFORGE_AUTOTUNE=0, CPU tensors and CUDA-graph capture of an untuned
# bucket all get the default, as before tuning existed.
_TUNERS: dict[tuple[RowConfig, ...], Tuner[RowConfig]] = {}
INTERPRET_SMS = 2  # the interpreter's stand-in SM count: persistent grids of a few programs, many rows each


def _tuner(kernel: str, configs: tuple[RowConfig, ...]) -> Tuner[RowConfig]:
    t = _TUNERS.get(configs)
    if t is None:
        d = configs[0]
        name = f"{kernel}_m{d.block_m}_n{d.block_n}_w{d.num_warps}{'_looped' if d.looped else ''}"
        t = _TUNERS.setdefault(configs, Tuner(name, configs, RowConfig))
    return t


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs a persistent grid is sized for: the GPU's count, a small constant in the interpreter."""
    if device.type != "cuda":
        return INTERPRET_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def _aligned(*ts: torch.Tensor) -> bool:
    """16-byte aligned bases and row strides: whether the loads can vectorize (tuned apart)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _choose(kernel: str, configs: tuple[RowConfig, ...], bucket: tuple, x2: torch.Tensor, out2: torch.Tensor,
            launch, valid) -> RowConfig:
    """The tuned config for ``bucket`` (``launch(cfg, dst)`` runs one trial). Trials rewrite the output
    many times: when it overlaps x (softmax in place), they write to a scratch buffer instead."""
    if len(configs) == 1:
        return configs[0]
    dst: list[torch.Tensor] = []  # allocated on the first trial only (a cached winner runs none)

    def trial(cfg: RowConfig) -> None:
        if not dst:
            dst.append(torch.empty_like(out2) if _shares_storage(out2, x2) else out2)
        launch(cfg, dst[0])

    return _tuner(kernel, configs).choose(bucket, x2.device, trial, valid=valid)


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
    if config is None:
        mb, db = pow2_bucket(m), pow2_bucket(d)
        configs = gated_candidates(mb, db)
        bucket = (act, str(x.dtype), mb, db, _aligned(x2, out2))
        config = _choose("gated", configs, bucket, x2, out2, lambda c, dst: _launch_gated(x2, dst, act, c),
                         valid=lambda c: c == configs[0] or (c.block_m <= mb and c.block_n <= db))
    elif config.looped or config.persistent:
        raise ValueError(f"config: looped / programs_per_sm are softmax-only tilings, got {config}")
    _launch_gated(x2, out2, act, config)
    return out


def _launch_gated(x2: torch.Tensor, out2: torch.Tensor, act: str, cfg: RowConfig) -> None:
    m, d = out2.shape
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(d, cfg.block_n))
    p = pdl(x2)
    _gated_kernel[grid](x2, out2, m, d, x2.stride(0), out2.stride(0), ACT=ACTIVATIONS[act], PDL=p, launch_pdl=p > 0,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)


# Alternatives to the default for the gated kernels (H200 bf16 4096x28672: the default [4, 1024] x 16 warps
# reached 90% of the HBM roof, torch.compile's 1-D 1024-element, 4-warp blocks 94%): smaller programs
# (more resident per SM, shorter tails) and wider ones (fewer programs), 8-16 elements of each operand
# per thread (one or two 16-byte loads each); 28-38 registers (offline sm_90), so each reaches 2048 threads
# per SM, >= 64 KB of loads in flight.
GATED_ALTERNATIVES = (
    RowConfig(1, 1024, 4),  # torch.compile's shape: 8 per thread, up to 16 programs per SM
    RowConfig(1, 2048, 8),
    RowConfig(2, 1024, 8),
    RowConfig(1, 2048, 4),  # 16 per thread
    RowConfig(1, 4096, 8),
    RowConfig(2, 2048, 8),
    RowConfig(8, 512, 8),  # narrow rows (d <= 512 keeps only these and the default)
)


@functools.lru_cache(maxsize=None)
def gated_candidates(m: int, d: int) -> tuple[RowConfig, ...]:
    """Tuning candidates for [m, 2d] -> [m, d]: the default ``row_config(m, d, max_block_n=1024)`` first."""
    default = row_config(m, d, max_block_n=1024)
    return (default, *[c for c in GATED_ALTERNATIVES if c != default])


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


FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a finite initial running max (see below)


@triton.jit
def _softmax_rows_persistent_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Whole rows in registers like _softmax_kernel, on a persistent grid: program p serves row blocks
    # p, p + G, ... and issues the next block's loads before this block's reductions and stores, so
    # loads stay in flight through the phases one short-lived program would run one after another.
    G = tl.num_programs(0)
    r = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = (cols < N)[None, :]
    rows = tl.program_id(0) * BLOCK_M + r
    nxt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                  mask=(rows < M)[:, None] & cmask, other=-float("inf"))
    for blk in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), G):
        rows = tl.cast(blk, tl.int32) * BLOCK_M + r  # (tl.cast: the loop index is a plain int in the interpreter)
        x = nxt.to(tl.float32)
        nrows = rows + G * BLOCK_M
        nxt = tl.load(x_ptr + nrows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                      mask=(nrows < M)[:, None] & cmask, other=-float("inf"))
        mx = tl.max(x, axis=1)
        mx = tl.where(mx == -float("inf"), 0.0, mx)  # rows past M (all -inf): no NaN in unstored lanes
        e = tl.exp(x - mx[:, None])
        y = e * (1.0 / tl.sum(e, axis=1))[:, None]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & cmask)


@triton.jit
def _online_update(x, m_vec, s_vec):
    """Fold a chunk x [R, VEC] into the running max / rescaled sum [R] (online softmax)."""
    m_new = tl.maximum(m_vec, tl.max(x, axis=1))
    s_vec = s_vec * tl.exp(m_vec - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    return m_new, s_vec


@triton.jit
def _softmax_persistent_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_om,
                               BLOCK_N: tl.constexpr, VEC: tl.constexpr,
                               KEEP: tl.constexpr = "", DROP: tl.constexpr = ""):
    # Streamed rows on a persistent grid of G programs (rows p, p + G, ...): G rows in flight, so pass 2
    # re-reads each from L2, where one program per row keeps a 512-row problem resident and goes to HBM.
    # A chunk is [BLOCK_N // VEC, VEC] (one 16-byte load a thread): the running max and sum take one fp32
    # per VEC elements, the registers go to loads in flight. The next chunk's loads (across passes and rows;
    # each pass's last chunk peeled) are issued before this chunk's math. KEEP / DROP: L2 eviction policies
    # ("", "evict_last", "evict_first") of the reads pass 2 needs again, and of what nothing reads again.
    R: tl.constexpr = BLOCK_N // VEC
    offs = tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [R, VEC] column offsets in a chunk
    G = tl.num_programs(0)
    pid = tl.program_id(0)
    last = (N - 1) // BLOCK_N * BLOCK_N  # the last chunk's first column
    nxt = tl.load(x_ptr + pid.to(tl.int64) * stride_xm + offs, mask=(offs < N) & (pid < M), other=-float("inf"),
                  eviction_policy=KEEP)
    for row in range(pid, M, G):
        row64 = tl.cast(row, tl.int64)  # (tl.cast: the loop index is a plain int in the interpreter)
        xr = x_ptr + row64 * stride_xm
        # Finite initial max: exp(m_old - m_new) stays defined for lanes that only ever saw -inf.
        m_vec = tl.full([R], -FLT_MAX, tl.float32)
        s_vec = tl.zeros([R], tl.float32)
        for start in range(0, last, BLOCK_N):  # pass 1 but the last chunk: prefetch the next chunk
            x = nxt.to(tl.float32)
            nxt = tl.load(xr + start + BLOCK_N + offs, mask=start + BLOCK_N + offs < N, other=-float("inf"),
                          eviction_policy=KEEP)
            m_vec, s_vec = _online_update(x, m_vec, s_vec)
        x = nxt.to(tl.float32)
        nxt = tl.load(xr + offs, mask=offs < N, other=-float("inf"), eviction_policy=DROP)  # pass 2's first
        m_vec, s_vec = _online_update(x, m_vec, s_vec)
        mx = tl.max(m_vec, axis=0)
        inv = 1.0 / tl.sum(s_vec * tl.exp(m_vec - mx), axis=0)
        orow = out_ptr + row64 * stride_om
        for start in range(0, last, BLOCK_N):  # pass 2 but the last chunk
            x = nxt.to(tl.float32)
            nxt = tl.load(xr + start + BLOCK_N + offs, mask=start + BLOCK_N + offs < N, other=-float("inf"),
                          eviction_policy=DROP)
            tl.store(orow + start + offs, (tl.exp(x - mx) * inv).to(out_ptr.dtype.element_ty),
                     eviction_policy=DROP)  # a full chunk: no mask
        x = nxt.to(tl.float32)
        nrow = row64 + G
        nxt = tl.load(x_ptr + nrow * stride_xm + offs, mask=(offs < N) & (nrow < M), other=-float("inf"),
                      eviction_policy=KEEP)  # the next row's first chunk
        tl.store(orow + last + offs, (tl.exp(x - mx) * inv).to(out_ptr.dtype.element_ty), mask=last + offs < N,
                 eviction_policy=DROP)


def softmax_config(m: int, n: int) -> RowConfig:
    """Default softmax tiling: whole rows in registers up to SOFTMAX_MAX_SINGLE, streamed beyond."""
    if n > SOFTMAX_MAX_SINGLE:
        return RowConfig(block_m=1, block_n=4096, num_warps=16, looped=True)
    return row_config(m, n)


# Streamed persistent candidates (block_n chunk, warps, programs per SM). Bytes in flight per SM (Little's
# law: ~4.6 TB/s x ~1 us / 132 SMs ~ 35 KB) = programs x 1-2 chunks of 2 bytes x block_n; rows in flight
# = 132 x programs, x row bytes under the L2 (60 MB; the cliff measured at 72 MiB) for pass 2 to hit it.
# Registers: block_n / (32 x warps) = 16 fp32 of x per thread in each, plus 8 for the prefetched 16-bit
# chunk and 2 x 2 for the running max and sum (offline sm_90: 40-64 registers, no spills).
SOFTMAX_STREAMED = (
    RowConfig(1, 16384, 32, looped=True, programs_per_sm=1),  # 32-64 KB/SM; 512x131072 bf16: 33 MB of rows
    RowConfig(1, 8192, 16, looped=True, programs_per_sm=1),   # 16-32 KB/SM, same rows in flight
    RowConfig(1, 8192, 16, looped=True, programs_per_sm=2),   # 32-64 KB/SM; rows of <= 128 KB (4096x32768)
    RowConfig(1, 4096, 8, looped=True, programs_per_sm=4),    # 32-64 KB/SM; rows of <= 64 KB
)
# Rows wider than SOFTMAX_MAX_SINGLE also try L2 eviction hints: between a chunk's two reads each program
# streams one row of loads plus part of a row of stores, ~34-50 MB in all at 512x131072 k=1 (k=2: twice).
SOFTMAX_STREAMED_HINTS = (
    RowConfig(1, 16384, 32, looped=True, programs_per_sm=1, l2_hints=True),
    RowConfig(1, 8192, 16, looped=True, programs_per_sm=2, l2_hints=True),
)


@functools.lru_cache(maxsize=None)
def softmax_candidates(m: int, n: int) -> tuple[RowConfig, ...]:
    """Tuning candidates for rows of n: ``softmax_config(m, n)`` first, then whole-row tilings with more
    rows or more programs per SM than the default, a persistent whole-row one, and streamed persistent
    ones for rows of >= 8192 (the default for 4096x32768 is 32 warps x 32 fp32 each, one program per SM
    whose load, reduce and store phases run one after another)."""
    default = softmax_config(m, n)
    bn = _pow2(n)
    out = [default]
    if bn <= SOFTMAX_MAX_SINGLE:
        for bm, w in ((1, 4), (1, 8), (2, 8), (2, 16), (4, 16)):
            if 4 <= bm * bn // (32 * w) <= 32 and bm * bn <= SOFTMAX_MAX_SINGLE:
                out.append(RowConfig(bm, bn, w))
        if 1024 <= bn <= 16384:  # 16 fp32 per thread + 8 registers of the next rows' 16-bit values:
            w = bn // 512        # ~40 registers (offline sm_90), so 48 warps per SM fit the register file
            out.append(RowConfig(1, bn, w, programs_per_sm=48 // w))
    if bn >= 8192:
        out += [c for c in SOFTMAX_STREAMED if c.block_n <= bn]
    if bn > SOFTMAX_MAX_SINGLE:
        out += SOFTMAX_STREAMED_HINTS
    seen: list[RowConfig] = []
    for c in out:
        if c not in seen:
            seen.append(c)
    return tuple(seen)


def _launch_softmax(x2: torch.Tensor, out2: torch.Tensor, cfg: RowConfig) -> None:
    m, n = x2.shape
    args = (x2, out2, m, n, x2.stride(0), out2.stride(0))
    if cfg.looped and cfg.persistent:
        vec = min(cfg.block_n, 16 // x2.element_size())
        grid = (min(m, num_sms(x2.device) * cfg.programs_per_sm),)
        hints = {"KEEP": "evict_last", "DROP": "evict_first"} if cfg.l2_hints else {}
        _softmax_persistent_kernel[grid](*args, BLOCK_N=cfg.block_n, VEC=vec, num_warps=cfg.num_warps, **hints)
    elif cfg.looped:
        _softmax_looped_kernel[(m,)](*args, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    else:
        if cfg.block_n < n:
            raise ValueError(f"config.block_n={cfg.block_n} must cover the row width {n} (or set looped=True)")
        blocks = triton.cdiv(m, cfg.block_m)
        if cfg.persistent:
            grid = (min(blocks, num_sms(x2.device) * cfg.programs_per_sm),)
            _softmax_rows_persistent_kernel[grid](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                                  num_warps=cfg.num_warps)
        else:
            _softmax_kernel[(blocks,)](*args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)


def softmax(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None,
            config: RowConfig | None = None) -> torch.Tensor:
    """Softmax of x [..., N] along the last dim, fp32 math, output in x's dtype (or ``out``).

    ``config`` fixes the tiling; without it the tuner picks one per (dtype, rows, width) bucket on the GPU
    (``softmax_candidates``; the default when tuning is off, on CPU and inside an untuned graph capture)."""
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
    if config is None:
        mb, nb = pow2_bucket(m), pow2_bucket(n)
        configs = softmax_candidates(mb, nb)
        config = _choose("softmax", configs, (str(x.dtype), mb, nb, _aligned(x2, out2)), x2, out2,
                         lambda c, dst: _launch_softmax(x2, dst, c),
                         valid=lambda c: c == configs[0] or c.block_m <= mb)
    _launch_softmax(x2, out2, config)
    return out


__all__ = ["ACTIVATIONS", "RowConfig", "apply_activation", "gated_candidates", "gelu_and_mul", "silu_and_mul",
           "softmax", "softmax_candidates", "softmax_config"]
