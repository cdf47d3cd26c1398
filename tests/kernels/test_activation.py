"""silu_and_mul / gelu_and_mul / softmax against the float64 reference (interpreter on CPU, Triton on GPU)."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels import activation
from warpforge.kernels import reference as ref
from warpforge.kernels.activation import (RowConfig, gated_candidates, gelu_and_mul, silu_and_mul, softmax,
                                          softmax_candidates)
from warpforge.kernels.tolerance import FP32_ELEMENTWISE_TOL, rel_err, tolerance

pytestmark = pytest.mark.usefixtures("triton_on_cpu")


def tol(dtype: torch.dtype) -> float:
    # fp32 elementwise code does no tf32 matrix math: rounding-level bound; others from the table.
    return FP32_ELEMENTWISE_TOL[0] if dtype == torch.float32 else tolerance(dtype)


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


GATED = [("silu", {}), ("gelu", {"approximate": "none"}), ("gelu", {"approximate": "tanh"})]


def _gated(kind, x, **kw):
    return silu_and_mul(x, **kw) if kind == "silu" else gelu_and_mul(x, **kw)


def _gated_ref(kind, x, approximate=None):
    if kind == "silu":
        return ref.silu_and_mul_reference(x, compute_dtype=torch.float64)
    return ref.gelu_and_mul_reference(x, approximate, compute_dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,d", [(1, 9), (7, 33), (129, 5), (3, 4095)])
@pytest.mark.parametrize("kind,kw", GATED)
def test_gated_matches_reference(device, dtype, rows, d, kind, kw):
    x = torch.randn(rows, 2 * d, device=device, dtype=dtype) * 3
    out = _poisoned((rows, d), dtype, device)
    got = _gated(kind, x, out=out, **kw)
    assert got is out
    assert rel_err(out, _gated_ref(kind, x, **kw)) <= tol(dtype)


def test_gated_leading_dims_and_row_strided_view(device):
    base = torch.randn(2, 5, 2 * 7 + 3, device=device)
    with pytest.raises(ValueError, match="row-contiguous"):
        silu_and_mul(base[:, :3, :14])  # leading dims that do not flatten to one row stride
    x2 = base.view(10, 17)[:, :14]  # 2-D row-strided view is served as is
    out = silu_and_mul(x2)
    assert out.shape == (10, 7)
    assert rel_err(out, ref.silu_and_mul_reference(x2, torch.float64)) <= tol(torch.float32)
    x3 = torch.randn(2, 3, 4, 10, device=device)
    assert rel_err(gelu_and_mul(x3), ref.gelu_and_mul_reference(x3, "none", torch.float64)) <= tol(torch.float32)


def test_gated_extreme_values(device):
    # silu/gelu tails: exp overflow must give exact limits, not NaN.
    a = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4], device=device)
    x = torch.cat([a, torch.ones_like(a)])[None]
    for kind, kw in GATED:
        out = _gated(kind, x, **kw)
        assert torch.isfinite(out).all()
        assert rel_err(out, _gated_ref(kind, x, **kw)) <= tol(torch.float32)


def test_gated_validation(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="dtype"):
        silu_and_mul(torch.ones(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="last dim"):
        silu_and_mul(torch.randn(8, 4, device=device).t())
    with pytest.raises(ValueError, match="out must have shape"):
        silu_and_mul(x, out=torch.empty(4, 8, device=device))
    with pytest.raises(ValueError, match="out must have dtype"):
        silu_and_mul(x, out=torch.empty(4, 4, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(x, approximate="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 1), (7, 33), (129, 100), (5, 4095)])
def test_softmax_matches_reference(device, dtype, rows, n):
    x = torch.randn(rows, n, device=device, dtype=dtype) * 4
    out = _poisoned((rows, n), dtype, device)
    softmax(x, out=out)
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)


@pytest.mark.parametrize("n,block", [(4095, 1024), (100, 16), (1, 16)])
def test_softmax_looped_matches_reference(device, n, block):
    x = torch.randn(3, n, device=device) * 4
    out = _poisoned((3, n), torch.float32, device)
    softmax(x, out=out, config=RowConfig(block_m=1, block_n=block, num_warps=4, looped=True))
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)


@pytest.mark.parametrize("looped", [False, True])
def test_softmax_stability_and_masking(device, looped):
    # Huge logits (exp would overflow without the max shift) and -inf entries (causal masks).
    x = torch.randn(6, 300, device=device) * 1e4
    x[:, 7::3] = float("-inf")
    x[2, :150] = float("-inf")  # the first chunk of a looped pass sees only -inf
    cfg = RowConfig(1, 64, 4, looped=True) if looped else None
    out = softmax(x, config=cfg)
    assert torch.isfinite(out).all()
    assert (out[:, 7::3] == 0).all()
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)


def test_softmax_leading_dims_and_validation(device):
    x = torch.randn(2, 3, 37, device=device, dtype=torch.float16)
    assert rel_err(softmax(x, dim=2), ref.softmax_reference(x, torch.float64)) <= tol(torch.float16)
    with pytest.raises(ValueError, match="last dim"):
        softmax(x, dim=1)
    with pytest.raises(ValueError, match="block_n"):
        softmax(x, config=RowConfig(1, 16, 4))
    with pytest.raises(ValueError, match="power of two"):
        RowConfig(3, 16, 4)
    with pytest.raises(ValueError, match="dtype"):
        softmax(torch.ones(3, dtype=torch.int64, device=device))


# ---- every tuning candidate, the persistent variants, the tuner path ------------------------------

# The kernels suite's shapes (H200 kernels.jsonl) as the launchers bucket them, plus the LLM vocab softmax.
SUITE_SOFTMAX = [(4096, 32768), (131072, 4096), (512, 131072), (256, 131072), (4096, 1024)]
SOFTMAX_CANDIDATES = sorted({c for m, n in SUITE_SOFTMAX for c in softmax_candidates(m, n)}, key=repr)
GATED_CANDIDATES = sorted({c for m, d in [(4096, 16384), (16, 256)] for c in gated_candidates(m, d)}, key=repr)


def _softmax_case(cfg: RowConfig) -> tuple[int, int]:
    """An odd (rows, width) this config serves: not a multiple of its chunk or row block, several row
    blocks per program of a persistent grid (the interpreter has activation.INTERPRET_SMS SMs)."""
    if cfg.looped:
        return 7, 2 * cfg.block_n + 37  # three chunks, the last one partial
    return 3 * cfg.block_m + 2, cfg.block_n - 3


def test_candidate_lists_start_with_the_untuned_default():
    from warpforge.kernels.activation import row_config, softmax_config

    for m, n in SUITE_SOFTMAX + [(1, 1), (7, 33), (129, 100)]:
        cands = softmax_candidates(m, n)
        assert cands[0] == softmax_config(m, n) and len(set(cands)) == len(cands)
        assert all(c.looped or c.block_n >= n for c in cands), "a whole-row candidate must cover the row"
    assert any(c.looped and c.persistent and not c.l2_hints for c in softmax_candidates(512, 131072))
    assert any(c.l2_hints for c in softmax_candidates(512, 131072))
    for m, d in [(4096, 16384), (16, 256), (1, 8)]:
        assert gated_candidates(m, d)[0] == row_config(m, d, max_block_n=1024)
    assert len(SOFTMAX_CANDIDATES) <= 24 and max(len(softmax_candidates(m, n)) for m, n in SUITE_SOFTMAX) <= 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", SOFTMAX_CANDIDATES, ids=str)
def test_softmax_every_candidate(device, dtype, cfg):
    """Each tuning candidate is correct on its own (a fast wrong one must never win), poisoned output."""
    rows, n = _softmax_case(cfg)
    x = torch.randn(rows, n, device=device, dtype=dtype) * 4
    x[1, ::5] = float("-inf")
    out = _poisoned((rows, n), dtype, device)
    softmax(x, out=out, config=cfg)
    assert not out.isnan().any(), "an element was not written"
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)


@pytest.mark.parametrize("kind,kw", GATED)
@pytest.mark.parametrize("cfg", GATED_CANDIDATES, ids=str)
def test_gated_every_candidate(device, cfg, kind, kw):
    rows, d = 2 * cfg.block_m + 1, cfg.block_n + 37  # a partial row block and a partial column block
    x = torch.randn(rows, 2 * d, device=device) * 3
    out = _poisoned((rows, d), torch.float32, device)
    _gated(kind, x, out=out, config=cfg, **kw)
    assert not out.isnan().any()
    assert rel_err(out, _gated_ref(kind, x, **kw)) <= tol(torch.float32)


PERSISTENT = [RowConfig(1, 16, 4, looped=True, programs_per_sm=1),  # 2 programs: many rows and chunks each
              RowConfig(1, 64, 2, looped=True, programs_per_sm=3),
              RowConfig(1, 32, 4, looped=True, programs_per_sm=1, l2_hints=True),
              RowConfig(1, 512, 4, programs_per_sm=1),  # whole rows, 2 programs
              RowConfig(2, 512, 4, programs_per_sm=2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 300), (7, 301), (129, 17)])
@pytest.mark.parametrize("cfg", PERSISTENT, ids=str)
def test_softmax_persistent_odd_sizes(device, dtype, rows, n, cfg):
    x = torch.randn(rows, n, device=device, dtype=dtype) * 4
    out = _poisoned((rows, n), dtype, device)
    softmax(x, out=out, config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)


@pytest.mark.parametrize("cfg", PERSISTENT + [None, RowConfig(1, 64, 4, looped=True)], ids=str)
def test_softmax_strided_views_extremes_and_in_place(device, cfg):
    # Row-strided views in and out (slices of wider buffers), huge logits, -inf entries, a row whose
    # first chunks are all -inf, and a fully masked row (NaN, as torch gives).
    base = torch.randn(9, 400, device=device) * 1e4
    x = base[:, 37:337]  # [9, 300], row stride 400
    x[:, 7::3] = float("-inf")
    x[2, :150] = float("-inf")
    x[5] = float("-inf")
    obuf = _poisoned((9, 512), torch.float32, device)
    out = obuf[:, 5:305]
    want = ref.softmax_reference(x, torch.float64)
    softmax(x, out=out, config=cfg)
    assert out[5].isnan().all() and want[5].isnan().all()
    keep = [r for r in range(9) if r != 5]
    assert torch.isfinite(out[keep]).all() and (out[:, 7::3][keep] == 0).all()
    assert rel_err(out[keep], want[keep]) <= tol(torch.float32)
    assert obuf[:, :5].isnan().all() and obuf[:, 305:].isnan().all(), "wrote outside the out view"
    y = x.clone()
    softmax(y, out=y, config=cfg)  # in place
    assert rel_err(y[keep], want[keep]) <= tol(torch.float32)


def test_rowconfig_validation(device):
    with pytest.raises(ValueError, match="programs_per_sm"):
        RowConfig(1, 16, 4, looped=True, programs_per_sm=33)
    with pytest.raises(ValueError, match="l2_hints needs looped=True and programs_per_sm"):
        RowConfig(1, 16, 4, looped=True, l2_hints=True)
    with pytest.raises(ValueError, match="block_m must be 1 when looped"):
        RowConfig(2, 16, 4, looped=True)
    with pytest.raises(ValueError, match="softmax-only"):
        silu_and_mul(torch.randn(3, 8, device=device), config=RowConfig(1, 16, 4, programs_per_sm=1))
    with pytest.raises(ValueError, match="block_n"):
        softmax(torch.randn(3, 40, device=device), config=RowConfig(1, 32, 4, programs_per_sm=1))


@pytest.fixture
def cpu_tuning(monkeypatch, tmp_path):
    """Run the launchers' real tuning path on CPU tensors (interpreter): the Tuner is told the device
    is an H200, its timer is fake and checks each trial's output, and every launch is recorded."""
    import warpforge.kernels._autotune as autotune

    monkeypatch.setenv("WARPFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(activation, "_TUNERS", {})
    real_choose = autotune.Tuner.choose
    monkeypatch.setattr(autotune.Tuner, "choose", lambda self, bucket, device, run, valid=None:
                        real_choose(self, bucket, torch.device("cuda", 0), run, valid))
    state = {"launched": [], "timed": [], "fast": None, "check": None}

    def record(real):
        def launch(x2, out2, *args):
            state["launched"].append(args[-1])
            return real(x2, out2, *args)
        return launch

    monkeypatch.setattr(activation, "_launch_softmax", record(activation._launch_softmax))
    monkeypatch.setattr(activation, "_launch_gated", record(activation._launch_gated))

    def fake_time(fn):
        fn()
        cfg = state["launched"][-1]
        state["timed"].append(cfg)
        if state["check"] is not None:
            state["check"]()  # the trial's output is right
        return 1.0 if cfg == state["fast"] else 2.0 + len(state["timed"])

    monkeypatch.setattr(autotune, "_time_ms", fake_time)
    state["capturing"] = capturing
    return state


def test_softmax_tuner_path(device, cpu_tuning, tmp_path, monkeypatch):
    st = cpu_tuning
    x = torch.randn(7, 40000, device=device) * 4  # bucket (8, 65536): the streamed default + persistent ones
    want = ref.softmax_reference(x, torch.float64)
    configs = softmax_candidates(7, 40000)
    st["fast"] = next(c for c in configs if c.persistent)
    out = _poisoned(x.shape, torch.float32, device)
    st["check"] = lambda: (rel_err(out, want) <= tol(torch.float32)) or pytest.fail("a trial's output is wrong")
    softmax(x, out=out)
    assert set(st["timed"]) == set(configs), "every candidate valid for the bucket must be timed"
    assert st["launched"][-1] == st["fast"], "the call must run the winner"
    assert rel_err(out, want) <= tol(torch.float32)
    files = list((tmp_path / "autotune").glob("*softmax*.json"))
    assert len(files) == 1 and "NVIDIA_H200" in files[0].name
    st["timed"].clear()
    monkeypatch.setattr(activation, "_TUNERS", {})  # a fresh process reads the winner from disk
    softmax(x, out=out)
    assert st["timed"] == [] and st["launched"][-1] == st["fast"]

    st["check"] = None
    explicit = RowConfig(1, 1024, 4, looped=True)
    softmax(x, config=explicit)
    assert st["timed"] == [] and st["launched"][-1] == explicit, "an explicit config wins"

    st["capturing"][0] = True  # inside a CUDA-graph capture: an untuned bucket gets the default, untimed
    y = torch.randn(3, 5000, device=device)
    softmax(y)
    assert st["timed"] == [] and st["launched"][-1] == softmax_candidates(3, 5000)[0]
    softmax(x)  # a tuned bucket serves the capture
    assert st["launched"][-1] == st["fast"]
    st["capturing"][0] = False

    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "0")
    softmax(y)
    assert st["timed"] == [] and st["launched"][-1] == softmax_candidates(3, 5000)[0]


def test_softmax_in_place_while_tuning(device, cpu_tuning):
    """Trials rewrite the output once per candidate: softmax(x, out=x) must still be applied once."""
    st = cpu_tuning
    x = torch.randn(5, 3000, device=device) * 4
    want = ref.softmax_reference(x, torch.float64)
    st["fast"] = softmax_candidates(5, 3000)[-1]
    softmax(x, out=x)
    assert len(st["timed"]) == len(softmax_candidates(5, 3000)) > 1
    assert rel_err(x, want) <= tol(torch.float32)


def test_gated_tuner_path(device, cpu_tuning):
    st = cpu_tuning
    x = torch.randn(5, 2 * 3000, device=device)
    want = ref.silu_and_mul_reference(x, torch.float64)
    configs = gated_candidates(5, 3000)
    valid = [c for c in configs if c == configs[0] or (c.block_m <= 8 and c.block_n <= 4096)]
    st["fast"] = RowConfig(1, 2048, 8)
    out = _poisoned((5, 3000), torch.float32, device)
    st["check"] = lambda: (rel_err(out, want) <= tol(torch.float32)) or pytest.fail("a trial's output is wrong")
    silu_and_mul(x, out=out)
    assert st["timed"] == valid and st["launched"][-1] == st["fast"]
    assert rel_err(out, want) <= tol(torch.float32)
    st["timed"].clear()
    st["check"] = None
    gelu_and_mul(x)  # another activation is another bucket: tuned apart
    assert len(st["timed"]) == len(valid)


def test_bench_suite_times_the_tuned_choice(monkeypatch):
    """The kernels suite's row-wise cases call the launchers without config=, so they time the tuner's pick."""
    from warpforge.bench.suites._kernels_fused import _elementwise_cases

    asked: list[str] = []
    real = activation._choose
    monkeypatch.setattr(activation, "_choose",
                        lambda kernel, *a, **kw: (asked.append(kernel), real(kernel, *a, **kw))[1])
    cases = _elementwise_cases(gpu=False)
    assert {c.params["op"] for c in cases} == {"silu_and_mul", "gelu_and_mul", "softmax"}
    for case in cases:
        asked.clear()
        case.ours(*case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu")))
        assert asked == ["softmax" if case.params["op"] == "softmax" else "gated"], case.name


def test_empty_inputs(device):
    assert silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
    assert softmax(torch.randn(3, 0, 5, device=device)).shape == (3, 0, 5)


def test_cpu_dispatch_without_force_runs_reference():
    from warpforge.kernels import _dispatch

    prev, _dispatch._forced = _dispatch._forced, False
    try:
        x = torch.randn(5, 18)
        assert rel_err(silu_and_mul(x), ref.silu_and_mul_reference(x, torch.float64)) <= tol(torch.float32)
        assert rel_err(softmax(x), ref.softmax_reference(x, torch.float64)) <= tol(torch.float32)
    finally:
        _dispatch._forced = prev


# ---- GPU: bf16 and LLM sizes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gated_llm_shape(dtype):
    x = torch.randn(1000, 2 * 14336, device="cuda", dtype=dtype)
    for kind, kw in GATED:
        out = _gated(kind, x, out=_poisoned((1000, 14336), dtype, "cuda"), **kw)
        assert rel_err(out, _gated_ref(kind, x.float(), **kw)) <= tol(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SOFTMAX_CANDIDATES, ids=str)
def test_gpu_softmax_every_candidate_bf16(cfg):
    """bf16 on the GPU at odd sizes near the suite's: rows not a multiple of the grid, partial chunks."""
    rows, n = (517, 131072 - 77) if cfg.looped else (3 * 132 * cfg.block_m + 5, cfg.block_n - 3)
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16) * 4
    x[1, ::5] = float("-inf")
    out = softmax(x, out=_poisoned((rows, n), torch.bfloat16, "cuda"), config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GATED_CANDIDATES, ids=str)
def test_gpu_gated_every_candidate_bf16(cfg):
    x = torch.randn(1001, 2 * 14336 + 2 * 37, device="cuda", dtype=torch.bfloat16)
    for kind, kw in GATED:
        out = _gated(kind, x, out=_poisoned((1001, 14336 + 37), torch.bfloat16, "cuda"), config=cfg, **kw)
        assert rel_err(out, _gated_ref(kind, x.float(), **kw)) <= tol(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_tuned_softmax_and_silu_bf16(monkeypatch):
    """The tuned path on the GPU (WARPFORGE_AUTOTUNE=retune): correct, in place too, and graph-capturable."""
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "retune")
    x = torch.randn(300, 65536 + 11, device="cuda", dtype=torch.bfloat16) * 4
    want = ref.softmax_reference(x, torch.float64)
    assert rel_err(softmax(x), want) <= tol(torch.bfloat16)
    y = x.clone()
    softmax(y, out=y)
    assert rel_err(y, want) <= tol(torch.bfloat16)
    g = torch.randn(1000, 2 * 5000, device="cuda", dtype=torch.bfloat16)
    assert rel_err(silu_and_mul(g), ref.silu_and_mul_reference(g, torch.float64)) <= tol(torch.bfloat16)
    monkeypatch.setenv("WARPFORGE_AUTOTUNE", "1")  # the winners just tuned serve a graph capture
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        softmax(x, out=out)
    out.fill_(float("nan"))
    graph.replay()
    assert rel_err(out, want) <= tol(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(4099, 4096), (129, 32768), (17, 65536 + 123), (3, 4095)])
def test_gpu_softmax_llm_shapes(dtype, rows, n):
    x = torch.randn(rows, n, device="cuda", dtype=dtype) * 3
    out = softmax(x, out=_poisoned((rows, n), dtype, "cuda"))
    assert rel_err(out, ref.softmax_reference(x, torch.float64)) <= tol(dtype)
