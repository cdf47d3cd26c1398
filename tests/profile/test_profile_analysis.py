"""The analysis on synthetic timelines: classification, roofline placement, attribution and the time split."""

from __future__ import annotations

import math

import pytest
from profile_synth import H200, Builder, bandwidth_bound_toy, launch_bound_toy, toy_model

from warpforge.profile.analysis import LaunchCost, Row, analyze, place, short_kernel_name
from warpforge.profile.events import ITER_ANNOTATION, GpuEvent, HostSpan, Trace
from warpforge.profile.flops import Counts, OpCount

LAUNCH = LaunchCost(5.0, "test")


def run(b: Builder, launch: LaunchCost = LAUNCH):
    return analyze(b.trace(), b.counts(), ceilings=H200, launch=launch)


def kinds(a) -> set[str]:
    return {f["kind"] for f in a.findings}


def check_split(a) -> None:
    s = a.split
    assert math.isclose(s.busy_us + s.idle_us, s.window_us, rel_tol=1e-9)
    assert math.isclose(s.idle_host_us + s.idle_launch_us, s.idle_us, rel_tol=1e-6, abs_tol=1e-6)
    assert math.isclose(s.compute_us + s.memory_us + s.comm_us - s.overlap_us, s.busy_us, rel_tol=1e-9)


# ---- classification ----------------------------------------------------------------------------------

def test_launch_bound_toy():
    """1,000 kernels of 2 us with ~8 us gaps: launch-bound, with the evidence in the finding."""
    a = run(launch_bound_toy())
    assert a.verdict.startswith("launch-bound")
    f = next(f for f in a.findings if f["kind"] == "launch-bound")
    assert "1,000 kernels under 5.0 µs" in f["text"] and "CUDA graph" in f["text"]
    assert f["evidence"]["short_kernels_per_iter"] == 1000
    assert f["evidence"]["mean_kernel_us"] == pytest.approx(2.0)
    assert f["evidence"]["mean_gap_us"] == pytest.approx(8.0, abs=0.5)
    assert a.split.busy_us / a.split.window_us == pytest.approx(0.2, abs=0.01)
    check_split(a)


def test_launch_bound_needs_the_launch_cost_to_exceed_the_kernels():
    """The same toy against a 1 us launch cost: its kernels are not 'short', so not launch-bound."""
    a = run(launch_bound_toy(), launch=LaunchCost(1.0, "test"))
    assert "launch-bound" not in kinds(a)
    assert a.verdict.startswith("host-bound")  # the GPU still waits on the host


def test_bandwidth_bound_toy():
    """One long copy at 90% of the HBM roof per iteration: memory-bound, placed at 0.9."""
    a = run(bandwidth_bound_toy(0.9))
    assert a.verdict.startswith("memory-bound")
    (row,) = a.ops
    assert row.bound == "memory" and row.fraction == pytest.approx(0.9, rel=1e-6)
    assert row.GBps == pytest.approx(0.9 * H200.hbm_GBps, rel=1e-6)
    assert "launch-bound" not in kinds(a) and "host-bound" not in kinds(a)
    near = next(f for f in a.findings if f["kind"] == "near-roof")
    assert "90% of the memory roof" in near["text"]
    check_split(a)


def test_low_bandwidth_copy_is_called_out():
    a = run(bandwidth_bound_toy(0.23))
    f = next(f for f in a.findings if f["kind"] == "below-roof")
    assert "runs at 23% of the memory roof" in f["text"]


def test_host_bound_toy():
    """Long kernels separated by long host work outside any op: the GPU waits on Python."""
    b = Builder()
    for _ in range(2):
        with b.iteration():
            for _ in range(5):
                b.op("aten::mul", [("mul_kernel", 50.0)], flops=1, nbytes=4, host_us=3.0)
                b.python(200.0)
    a = run(b)
    assert a.verdict.startswith("host-bound")
    f = next(f for f in a.findings if f["kind"] == "host-bound")
    assert f["evidence"]["gaps"][0]["host_was_in"] == "Python between operators"
    assert a.split.idle_host_us > 0.7 * a.split.window_us
    check_split(a)


# ---- roofline placement --------------------------------------------------------------------------

def _row(flops, nbytes, time_us, ceiling="tf32") -> Row:
    return Row(name="r", module="", op="op", kind="matmul", calls=1, time_us=time_us, share=1.0, flops=flops,
               bytes=nbytes, ceiling=ceiling)


def test_place_compute_bound_point():
    r = _row(1e12, 1e9, 4000.0)  # 1 TFLOP in 4 ms against 494.5 TFLOP/s tf32
    place(r, H200)
    assert r.bound == "compute"
    assert r.tflops == pytest.approx(250.0)
    assert r.intensity == pytest.approx(1000.0)
    assert r.floor_us == pytest.approx(1e12 / 494.5e12 * 1e6)
    assert r.fraction == pytest.approx(r.floor_us / 4000.0)


def test_place_memory_bound_point():
    r = _row(1e9, 4.8e9, 2000.0)  # 4.8 GB in 2 ms against 4.8 TB/s: half the roof
    place(r, H200)
    assert r.bound == "memory" and r.fraction == pytest.approx(0.5)
    assert r.GBps == pytest.approx(2400.0)


def test_place_on_the_ridge_counts_as_memory():
    ridge = H200.tflops["bf16"] * 1e12 / (H200.hbm_GBps * 1e9)
    r = _row(ridge * 1e9, 1e9, 1000.0, ceiling="bf16")
    place(r, H200)
    assert r.bound == "memory"


def test_place_without_ceilings_gives_rates_only():
    r = _row(1e9, 1e9, 1000.0)
    place(r, None)
    assert r.tflops == pytest.approx(1.0) and r.fraction is None and r.bound is None


def test_place_without_a_precision_ceiling_skips_the_roof():
    r = _row(1e9, 1e9, 1000.0, ceiling=None)  # float64 work: no ceiling in the table
    place(r, H200)
    assert r.tflops is not None and r.fraction is None


# ---- attribution ---------------------------------------------------------------------------------

def test_toy_model_attribution():
    a = run(toy_model(iters=3))
    assert a.iterations == 3
    by = {r.name: r for r in a.ops}
    lin = by["blocks.1.fc / aten::linear"]  # the kernel launched from the inner aten::addmm
    assert lin.calls == 1 and lin.time_us == pytest.approx(80.0) and lin.flops == pytest.approx(2e10)
    assert lin.bound == "compute"
    mul = by["blocks.0 / aten::mul"]
    assert mul.calls == 8 and mul.time_us == pytest.approx(16.0)
    tri = by["blocks.2 / triton::_fused_gelu_kernel"]
    assert tri.bytes == pytest.approx(8e7) and tri.bound == "memory"
    graph = by["head / cuda_graph_replay"]
    assert graph.graph and graph.flops is None and graph.time_us == pytest.approx(3 * (6.0 + 3.0))
    assert any("replayed from CUDA graphs" in n for n in a.notes)
    assert "syncs" in kinds(a)
    kern = {k.op: k for k in a.kernels}
    conv = kern["sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc"]
    assert conv.flops == pytest.approx(1.2e11) and conv.launched == ["stem.conv / aten::conv2d"]
    assert kern["void gemv_kernel<float>()"].flops is None  # graph kernels carry no per-kernel work
    assert sum(r.share for r in a.ops) == pytest.approx(1.0)
    check_split(a)


def test_instances_match_counted_calls_in_order():
    """Two calls of one op in one module with different work: each kernel gets its own call's work."""
    b = Builder()
    for _ in range(2):
        with b.iteration(), b.module("attn"):
            b.op("aten::bmm", [("bmm_small", 10.0)], flops=1e9, nbytes=1e6, kind="matmul", ceiling="bf16")
            b.op("aten::bmm", [("bmm_large", 40.0)], flops=8e9, nbytes=4e6, kind="matmul", ceiling="bf16")
    a = run(b)
    kern = {k.op: k for k in a.kernels}
    assert kern["bmm_small"].flops == pytest.approx(1e9) and kern["bmm_large"].flops == pytest.approx(8e9)
    (row,) = a.ops
    assert row.calls == 2 and row.flops == pytest.approx(9e9)
    assert not any("different number of times" in n for n in a.notes)


def test_call_count_mismatch_averages_and_says_so():
    b = Builder()
    with b.iteration():
        for _ in range(3):
            b.op("aten::mm", [("mm", 10.0)], kind="matmul", counted=False)
    b.records = [OpCount("", "aten::mm", "matmul", 600, 60, "bf16", "")] * 2  # the counted call saw two
    a = run(b)
    assert a.ops[0].flops == pytest.approx(1200)  # the counted total, spread over three calls
    assert any("different number of times" in n for n in a.notes)


def test_work_launched_outside_the_window_is_dropped():
    b = Builder()
    b.op("aten::mul", [("warmup_kernel", 100.0)])  # the profiler's warm-up call: no iteration range
    with b.iteration():
        b.op("aten::mul", [("mul_kernel", 10.0)], flops=1, nbytes=1)
    a = run(b)
    assert [k.op for k in a.kernels] == ["mul_kernel"]
    assert a.split.busy_us == pytest.approx(10.0)


def test_cpu_trace_uses_host_time_and_omits_the_roofline():
    host = [HostSpan(ITER_ANNOTATION, "annotation", 0.0, 100.0), HostSpan("module:fc", "annotation", 1.0, 60.0),
            HostSpan("aten::linear", "op", 2.0, 50.0), HostSpan("aten::t", "op", 3.0, 2.0),
            HostSpan("aten::addmm", "op", 6.0, 40.0), HostSpan("aten::relu", "op", 70.0, 10.0)]
    counts = Counts(records=[OpCount("fc", "aten::addmm", "matmul", 1000, 100, "fp32", ""),
                             OpCount("", "aten::relu", "pointwise", 10, 80, "fp32", "")])
    a = analyze(Trace(host=host, device_type="cpu"), counts, ceilings=H200, launch=LAUNCH)
    by = {r.name: r for r in a.ops}
    assert set(by) == {"fc / aten::addmm", "fc / aten::t", "(root) / aten::relu"}
    assert by["fc / aten::addmm"].time_us == 40.0 and by["fc / aten::addmm"].fraction is None
    assert a.ceilings is None and a.kernels == [] and a.launch is None
    assert a.verdict.startswith("CPU run") and any("roofline is omitted" in n for n in a.notes)
    assert a.split.window_us == 100.0 and a.split.ops_us == pytest.approx(52.0)


def test_empty_window_raises():
    with pytest.raises(ValueError, match="empty window"):
        analyze(Trace(device_type="cuda"), Counts(), ceilings=H200, launch=LAUNCH)
    only_iter = Trace(host=[HostSpan(ITER_ANNOTATION, "annotation", 0.0, 5.0)], device_type="cpu")
    with pytest.raises(ValueError, match="no operator ran"):
        analyze(only_iter, Counts())


def test_unattributed_device_work_counts_in_the_split():
    host = [HostSpan(ITER_ANNOTATION, "annotation", 0.0, 50.0), HostSpan("aten::mul", "op", 1.0, 5.0),
            HostSpan("cudaLaunchKernel", "runtime", 2.0, 3.0, correlation=1)]
    gpu = [GpuEvent("mul", "kernel", 6.0, 10.0, correlation=1), GpuEvent("ncclKernel_AllReduce", "kernel", 20.0, 20.0,
                                                                        correlation=None)]
    a = analyze(Trace(host, gpu, "cuda"), Counts(), ceilings=H200, launch=LAUNCH)
    assert a.split.comm_us == pytest.approx(20.0) and a.split.compute_us == pytest.approx(10.0)
    assert any(k.op == "ncclKernel_AllReduce" for k in a.kernels)
    check_split(a)


def test_short_kernel_names():
    assert (short_kernel_name("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>"
                              "(int, at::native::AddFunctor<float>, at::detail::Array<char*, 3>)")
            == "vectorized_elementwise_kernel<4, AddFunctor<float>>")
    assert short_kernel_name("_copy_kernel") == "_copy_kernel"
    assert short_kernel_name("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(float*)") \
        == "softmax_warp_forward<float, float, float, 10>"
    assert len(short_kernel_name("k" * 200)) == 80


def test_bare_runtime_launch_is_named_by_its_kernel_not_as_triton():
    """A kernel launched through cudaLaunchKernel outside any op (a C++ extension): its own name."""
    b = Builder()
    with b.iteration(), b.module("ext"):
        b._launch([("my_extension_kernel", 30.0)])
    a = run(b)
    assert [r.name for r in a.ops] == ["ext / my_extension_kernel"]


def test_compiled_regions_are_looked_through():
    """Inductor wraps each Triton kernel in a range named after it, inside 'Torch-Compiled Region':
    every kernel keeps its own row instead of one row for the whole region."""
    b = Builder()
    with b.iteration(), b.region("Torch-Compiled Region: 0/0"):
        b.op("triton_poi_fused_gelu_0", [("triton_poi_fused_gelu_0", 12.0)], counted=False)
        b.op("aten::mm", [("gemm", 30.0)], counted=False)  # an extern kernel call inside the graph
        b.op("triton_red_fused_sum_1", [("triton_red_fused_sum_1", 8.0)], counted=False)
    a = run(b)
    assert sorted(r.name for r in a.ops) == ["(root) / aten::mm", "(root) / triton_poi_fused_gelu_0",
                                             "(root) / triton_red_fused_sum_1"]
