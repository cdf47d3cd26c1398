"""Matmul-family cases of the ``kernels`` suite (suites/kernels.py concatenates them).

Rows (H200, full run), each against its peer in the same run:

* bf16 matmul 8192^3 and 4096^3 vs cuBLAS (torch.matmul): TFLOP/s from 2*M*N*K.
* bf16 matmul + bias + gelu at 8192^3 and the MLP shape 16384x14336x4096 vs cuBLAS then the torch
  epilogue (``gelu(a @ b + bias)``) and torch.compile of that function in its fastest mode (max-autotune).
* fp8 e4m3 matmul 8192^3, per-tensor and per-row/column scales, vs torch._scaled_mm.
* decode linear M = 1, 16, 64; K = 4096, N = 14336, bf16 weights vs cuBLAS (F.linear).
* weight-only int8 / int4 g128 / fp8 linear, same shapes, vs cuBLAS bf16 on the dequantized weight
  (so both sides compute the same product and pass the same check).

Decode cases report GB/s with ``bytes`` = every byte the kernel must move (weight incl. scales and
group minimums, x, out); ``params["weight_bytes"]`` is the weight part alone, so the issue's "weight
bandwidth" is weight_bytes / time (at M=1 the two differ by < 0.1%). They are timed by CUDA-graph
replay: a 30 us kernel would otherwise measure Python launch overhead.

On a machine without a GPU the kernels run their torch references (docs/design.md, "Dispatch") at tiny
fp32 sizes so the suite still builds and checks in seconds; fp8 cases need a GPU and are omitted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from warpforge.bench.suite import Case
from warpforge.kernels import reference
from warpforge.kernels.gemv import linear
from warpforge.kernels.matmul import matmul
from warpforge.kernels.matmul_fp8 import matmul_fp8
from warpforge.kernels.quant_linear import quantize_weight
from warpforge.kernels.tolerance import tolerance

F8 = torch.float8_e4m3fn


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nan(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)  # poison: unwritten elements fail


def _randn(shape, gen, device, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _compiled(fn: Callable, gpu: bool) -> dict[str, Callable]:
    # torch.compile's fastest mode for a GEMM: max-autotune benchmarks its Triton GEMM templates (the
    # epilogue fused in) against cuBLAS + a fused epilogue kernel and keeps the faster; the default mode
    # never tries the templates. "-no-cudagraphs": the harness decides about CUDA graphs for every side alike.
    # Built lazily on the first (untimed, checked) call; if inductor cannot build, the runner records the
    # peer's error and the case goes on.
    return {"torch.compile max-autotune": torch.compile(fn, mode="max-autotune-no-cudagraphs")} if gpu else {}


# ---- bf16 GEMM --------------------------------------------------------------------------------
def _matmul_case(M: int, N: int, K: int, dtype: torch.dtype, peer: str, b_transposed: bool = False) -> Case:
    def make(gen, device):
        a = _randn((M, K), gen, device, dtype)
        b = _randn((N, K), gen, device, dtype).t() if b_transposed else _randn((K, N), gen, device, dtype)
        return a, b, _nan((M, N), dtype, device)

    layout = " b=w.T" if b_transposed else ""
    return Case(
        name=f"{_dname(dtype)} matmul M{M} N{N} K{K}{layout}",
        params={"op": "matmul", "M": M, "N": N, "K": K, "dtype": _dname(dtype), "b_layout": "col" if b_transposed
                else "row"},
        make_inputs=make,
        ours=lambda a, b, out: matmul(a, b, out=out),
        peers={peer: lambda a, b, out: torch.matmul(a, b, out=out)},
        reference=lambda a, b, out: reference.matmul_ref(a, b),  # fp32 (ieee on CUDA): far inside bf16's 1e-2
        flops=2.0 * M * N * K, bytes=float(dtype.itemsize * (M * K + K * N + M * N)), dtype=dtype, metric="tflops")


def _epilogue_case(M: int, N: int, K: int, dtype: torch.dtype, peer: str, gpu: bool) -> Case:
    def make(gen, device):
        a, b = _randn((M, K), gen, device, dtype), _randn((K, N), gen, device, dtype)
        return a, b, _randn((N,), gen, device, dtype), _nan((M, N), dtype, device)

    def eager(a, b, bias, out):
        return F.gelu(a @ b + bias)

    return Case(
        name=f"{_dname(dtype)} matmul+bias+gelu M{M} N{N} K{K}",
        params={"op": "matmul_bias_gelu", "M": M, "N": N, "K": K, "dtype": _dname(dtype)},
        make_inputs=make,
        ours=lambda a, b, bias, out: matmul(a, b, bias=bias, activation="gelu", out=out),
        peers={f"{peer}+torch epilogue": eager, **_compiled(eager, gpu)},
        reference=lambda a, b, bias, out: reference.matmul_ref(a, b, bias, "gelu"),
        flops=2.0 * M * N * K,
        bytes=float(dtype.itemsize * (M * K + K * N + M * N + N)), dtype=dtype, metric="tflops")


# ---- fp8 GEMM ---------------------------------------------------------------------------------
def _fp8_case(M: int, N: int, K: int, rowwise: bool) -> Case:
    def make(gen, device):
        a = _randn((M, K), gen, device, torch.float32).to(F8)
        b = _randn((N, K), gen, device, torch.float32).to(F8).t()  # [K, N] column-major, as _scaled_mm wants
        if rowwise:
            sa = torch.rand((M, 1), generator=gen, device=device) + 0.5
            sb = torch.rand((1, N), generator=gen, device=device) + 0.5
        else:
            sa = torch.rand((), generator=gen, device=device) + 0.5
            sb = torch.rand((), generator=gen, device=device) + 0.5
        return a, b, sa, sb, _nan((M, N), torch.bfloat16, device)

    scales = "rowwise" if rowwise else "tensorwise"
    return Case(
        name=f"fp8 matmul {scales} M{M} N{N} K{K}",
        params={"op": "matmul_fp8", "M": M, "N": N, "K": K, "dtype": "float8_e4m3fn", "scales": scales,
                "out_dtype": "bfloat16"},
        make_inputs=make,
        ours=lambda a, b, sa, sb, out: matmul_fp8(a, b, sa, sb, out=out),
        peers={"torch._scaled_mm": lambda a, b, sa, sb, out: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                             out_dtype=torch.bfloat16)},
        reference=lambda a, b, sa, sb, out: reference.matmul_fp8_ref(a, b, sa, sb),
        flops=2.0 * M * N * K, bytes=float(M * K + K * N + 2 * M * N), dtype=F8, metric="tflops",
        # The e4m3 inputs are exact in the reference: only fp32 accumulation and the bf16 output round.
        tol=tolerance(torch.bfloat16))


# ---- decode linear ----------------------------------------------------------------------------
def _weight_bytes(scheme: str | None, N: int, K: int, dtype: torch.dtype) -> int:
    """Bytes of the weight as stored (QuantizedWeight.nbytes for packed ones)."""
    if scheme is None:
        return N * K * dtype.itemsize
    if scheme in ("int8", "fp8"):
        return N * K + 4 * N  # 1-byte values + fp32 scale per row
    group = int(scheme.split("_g")[1])
    groups = -(-K // group)
    return N * groups * group // 2 + N * groups * 2 * dtype.itemsize  # nibbles + scale + minimum


def _linear_case(M: int, N: int, K: int, dtype: torch.dtype, scheme: str | None, peer: str) -> Case:
    def make(gen, device):
        x = _randn((M, K), gen, device, dtype)
        w = _randn((N, K), gen, device, dtype, scale=K ** -0.5)
        if scheme is None:
            return x, w, w, _nan((M, N), dtype, device)
        qw = quantize_weight(w, scheme)
        return x, qw, qw.dequantize(), _nan((M, N), dtype, device)  # the peer multiplies the same values

    wbytes = _weight_bytes(scheme, N, K, dtype)
    kind = f"{scheme} weight-only" if scheme else _dname(dtype)
    return Case(
        name=f"{kind} linear M{M} N{N} K{K}",
        params={"op": "linear", "M": M, "N": N, "K": K, "dtype": _dname(dtype), "weight": scheme or _dname(dtype),
                "weight_bytes": wbytes, "bytes_counted": "weight (+scales, mins) + x + out"},
        make_inputs=make,
        ours=lambda x, w, w_dense, out: linear(x, w, out=out),
        peers={peer: lambda x, w, w_dense, out: F.linear(x, w_dense)},
        reference=lambda x, w, w_dense, out: reference.linear_ref(x, w_dense),
        flops=2.0 * M * N * K, bytes=float(wbytes + dtype.itemsize * (M * K + M * N)), dtype=dtype,
        metric="GBps", cuda_graph=torch.cuda.is_available())


# ---- the list ---------------------------------------------------------------------------------
def cases(quick: bool) -> list[Case]:
    gpu = torch.cuda.is_available()
    if not gpu:  # torch references on CPU, tiny fp32 shapes: the suite builds and checks in seconds
        dt, peer = torch.float32, "torch"
        out = [_matmul_case(96, 80, 64, dt, peer), _epilogue_case(96, 80, 64, dt, peer, gpu=False)]
        for M in (1, 16):
            out += [_linear_case(M, 256, 128, dt, scheme, peer) for scheme in (None, "int8", "int4_g128")]
        return out

    bf16, peer = torch.bfloat16, "cublas"
    big = (4096,) if quick else (8192, 4096)
    out = [_matmul_case(n, n, n, bf16, peer) for n in big]
    if not quick:
        out.append(_matmul_case(8192, 8192, 8192, bf16, peer, b_transposed=True))  # the layout linear() uses
    out += [_epilogue_case(n, n, n, bf16, peer, gpu) for n in big[:1]]
    if not quick:
        out.append(_epilogue_case(16384, 14336, 4096, bf16, peer, gpu))
    out += [_fp8_case(n, n, n, rowwise) for n in big[:1] for rowwise in (False, True)]
    for scheme in (None, "int8", "int4_g128", "fp8"):
        out += [_linear_case(M, 14336, 4096, bf16, scheme, peer) for M in ((1, 16) if quick else (1, 16, 64))]
    return out
