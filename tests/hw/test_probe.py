"""The probe: CPU path end to end through the CLI, the cache, the table, and (on a GPU) sane figures."""

from __future__ import annotations

import io
import json

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from warpforge.cli import main
from warpforge.hw import probe
from warpforge.hw._probe_measure import analyze_sweep
from warpforge.hw.roofline import ceilings
from warpforge.hw.specs import spec_for

CPU_LINE = "no CUDA GPU: measuring CPU-side figures only"


@pytest.fixture
def no_cuda(monkeypatch):
    """The CPU path, also on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cli_probe_cpu_quick_json(tmp_path, no_cuda):
    out = tmp_path / "probe.json"
    res = CliRunner().invoke(main, ["probe", "--quick", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert CPU_LINE in res.output
    assert "host memory copy" in res.output and "CPU fp32 matmul" in res.output
    data = json.loads(out.read_text())
    assert data["device"]["kind"] == "cpu" and data["device"]["name"] == probe.cpu_name()
    assert data["quick"] is True and data["schema"] == probe.SCHEMA
    assert data["cpu"]["memcpy_GBps"] > 0.1 and data["cpu"]["fp32_matmul_GFLOPs"] > 0.1
    assert [r["figure"] for r in data["figures"]][0] == "host memory copy (read + write)"
    # cached for the roofline, which now reports the measured CPU figures
    cached = probe.load_cached(probe.cpu_name())
    assert cached is not None and cached["cpu"] == data["cpu"]
    c = ceilings("cpu")
    assert c.source.startswith("probe (CPU") and c.hbm_GBps == pytest.approx(data["cpu"]["memcpy_GBps"])


def test_cli_probe_json_alone_on_stdout(no_cuda):
    """--json without a file: the result on stdout, the table on stderr; on a CPU the cache line does
    not promise a roofline that bench and profile compute for GPU runs only."""
    res = CliRunner().invoke(main, ["probe", "--quick", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["device"]["kind"] == "cpu" and "host memory copy" in res.stderr
    assert "roofline for GPU runs only" in res.stderr and "cached for the roofline" not in res.stderr


def test_cli_probe_no_cache(no_cuda):
    res = CliRunner().invoke(main, ["probe", "--quick", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert CPU_LINE in res.output
    assert probe.load_cached(probe.cpu_name()) is None
    assert not probe.cache_path(probe.cpu_name()).exists()


def test_run_probe_progress_reports_steps(no_cuda):
    seen = []
    result = probe.run_probe(quick=True, progress=lambda step, done, total: seen.append((step, done, total)))
    assert seen[0][1:] == (0, 1) and seen[-1] == ("done", 1, 1)
    assert "error" not in result["cpu"]
    json.dumps(result, allow_nan=False)


def test_cache_round_trip_is_atomic():
    result = {"schema": probe.SCHEMA, "device": {"name": "NVIDIA H200", "kind": "cuda"}, "hbm": {"copy_GBps": 1.5}}
    path = probe.save_cache(result)
    assert path == probe.cache_path("NVIDIA H200") and path.name == "nvidia-h200.json"
    assert probe.load_cached("NVIDIA H200") == result
    assert [p.name for p in path.parent.iterdir()] == ["nvidia-h200.json"]  # no temp file left behind
    result["hbm"]["copy_GBps"] = 2.5
    probe.save_cache(result)
    assert probe.load_cached("NVIDIA H200")["hbm"]["copy_GBps"] == 2.5


def test_load_cached_rejects_other_schema_and_garbage():
    assert probe.load_cached("NVIDIA H200") is None
    probe.save_cache({"schema": probe.SCHEMA + 1, "device": {"name": "NVIDIA H200"}})
    assert probe.load_cached("NVIDIA H200") is None
    probe.cache_path("NVIDIA H200").write_text("[1, 2")
    assert probe.load_cached("NVIDIA H200") is None


def test_cache_path_slug():
    assert probe.cache_path("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"
    assert probe.cache_path("CPU Intel(R) Xeon(R) Gold 6338").name == "cpu-intel-r-xeon-r-gold-6338.json"


def test_analyze_sweep_finds_plateau_stream_and_cliff():
    bw = {1: 11000, 2: 10500, 4: 10000, 8: 9800, 16: 9700, 24: 9700, 32: 9600, 40: 9000, 48: 7000, 56: 5500,
          64: 4600, 96: 4000, 128: 3950, 256: 3900, 512: 3900}
    r = analyze_sweep([{"MiB": k, "GBps": v} for k, v in bw.items()], l2_MiB=60)
    assert r["plateau_GBps"] == pytest.approx(9900)  # median of sets <= 30 MiB: 1..24
    assert r["stream_GBps"] == pytest.approx(3900)  # median of sets >= 240 MiB
    assert r["cliff_MiB"] == 56  # first set below (9900 + 3900) / 2 = 6900 (48 MiB: 7000 is not)


def test_analyze_sweep_flat_has_no_cliff():
    r = analyze_sweep([{"MiB": m, "GBps": 1000.0 + m} for m in (1, 8, 64, 512)], l2_MiB=4)
    assert r["cliff_MiB"] is None
    with pytest.raises(ValueError):
        analyze_sweep([], l2_MiB=4)


def _fake_gpu_result() -> dict:
    return {
        "schema": probe.SCHEMA, "time": "t", "quick": False, "elapsed_s": 41.0,
        "device": {"name": "NVIDIA H200", "kind": "cuda"}, "datasheet": spec_for("NVIDIA H200").as_dict(),
        "hbm": {"read_GBps": 4000.0, "write_GBps": 3300.0, "copy_GBps": 4200.0, "torch_copy_GBps": 4248.0},
        "sweep": {"points": [{"MiB": 1, "GBps": 11000.0}, {"MiB": 64, "GBps": 5000.0}, {"MiB": 512, "GBps": 3900.0}],
                  "plateau_GBps": 11000.0, "stream_GBps": 3900.0, "cliff_MiB": 64},
        "latency": {"l1": {"cycles": 34.0, "ns": 17.2, "chain_ok": True},
                    "l2": {"cycles": 300.0, "ns": 152.0, "chain_ok": True},
                    "hbm": {"cycles": 700.0, "ns": 354.0, "chain_ok": False}, "clock_MHz": 1977.0},
        "matmul": {"fp32": {"tflops": 50.6}, "tf32": {"tflops": 397.0}, "fp16": {"tflops": 755.7},
                   "bf16": {"tflops": 765.0}, "fp8": {"tflops": 1408.0}, "int8": {"error": "RuntimeError: nope"}},
        "launch": {"eager_us": 9.4, "eager_per_s": 106000.0, "graph_us": 1.04},
        "pcie": {"error": "RuntimeError: no pinned memory"},
    }


def test_figures_and_table_for_a_gpu_result():
    result = _fake_gpu_result()
    result["figures"] = probe.figures(result)
    rows = {r["figure"]: r for r in result["figures"]}
    copy = rows["HBM copy (warpforge copy, read + write)"]
    assert copy["datasheet"] == 4800 and copy["fraction"] == pytest.approx(4200 / 4800)
    assert rows["matmul bf16 (cuBLAS)"]["fraction"] == pytest.approx(765.0 / 989.5)
    assert rows["matmul int8 (cuBLAS)"]["error"].startswith("RuntimeError")
    assert rows["L2 cliff (working set)"]["fraction"] == pytest.approx(64 / 60)
    assert rows["host->device, pinned"]["error"] and rows["host->device, pinned"]["datasheet"] == 64
    assert "WRONG" in rows["HBM load-to-use latency"]["text"]
    assert rows["L2 bandwidth plateau (sets <= L2/2)"]["datasheet"] is None
    buf = io.StringIO()
    probe.render(result, Console(file=buf, width=160, color_system=None))
    text = buf.getvalue()
    for needle in ("NVIDIA H200", "4,200 GB/s", "88%", "34 cycles, 17.2 ns", "9.40 us (106,000/s)", "1.04 us",
                   "<- cliff", "error: RuntimeError: nope", "probe took 41.0 s"):
        assert needle in text, needle


def test_probe_plan_validates():
    import dataclasses

    with pytest.raises(ValueError, match="hbm_rep"):
        dataclasses.replace(probe.QUICK, hbm_rep=0)
    with pytest.raises(ValueError, match="sweep_MiB"):
        dataclasses.replace(probe.QUICK, sweep_MiB=())


# ---- on the GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_run_probe_quick_on_gpu_is_sane():
    r = probe.run_probe(quick=True)
    json.dumps(r, allow_nan=False)
    errors = {k: r[k]["error"] for k in ("hbm", "sweep", "latency", "matmul", "launch", "pcie") if "error" in r[k]}
    assert not errors, errors
    spec = spec_for(r["device"]["name"])
    hbm_ref = spec.hbm_GBps if spec else 500.0
    assert r["hbm"]["check_ok"]
    for key in ("read_GBps", "write_GBps", "copy_GBps"):
        assert 0.4 * hbm_ref < r["hbm"][key] < 1.1 * hbm_ref, (key, r["hbm"][key])
    sw = r["sweep"]
    assert sw["plateau_GBps"] > 1.3 * sw["stream_GBps"], sw
    assert sw["cliff_MiB"] is not None and 0.25 * r["device"]["l2_MiB"] <= sw["cliff_MiB"] <= 4 * r["device"]["l2_MiB"]
    lat = r["latency"]
    assert all(lat[lv]["chain_ok"] for lv in ("l1", "l2", "hbm"))
    assert 10 < lat["l1"]["cycles"] < lat["l2"]["cycles"] < lat["hbm"]["cycles"] < 3000, lat
    assert 0 < lat["l1"]["ns"] < lat["l2"]["ns"] < lat["hbm"]["ns"] < 2000, lat
    assert 300 < lat["clock_MHz"] < 3500
    for prec in ("fp32", "tf32", "fp16", "bf16"):
        tf = r["matmul"][prec]["tflops"]
        peak = spec.tflops[prec] if spec else None
        assert tf > 0 and (peak is None or 0.3 * peak < tf < 1.1 * peak), (prec, tf, peak)
    assert 0 < r["launch"]["graph_us"] < r["launch"]["eager_us"]
    assert r["pcie"]["h2d_pinned_GBps"] > 1 and r["pcie"]["d2h_pinned_GBps"] > 1
    assert r["elapsed_s"] < 60


@pytest.mark.gpu
def test_probe_meets_h200_targets(tmp_path):
    """The issue's done criteria: a full `warpforge probe` on an H200, as a user runs it (its own process).

    In a pytest process that had run other GPU tests first, cuBLAS bf16 read 651-664 TFLOP/s in all
    three trials (twice, on 2026-11-30), while `warpforge probe` right after read 778-786: the
    target is judged the way the figure is produced, in a fresh process."""
    import json
    import subprocess
    import sys

    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("H200 targets")
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "-m", "warpforge", "probe", "--json", str(out), "--no-cache"], check=True,
                   capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["elapsed_s"] < 60
    assert max(r["hbm"]["copy_GBps"], r["hbm"]["torch_copy_GBps"]) >= 4000, r["hbm"]
    assert r["hbm"]["copy_GBps"] >= 4000, r["hbm"]
    mm = {p: (round(v["tflops"]), [round(t, 3) for t in v["trial_ms"]])
          for p, v in r["matmul"].items() if "tflops" in v}
    assert r["matmul"]["bf16"]["tflops"] >= 740 and r["matmul"]["fp8"]["tflops"] >= 1300, mm
    assert r["launch"]["graph_us"] < 2.0 and r["launch"]["eager_us"] > r["launch"]["graph_us"]
    sw = r["sweep"]
    assert sw["plateau_GBps"] > 1.8 * sw["stream_GBps"] and 32 <= sw["cliff_MiB"] <= 96, sw
