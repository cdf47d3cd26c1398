"""Parsing a Kineto trace (the JSON torch.profiler exports) into the analysis' events."""

from __future__ import annotations

import pytest

from warpforge.profile.analysis import LaunchCost, analyze
from warpforge.profile.events import GpuEvent, HostSpan, Trace, parse_kineto
from warpforge.profile.flops import Counts, OpCount

# The shape of a CUDA Kineto trace: host ops on the Python thread, a runtime launch inside aten::mm with a
# correlation id, the kernel on stream 7 with the same id, an ac2g flow pair, a GPU-side annotation copy,
# our ranges as fast record functions (Kineto files those as cpu_op), and a Triton driver launch.
KINETO = {"schemaVersion": 1, "traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
    {"ph": "X", "cat": "cpu_op", "name": "warpforge:iter", "pid": 1, "tid": 11, "ts": 100.0, "dur": 60.0, "args": {}},
    {"ph": "X", "cat": "cpu_op", "name": "module:fc", "pid": 1, "tid": 11, "ts": 101.0, "dur": 40.0, "args": {}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 11, "ts": 102.0, "dur": 20.0,
     "args": {"External id": 5}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 11, "ts": 104.0, "dur": 15.0,
     "args": {"External id": 6}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 11, "ts": 106.0, "dur": 5.0,
     "args": {"External id": 6, "cbid": 211, "correlation": 900}},
    {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n", "pid": 0, "tid": 7, "ts": 112.0,
     "dur": 40.0, "args": {"External id": 6, "device": 0, "stream": 7, "correlation": 900, "grid": [4, 1, 1]}},
    {"ph": "s", "id": 900, "pid": 1, "tid": 11, "ts": 106.0, "cat": "ac2g", "name": "ac2g"},
    {"ph": "f", "id": 900, "pid": 0, "tid": 7, "ts": 112.0, "cat": "ac2g", "name": "ac2g", "bp": "e"},
    {"ph": "X", "cat": "gpu_user_annotation", "name": "module:fc", "pid": 0, "tid": 7, "ts": 112.0, "dur": 40.0},
    {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "pid": 1, "tid": 11, "ts": 135.0, "dur": 4.0,
     "args": {"correlation": 901}},
    {"ph": "X", "cat": "kernel", "name": "_fused_gelu_kernel", "pid": 0, "tid": 7, "ts": 153.0, "dur": 10.0,
     "args": {"device": 0, "stream": 7, "correlation": 901}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 7, "ts": 170.0,
     "dur": 2.0, "args": {"device": 0, "stream": 7, "correlation": 950, "bytes": 4096}},
    {"ph": "X", "cat": "python_function", "name": "forward", "pid": 1, "tid": 11, "ts": 100.5, "dur": 1.0},
    {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": 1, "tid": 0, "ts": 0.0, "dur": 500.0},
]}


def test_parse_kinds_and_correlations():
    t = parse_kineto(KINETO)
    assert t.device_type == "cuda"
    kinds = {(s.name, s.kind) for s in t.host}
    assert ("warpforge:iter", "annotation") in kinds and ("module:fc", "annotation") in kinds
    assert ("aten::addmm", "op") in kinds and ("cuLaunchKernelEx", "runtime") in kinds
    assert not any(s.name == "forward" for s in t.host)  # python stack frames are not spans we use
    launch = next(s for s in t.host if s.name == "cudaLaunchKernel")
    assert launch.correlation == 900
    assert [(g.kind, g.correlation, g.stream) for g in t.gpu] == [("kernel", 900, 7), ("kernel", 901, 7),
                                                                   ("memcpy", 950, 7)]
    assert t.gpu[2].bytes == 4096


def test_parsed_trace_attributes_kernels_to_operators():
    counts = Counts(records=[OpCount("fc", "aten::linear", "matmul", 2 * 64 * 64 * 64, 3 * 64 * 64 * 4, "tf32", ""),
                             OpCount("fc", "triton::_fused_gelu_kernel", "triton", 0, 8 * 4096, "fp32", "")])
    a = analyze(parse_kineto(KINETO), counts, launch=LaunchCost(5.0, "test"))
    by = {r.name: r for r in a.ops}
    assert by["fc / aten::linear"].time_us == 40.0  # launched from the inner addmm, filed under linear
    assert by["fc / aten::linear"].flops == 2 * 64 ** 3
    assert by["fc / triton::_fused_gelu_kernel"].bytes == 8 * 4096  # the driver launch is named by its kernel
    # The DtoH copy has no launch record in this trace: kept in the time split, in no operator row.
    assert a.split.memory_us == 2.0
    assert any("no launch record" in n for n in a.notes)


def test_cpu_trace_has_no_device_events():
    cpu = {"traceEvents": [e for e in KINETO["traceEvents"] if e.get("cat") in ("cpu_op",)]}
    t = parse_kineto(cpu)
    assert t.device_type == "cpu" and t.gpu == []


def test_not_a_trace():
    with pytest.raises(ValueError, match="traceEvents"):
        parse_kineto({"events": []})


def test_trace_validates_events():
    with pytest.raises(ValueError, match="kind"):
        Trace(host=[HostSpan("x", "cpu", 0.0, 1.0)])
    with pytest.raises(ValueError, match="negative"):
        Trace(gpu=[GpuEvent("k", "kernel", 0.0, -1.0)])
