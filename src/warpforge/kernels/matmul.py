"""Matrix multiply with a fused epilogue: ``out = activation(a @ b + bias) + residual``.

Two kernels share one epilogue:

* ``_matmul_tma_kernel`` (Hopper path): a persistent grid of one program per SM walks the output
  tiles in grouped order (GROUP_M row-tiles share a column of B while it sits in L2); operands
  arrive through TMA tensor descriptors built on the host, so any layout with a unit inner stride
  and 16-byte aligned outer stride is served without a copy (``a`` or ``a.T`` contiguous, ``b`` or
  ``b.T`` contiguous). Warp specialization and loop flattening are config knobs.
* ``_matmul_ptr_kernel``: a plain tiled kernel on pointers for every other stride pattern (and the
  fallback when a TMA config cannot be used).

The epilogue (per-row/column scales for fp8, bias, activation, residual, cast) runs in registers
on the fp32 accumulator before the single store. ``matmul_fp8`` (kernels/matmul_fp8.py) launches
the same kernels with e4m3 operands and scales; ``matmul_int8`` (kernels/matmul_int8.py) with int8
operands, an int32 accumulator (constexpr INT_ACC) converted to fp32 before the epilogue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from warpforge.kernels import _dispatch  # noqa: F401  (selects the interpreter before any @jit)
from warpforge.kernels import reference
from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels._checks import check_num_warps, check_pow2, check_range, refuse_interpreted_bf16
from warpforge.kernels._dispatch import INTERPRET, use_triton

import triton  # noqa: E402  (after _dispatch)
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

ACTIVATIONS: dict[str | None, int] = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR = 0, 1, 2  # epilogue scale modes (fp8 and per-channel weights)


# ---- config -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulConfig:
    """One launch configuration of the matmul kernels (a point of the autotuning sweep)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # row-tiles per group in the grouped tile order (L2 reuse of B)
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True  # persistent TMA kernel; False: pointer kernel
    warp_specialize: bool = False  # TMA kernel only: producer/consumer warp groups; disabled (it hung, Triton 3.6)
    flatten: bool = False  # TMA kernel only: flatten tile and K loops into one pipelined loop
    epilogue_subtile: bool = False  # TMA kernel only: store C in two halves (less shared memory)

    def __post_init__(self) -> None:
        check_pow2(self, "block_m", "block_n", "block_k", lo=16, hi=256)
        check_pow2(self, "group_m", hi=64)
        check_num_warps(self)
        check_range(self, "num_stages", 1, 8)
        if not self.tma and (self.warp_specialize or self.flatten or self.epilogue_subtile):
            raise ValueError("MatmulConfig: warp_specialize/flatten/epilogue_subtile need tma=True")
        if self.warp_specialize:
            raise ValueError("MatmulConfig.warp_specialize: the warp-specialized persistent kernel hangs with "
                             "triton 3.6.0 on Hopper (see _tma_configs); it is disabled")
        if self.epilogue_subtile and self.block_n < 32:
            raise ValueError("MatmulConfig.epilogue_subtile needs block_n >= 32")


SMEM_BUDGET = 232448 - 16384  # sm_90's 227 KB per block, less room for barriers and layout scratch


def fit_shared_memory(cfg: MatmulConfig, itemsize: int, out_itemsize: int) -> MatmulConfig:
    """The candidates are sized for 16-bit operands; 4-byte (fp32) operands would need twice the
    shared memory (a default config would ask for ~1.4x sm_90's 232,448 B). Drop pipeline stages
    (to 2), then halve block_k (to 16), until the estimate fits. 16-bit and fp8 candidates are left
    as they are: each was compiled for sm_90 and fits (tests/kernels/sm90_compile.py)."""
    if itemsize <= 2:
        return cfg

    def est(c: MatmulConfig) -> int:
        ring = c.num_stages * (c.block_m + c.block_n) * c.block_k * itemsize
        c_tile = c.block_m * (c.block_n // 2 if c.epilogue_subtile else c.block_n) * out_itemsize if c.tma else 0
        return ring + c_tile

    while est(cfg) > SMEM_BUDGET and cfg.num_stages > 2:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    while est(cfg) > SMEM_BUDGET and cfg.block_k > 16:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def _tma_configs(bk: int) -> list[MatmulConfig]:
    """Hopper starting points; offline sm_90 compiles (bf16, bias+gelu epilogue) fit 227 KB of shared
    memory without spills, except the plain 128x256 one, which spills ~130 B with a heavy epilogue.

    8 warps = two consumer warp groups sharing one 128-row tile. Warp specialization in Triton 3.6
    engages on Hopper only with num_warps=4 (it adds a producer group and splits the tile between two
    consumer groups: 12 warps in all); with 8 warps it is silently ignored.
    """
    return [
        MatmulConfig(128, 256, bk, 8, 8, 3, epilogue_subtile=True),  # default: no spills with any epilogue
        MatmulConfig(128, 256, bk, 8, 8, 3),
        MatmulConfig(128, 256, bk, 8, 8, 4, epilogue_subtile=True),
        # No flatten=True candidate: (128, 256, 64, 8 warps, 3 stages, flatten, subtile) gave wrong
        # results on sm_90 with triton 3.6 (test_matmul_every_candidate_gpu) while the same tile
        # unflattened is right. The knob stays for sweeps; it is not tuned over.
        # No warp_specialize=True candidate either: (128, 256 | 128, 64, 4 warps) deadlocked in the
        # persistent kernel's specialized outer loop on sm_90 with triton 3.6. Rejected in __post_init__.
        MatmulConfig(128, 128, bk, 8, 8, 4),
        MatmulConfig(64, 128, bk, 8, 4, 4),  # small problems: more tiles than SMs
    ]


def _ptr_configs(bk: int) -> list[MatmulConfig]:
    """Pointer kernel: every A/B element address is a 64-bit register, so tiles stay smaller than TMA's."""
    return [
        MatmulConfig(128, 128, bk, 8, 8, 3, tma=False),
        MatmulConfig(128, 128, bk // 2, 8, 8, 4, tma=False),
        MatmulConfig(64, 128, bk, 8, 8, 3, tma=False),
        MatmulConfig(64, 64, bk, 8, 4, 4, tma=False),
    ]


MATMUL_CONFIGS = _tma_configs(64) + _ptr_configs(64)
TUNER = Tuner("matmul", MATMUL_CONFIGS, MatmulConfig)
# The interpreter cannot tune (and is slow): small blocks, a few programs so the persistent loop runs.
INTERPRET_CONFIG = MatmulConfig(32, 32, 32, 2, 4, 1)
INTERPRET_NUM_SMS = 3


# ---- device code ------------------------------------------------------------------------------
@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """x: fp32 tile. 1 relu, 2 gelu (erf), 3 gelu (tanh approximation), 4 silu."""
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == 3:
        # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): one exp, no overflow for large |x|.
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACTIVATION == 4:
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias, res_ptr, stride_rm, stride_rn,
              SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
              HAS_RES: tl.constexpr):
    """acc: fp32 [BM, BN] at rows offs_m, columns offs_n -> activation(acc * sa * sb + bias) + residual (fp32)."""
    if SCALE_A == 1:
        acc = acc * tl.load(sa_ptr).to(tl.float32)
    elif SCALE_A == 2:
        acc = acc * tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(sb_ptr).to(tl.float32)
    elif SCALE_B == 2:
        acc = acc * tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    acc = _activation(acc, ACTIVATION)
    if HAS_RES:
        r_ptrs = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :] * stride_rn
        r_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        acc = acc + tl.load(r_ptrs, mask=r_mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn):
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: consecutive tiles walk GROUP_M rows of tiles down one column, so B is reused from L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    r = tile_id % in_group
    return first_m + r % group_rows, r // group_rows


@triton.jit
def _finish_tile(acc, off_m, off_n, c_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
                 M, N, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
                 C_TMA: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACTIVATION: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    offs_m = off_m + tl.arange(0, BM)
    offs_n = off_n + tl.arange(0, BN)
    acc = _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias, res_ptr, stride_rm, stride_rn,
                    SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, HAS_RES)
    if C_TMA:
        c_desc.store([off_m, off_n], acc.to(c_ptr.dtype.element_ty))  # TMA clips the ragged edge
    else:
        _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
    M, N, K, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
    A_KMAJOR: tl.constexpr,  # True: a_desc is over a [M, K]; False: over a.T [K, M]
    B_KMAJOR: tl.constexpr,  # True: b_desc is over b.T [N, K]; False: over b [K, N]
    C_TMA: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_RES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    INT_ACC: tl.constexpr = False,  # int8 operands: exact int32 accumulator, converted to fp32 for the epilogue
):
    """Persistent: program p computes tiles p, p + NUM_SMS, ... of the [M, N] output."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if INT_ACC:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K  # out-of-range rows/columns arrive as zeros (TMA padding)
            if A_KMAJOR:
                a = a_desc.load([off_m, off_k])  # [BM, BK]
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T  # [BK, BN]
            else:
                b = b_desc.load([off_k, off_n])
            if INT_ACC:
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if INT_ACC:
            acc = acc.to(tl.float32)
        if EPILOGUE_SUBTILE:
            # Two [BM, BN/2] halves: the C staging buffer is half the size, leaving room for a stage.
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            _finish_tile(acc0, off_m, off_n, c_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
                         M, N, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
                         C_TMA, SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, HAS_RES, BLOCK_M, BLOCK_N // 2)
            _finish_tile(acc1, off_m, off_n + BLOCK_N // 2, c_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
                         M, N, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
                         C_TMA, SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, HAS_RES, BLOCK_M, BLOCK_N // 2)
        else:
            _finish_tile(acc, off_m, off_n, c_desc, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
                         M, N, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
                         C_TMA, SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, HAS_RES, BLOCK_M, BLOCK_N)


@triton.jit
def _matmul_ptr_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, res_ptr,
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias, stride_rm, stride_rn,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_RES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INT_ACC: tl.constexpr = False,  # int8 operands: exact int32 accumulator, converted to fp32 for the epilogue
):
    """One program per [BLOCK_M, BLOCK_N] output tile; any strides."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp rows/columns past the edge onto row 0: loads stay in bounds without an M/N mask.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn  # [BK, BN]
    if INT_ACC:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if INT_ACC:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if INT_ACC:
        acc = acc.to(tl.float32)
    acc = _epilogue(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, bias_ptr, stride_bias, res_ptr, stride_rm, stride_rn,
                    SCALE_A, SCALE_B, HAS_BIAS, ACTIVATION, HAS_RES)
    _store(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


# ---- validation helpers (shared by matmul_fp8, gemv, quant_linear) ------------------------------
def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=None, ndim: int | None = None, shape: tuple | None = None,
                 device: torch.device | None = None) -> None:
    """Raise ValueError naming ``name`` when ``t`` is not a tensor of the expected kind."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the first operand), got {t.device}")


def activation_code(activation: str | None) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected {_dtype_names(FLOAT_DTYPES)}, got {out_dtype}")


def _shares_storage(x: torch.Tensor, y: torch.Tensor | None) -> bool:
    return y is not None and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def check_epilogue_operands(M: int, N: int, device, bias, residual, out, out_dtype, inputs) -> None:
    """bias [N], residual [M, N] (any strides), out [M, N] of out_dtype not aliasing the inputs."""
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(N,), device=device)
    if residual is not None:
        check_tensor("residual", residual, dtypes=FLOAT_DTYPES, shape=(M, N), device=device)
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,), shape=(M, N), device=device)
        if any(_shares_storage(out, t) for t in inputs):
            raise ValueError("out: must not share memory with the matrix operands (residual may be out itself)")


# ---- launcher ---------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_arch_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return INTERPRET  # the interpreter emulates descriptors
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_layout(t: torch.Tensor) -> str | None:
    """'row' if ``t`` [R, C] is row-major enough for a TMA descriptor, 'col' if ``t.T`` is, else None.

    TMA needs a unit inner stride, a 16-byte aligned outer stride and base address.
    """
    if t.dim() != 2 or t.numel() == 0 or t.data_ptr() % 16:
        return None
    es = t.element_size()
    (r, c), (s0, s1) = t.shape, t.stride()
    if s1 == 1 and (r == 1 or (s0 * es % 16 == 0 and s0 >= c)):
        return "row"
    if s0 == 1 and (c == 1 or (s1 * es % 16 == 0 and s1 >= r)):
        return "col"
    return None


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Descriptor over a row-major view ``t`` [R, C]; a single row gets a padded (unused) row stride."""
    es = t.element_size()
    s0 = t.stride(0) if t.shape[0] > 1 else -(-t.shape[1] * es // 16) * 16 // es
    return TensorDescriptor(t, list(t.shape), [s0, 1], block)


def launch_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, scale_a=None, scale_b=None,
                scale_a_mode: int = SCALE_NONE, scale_b_mode: int = SCALE_NONE, bias=None, activation: int = 0,
                residual=None, config: MatmulConfig | None = None, tuner: Tuner = TUNER,
                interpret_config: MatmulConfig = INTERPRET_CONFIG) -> None:
    """Validated operands in, ``out`` [M, N] written. a [M, K], b [K, N]; scales contiguous."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return
    device = a.device
    a_layout, b_layout = tma_layout(a), tma_layout(b)
    tma_ok = _tma_arch_ok(device) and K > 0 and a_layout is not None and b_layout is not None
    c_tma_ok = tma_layout(out) == "row" and out.stride(1) == 1
    dot_precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 inputs: exact, as torch.matmul
    sms = INTERPRET_NUM_SMS if device.type != "cuda" else num_sms(device)
    common = dict(SCALE_A=scale_a_mode, SCALE_B=scale_b_mode, HAS_BIAS=bias is not None, ACTIVATION=activation,
                  HAS_RES=residual is not None, DOT_PRECISION=dot_precision, INT_ACC=a.dtype == torch.int8)
    bias_stride = bias.stride(0) if bias is not None else 0
    rs = residual.stride() if residual is not None else (0, 0)

    def run(cfg: MatmulConfig, out: torch.Tensor = out) -> None:
        cfg = fit_shared_memory(cfg, a.element_size(), out.element_size())
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
        if cfg.tma:
            a_desc = (_descriptor(a, [cfg.block_m, cfg.block_k]) if a_layout == "row"
                      else _descriptor(a.t(), [cfg.block_k, cfg.block_m]))
            b_desc = (_descriptor(b.t(), [cfg.block_n, cfg.block_k]) if b_layout == "col"
                      else _descriptor(b, [cfg.block_k, cfg.block_n]))
            c_block_n = cfg.block_n // 2 if cfg.epilogue_subtile else cfg.block_n
            # fp32 inputs take the exact FMA dot: no tensor-core pipeline to specialize (Triton 3.6 fails to).
            ws = cfg.warp_specialize and a.dtype != torch.float32
            # Triton 3.6's Hopper warp specialization splits the tile between two consumer warp groups
            # and then rejects a full-tile TMA store: warp-specialized configs store through pointers.
            c_tma = c_tma_ok and not ws
            c_desc = _descriptor(out, [cfg.block_m, c_block_n]) if c_tma else None
            tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
            _matmul_tma_kernel[(min(sms, tiles),)](
                a_desc, b_desc, c_desc, out, scale_a, scale_b, bias, residual,
                M, N, K, out.stride(0), out.stride(1), bias_stride, rs[0], rs[1],
                A_KMAJOR=a_layout == "row", B_KMAJOR=b_layout == "col", C_TMA=c_tma, NUM_SMS=sms,
                WARP_SPECIALIZE=ws, FLATTEN=cfg.flatten, EPILOGUE_SUBTILE=cfg.epilogue_subtile,
                **meta)
        else:
            grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
            _matmul_ptr_kernel[grid](
                a, b, out, scale_a, scale_b, bias, residual,
                M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                bias_stride, rs[0], rs[1], **meta)

    if config is None:
        if INTERPRET:
            config = dataclasses.replace(interpret_config, tma=tma_ok)
        else:
            bucket = (str(a.dtype), str(out.dtype), a_layout, b_layout, c_tma_ok,
                      pow2_bucket(M, 16, 16384), pow2_bucket(N, 16, 16384), pow2_bucket(K, 16, 16384))
            # Tuning runs the kernel many times: an in-place residual (out is residual) would pile up.
            scratch = torch.empty_like(out) if _shares_storage(out, residual) else out
            config = tuner.choose(bucket, device, lambda c: run(c, scratch), valid=lambda c: c.tma == tma_ok)
    elif config.tma and not tma_ok:
        raise ValueError("config: tma=True needs sm_90+ and operands whose inner stride is 1 with 16-byte aligned "
                         f"outer stride and base (a strides {a.stride()}, b strides {b.stride()})")
    run(config)


def matmul(
    a: torch.Tensor,  # [M, K] fp16/bf16 (fp32 accepted), any strides
    b: torch.Tensor,  # [K, N] same dtype, any strides (b = w.T of a [N, K] weight is the TMA fast path too)
    *,
    bias: torch.Tensor | None = None,  # [N]
    activation: str | None = None,  # None | "relu" | "gelu" | "gelu_tanh" | "silu"
    residual: torch.Tensor | None = None,  # [M, N], added after the activation
    out_dtype: torch.dtype | None = None,  # default: a.dtype (out.dtype when out is given)
    out: torch.Tensor | None = None,  # [M, N] preallocated output, any strides
    config: MatmulConfig | None = None,  # fixed launch config (skips autotuning; for sweeps)
) -> torch.Tensor:  # [M, N]
    """``activation(a @ b + bias) + residual`` with fp32 accumulation, one kernel, epilogue in registers."""
    check_tensor("a", a, dtypes=FLOAT_DTYPES, ndim=2)
    device = a.device
    check_tensor("b", b, dtypes=(a.dtype,), ndim=2, device=device)
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b: expected shape ({a.shape[1]}, N) to match a {tuple(a.shape)}, got {tuple(b.shape)}")
    M, N = a.shape[0], b.shape[1]
    act = activation_code(activation)
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else a.dtype
    check_out_dtype(out_dtype)
    check_epilogue_operands(M, N, device, bias, residual, out, out_dtype, (a, b))
    if config is not None and not isinstance(config, MatmulConfig):
        raise ValueError(f"config: expected a MatmulConfig, got {type(config).__name__}")

    if not use_triton(a, b, bias, residual, out):
        ref = reference.matmul_ref(a, b, bias, activation, residual, out_dtype)
        return out.copy_(ref) if out is not None else ref
    refuse_interpreted_bf16("matmul", a, b)
    if out is None:
        out = torch.empty((M, N), device=device, dtype=out_dtype)
    launch_gemm(a, b, out, bias=bias, activation=act, residual=residual, config=config)
    return out
