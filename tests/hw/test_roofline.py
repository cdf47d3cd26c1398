"""Roofline math (exact), dtype keys, and where ceilings() takes its figures from."""

from __future__ import annotations

import json

import pytest
import torch

from warpforge.hw import probe
from warpforge.hw.roofline import (
    CPU_NOMINAL_GBPS,
    CPU_NOMINAL_TFLOPS,
    Ceilings,
    ceilings,
    ceilings_from_probe,
    dtype_key,
    roofline,
)
from warpforge.hw.specs import PRECISIONS

TF = {"fp32": 50.0, "tf32": 400.0, "fp16": 800.0, "bf16": 800.0, "fp8": 1600.0, "int8": 1600.0}
CEIL = Ceilings(device="test", hbm_GBps=4000.0, tflops=TF, source="test")


def test_compute_bound_exact():
    # 2e12 FLOP at 800 TFLOP/s = 2.5 ms; 1e9 B at 4000 GB/s = 0.25 ms.
    r = roofline(2e12, 1e9, torch.bfloat16, 5.0, CEIL)
    assert r["compute_ms"] == pytest.approx(2.5, rel=1e-12)
    assert r["memory_ms"] == pytest.approx(0.25, rel=1e-12)
    assert r["floor_ms"] == pytest.approx(2.5, rel=1e-12)
    assert r["bound"] == "compute"
    assert r["fraction"] == pytest.approx(0.5, rel=1e-12)


def test_memory_bound_exact():
    # copy of 1 GiB fp32: 2 GiB moved, 2^31 / 4e12 s = 0.536870912 ms; 0 FLOPs.
    r = roofline(0, 2 * 2**30, torch.float32, 0.6, CEIL)
    assert r["memory_ms"] == pytest.approx(2**31 / 4e12 * 1e3, rel=1e-12)
    assert r["compute_ms"] == 0.0
    assert r["bound"] == "memory"
    assert r["floor_ms"] == r["memory_ms"]
    assert r["fraction"] == pytest.approx(2**31 / 4e12 * 1e3 / 0.6, rel=1e-12)


def test_precision_picks_its_peak():
    fp32 = roofline(1e12, 0, "fp32", 100.0, CEIL)["compute_ms"]
    tf32 = roofline(1e12, 0, "tf32", 100.0, CEIL)["compute_ms"]
    fp8 = roofline(1e12, 0, torch.float8_e4m3fn, 100.0, CEIL)["compute_ms"]
    assert fp32 == pytest.approx(20.0) and tf32 == pytest.approx(2.5) and fp8 == pytest.approx(0.625)


def test_tie_is_memory_and_no_measured_time():
    # 800e9 FLOP at 800 TFLOP/s = 1 ms; 4e9 B at 4000 GB/s = 1 ms.
    r = roofline(800e9, 4e9, "bf16", None, CEIL)
    assert r["compute_ms"] == pytest.approx(r["memory_ms"]) and r["bound"] == "memory"
    assert r["fraction"] is None


def test_zero_flops_needs_no_precision():
    r = roofline(0, 1e9, torch.int32, 1.0, CEIL)  # an int32 copy: no compute ceiling is needed
    assert r["bound"] == "memory" and r["floor_ms"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="dtype"):
        roofline(1.0, 1e9, torch.int32, 1.0, CEIL)


@pytest.mark.parametrize("bad", [dict(flops=-1), dict(bytes_moved=float("nan")), dict(measured_ms=0.0),
                                 dict(measured_ms=-2.0), dict(flops=float("inf"))])
def test_roofline_rejects_bad_numbers(bad):
    args = {"flops": 1.0, "bytes_moved": 1.0, "dtype": "fp16", "measured_ms": 1.0, "ceil": CEIL} | bad
    with pytest.raises(ValueError):
        roofline(**args)


@pytest.mark.parametrize("dtype, key", [
    (torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8"),
    (torch.float8_e5m2, "fp8"), (torch.int8, "int8"), (torch.uint8, "int8"), ("tf32", "tf32"),
    ("bfloat16", "bf16"), ("torch.float16", "fp16"), ("half", "fp16"), ("FP8", "fp8"), ("e4m3", "fp8"),
])
def test_dtype_key(dtype, key):
    assert dtype_key(dtype) == key


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, "fp64", "complex64"])
def test_dtype_key_rejects(dtype):
    with pytest.raises(ValueError, match="dtype"):
        dtype_key(dtype)


def test_ceilings_validate():
    with pytest.raises(ValueError, match="missing"):
        Ceilings(device="x", hbm_GBps=1.0, tflops={"fp32": 1.0})
    with pytest.raises(ValueError, match="hbm_GBps"):
        Ceilings(device="x", hbm_GBps=0.0, tflops=TF)
    with pytest.raises(ValueError, match="tflops"):
        Ceilings(device="x", hbm_GBps=1.0, tflops=TF | {"fp8": 0.0})


# ---- where the ceilings come from -------------------------------------------------------------------

def _gpu_result(name: str, matmul: dict, hbm: dict | None = None) -> dict:
    return {"schema": probe.SCHEMA, "time": "2026-11-29T00:00:00+00:00", "quick": False,
            "device": {"name": name, "kind": "cuda"}, "datasheet": None,
            "hbm": hbm or {"read_GBps": 4016.0, "write_GBps": 3300.0, "copy_GBps": 4100.0, "torch_copy_GBps": 4248.0},
            "sweep": {"points": [], "plateau_GBps": 10000.0, "stream_GBps": 3900.0, "cliff_MiB": 56},
            "matmul": matmul}


def test_ceilings_are_the_larger_of_probe_and_datasheet():
    """A probed cuBLAS rate is what cuBLAS reached, not the chip's ceiling: below the datasheet the
    datasheet is the ceiling; a measurement above the datasheet (a part clocked higher) wins."""
    mm = {"fp32": {"tflops": 50.6}, "tf32": {"tflops": 397.0}, "fp16": {"tflops": 755.7},
          "bf16": {"tflops": 765.0}, "fp8": {"tflops": 2100.0}, "int8": {"error": "RuntimeError: no"}}
    path = probe.save_cache(_gpu_result("NVIDIA H200", mm))
    assert path.name == "nvidia-h200.json"
    c = ceilings("NVIDIA H200")
    assert c.hbm_GBps == 4800.0  # measured 4248 at best: the datasheet's 4.8 TB/s is the ceiling
    assert c.tflops["bf16"] == 989.5 and c.tflops["fp32"] == 67.0  # datasheet above the probe
    assert c.tflops["fp8"] == 2100.0  # measured above the datasheet's 1979
    assert c.tflops["int8"] == 1979.0  # not measured: the datasheet
    assert c.l2_GBps == 10000.0
    assert c.source.startswith("probe") and "datasheet H200 where higher" in c.source and "hbm" in c.source
    assert "fp8" not in c.source.split("where higher:")[1]
    probe.save_cache(_gpu_result("NVIDIA H200", mm, hbm={"copy_GBps": 5000.0}))
    assert ceilings("NVIDIA H200").hbm_GBps == 5000.0


def test_a_fraction_above_one_raises_only_when_strict():
    """1.094 of the fp8 roof against a probed 1,377 TFLOP/s was stored as a figure; strict, it raises."""
    from warpforge.hw.roofline import CeilingError, check_fraction

    ceil = Ceilings(device="x", hbm_GBps=1000.0, tflops=TF, source="probe x")
    flops = 2 * 8192 ** 3
    ms = flops / (TF["fp8"] * 1e12) * 1e3 / 1.094  # 9.4% faster than the ceiling allows
    assert roofline(flops, 1e6, "fp8", ms, ceil)["fraction"] == pytest.approx(1.094)  # the profiler's per-op use
    with pytest.raises(CeilingError, match=r"roofline fraction 1.094 > 1 against probe x"):
        roofline(flops, 1e6, "fp8", ms, ceil, strict=True)
    assert roofline(flops, 1e6, "fp8", ms * 1.094, ceil, strict=True)["fraction"] == pytest.approx(1.0)
    assert check_fraction(0.5, "mfu", "x") == 0.5
    with pytest.raises(CeilingError, match="mfu 9.73 > 1"):
        check_fraction(9.73, "mfu", "x")


def test_ceilings_unknown_gpu_cache_fills_by_rules():
    mm = {"fp32": {"tflops": 10.0}, "bf16": {"tflops": 100.0}}
    probe.save_cache(_gpu_result("Some Future GPU", mm, hbm={"copy_GBps": 900.0}))
    c = ceilings("Some Future GPU")
    assert c.hbm_GBps == 900.0 and c.source.startswith("probe")
    assert c.tflops == {"fp32": 10.0, "tf32": 50.0, "fp16": 100.0, "bf16": 100.0, "fp8": 100.0, "int8": 200.0}


def test_ceilings_datasheet_without_cache_and_with_broken_cache():
    c = ceilings("NVIDIA H100 80GB HBM3")
    assert c.source.startswith("datasheet H100 SXM") and c.hbm_GBps == 3350.0 and c.tflops["bf16"] == 989.5
    probe.cache_path("NVIDIA H200").parent.mkdir(parents=True, exist_ok=True)
    probe.cache_path("NVIDIA H200").write_text("{not json")
    c = ceilings("NVIDIA H200")
    assert c.source.startswith("datasheet H200") and c.hbm_GBps == 4800.0


def test_ceilings_a100_without_fp8_uses_fp16_rate():
    c = ceilings("NVIDIA A100-SXM4-80GB")
    assert c.tflops["fp8"] == c.tflops["fp16"] == 312.0 and c.tflops["int8"] == 624.0


def test_ceilings_unknown_gpu_without_anything_says_so():
    c = ceilings("Mystery GPU 9000")
    assert "run `warpforge probe`" in c.source and set(c.tflops) == set(PRECISIONS)


def test_ceilings_cpu_nominal_then_measured():
    c = ceilings("cpu")
    assert c.source.startswith("nominal CPU estimate")
    assert c.hbm_GBps == CPU_NOMINAL_GBPS and all(v == CPU_NOMINAL_TFLOPS for v in c.tflops.values())
    assert c.device == probe.cpu_name()
    probe.save_cache({"schema": probe.SCHEMA, "time": "t", "device": {"name": probe.cpu_name(), "kind": "cpu"},
                      "cpu": {"memcpy_GBps": 12.5, "fp32_matmul_GFLOPs": 150.0}})
    c = ceilings(torch.device("cpu"))
    assert c.source.startswith("probe (CPU") and c.hbm_GBps == 12.5
    assert all(v == pytest.approx(0.15) for v in c.tflops.values())
    assert ceilings(probe.cpu_name()).hbm_GBps == 12.5  # the CPU's name works too


def test_roofline_default_ceilings_are_the_current_device():
    r = roofline(0, 20e9, "fp32", 2000.0)
    expected = ceilings()
    assert r["memory_ms"] == pytest.approx(20e9 / (expected.hbm_GBps * 1e9) * 1e3)


def test_ceilings_from_probe_rejects_results_without_bandwidth():
    res = _gpu_result("NVIDIA H200", {"fp32": {"tflops": 1.0}}, hbm={"error": "boom"})
    with pytest.raises(ValueError, match="HBM"):
        ceilings_from_probe(res)
    assert json.loads(json.dumps(CEIL.as_dict()))["tflops"] == TF
