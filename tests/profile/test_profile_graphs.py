"""Kernels replayed from CUDA graphs find the eager operators that launched them; the profiler's own cost.

Synthetic timelines (``profile_synth``) stand in for a GPU trace: a decode-like step replays one graph
(an embedding gather, a norm, two linears and a kernel the counted call never launched) and launches the
LM head eagerly. The counted call is the graph's eager twin, in its call order.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from profile_synth import H200, Builder
from warpforge.profile.analysis import analyze, short_kernel_name
from warpforge.profile.attribute import GRAPH_LABEL, attribute
from warpforge.profile.events import COUNT_PREFIX, GpuEvent, HostSpan, Trace, iteration_load, parse_kineto, \
    work_in_ranges
from warpforge.profile.flops import Counts, FlopCounter, OpCount, kernels_by_record

EMBED = "void indexSelectSmallIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>()"


def decode_like(iters: int = 2, norms: int = 1) -> Builder:
    b = Builder(root_type="Llama")
    for _ in range(iters):
        with b.iteration():
            b.memcpy(64, 1.0)  # the step's inputs, uploaded eagerly
            b.graph([(EMBED, 2.0)] + [("_norm_kernel", 3.0)] * norms
                    + [("_linear_kernel", 5.0), ("_linear_kernel", 9.0), ("mystery_kernel", 4.0)])
            b.triton("_linear_kernel", 20.0, nbytes=0)  # the LM head, eager, outside the graph
            b.sync()
    return b


def twin_records() -> list[OpCount]:
    """The eager twin's counted call: the model's operators in call order, then the LM head."""
    return [OpCount("", "aten::copy_", "movement", 0, 128, "fp32", ""),
            OpCount("embed", "aten::embedding", "movement", 0, 4096, "bf16", ""),
            OpCount("layers.0.norm", "triton::_norm_kernel", "triton", 0, 1000, "bf16", ""),
            OpCount("layers.0.qkv", "triton::_linear_kernel", "matmul", 2_000_000, 1_000_000, "bf16", ""),
            OpCount("layers.0.o", "triton::_linear_kernel", "matmul", 4_000_000, 2_000_000, "bf16", ""),
            OpCount("", "triton::_linear_kernel", "matmul", 50_000_000, 25_000_000, "bf16", "")]


def rows(a):
    return {r.name: r for r in a.ops}


def test_replayed_triton_kernels_take_the_module_and_work_of_their_eager_launch():
    a = analyze(decode_like().trace(), Counts(records=twin_records()), ceilings=H200)
    by = rows(a)
    qkv, o = by["layers.0.qkv / triton::_linear_kernel"], by["layers.0.o / triton::_linear_kernel"]
    # One-to-one in launch order: the first replayed _linear_kernel (5 us) is qkv's, the second (9 us) o's.
    assert (qkv.time_us, qkv.flops, qkv.bytes, qkv.calls) == (5.0, 2e6, 1e6, 1.0)
    assert (o.time_us, o.flops, o.bytes) == (9.0, 4e6, 2e6)
    assert qkv.graph and o.graph and qkv.fraction is not None and o.bound == "memory"
    assert by["layers.0.norm / triton::_norm_kernel"].bytes == 1000
    # The eager LM head keeps its own record (its key is seen eagerly, so it is not offered to the graph).
    head = by["(root) / triton::_linear_kernel"]
    assert head.flops == 5e7 and not head.graph and head.time_us == 20.0
    # Untraced counting names only Triton kernels: the gather and the stranger stay with the launch site.
    rest = by[f"(root) / {GRAPH_LABEL}"]
    assert rest.time_us == pytest.approx(6.0) and rest.flops is None
    assert sorted(rest.launched) == sorted([short_kernel_name(EMBED, 60), "mystery_kernel"])
    note = next(n for n in a.notes if "replayed from CUDA graphs" in n)
    assert "3 matched one-to-one" in note and "2 the counted call never launched" in note
    kern = next(k for k in a.kernels if k.op == "_linear_kernel")
    assert kern.calls == 3 and kern.bytes == 1e6 + 2e6 + 25e6 and kern.fraction is not None
    unplaced = sum(r.share for r in a.ops if r.fraction is None)
    assert unplaced == pytest.approx(6.0 / sum(r.time_us for r in a.ops))  # the two unmatched kernels only


def test_traced_counting_places_aten_kernels_replayed_from_a_graph():
    counts = Counts(records=twin_records(), kernels={1: [EMBED], 2: ["_norm_kernel"], 3: ["_linear_kernel"],
                                                     4: ["_linear_kernel"], 5: ["_linear_kernel"],
                                                     0: ["Memcpy HtoD (Pageable -> Device)"]})
    a = analyze(decode_like().trace(), counts, ceilings=H200)
    by = rows(a)
    emb = by["embed / aten::embedding"]
    assert emb.graph and emb.bytes == 4096 and emb.time_us == 2.0 and emb.fraction is not None
    assert by[f"(root) / {GRAPH_LABEL}"].launched == ["mystery_kernel"]
    assert "4 matched one-to-one" in next(n for n in a.notes if "replayed from CUDA graphs" in n)


def test_counts_that_differ_fall_back_to_the_average_and_say_so():
    a = analyze(decode_like(norms=2).trace(), Counts(records=twin_records()), ceilings=H200)
    norm = rows(a)["layers.0.norm / triton::_norm_kernel"]
    assert norm.calls == 2 and norm.bytes == 1000  # two replayed kernels share the one counted launch's bytes
    k = next(k for k in a.kernels if k.op == "_norm_kernel")
    assert k.bytes == 1000 and k.calls == 2
    note = next(n for n in a.notes if "replayed from CUDA graphs" in n)
    assert "_norm_kernel 2 replayed vs 1 counted" in note and "average" in note


def test_without_an_eager_twin_the_graph_stays_whole():
    a = analyze(decode_like().trace(), Counts(), ceilings=H200)
    graph = rows(a)[f"(root) / {GRAPH_LABEL}"]
    assert graph.time_us == pytest.approx(2 + 3 + 5 + 9 + 4) and graph.calls == 1
    assert any("none is a kernel the counted call launched" in n for n in a.notes)


def test_attribute_takes_a_kernel_map():
    b = decode_like(iters=1)
    att = attribute(b.trace(), twin_records(), lambda i: [EMBED] if i == 1 else [])
    emb = [i for i in att.instances if i.label == "aten::embedding"]
    assert len(emb) == 1 and emb[0].module == "embed" and emb[0].work.bytes == 4096 and emb[0].graph


# ---- which kernels each counted operator launched ------------------------------------------------------

def test_work_in_ranges_links_launches_to_the_enclosing_count_range():
    host = [HostSpan(f"{COUNT_PREFIX}1", "op", 0.0, 10.0, tid=1),
            HostSpan("cudaLaunchKernel", "runtime", 2.0, 1.0, tid=1, correlation=11),
            HostSpan("cudaLaunchKernel", "runtime", 4.0, 1.0, tid=1, correlation=12),
            HostSpan(f"{COUNT_PREFIX}2", "op", 20.0, 10.0, tid=1),
            HostSpan("cudaStreamSynchronize", "runtime", 21.0, 1.0, tid=1, correlation=13),  # not a launch
            HostSpan("cuLaunchKernelEx", "runtime", 25.0, 1.0, tid=1, correlation=14),
            HostSpan("cudaLaunchKernel", "runtime", 40.0, 1.0, tid=1, correlation=15),  # outside every range
            HostSpan("cudaLaunchKernel", "runtime", 5.0, 1.0, tid=2, correlation=16)]  # another thread
    gpu = [GpuEvent("b", "kernel", 9.0, 1.0, correlation=12), GpuEvent("a", "kernel", 6.0, 1.0, correlation=11),
           GpuEvent("s", "kernel", 22.0, 1.0, correlation=13), GpuEvent("t", "kernel", 27.0, 1.0, correlation=14),
           GpuEvent("u", "kernel", 41.0, 1.0, correlation=15), GpuEvent("v", "kernel", 7.0, 1.0, correlation=16)]
    assert work_in_ranges(Trace(host=host, gpu=gpu, device_type="cuda")) == {1: ["a", "b"], 2: ["t"]}
    # A Triton launch inside a custom operator: its range nests; launches after it ends are the outer one's.
    host = [HostSpan(f"{COUNT_PREFIX}1", "op", 0.0, 20.0, tid=1), HostSpan(f"{COUNT_PREFIX}2", "op", 2.0, 5.0, tid=1),
            HostSpan("cuLaunchKernel", "runtime", 3.0, 1.0, tid=1, correlation=1),
            HostSpan("cudaLaunchKernel", "runtime", 10.0, 1.0, tid=1, correlation=2)]
    gpu = [GpuEvent("inner", "kernel", 5.0, 1.0, correlation=1), GpuEvent("outer", "kernel", 12.0, 1.0, correlation=2)]
    assert work_in_ranges(Trace(host=host, gpu=gpu, device_type="cuda")) == {2: ["inner"], 1: ["outer"]}


def test_the_counter_wraps_each_operator_call_in_a_numbered_range():
    """A real (CPU) profiler trace of a marked counting pass: each record's range holds its operator, and
    device work launched inside a range is credited to that record."""
    from torch.profiler import ProfilerActivity, profile

    from warpforge.profile.trace import export_trace, profiler_options

    x = torch.randn(16, 16)
    counter = FlopCounter(mark=True)
    with profile(activities=[ProfilerActivity.CPU], **profiler_options()) as prof, torch.inference_mode():
        with counter:
            (x @ x).relu()
    trace = parse_kineto(export_trace(prof), device_type="cpu")
    recs = counter.counts.records
    assert [r.op for r in recs] == ["aten::matmul", "aten::relu"] and len(counter.call_of) == 2
    ranges = {s.name: s for s in trace.host if s.name.startswith(COUNT_PREFIX)}
    for r, call in zip(recs, counter.call_of):
        rng = ranges[f"{COUNT_PREFIX}{call}"]
        assert any(s.name == r.op and rng.ts_us <= s.ts_us and s.end_us <= rng.end_us + 1e-3 for s in trace.host)
    # A launch inside relu's range (as CUPTI would record it on a GPU) is relu's kernel.
    rng = ranges[f"{COUNT_PREFIX}{counter.call_of[1]}"]
    trace.host.append(HostSpan("cudaLaunchKernel", "runtime", rng.ts_us + rng.dur_us / 2, 0.0, tid=rng.tid,
                               correlation=99))
    trace.gpu.append(GpuEvent("relu_kernel", "kernel", rng.end_us + 5, 1.0, correlation=99))
    assert kernels_by_record(trace, counter.call_of) == {1: ["relu_kernel"]}


def test_unmarked_counting_opens_no_ranges_and_triton_records_name_their_kernel():
    counter = FlopCounter()
    assert isinstance(counter.range(3), contextlib.nullcontext)
    call = counter.record_triton("_copy_kernel", {"x": torch.ones(4), "n": 4}, None)
    assert call == 1 and counter.call_of == [1]
    c = Counts(records=counter.counts.records)
    assert c.kernels_of(0) == ["_copy_kernel"]
    c.kernels = {}  # a traced call that launched nothing: authoritative, no fallback to the name
    assert c.kernels_of(0) == []


# ---- the profiler's own cost ----------------------------------------------------------------------

def test_overhead_is_profiled_over_plain_minus_one():
    from warpforge.profile.trace import overhead, plain_window_ms

    assert overhead(1.2, 1.0) == pytest.approx(0.2)
    assert overhead(0.98, 1.0) == pytest.approx(-0.02)
    assert overhead(1.0, None) is None and overhead(1.0, 0.0) is None
    assert plain_window_ms(1.0, 3.0) == 2.0 and plain_window_ms(None, 3.0) is None


def test_overhead_finding_says_what_the_profiler_recorded():
    from warpforge.profile.api import OVERHEAD_LIMIT, overhead_finding

    load = {"host_ops": 40.0, "runtime_calls": 30.0, "graph_kernels": 165.0, "graph_launch_host_us": 153.0}
    f = overhead_finding(0.2, 1.416, 1.18, load)
    assert f["kind"] == "profiler-overhead" and f["severity"] == pytest.approx(0.2 / 1.2, abs=1e-4)
    assert "20%" in f["text"] and "165 kernels replayed from CUDA graphs" in f["text"] and "153 µs" in f["text"]
    assert overhead_finding(OVERHEAD_LIMIT * 0.9, 1.0, 1.0, load) is None
    assert overhead_finding(None, 1.0, None, load) is None


def test_iteration_load_counts_what_each_iteration_traced():
    load = iteration_load(decode_like(iters=2).trace())
    assert load["graph_launches"] == 1 and load["graph_kernels"] == 5 and load["graph_launch_host_us"] == 6.0
    # per iteration: the copy's launch, the graph launch, the LM head's launch (+ the sync, not a launch)
    assert load["launches"] == 3 and load["runtime_calls"] == 4
    assert load["host_ops"] == 2  # aten::copy_ and aten::item
    assert iteration_load(Trace()) == {}


def test_profiler_options_are_the_light_ones():
    from warpforge.profile.trace import profiler_options

    opts = profiler_options()
    for k in ("record_shapes", "with_stack", "profile_memory", "with_flops", "with_modules"):
        assert opts[k] is False, k
    cls = torch._C._profiler._ExperimentalConfig
    try:
        want = cls(disable_external_correlation=True).__getstate__()
    except TypeError:  # a torch without the option: nothing to ask for
        assert "experimental_config" not in opts
    else:
        assert opts["experimental_config"].__getstate__() == want != cls().__getstate__()


def test_the_measured_window_uses_those_options(monkeypatch):
    import torch.profiler as tp

    from warpforge.profile import profile
    from warpforge.profile.trace import profiler_options

    seen = []
    real = tp.profile

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tp, "profile", spy)
    p = profile(lambda x: x * 2, torch.ones(8), warmup=0, iters=2, measure_overhead=False, overhead_parts=True)
    assert len(seen) == 1  # the window only: the counting pass is traced on a GPU alone, parts too
    got = {k: v for k, v in seen[0].items() if k != "activities"}
    want = profiler_options()
    assert set(got) == set(want) and all(got[k] == want[k] for k in want if k != "experimental_config")
    assert p.overhead_parts is None and p.as_dict()["timing"]["overhead_parts"] is None


def test_overhead_parts_reach_the_json_and_the_report():
    from warpforge.profile.api import Profile
    from warpforge.profile.report import render_html

    b = decode_like()
    a = analyze(b.trace(), Counts(records=twin_records()), ceilings=H200)
    meta = {"device": "synthetic", "device_type": "cuda", "iters": 2, "torch": torch.__version__,
            "time": "2026-01-01T00:00:00+00:00", "warmup": 0, "grad": False}
    p = Profile(target="decode-like", meta=meta, analysis=a,
                counts=Counts(records=twin_records()), window_ms=1.2, plain_ms=1.0,
                load=iteration_load(b.trace()), parts_ms={"cpu": 1.05, "cuda": 1.15})
    t = p.as_dict()["timing"]
    assert t["overhead"] == pytest.approx(0.2)
    assert t["overhead_parts"] == pytest.approx({"cpu": 0.05, "cuda": 0.15})
    assert t["traced_per_iter"]["graph_kernels"] == 5
    html = render_html(p.as_dict())
    assert "CUDA half of it alone" in html and "15%" in html
