"""``linear(x, weight)``: decode-shaped products that stream the weight, dense or quantized.

At decode (M = 1..64 rows of activations against a [N, K] weight) the work is reading the weight
once at full HBM bandwidth; the arithmetic is almost free. ``_linear_kernel`` gives each program
BLOCK_N weight rows and (with split-K) a slice of K, loads contiguous [BLOCK_N, BLOCK_K] weight
tiles (dequantized in registers for int8/int4/fp8 weights) and multiplies them against every row
of x, so the weight is read once whatever M is:

* BLOCK_M < 16 (M <= 8): CUDA-core FMAs into a [BM, BN, BK] fp32 accumulator, reduced over K once
  at the end (no shuffles in the loop);
* BLOCK_M >= 16: tensor cores with the weight tile as the *left* operand (out.T = W @ x.T), so the
  MMA's large M dimension is the weight rows, not the few activation rows.

When N / BLOCK_N gives too few programs to fill the SMs, split-K writes fp32 partial sums and
``_splitk_reduce_kernel`` adds them and applies the epilogue (deterministic: no atomics). The same
kernel serves quantized weights at any M (prefill), as a plain tiled GEMM with dequantization.
``linear()`` picks: dense and M <= 64 -> this kernel; dense and M > 64 -> ``matmul`` (persistent
TMA GEMM); quantized -> this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warpforge.kernels import _dispatch  # noqa: F401  (selects the interpreter before any @jit)
from warpforge.kernels import reference
from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels.activation import ACTIVATIONS, apply_activation
from warpforge.kernels._checks import check_num_warps, check_pow2, check_range, refuse_interpreted_bf16
from warpforge.kernels._dispatch import INTERPRET, pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.matmul import (
    FLOAT_DTYPES, SCALE_NONE, SCALE_VECTOR, _epilogue, _shares_storage, _store, activation_code,
    check_epilogue_operands, check_tensor, matmul,
)
from warpforge.kernels.norm import rms_norm
from warpforge.kernels.quant_linear import (FMT_DENSE, FMT_FP8, FMT_INT4, FMT_INT8, FORMAT_NAMES, QuantizedWeight,
                                            _load_weight_tile)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

GEMV_MAX_M = 64  # linear() streams dense weights through this kernel up to here, then uses matmul
NORM_NONE, NORM_RMS, NORM_RMS_RES = 0, 1, 2  # _linear_kernel's NORM: none, rms_norm(x), rms_norm(x + residual)


@dataclass(frozen=True)
class InputNorm:
    """An RMSNorm that ``linear(..., norm=)`` applies to its input: ``s / rms(s) * (weight + offset)``,
    s = x (+ residual), exactly as ``kernels.norm.rms_norm(x, weight, eps, weight_offset=offset)`` (offset 1:
    Gemma's ``(1 + weight)``). At GEMV sizes the weight-streaming kernel computes it in its x loads."""

    weight: torch.Tensor  # [K] float32 or x's dtype
    eps: float = 1e-6
    offset: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor):
            raise ValueError(f"norm: weight must be a torch.Tensor [K], got {type(self.weight).__name__}")
        for name in ("eps", "offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ValueError(f"norm: {name} must be a number, got {v!r}")
        if self.eps < 0:
            raise ValueError(f"norm: eps must be >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class _NormLaunch:
    """A validated norm fusion for _launch: residual / residual_out are [M, K] (or None), weight [K]."""

    code: int
    weight: torch.Tensor
    eps: float
    offset: float
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None


def _norm_block_k(cfg: LinearConfig, K: int) -> int:
    """Width of the statistics pass's tiles: ~4096 elements per tile (a 2048-4096 wide row in one or two)."""
    return max(16, min(triton.next_power_of_2(max(K, 1)), 4096 // cfg.block_m))


@dataclass(frozen=True)
class LinearConfig:
    """Launch configuration of ``_linear_kernel``. block_m < 16 selects the CUDA-core (FMA) path."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the K loop
    words: bool = False  # M=1 int8/int4 only: read 32-bit words, convert by float bit tricks (_linear_words_kernel)

    def __post_init__(self) -> None:
        if self.words and self.block_m != 1:
            raise ValueError(f"LinearConfig.words needs block_m == 1, got {self.block_m}")
        check_pow2(self, "block_m", hi=128)
        check_pow2(self, "block_n", lo=8, hi=256)
        check_pow2(self, "block_k", lo=16, hi=1024)
        if self.use_dot and self.block_n < 16:
            raise ValueError("LinearConfig.block_n must be >= 16 on the tensor-core path (block_m >= 16)")
        check_range(self, "split_k", 1, 32)
        check_num_warps(self)
        check_range(self, "num_stages", 1, 8)

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


def _m_class(M: int) -> int:
    """The block_m a call with M rows uses: 1, 2, 4 (FMA), 16, 32, 64 (tensor cores), 128 (prefill)."""
    if M <= 4:
        return pow2_bucket(M)
    if M <= 64:
        return max(16, pow2_bucket(M))
    return 128


def _configs(bm: int) -> list[LinearConfig]:
    """4-8 candidates per M class; the first is the class's untuned default."""
    if bm < 16:  # FMA: the accumulator bm*bn*bk fp32 is spread over 32*num_warps threads
        bk = 512 // bm
        words = [  # M=1 int8/int4 weights (invalid for the others, so the first of these is their default)
            LinearConfig(1, 64, 256, 1, 4, 3, words=True),
            # Narrow and deep: 896 programs of 8 KB (int4) per stage, ~6 resident per SM, as the dense
            # default keeps ~4 x 48 KB in flight per SM; 64-row tiles left ~40 KB (notes/kernels.md).
            LinearConfig(1, 16, 1024, 1, 4, 3, words=True),
            LinearConfig(1, 32, 1024, 1, 4, 3, words=True),
            LinearConfig(1, 128, 512, 2, 8, 3, words=True),
        ] if bm == 1 else []
        return words + [
            LinearConfig(bm, 16, bk, 1, 4, 3),
            LinearConfig(bm, 32, bk // 2, 1, 4, 3),
            LinearConfig(bm, 8, bk, 1, 4, 4),
            LinearConfig(bm, 16, bk, 2, 4, 3),
            LinearConfig(bm, 16, bk, 4, 4, 3),
            LinearConfig(16, 64, 128, 1, 4, 4),  # tensor cores even for tiny M: padding rows costs nothing
            LinearConfig(16, 64, 128, 4, 4, 4),
        ]
    if bm <= 64:
        return [
            LinearConfig(bm, 64, 128, 1, 4, 4),
            LinearConfig(bm, 128, 128, 1, 4, 3),
            LinearConfig(bm, 64, 256, 1, 4, 3),
            LinearConfig(bm, 64, 128, 2, 4, 4),
            LinearConfig(bm, 64, 128, 4, 4, 4),
            LinearConfig(bm, 128, 128, 1, 8, 4),
            LinearConfig(bm, 64, 64, 1, 4, 3),  # small enough for a gated fp32 x at bm 64 (see _fits)
        ]
    return [  # M > 64: quantized weights at prefill (dense weights go to matmul)
        LinearConfig(128, 128, 64, 1, 8, 3),
        LinearConfig(128, 128, 128, 1, 8, 3),
        LinearConfig(128, 64, 128, 1, 4, 4),
        LinearConfig(64, 128, 128, 1, 4, 4),
    ]


M_CLASSES = (1, 2, 4, 16, 32, 64, 128)
LINEAR_CONFIGS: dict[int, list[LinearConfig]] = {bm: _configs(bm) for bm in M_CLASSES}
TUNERS = {bm: Tuner(f"linear_m{bm}", cfgs, LinearConfig) for bm, cfgs in LINEAR_CONFIGS.items()}


def _interpret_config(M: int, group: int | None, words_ok: bool) -> LinearConfig:
    bm = _m_class(M)
    return LinearConfig(min(bm, 16), 16, max(32, group or 0), 1, 4, 1, words=words_ok and bm == 1)


def words_ok(fmt: int, w: torch.Tensor, K_w: int) -> bool:
    """Can the word kernel read this int8/int4 weight as int32 words (rows whole words, 4-byte aligned)?"""
    nbytes = K_w // 2 if fmt == FMT_INT4 else K_w
    return (fmt in (FMT_INT8, FMT_INT4) and nbytes % 4 == 0 and w.stride(0) % 4 == 0
            and w.data_ptr() % 4 == 0)


SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


def _fits(cfg: LinearConfig, group: int | None, words: bool = False, gate: int = 0, x_bytes: int = 2,
          norm: int = NORM_NONE) -> bool:
    """Can ``cfg`` serve this call? With a gated input on the tensor-core path each pipeline stage holds the
    weight tile and three x-sized tiles (gate, up, and act(gate) * up as the dot's operand): the H200 read
    327,680 bytes (4 stages x 80 KB) for an fp32 x at block_m 32, over the 227 KB a block may have.
    The norm fusion adds a residual tile (with a residual) and a gamma slice per stage to the weight and x
    tiles: offline sm_90 compiles (tests/kernels/sm90_compile.py --norm) read (stages - 1) x (residual +
    fp32 gamma) on top of stages x (weight + x); counted here per stage, so the model stays above them.
    Tiles of 64 x 256 (block_m x block_k) spill registers with the norm's extra loads: dropped too."""
    if gate and cfg.use_dot:
        stage = (cfg.block_n + 3 * cfg.block_m) * cfg.block_k * x_bytes
        if cfg.num_stages * stage > SMEM_LIMIT:
            return False
    if norm and cfg.use_dot:
        x_tiles = 2 if norm == NORM_RMS_RES else 1
        stage = (cfg.block_n + x_tiles * cfg.block_m) * cfg.block_k * x_bytes + 4 * cfg.block_k
        if cfg.num_stages * stage > SMEM_LIMIT or cfg.block_m * cfg.block_k > 8192:
            return False
    return (group is None or cfg.block_k % group == 0) and (words or not cfg.words)


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def _linear_step(acc, w, x_ptr, xrows, stride_xm, stride_xk, k0, K, gate_off, EVEN_K: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATE: tl.constexpr, res_ptr, stride_rm, stride_rk, g_ptr, rstd, norm_offset, NORM: tl.constexpr):
    """acc += the [BN, BK] weight tile w times x's [BM, BK] tile at columns k0.. With GATE (an activation
    code) x is [M, 2K] and its tile is act(x[:, k]) * x[:, K + k], rounded to x's dtype as silu_and_mul /
    gelu_and_mul would store it: the gated MLP's activation fused into the down projection's loads.
    With NORM (NORM_RMS, NORM_RMS_RES) the tile is rms_norm's output at these columns: h = x (+ residual,
    rounded to x's dtype), then h * rstd * (gamma + offset) rounded to x's dtype, rstd [BM] the full rows'."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + xrows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    if EVEN_K:
        xt = tl.load(x_ptrs)  # [BM, BK]
    else:
        xt = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0)
    if GATE != 0:
        if EVEN_K:
            up = tl.load(x_ptrs + gate_off)
        else:
            up = tl.load(x_ptrs + gate_off, mask=offs_k[None, :] < K, other=0.0)
        xt = (apply_activation(xt.to(tl.float32), GATE) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if NORM != 0:
        h = xt.to(tl.float32)
        if NORM == 2:
            r_ptrs = res_ptr + xrows[:, None] * stride_rm + offs_k[None, :] * stride_rk
            if EVEN_K:
                r = tl.load(r_ptrs)
            else:
                r = tl.load(r_ptrs, mask=offs_k[None, :] < K, other=0.0)
            h = (h + r.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)  # the stored residual
        if EVEN_K:
            g = tl.load(g_ptr + offs_k).to(tl.float32) + norm_offset
        else:
            g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32) + norm_offset
        xt = ((h * rstd[:, None]) * g[None, :]).to(x_ptr.dtype.element_ty)  # rms_norm's order and rounding
    if USE_DOT:
        acc = tl.dot(w, tl.trans(xt), acc, input_precision=DOT_PRECISION)  # [BN, BM]
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * xt.to(tl.float32)  # [BN, BK] * [1, BK]
    else:
        acc += w.to(tl.float32)[None, :, :] * xt.to(tl.float32)[:, None, :]
    return acc


@triton.jit
def _norm_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, M, K, stride_xm, stride_xk, stride_rm, stride_rk, stride_rom,
               eps, write, NORM: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BK: tl.constexpr):
    """rsqrt(mean(h^2) + eps) [BM] over the whole row h = x (+ residual, rounded to x's dtype) of each of this
    program's rows, whatever K slice the program multiplies: every program of a row block (N blocks, K splits)
    computes the same statistics from the same inputs (L2-resident: the previous kernel just wrote them).
    ``write`` (true in one program per row block): store h to res_out, as rms_norm stores the new residual."""
    DT = x_ptr.dtype.element_ty
    row_ok = offs_m < M  # padding rows load nothing (their outputs are masked off at the store)
    rows = offs_m.to(tl.int64)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in tl.range(0, K, NORM_BK, num_stages=1):  # a few wide tiles of L2 reads; not worth pipeline buffers
        offs_k = k0 + tl.arange(0, NORM_BK)
        mask = row_ok[:, None] & (offs_k[None, :] < K)
        h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
        h = h.to(tl.float32)
        if NORM == 2:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_k[None, :] * stride_rk, mask=mask, other=0.0)
            hq = (h + r.to(tl.float32)).to(DT)
            tl.store(res_out_ptr + rows[:, None] * stride_rom + offs_k[None, :], hq, mask=mask & write)
            h = hq.to(tl.float32)  # normalize exactly what the next layer will read as its residual
        ss += tl.sum(h * h, axis=1)
    return tl.math.rsqrt(ss / K + eps)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, ws_ptr, wm_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_w, stride_xm, stride_xk, stride_wn, stride_sn, stride_bias, stride_om, stride_on, k_per_split,
    gate_off, res_ptr, g_ptr, res_out_ptr, stride_rm, stride_rk, stride_rom, eps, norm_offset,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATE: tl.constexpr = 0, PDL: tl.constexpr = 0, NORM: tl.constexpr = 0, NORM_BK: tl.constexpr = 16,
):
    """out[m, n] = act(sum_k x[m, k] * W[n, k] * scale[n] + bias[n]); grid (N blocks, M blocks, K splits).
    NORM (NORM_RMS, NORM_RMS_RES): x is first replaced by rms_norm(x (+ residual), gamma) (see _norm_rstd)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # clamp: loads in range, stores masked
    xrows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    k_lo = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: no tile straddles two splits
    k_hi = tl.minimum(k_lo + k_per_split, K)
    DT = x_ptr.dtype.element_ty
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # one activation row: plain 2-D tiles
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    start = k_lo
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: 1 / rms of each row, set before the first step
    if PDL != 0 or NORM != 0:
        # The weight does not depend on the kernel before this one (PDL is used only in the LLM decode
        # graphs, over static weights), so its first tile streams in while that kernel drains; x, the
        # previous kernel's output, is read only after griddepcontrol.wait. With NORM the tile's HBM
        # latency also hides behind the statistics pass over the rows (L2 reads).
        w = _load_weight_tile(w_ptr, ws_ptr, wm_ptr, rows, k_lo, K_w, stride_wn, stride_sn,
                              FORMAT, GROUP, BLOCK_N, BLOCK_K, EVEN_K, DT)  # [BN, BK]
        pdl_enter(PDL)
        if NORM != 0:
            rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, M, K, stride_xm, stride_xk, stride_rm,
                              stride_rk, stride_rom, eps, (pid_n == 0) & (pid_k == 0), NORM, BLOCK_M, NORM_BK)
        acc = _linear_step(acc, w, x_ptr, xrows, stride_xm, stride_xk, k_lo, K, gate_off,
                           EVEN_K, USE_DOT, DOT_PRECISION, BLOCK_M, BLOCK_K, GATE,
                           res_ptr, stride_rm, stride_rk, g_ptr, rstd, norm_offset, NORM)
        start = k_lo + BLOCK_K
    for k0 in tl.range(start, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        w = _load_weight_tile(w_ptr, ws_ptr, wm_ptr, rows, k0, K_w, stride_wn, stride_sn,
                              FORMAT, GROUP, BLOCK_N, BLOCK_K, EVEN_K, DT)  # [BN, BK]
        acc = _linear_step(acc, w, x_ptr, xrows, stride_xm, stride_xk, k0, K, gate_off,
                           EVEN_K, USE_DOT, DOT_PRECISION, BLOCK_M, BLOCK_K, GATE,
                           res_ptr, stride_rm, stride_rk, g_ptr, rstd, norm_offset, NORM)
    pdl_release(PDL)
    if USE_DOT:
        res = tl.trans(acc)  # [BM, BN]
    elif BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
    else:
        res = tl.sum(acc, axis=2)
    if SPLIT_K > 1:
        p_ptrs = part_ptr + pid_k.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(p_ptrs, res, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    else:
        res = _epilogue(res, offs_m, offs_n, M, N, ws_ptr, ws_ptr, bias_ptr, stride_bias, out_ptr, 0, 0,
                        0, SCALE_B, HAS_BIAS, ACTIVATION, False)
        _store(out_ptr, res, offs_m, offs_n, M, N, stride_om, stride_on)


@triton.jit
def _lop3(a, mask: tl.constexpr, bits: tl.constexpr, XOR: tl.constexpr, ASM: tl.constexpr):
    """(a & mask) ^ bits with XOR, else (a & mask) | bits, as one LOP3 (ptxas otherwise emits two: one immediate
    per instruction). LOP3's immediate is the function's truth table on (0xF0, 0xCC, 0xAA): 0x6A, 0xEA."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0x6A;" if XOR else "lop3.b32 $0, $1, $2, $3, 0xEA;",
                                         "=r,r,r,r",
                                         [a, tl.full(a.shape, mask, tl.int32), tl.full(a.shape, bits, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    if XOR:
        return (a & mask) ^ bits
    return (a & mask) | bits


@triton.jit
def _linear_words_kernel(
    x_ptr, w_ptr, ws_ptr, wm_ptr, bias_ptr, out_ptr, part_ptr,
    N, K, K_w, stride_xk, stride_wn, stride_sn, stride_bias, stride_on, k_per_split,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, LOOP_STAGES: tl.constexpr, ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """M = 1 against int8 (per-channel scale) or int4 (group scale and minimum) weights read as int32 words.

    The general kernel spends ~8 instructions per int4 weight (unpack, join, offset, scale, minimum,
    convert, FMA), which made it instruction-bound well under the memory bandwidth. Here each word's nibble
    (or byte) j is turned into an fp32 by bit operations alone: OR-ing a value v < 2^8 into the
    mantissa of 2^23 (0x4B000000) gives the float 2^23 + v, and one subtraction leaves v exactly
    (signed bytes are first offset by 128 with an XOR). It is multiplied by x[8i + j] (x[4i + j]
    for bytes). Nothing else runs per weight: the int4 scale and minimum factor out of each
    group's sum, sum_g (s_g * sum_k x_k q_k + m_g * sum_k x_k), and the int8 scale goes to the
    epilogue. w_ptr is the packed weight viewed as int32 [N, K_w / per-word]; stride_wn in words.
    """
    pdl_enter(PDL)
    PER: tl.constexpr = 8 if FORMAT == 2 else 4  # values per 32-bit word
    BW: tl.constexpr = BLOCK_K // PER  # words per row per tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_i = tl.arange(0, BW)
    if FORMAT == 2:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        offs_w = k0 // PER + offs_i
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
        if EVEN_K:
            p = tl.load(w_ptrs)
        else:
            p = tl.load(w_ptrs, mask=offs_w[None, :] < K_w // PER, other=0)
        part = tl.zeros((BLOCK_N, BW), dtype=tl.float32)
        if FORMAT == 2:
            xsum = tl.zeros((BW,), dtype=tl.float32)
        xk = k0 + offs_i * PER  # this tile's x[8i] (x[4i] for bytes): x[8i + j] is a constant offset away
        x_base = x_ptr + xk * stride_xk
        # Values are masked in place, not shifted down: OR-ing nibble jj of a 16-bit half (bits 4jj..)
        # into 2^23 gives 2^23 + q * 16^jj, exact while the bits stay below the exponent (bit 23); x is
        # pre-scaled by 16^-jj (a power of two: exact), so each weight costs one LOP3, one FADD and
        # one FFMA. The high half is shifted down once per word. Bytes: 256^jj, jj = 0, 1.
        VALS: tl.constexpr = PER // 2  # values per 16-bit half
        BITS: tl.constexpr = 32 // PER
        for h in tl.static_range(2):
            ph = p if h == 0 else p >> 16
            for jj in tl.static_range(VALS):
                j = h * VALS + jj
                if EVEN_K:
                    xj = tl.load(x_base + j * stride_xk).to(tl.float32)
                else:
                    xj = tl.load(x_base + j * stride_xk, mask=xk + j < K, other=0.0).to(tl.float32)
                step = float(1 << (BITS * jj))  # the value's weight in the word: 16^jj or 256^jj
                if FORMAT == 2:
                    xsum += xj
                    v = _lop3(ph, 0xF << (BITS * jj), 0x4B000000, XOR=False, ASM=ASM)
                    q = v.to(tl.float32, bitcast=True) - 8388608.0  # q * 16^jj
                else:  # two's-complement byte b: b ^ 0x80 = q + 128, placed as (q + 128) * 256^jj
                    v = _lop3(ph, 0xFF << (BITS * jj), 0x4B000000 | (0x80 << (BITS * jj)), XOR=True, ASM=ASM)
                    q = v.to(tl.float32, bitcast=True) - (8388608.0 + 128.0 * step)  # q * 256^jj
                part += q * (xj * (1.0 / step))
        if FORMAT == 2:
            NG: tl.constexpr = BLOCK_K // GROUP
            gs = tl.sum(tl.reshape(part, (BLOCK_N, NG, GROUP // PER)), axis=2)  # [BN, NG]
            xg = tl.sum(tl.reshape(xsum, (NG, GROUP // PER)), axis=1)  # [NG]
            offs_g = k0 // GROUP + tl.arange(0, NG)
            g_off = rows[:, None] * stride_sn + offs_g[None, :]
            if EVEN_K:
                sc = tl.load(ws_ptr + g_off).to(tl.float32)
                mn = tl.load(wm_ptr + g_off).to(tl.float32)
            else:
                gmask = offs_g[None, :] < K_w // GROUP
                sc = tl.load(ws_ptr + g_off, mask=gmask, other=0.0).to(tl.float32)
                mn = tl.load(wm_ptr + g_off, mask=gmask, other=0.0).to(tl.float32)
            acc += tl.sum(sc * gs + mn * xg[None, :], axis=1)
        else:
            acc2 += part
    pdl_release(PDL)
    if FORMAT == 2:
        res = acc[None, :]
    else:
        res = tl.sum(acc2, axis=1)[None, :]
    offs_m = tl.arange(0, 1)
    if SPLIT_K > 1:
        tl.store(part_ptr + pid_k.to(tl.int64) * N + offs_n[None, :], res, mask=offs_n[None, :] < N)
    else:
        res = _epilogue(res, offs_m, offs_n, 1, N, ws_ptr, ws_ptr, bias_ptr, stride_bias, out_ptr, 0, 0,
                        0, SCALE_B, HAS_BIAS, ACTIVATION, False)
        _store(out_ptr, res, offs_m, offs_n, 1, N, 0, stride_on)


@triton.jit
def _splitk_reduce_kernel(part_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_bias, stride_om, stride_on,
                          SPLIT_K: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          PDL: tl.constexpr = 0):
    """out = epilogue(sum over splits of part[s]); part fp32 [SPLIT_K, M, N]."""
    pdl_enter(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    pdl_release(PDL)
    acc = _epilogue(acc, offs_m, offs_n, M, N, ws_ptr, ws_ptr, bias_ptr, stride_bias, out_ptr, 0, 0,
                    0, SCALE_B, HAS_BIAS, ACTIVATION, False)
    _store(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on)


# ---- launcher ---------------------------------------------------------------------------------
def _launch(x: torch.Tensor, w: torch.Tensor, scales, mins, fmt: int, group: int | None, K_w: int,
            bias, act: int, out: torch.Tensor, config: LinearConfig | None, gate: int = 0,
            norm: _NormLaunch | None = None) -> None:
    """x [M, K] (any strides), w [N, K_w or K_w/2] unit inner stride, out [M, N]. ``gate`` (an activation
    code, dense weights only): x is [M, 2K], the product's input act(x[:, :K]) * x[:, K:]. ``norm`` (dense
    weights only): the product's input is rms_norm(x (+ residual)), the new residual written once."""
    M, K = x.shape[0], x.shape[1] // 2 if gate else x.shape[1]
    N = out.shape[1]
    if M == 0 or N == 0:
        return
    device = x.device
    scale_mode = SCALE_VECTOR if fmt not in (FMT_DENSE, FMT_INT4) else SCALE_NONE
    bias_stride = bias.stride(0) if bias is not None else 0
    sn = scales.stride(0) if fmt == FMT_INT4 else 0

    p = pdl(x)
    nc = norm.code if norm is not None else NORM_NONE
    r2 = norm.residual if norm is not None and norm.residual is not None else x  # x: an unread placeholder
    ro2 = norm.residual_out if norm is not None and norm.residual_out is not None else out
    gamma = norm.weight if norm is not None else x

    def run(cfg: LinearConfig) -> None:
        k_per_split = triton.cdiv(triton.cdiv(max(K, 1), cfg.block_k), cfg.split_k) * cfg.block_k
        splits = triton.cdiv(max(K, 1), k_per_split)
        part = torch.empty((splits, M, N), device=device, dtype=torch.float32) if splits > 1 else None
        grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), splits)
        if cfg.words:
            per = 8 if fmt == FMT_INT4 else 4
            _linear_words_kernel[grid](
                x, w.view(torch.int32), scales, mins, bias, out, part,
                N, K, K_w, x.stride(1), w.stride(0) // 4, sn, bias_stride, out.stride(1), k_per_split,
                FORMAT=fmt, GROUP=group or 1, SCALE_B=scale_mode, HAS_BIAS=bias is not None, ACTIVATION=act,
                SPLIT_K=splits,
                EVEN_K=(K % cfg.block_k == 0 and K_w == K and K_w % per == 0), LOOP_STAGES=cfg.num_stages,
                ASM=not INTERPRET,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=p, launch_pdl=p > 0,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        else:
            _linear_kernel[grid](
                x, w, scales, mins, bias, out, part,
                M, N, K, K_w, x.stride(0), x.stride(1), w.stride(0), sn, bias_stride, out.stride(0), out.stride(1),
                k_per_split, K * x.stride(1), r2, gamma, ro2, r2.stride(0), r2.stride(1), ro2.stride(0),
                float(norm.eps) if norm is not None else 0.0, float(norm.offset) if norm is not None else 0.0,
                FORMAT=fmt, GROUP=group or 1, SCALE_B=scale_mode, HAS_BIAS=bias is not None, ACTIVATION=act,
                SPLIT_K=splits, EVEN_K=(K > 0 and K % cfg.block_k == 0 and K_w == K), USE_DOT=cfg.use_dot,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", LOOP_STAGES=cfg.num_stages,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATE=gate, PDL=p, launch_pdl=p > 0,
                NORM=nc, NORM_BK=_norm_block_k(cfg, K), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        if splits > 1:
            rbm, rbn = min(16, pow2_bucket(M)), 128
            _splitk_reduce_kernel[(triton.cdiv(N, rbn), triton.cdiv(M, rbm))](
                part, scales, bias, out, M, N, bias_stride, out.stride(0), out.stride(1),
                SPLIT_K=splits, SCALE_B=scale_mode, HAS_BIAS=bias is not None, ACTIVATION=act,
                BLOCK_M=rbm, BLOCK_N=rbn, PDL=p, launch_pdl=p > 0, num_warps=4)

    words = words_ok(fmt, w, K_w) and not gate and not nc
    if config is None:
        if INTERPRET:
            config = _interpret_config(M, group, words)
        else:
            bm = _m_class(M)
            bucket = (fmt, group, str(x.dtype), pow2_bucket(M), pow2_bucket(N, 16, 1 << 18),
                      pow2_bucket(K, 16, 1 << 18))
            bucket += (("gate", gate),) if gate else ()  # twice the x loads: tuned apart
            bucket += (("norm", nc),) if nc else ()  # a statistics pass and two more loads per tile: apart too
            x_bytes = x.element_size()
            config = TUNERS[bm].choose(bucket, device, run,
                                       valid=lambda c: _fits(c, group, words, gate, x_bytes, norm=nc))
    elif group is not None and config.block_k % group:
        raise ValueError(f"config: block_k {config.block_k} must be a multiple of the quantization group {group}")
    elif config.words and not (words and M == 1):
        raise ValueError("config: words=True serves one row (M == 1) of int8 weights with K % 4 == 0 or int4 "
                         f"weights; got M={M} and a {FORMAT_NAMES[fmt]} weight with K={K}")
    run(config)


def _check_linear_args(x, N, bias, activation, out, weight_tensors) -> int:
    M = x.shape[0]
    act = activation_code(activation)
    check_epilogue_operands(M, N, x.device, bias, None, out, x.dtype, weight_tensors + (x,))
    return act


def gemv(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32, any strides (M <= 64 is the case this is built for)
    weight: torch.Tensor,  # [N, K] same dtype, unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    *,
    activation: str | None = None,
    out: torch.Tensor | None = None,  # [M, N] of x.dtype
    config: LinearConfig | None = None,  # fixed launch config (skips autotuning; for sweeps)
    gated_input: str | None = None,  # "silu" | "gelu" | "gelu_tanh": x is [M, 2K] (gate | up), see below
    norm: InputNorm | None = None,  # the product's input is rms_norm(x (+ residual)), see below
    residual: torch.Tensor | None = None,  # [M, K] of x.dtype, any strides (with norm)
    residual_out: torch.Tensor | None = None,  # [M, K] contiguous: where x + residual goes (with residual)
):  # -> [M, N]; with residual: ([M, N], new residual [M, K])
    """``activation(x @ weight.T + bias)`` by streaming the weight once (split-K when N is small).

    ``gated_input``: x is a gated MLP's [M, 2K] gate|up projection and the product's input is
    ``act(x[:, :K]) * x[:, K:]`` rounded to x's dtype, exactly what ``silu_and_mul`` / ``gelu_and_mul``
    would store, computed as each x tile is loaded (one kernel and one round trip fewer).

    ``norm``: the product's input is ``rms_norm(x, norm.weight, norm.eps, residual=residual,
    weight_offset=norm.offset)``'s output, computed in the x loads: every program first takes the full
    rows' mean of squares (fp32, h = x + residual rounded to x's dtype, as rms_norm stores it), then feeds
    ``h * rsqrt(ms + eps) * (weight + offset)`` rounded to x's dtype into the dot; with ``residual`` one
    program per row block writes h to ``residual_out`` (allocated when None; it must not share memory
    with x or residual) and the call returns ``(out, residual_out)``, as rms_norm returns its pair.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    gate = _gate_code(gated_input)
    _check_norm(norm, x, residual, residual_out, out, gated_input)
    k_x = x.shape[1] // 2 if gate else x.shape[1]
    if gate and x.shape[1] % 2:
        raise ValueError(f"x: gated_input={gated_input!r} needs an even last dimension [M, 2K], got {tuple(x.shape)}")
    if weight.shape[1] != k_x:
        raise ValueError(f"weight: expected shape (N, {k_x}) to match x {tuple(x.shape)}"
                         f"{' (gate | up halves)' if gate else ''}, got {tuple(weight.shape)}")
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        raise ValueError(f"weight: expected unit stride along K (rows contiguous), got strides {weight.stride()}; "
                         "pass weight.contiguous()")
    if config is not None and not isinstance(config, LinearConfig):
        raise ValueError(f"config: expected a LinearConfig, got {type(config).__name__}")
    N = weight.shape[0]
    act = _check_linear_args(x, N, bias, activation, out, (weight,))
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if not use_triton(x, weight, bias, out, residual, residual_out, norm.weight if norm is not None else None):
        xin = _gated_reference(x, gated_input) if gate else x
        if norm is not None:  # the unfused pair's reference: the same values the fused kernel feeds the dot
            xin = rms_norm(x, norm.weight, norm.eps, residual=residual, weight_offset=norm.offset,
                           residual_out=residual_out)
            xin = xin[0] if residual is not None else xin
        ref = reference.linear_ref(xin, weight, bias, activation, x.dtype)
        y = out.copy_(ref) if out is not None else ref
        return (y, residual_out) if residual is not None else y
    refuse_interpreted_bf16("gemv", x, weight)
    if out is None:
        out = torch.empty((x.shape[0], N), device=x.device, dtype=x.dtype)
    nl = None
    if norm is not None:
        nl = _NormLaunch(NORM_RMS_RES if residual is not None else NORM_RMS, norm.weight, float(norm.eps),
                         float(norm.offset), residual, residual_out)
    _launch(x, weight, None, None, FMT_DENSE, None, k_x, bias, act, out, config, gate=gate, norm=nl)
    return (out, residual_out) if residual is not None else out


def _check_norm(norm, x: torch.Tensor, residual, residual_out, out, gated_input) -> None:
    """norm an InputNorm with a [K] weight (K = x.shape[-1]); residual like x; residual_out like x, contiguous,
    sharing memory with neither x nor residual (other programs still read them while one writes it)."""
    if norm is None:
        if residual is not None:
            raise ValueError("residual: only meaningful with norm= (the input RMSNorm's residual add)")
        if residual_out is not None:
            raise ValueError("residual_out: only meaningful with norm= and residual=")
        return
    if not isinstance(norm, InputNorm):
        raise ValueError(f"norm: expected an InputNorm(weight, eps, offset), got {type(norm).__name__}")
    if gated_input is not None:
        raise ValueError(f"norm: cannot be combined with gated_input={gated_input!r} (the gated input of a down "
                         "projection is not normalized)")
    K, g = x.shape[-1], norm.weight
    if K == 0:
        raise ValueError(f"norm: x rows must be at least 1 wide to normalize, got shape {tuple(x.shape)}")
    if g.dim() != 1 or g.shape[0] != K:
        raise ValueError(f"norm: weight must have shape [{K}] (x's last dimension), got {tuple(g.shape)}")
    if g.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"norm: weight must be float32 or x's dtype ({str(x.dtype).replace('torch.', '')}), "
                         f"got {str(g.dtype).replace('torch.', '')}")
    if g.device != x.device:
        raise ValueError(f"norm: weight must be on {x.device} like x, got {g.device}")
    if g.stride(0) != 1 and K > 1:
        raise ValueError(f"norm: weight must be contiguous, got stride {g.stride(0)}")
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out: only meaningful with residual=")
        return
    check_tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape), device=x.device)
    if residual_out is not None:
        check_tensor("residual_out", residual_out, dtypes=(x.dtype,), shape=tuple(x.shape), device=x.device)
        if not residual_out.is_contiguous():
            raise ValueError(f"residual_out: expected a contiguous tensor, got strides {residual_out.stride()}")
        if _shares_storage(residual_out, x) or _shares_storage(residual_out, residual):
            raise ValueError("residual_out: must not share memory with x or residual (every program of the fused "
                             "GEMV reads the whole rows while one of them writes the sum)")
    if out is not None and any(_shares_storage(out, t) for t in (residual, residual_out) if t is not None):
        raise ValueError("out: must not share memory with residual or residual_out")


GATED_INPUTS = ("silu", "gelu", "gelu_tanh")


def _gate_code(gated_input: str | None) -> int:
    if gated_input is None:
        return 0
    if gated_input not in GATED_INPUTS:
        raise ValueError(f"gated_input: expected None or one of {GATED_INPUTS}, got {gated_input!r}")
    return ACTIVATIONS[gated_input]


def _gated_reference(x: torch.Tensor, gated_input: str) -> torch.Tensor:
    """act(x[..., :K]) * x[..., K:] in x's dtype, as the gated kernels store it."""
    if gated_input == "silu":
        return reference.silu_and_mul_reference(x).to(x.dtype)
    return reference.gelu_and_mul_reference(x, approximate="tanh" if gated_input == "gelu_tanh" else "none").to(x.dtype)


def _quantized(x: torch.Tensor, qw: QuantizedWeight, bias, activation, out, config) -> torch.Tensor:
    N, K = qw.shape
    if qw.device != x.device:
        raise ValueError(f"weight: expected a QuantizedWeight on {x.device} (the device of x), got {qw.device}")
    act = _check_linear_args(x, N, bias, activation, out, (qw.data,))
    if not use_triton(x, qw.data, bias, out):
        ref = reference.linear_ref(x, qw.dequantize(), bias, activation, x.dtype)
        return out.copy_(ref) if out is not None else ref
    refuse_interpreted_bf16("linear", x)
    if out is None:
        out = torch.empty((x.shape[0], N), device=x.device, dtype=x.dtype)
    data = qw.data.view(torch.uint8) if qw.format == FMT_FP8 else qw.data  # see _load_weight_tile
    _launch(x, data, qw.scales, qw.mins, qw.format, qw.group, qw.k_stored, bias, act, out, config)
    return out


def linear(
    x: torch.Tensor,  # [..., K] fp16/bf16/fp32
    weight: torch.Tensor | QuantizedWeight,  # [N, K] like nn.Linear.weight, or quantize_weight(...) of one
    bias: torch.Tensor | None = None,  # [N]
    *,
    activation: str | None = None,  # None | "relu" | "gelu" | "gelu_tanh" | "silu"
    out: torch.Tensor | None = None,  # [..., N] of x.dtype, contiguous (e.g. a CUDA-graph buffer)
    config: LinearConfig | None = None,  # fixed config for the streaming kernel (not used by the matmul path)
    gated_input: str | None = None,  # "silu" | "gelu" | "gelu_tanh": x is [..., 2K] gate | up (see gemv)
    norm: InputNorm | None = None,  # RMSNorm of the input (see gemv)
    residual: torch.Tensor | None = None,  # [..., K] like x (with norm): normalize x + residual
    residual_out: torch.Tensor | None = None,  # [..., K] contiguous, the new residual x + residual
):  # -> [..., N] in x.dtype; with residual: ([..., N], new residual [..., K])
    """``activation(x @ weight.T + bias)``, choosing the weight-streaming kernel or the GEMM by shape.
    With ``gated_input`` the input is ``act(x[..., :K]) * x[..., K:]``: fused into the weight-streaming
    kernel's loads for dense weights at GEMV sizes, a separate silu_and_mul / gelu_and_mul otherwise.
    With ``norm`` the input is ``rms_norm(x (+ residual))`` and, with ``residual``, the call returns
    ``(out, new_residual)``: fused likewise for dense weights at GEMV sizes, a separate rms_norm otherwise."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension [..., K], got a scalar")
    _check_norm(norm, x, residual, residual_out, out, gated_input)
    rows = x.numel() // max(1, x.shape[-1])
    fusable = not isinstance(weight, QuantizedWeight) and (rows <= GEMV_MAX_M or config is not None)
    if norm is not None and not fusable:
        from warpforge.kernels.norm import rms_norm

        normed = rms_norm(x, norm.weight, norm.eps, residual=residual, weight_offset=norm.offset,
                          residual_out=residual_out)
        if residual is None:
            return linear(normed, weight, bias, activation=activation, out=out, config=config)
        return linear(normed[0], weight, bias, activation=activation, out=out, config=config), normed[1]
    gate = _gate_code(gated_input)
    if gate:
        if x.shape[-1] % 2:
            raise ValueError(f"x: gated_input={gated_input!r} needs an even last dimension [..., 2K], "
                             f"got {tuple(x.shape)}")
        if not fusable:
            from warpforge.kernels.activation import gelu_and_mul, silu_and_mul

            x = silu_and_mul(x) if gated_input == "silu" else gelu_and_mul(
                x, approximate="tanh" if gated_input == "gelu_tanh" else "none")
            gated_input = None
    if isinstance(weight, QuantizedWeight):
        N, K = weight.shape
    else:
        check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
        N, K = weight.shape
    k_x = 2 * K if gated_input else K
    if x.shape[-1] != k_x:
        raise ValueError(f"x: expected last dimension {k_x} to match weight {tuple((N, K))}"
                         f"{' (gate | up halves)' if gated_input else ''}, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_x)  # [M, K] (or [M, 2K] gated): a view when it can be
    out2 = None
    if out is not None:
        check_tensor("out", out, dtypes=(x.dtype,), shape=(*lead, N), device=x.device)
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, got strides {out.stride()}")
        out2 = out.view(-1, N)
    if norm is not None:  # fused: dense weight, GEMV rows
        if residual is not None and residual_out is None:
            residual_out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        y = gemv(x2, weight, bias, activation=activation, out=out2, config=config, norm=norm,
                 residual=residual.reshape(-1, K) if residual is not None else None,
                 residual_out=residual_out.view(-1, K) if residual is not None else None)
        if residual is None:
            return out if out is not None else y.reshape(*lead, N)
        return (out if out is not None else y[0].reshape(*lead, N)), residual_out
    if isinstance(weight, QuantizedWeight):
        y = _quantized(x2, weight, bias, activation, out2, config)
    elif x2.shape[0] <= GEMV_MAX_M or config is not None:
        y = gemv(x2, weight, bias, activation=activation, out=out2, config=config, gated_input=gated_input)
    else:
        y = matmul(x2, weight.t(), bias=bias, activation=activation, out=out2)
    return out if out is not None else y.reshape(*lead, N)
