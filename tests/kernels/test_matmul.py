"""matmul / matmul_fp8 against the float64 reference; the autotune disk cache.

CPU runs force the Triton interpreter (fixture ``triton_on_cpu``) with fp32/fp16 at small odd sizes;
bf16 and fp8 at real sizes are ``gpu`` tests. Outputs are pre-filled with NaN where ``out=`` is
accepted so unwritten elements fail.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from warpforge.kernels import reference
from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels.matmul import MATMUL_CONFIGS, MatmulConfig, matmul
from warpforge.kernels.matmul_fp8 import FP8_CONFIGS, matmul_fp8
from warpforge.kernels.tolerance import rel_err, tolerance

from .linalg_helpers import _check, _randn

ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]
SMALL_TMA = MatmulConfig(32, 32, 32, 2, 4, 1, tma=True)
SMALL_PTR = MatmulConfig(32, 32, 32, 2, 4, 1, tma=False)




def _operand(rows, cols, dtype, gen, layout, device="cpu"):
    """A [rows, cols] matrix stored row-major, column-major (its .T contiguous) or as a strided slice."""
    if layout == "row":
        return _randn((rows, cols), dtype, gen, device)
    if layout == "col":
        return _randn((cols, rows), dtype, gen, device).t()
    if layout == "strided":  # every other column of a wider matrix: no unit stride anywhere after .t()
        return _randn((rows, 2 * cols + 1), dtype, gen, device)[:, 1::2]
    raise AssertionError(layout)



# ---- CPU (interpreter) ------------------------------------------------------------------------
@pytest.mark.parametrize("M,N,K", [(1, 40, 48), (7, 24, 64), (129, 72, 96), (33, 29, 45)])
@pytest.mark.parametrize("a_layout,b_layout", [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")])
def test_matmul_shapes_layouts(triton_on_cpu, device, gen, M, N, K, a_layout, b_layout):
    a = _operand(M, K, torch.float16, gen, a_layout, device)
    b = _operand(K, N, torch.float16, gen, b_layout, device)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=device)
    matmul(a, b, out=out)
    _check(out, reference.matmul_ref(a, b, acc_dtype=torch.float64), torch.float16)


@pytest.mark.parametrize("config", [SMALL_TMA, SMALL_PTR, MatmulConfig(32, 64, 32, 1, 4, 1, epilogue_subtile=True)],
                         ids=["tma", "ptr", "tma-subtile"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matmul_configs(triton_on_cpu, device, gen, config, dtype):
    # 48 columns of fp16/fp32 are 16-byte aligned rows: every config above can run (tma=True raises otherwise).
    M, N, K = 37, 48, 80
    a, b = _randn((M, K), dtype, gen, device), _randn((K, N), dtype, gen, device)
    bias, res = _randn((N,), dtype, gen, device), _randn((M, N), dtype, gen, device)
    out = matmul(a, b, bias=bias, activation="gelu", residual=res, config=config)
    _check(out, reference.matmul_ref(a, b, bias, "gelu", res, acc_dtype=torch.float64), dtype)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_bias,with_res", [(True, False), (False, True), (True, True)])
def test_matmul_epilogue(triton_on_cpu, device, gen, activation, with_bias, with_res):
    M, N, K = 19, 40, 56
    a, b = _randn((M, K), torch.float16, gen, device), _randn((K, N), torch.float16, gen, device)
    bias = _randn((N,), torch.float16, gen, device) if with_bias else None
    res = _randn((M, N), torch.float32, gen, device) if with_res else None  # residual dtype may differ from a
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device=device)
    matmul(a, b, bias=bias, activation=activation, residual=res, out=out)
    _check(out, reference.matmul_ref(a, b, bias, activation, res, acc_dtype=torch.float64), torch.float16)


@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_matmul_out_dtype(triton_on_cpu, device, gen, in_dtype, out_dtype):
    M, N, K = 9, 33, 70
    a, b = _randn((M, K), in_dtype, gen, device), _randn((K, N), in_dtype, gen, device)
    bias = _randn((N,), in_dtype, gen, device)
    out = matmul(a, b, bias=bias, activation="silu", out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    # fp16 inputs are exact; the result carries only fp32 accumulation, checked at the output's precision
    _check(out, reference.matmul_ref(a, b, bias, "silu", acc_dtype=torch.float64), out_dtype)


def test_matmul_strided_operands_and_out(triton_on_cpu, device, gen):
    M, N, K = 21, 26, 31
    a = _operand(M, K, torch.float32, gen, "strided", device)
    b = _operand(K, N, torch.float32, gen, "strided", device)
    big = torch.full((N, 2 * M), float("nan"), dtype=torch.float32, device=device)
    out = big[:, :M].t()  # [M, N] with strides (1, 2M): written through pointers
    matmul(a, b, out=out)
    _check(out, reference.matmul_ref(a, b, acc_dtype=torch.float64), torch.float32)
    assert torch.isnan(big[:, M:]).all(), "wrote outside out"


def test_matmul_residual_in_place(triton_on_cpu, device, gen):
    M, N, K = 17, 32, 40
    a, b = _randn((M, K), torch.float16, gen, device), _randn((K, N), torch.float16, gen, device)
    res = _randn((M, N), torch.float16, gen, device)
    expect = reference.matmul_ref(a, b, None, "relu", res, acc_dtype=torch.float64)
    out = matmul(a, b, activation="relu", residual=res, out=res)
    assert out.data_ptr() == res.data_ptr()
    _check(out, expect, torch.float16)


def test_matmul_cpu_tensors_use_reference(gen):
    a, b = _randn((5, 7), torch.float32, gen), _randn((7, 3), torch.float32, gen)
    out = matmul(a, b, activation="relu")
    torch.testing.assert_close(out, torch.relu(a @ b))


def test_matmul_empty(triton_on_cpu, device):
    assert matmul(torch.zeros(0, 8, device=device), torch.zeros(8, 5, device=device)).shape == (0, 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(a=torch.zeros(4, 4, dtype=torch.int32)), "^a: expected dtype"),
    (dict(a=torch.zeros(4, 4, 4)), "^a: expected a 2-D"),
    (dict(b=torch.zeros(4, 5, dtype=torch.float16)), "^b: expected dtype float32"),
    (dict(b=torch.zeros(5, 5)), r"^b: expected shape \(4, N\)"),
    (dict(b=torch.zeros(4, 5, device="meta")), "^b: expected a tensor on cpu"),
    (dict(bias=torch.zeros(4)), r"^bias: expected shape \(5,\)"),
    (dict(residual=torch.zeros(5, 4)), r"^residual: expected shape \(4, 5\)"),
    (dict(activation="tanh"), "^activation: expected one of"),
    (dict(out_dtype=torch.int8), "^out_dtype: expected"),
    (dict(out=torch.zeros(4, 5, dtype=torch.float16), out_dtype=torch.float32), "^out: expected dtype float32"),
    (dict(out=torch.zeros(5, 4)), r"^out: expected shape \(4, 5\)"),
    (dict(config="fast"), "^config: expected a MatmulConfig"),
])
def test_matmul_validation(kwargs, match):
    args = dict(a=torch.zeros(4, 4), b=torch.zeros(4, 5))
    args.update(kwargs)
    a, b = args.pop("a"), args.pop("b")
    with pytest.raises(ValueError, match=match):
        matmul(a, b, **args)


def test_matmul_validation_aliasing_and_tma_config(triton_on_cpu, device):
    a = torch.zeros(4, 4, device=device)
    with pytest.raises(ValueError, match="^out: must not share memory"):
        matmul(a, torch.zeros(4, 4, device=device), out=a)
    odd = torch.zeros(4, 5, device=device)  # 20-byte rows: no TMA descriptor
    with pytest.raises(ValueError, match="^config: tma=True needs"):
        matmul(odd.t(), odd, config=SMALL_TMA)


def test_config_validation():
    with pytest.raises(ValueError, match="block_n"):
        MatmulConfig(block_n=96)
    with pytest.raises(ValueError, match="need tma=True"):
        MatmulConfig(tma=False, warp_specialize=True)
    with pytest.raises(ValueError, match="warp_specialize: .* hangs with triton"):
        MatmulConfig(warp_specialize=True)  # deadlocked there; see matmul._tma_configs


def test_matmul_fp8_validation():
    f8 = torch.float8_e4m3fn
    a = torch.zeros(8, 32).to(f8)
    b_col = torch.zeros(16, 32).to(f8).t()  # [32, 16] column-major
    one = torch.ones(())
    with pytest.raises(ValueError, match="^a: expected dtype float8_e4m3fn"):
        matmul_fp8(torch.zeros(8, 32), b_col, one, one)
    with pytest.raises(ValueError, match="^b: expected column-major"):
        matmul_fp8(a, torch.zeros(32, 16).to(f8), one, one)
    with pytest.raises(ValueError, match="^a: expected row-major"):
        matmul_fp8(torch.zeros(32, 8).to(f8).t(), b_col, one, one)
    with pytest.raises(ValueError, match="^scale_a: expected one value"):
        matmul_fp8(a, b_col, torch.ones(3), one)
    with pytest.raises(ValueError, match="^scale_b: expected dtype float32"):
        matmul_fp8(a, b_col, one, torch.ones(16, dtype=torch.float16))


def test_matmul_fp8_cpu_reference():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(6, 32, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32, generator=gen).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(6, 1, generator=gen) + 0.5, torch.rand(1, 16, generator=gen) + 0.5
    out = matmul_fp8(a, b, sa, sb)
    expect = ((a.float() @ b.float()) * sa * sb).to(torch.bfloat16)
    torch.testing.assert_close(out, expect)


# ---- autotune disk cache ----------------------------------------------------------------------
def test_pow2_bucket():
    assert [pow2_bucket(n) for n in (1, 2, 3, 4095, 4096, 4097)] == [1, 2, 4, 4096, 4096, 8192]
    assert pow2_bucket(3, lo=16) == 16 and pow2_bucket(10**9, hi=1024) == 1024


def test_tuner_caches_winner_on_disk(monkeypatch, tmp_path):
    """The first process times every candidate and writes the winner; a second one reads it back."""
    import warpforge.kernels._autotune as autotune

    monkeypatch.setenv("WARPFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "1")  # conftest turns tuning off for other tests
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    times = {0: 3.0, 1: 1.0, 2: 2.0}
    timed: list = []

    def fake_time(fn):
        fn()
        return times[timed[-1]]

    monkeypatch.setattr(autotune, "_time_ms", fake_time)
    configs = [MatmulConfig(block_m=64 * (i + 1) if i < 2 else 32) for i in range(3)]
    dev = torch.device("cuda", 0)
    run = lambda cfg: timed.append(configs.index(cfg))  # noqa: E731

    first = Tuner("unit", configs, MatmulConfig).choose(("b", 1), dev, run)
    assert first == configs[1]
    files = list((tmp_path / "autotune").glob("*.json"))
    assert len(files) == 1 and "NVIDIA_H200" in files[0].name and "triton-" in files[0].name
    assert json.loads(files[0].read_text())["('b', 1)"]["config"]["block_m"] == 128

    timed.clear()
    second = Tuner("unit", configs, MatmulConfig).choose(("b", 1), dev, run)  # a fresh process's tuner
    assert second == configs[1] and timed == [], "re-tuned despite the disk cache"

    capturing = Tuner("unit", configs, MatmulConfig)  # inside CUDA-graph capture: cached winners only
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert capturing.choose(("b", 1), dev, run) == configs[1], "a tuned bucket must serve graph capture"
    assert capturing.choose(("new", 3), dev, run) == configs[0] and timed == [], "no timing inside a capture"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    changed = Tuner("unit", configs[:2], MatmulConfig).choose(("b", 1), dev, run)  # new candidate list
    assert changed == configs[1] and timed, "a changed candidate list must re-tune"

    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "0")
    timed.clear()
    assert Tuner("unit", configs, MatmulConfig).choose(("c", 2), dev, run) == configs[0] and timed == []


def test_tuner_reads_shipped_winners_when_its_cache_lacks_them(monkeypatch, tmp_path):
    """Winners shipped in the package serve a fresh cache (no timing); a stale candidate list or a
    bucket they lack still tunes, and the user's own winner beats the shipped one."""
    import warpforge.kernels._autotune as autotune

    monkeypatch.setenv("WARPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "SHIPPED_DIR", tmp_path / "shipped")
    configs = [MatmulConfig(block_m=32), MatmulConfig(block_m=64), MatmulConfig(block_m=128)]
    timed: list = []
    monkeypatch.setattr(autotune, "_time_ms", lambda fn: (fn(), 1.0 + timed[-1])[1])  # first candidate wins
    run = lambda cfg: timed.append(configs.index(cfg))  # noqa: E731
    dev = torch.device("cuda", 0)
    tuner = Tuner("unit", configs, MatmulConfig)
    shipped = tmp_path / "shipped" / tuner._path(dev).name
    shipped.parent.mkdir()
    entry = lambda cfg, h: {"config": dataclasses.asdict(cfg), "ms": 0.1, "candidates": h}  # noqa: E731
    shipped.write_text(json.dumps({"('s', 1)": entry(configs[2], tuner.candidates_hash),
                                   "('stale', 1)": entry(configs[2], "0" * 16)}))

    assert tuner.choose(("s", 1), dev, run) == configs[2] and timed == [], "a shipped winner must serve"
    assert tuner.choose(("stale", 1), dev, run) == configs[0] and timed, "a stale shipped entry must re-tune"
    timed.clear()
    assert Tuner("unit", configs, MatmulConfig).choose(("stale", 1), dev, run) == configs[0] and timed == []
    own = tuner._path(dev)  # the user's cache now holds ('stale', 1); a winner of their own for ('s', 1) too
    data = json.loads(own.read_text())
    data["('s', 1)"] = entry(configs[1], tuner.candidates_hash)
    own.write_text(json.dumps(data))
    assert Tuner("unit", configs, MatmulConfig).choose(("s", 1), dev, run) == configs[1]


# ---- GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (129, 257, 4095), (7, 1000, 512), (2048, 2048, 2048)])
@pytest.mark.parametrize("a_layout,b_layout", [("row", "row"), ("row", "col"), ("col", "row"), ("strided", "col")])
def test_matmul_bf16_gpu(gen, M, N, K, a_layout, b_layout):
    a = _operand(M, K, torch.bfloat16, gen, a_layout, "cuda")
    b = _operand(K, N, torch.bfloat16, gen, b_layout, "cuda")
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(a, b, out=out)
    _check(out, reference.matmul_ref(a, b, acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("M,N,K", [(4096, 4096, 4096), (333, 1000, 4095)])
def test_matmul_bf16_epilogue_gpu(gen, activation, M, N, K):
    a, b = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((K, N), torch.bfloat16, gen, "cuda")
    bias, res = _randn((N,), torch.bfloat16, gen, "cuda"), _randn((M, N), torch.bfloat16, gen, "cuda")
    out = matmul(a, b, bias=bias, activation=activation, residual=res)
    _check(out, reference.matmul_ref(a, b, bias, activation, res, acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", MATMUL_CONFIGS, ids=str)
def test_matmul_every_candidate_gpu(gen, config):
    """Each autotune candidate must be correct on its own (a fast wrong config must never win)."""
    M, N, K = 1000, 1032, 1016
    a, b = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((K, N), torch.bfloat16, gen, "cuda")
    bias, res = _randn((N,), torch.bfloat16, gen, "cuda"), _randn((M, N), torch.bfloat16, gen, "cuda")
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(a, b, bias=bias, activation="gelu", residual=res, out=out, config=config)
    _check(out, reference.matmul_ref(a, b, bias, "gelu", res, acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
def test_matmul_residual_in_place_while_tuning_gpu(gen, monkeypatch):
    """Tuning launches the kernel once per candidate: an in-place residual must still be added once."""
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "retune")
    M, N, K = 1024, 1024, 1024
    a, b = _randn((M, K), torch.bfloat16, gen, "cuda"), _randn((K, N), torch.bfloat16, gen, "cuda")
    res = _randn((M, N), torch.bfloat16, gen, "cuda")
    expect = reference.matmul_ref(a, b, None, None, res, acc_dtype=torch.float64)
    matmul(a, b, residual=res, out=res)
    _check(res, expect, torch.bfloat16)


def _fp8_operands(M, N, K, gen):
    a = _randn((M, K), torch.float32, gen, "cuda").to(torch.float8_e4m3fn)
    b = _randn((N, K), torch.float32, gen, "cuda").to(torch.float8_e4m3fn).t()  # [K, N] column-major
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(8192, 8192, 8192), (129, 272, 4096), (1, 4096, 4112), (100, 48, 4095)])
@pytest.mark.parametrize("per_row", [False, True])
def test_matmul_fp8_gpu(gen, M, N, K, per_row):
    a, b = _fp8_operands(M, N, K, gen)
    if per_row:
        sa = torch.rand(M, 1, generator=gen).add(0.5).cuda()
        sb = torch.rand(1, N, generator=gen).add(0.5).cuda()
    else:
        sa, sb = torch.tensor(0.7, device="cuda"), torch.tensor(1.3, device="cuda")
    bias = _randn((N,), torch.bfloat16, gen, "cuda")
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul_fp8(a, b, sa, sb, bias=bias, activation="relu", out=out)
    # Inputs are exact e4m3 values: the only errors are fp32 accumulation and the bf16 output rounding.
    _check(out, reference.matmul_fp8_ref(a, b, sa, sb, bias, "relu", acc_dtype=torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("config", FP8_CONFIGS, ids=str)
def test_matmul_fp8_every_candidate_gpu(gen, config):
    M, N, K = 1000, 1040, 1024
    a, b = _fp8_operands(M, N, K, gen)
    sa, sb = torch.rand(M, generator=gen).add(0.5).cuda(), torch.rand(N, generator=gen).add(0.5).cuda()
    out = matmul_fp8(a, b, sa, sb, out_dtype=torch.float16, config=config)
    _check(out, reference.matmul_fp8_ref(a, b, sa, sb, acc_dtype=torch.float64), torch.float16)


@pytest.mark.gpu
def test_matmul_fp8_matches_scaled_mm_gpu(gen):
    M, N, K = 512, 1024, 2048
    a, b = _fp8_operands(M, N, K, gen)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    ours = matmul_fp8(a, b, sa, sb)
    theirs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert rel_err(ours, theirs.float()) <= tolerance(torch.bfloat16)


def test_bench_cases_build_on_cpu():
    from warpforge.bench.suite import Case
    from warpforge.bench.suites._kernels_matmul import cases

    built = cases(quick=True)
    assert built and all(isinstance(c, Case) for c in built)
    assert len({c.name for c in built}) == len(built)
    for c in built:
        assert c.flops > 0 and c.bytes > 0 and c.peers


@pytest.mark.slow
def test_default_configs_compile_for_sm90(sm90_cache):
    """Without a GPU: each family's default config compiles for Hopper, fits shared memory, does not
    spill, and the GEMMs reach wgmma (tests/kernels/sm90_compile.py --all checks every candidate)."""
    from .sm90_shards import run_sharded

    rows, rcs, err = run_sharded([], sm90_cache, timeout=590)
    assert rows, err
    bad = [row for row in rows if not row["ok"]]
    assert not bad and not any(rcs), bad or err
    assert all(row["wgmma"] for row in rows if row["kernel"].startswith(("matmul", "fp8", "int8", "conv")))
    # No conv main loop copies its A tile smem -> registers -> smem (unsigned int8 x once did: a masked load
    # with other=-128); fp16 keeps its MMA in flight across K steps (Triton 3.6 never does for int32 acc).
    convs = [row for row in rows if row["kernel"].startswith("conv")]
    assert convs and all(row["local_loads"] == 0 for row in convs), [r for r in convs if r["local_loads"]]
    assert all(row["mma_async"] for row in convs if row["kernel"].startswith("conv fp16"))
    pdl = [row for row in rows if row["kernel"].startswith("linear pdl")]
    assert pdl and all(row["pdl"] for row in pdl)  # PDL=True emits griddepcontrol.wait + launch_dependents
    assert not any(row["pdl"] for row in rows if not row["kernel"].startswith("linear pdl"))


@pytest.mark.gpu
def test_tuner_times_the_gpu_not_the_host_launcher():
    """A candidate whose launcher spends 300 us on the host before a tiny kernel reads its GPU time."""
    import time

    from warpforge.kernels._autotune import _time_ms

    x = torch.randn(1024, device="cuda")

    def slow_launcher():
        t = time.perf_counter()
        while time.perf_counter() - t < 300e-6:
            pass
        x.mul_(1.0)

    assert _time_ms(slow_launcher) < 0.05
