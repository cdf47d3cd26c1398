"""The light timed window on synthetic traces: device times move from the CUDA-only window onto the detail
window's operators when both launched the same work, and anything else falls back to the detail window with a
note. Also the host's head start (the GPU sleep in front of every window), where a CPU can check it."""

from __future__ import annotations

import pytest

from profile_synth import H200, Builder
from warpforge.profile.analysis import analyze
from warpforge.profile.attribute import attribute
from warpforge.profile.events import ITER_ANNOTATION
from warpforge.profile.window import PAD_KERNEL, Warp, groups, transfer

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
NORM = "_norm_kernel"
ADD = "void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>()"


def run(b: Builder, iters: int = 3, *, scale: float = 1.0, extra: dict[int, str] | None = None,
        norm: str = NORM, pad_us: float = 200.0, warm: bool = False) -> Builder:
    """A small model: a linear (addmm inside), a Triton norm, a graph of two adds and a sync per iteration.
    Device times are scaled by ``scale``; ``extra[i]`` adds one more add kernel to iteration i. ``warm``: one
    untimed call first, as each profiler session makes before its window."""
    def body(i: int) -> None:
        with b.module("fc"):
            b.op("aten::linear", [(GEMM, 40.0 * scale)], flops=2e9, nbytes=4e6, kind="matmul", ceiling="bf16",
                 inner="aten::addmm", host_us=6.0)
        with b.module("norm"):
            b.triton(norm, 12.0 * scale, nbytes=8e6)
        b.graph([(ADD, 3.0 * scale), (ADD, 5.0 * scale)])
        if extra and i in extra:
            b.op("aten::add", [(extra[i], 2.0 * scale)], nbytes=1e3)
        b.sync()
        b.python(20.0)

    if warm:
        body(-1)
        b.sync()
    b.pad(pad_us)
    for i in range(iters):
        with b.iteration():
            body(i)
    return b


def detail(iters: int = 3, **kw) -> Builder:
    return run(Builder(root_type="Toy"), iters, **kw)


def timed(iters: int = 3, **kw) -> Builder:
    """The same run as the light window sees it: another clock, a host twice as fast, its own device times."""
    b = Builder(root_type="Toy", bare=True, host_scale=0.5, t=50_000.0, g=50_000.0)
    return run(b, iters, warm=True, **kw)


def test_matching_windows_move_the_timed_device_times_onto_the_detail_operators():
    d, t = detail(), timed(scale=0.9)
    tr = transfer(d.trace(), t.trace())
    assert tr.trace is not None, tr.note
    assert "light window" in tr.note and "3 launches per iteration x 3 iterations" in tr.note
    full = analyze(d.trace(), d.counts(), ceilings=H200)
    light = analyze(tr.trace, d.counts(), ceilings=H200)
    # Operators: the detail window's, with their counted work; nothing left without an operator.
    assert [(r.name, r.calls, r.flops, r.bytes) for r in light.ops] == \
        [(r.name, r.calls, r.flops, r.bytes) for r in full.ops]
    # Device times: the timed window's (0.9x the detail's here), kernel by kernel.
    kt = {r.op: r.time_us for r in light.kernels}
    assert kt[GEMM] == pytest.approx(36.0) and kt["_norm_kernel"] == pytest.approx(10.8)
    assert kt[ADD] == pytest.approx(7.2)
    assert light.split.busy_us == pytest.approx(0.9 * full.split.busy_us)
    # Every timed device event of the iterations is in the merged trace, none of the untimed call's.
    merged_ids = {(g.correlation, g.ts_us) for g in tr.trace.gpu}
    t_groups, _ = groups(t.trace())
    pad_at = max(i for i, gr in enumerate(t_groups) if gr.is_pad)
    assert merged_ids == {(g.correlation, g.ts_us) for gr in t_groups[pad_at:] for g in gr.work}
    # What the light window traced: its runtime calls and graph nodes, no operator records.
    assert tr.load["host_ops"] == 0 and tr.load["launches"] == 3 and tr.load["graph_kernels"] == 2
    assert tr.load["runtime_calls"] == 4  # 3 launches (the graph's one) + the sync


def test_merged_trace_is_on_the_timed_clock_with_each_launch_inside_its_operator():
    d, t = detail(), timed()
    tr = transfer(d.trace(), t.trace())
    att = attribute(tr.trace, d.counts().records)
    t_launch = {s.correlation: s for s in t.trace().host if s.kind == "runtime" and s.correlation is not None}
    for inst in att.instances:
        for g in inst.gpu:  # each kernel's launch call is the timed window's own, at its own time
            got, want = att.launch_of[g.correlation], t_launch[g.correlation]
            assert (got.name, got.ts_us, got.dur_us) == (want.name, want.ts_us, want.dur_us)
    linear = [i for i in att.instances if i.label == "aten::linear"]
    assert len(linear) == 3 and all(i.module == "fc" and [g.name for g in i.gpu] == [GEMM] for i in linear)
    iters = sorted((s for s in tr.trace.host if s.name == ITER_ANNOTATION), key=lambda s: s.ts_us)
    # the iterations lie on the timed clock, after the pad's launch call and in order
    assert iters[0].ts_us > 50_000.0 and all(a.end_us <= b.ts_us for a, b in zip(iters, iters[1:]))


def test_the_split_reads_idle_and_host_gaps_from_the_timed_window():
    """A host-bound step: in the detail window the profiler's host costs (2x) widen the gaps; the light window's
    gaps are its own, and the host-gap labels still name where the detail window's host was."""
    d, t = detail(), timed()
    tr = transfer(d.trace(), t.trace())
    full = analyze(d.trace(), d.counts(), ceilings=H200).split
    light = analyze(tr.trace, d.counts(), ceilings=H200).split
    assert light.busy_us == pytest.approx(full.busy_us)  # same device times here (scale 1)
    assert light.idle_host_us < full.idle_host_us and light.window_us < full.window_us
    assert light.host_gaps and {g["host_was_in"] for g in light.host_gaps} <= \
        {g["host_was_in"] for g in full.host_gaps} | {"Python between operators"}
    assert light.syncs == full.syncs


@pytest.mark.parametrize("case, why", [
    ("names", "differs between the windows: _norm_kernel_v2 vs _norm_kernel"),
    ("uneven", "the timed window launched 10 times in 3 iterations, the detail window 3 times per iteration"),
    ("detail-uneven", "the detail window's iterations launch different work"),
    ("no-pad", "no GPU sleep in front of the timed window"),
])
def test_windows_that_launched_different_work_fall_back_to_the_detail_window(case, why):
    d = detail(extra={1: ADD}) if case == "detail-uneven" else detail()
    t = {"names": lambda: timed(norm="_norm_kernel_v2"), "uneven": lambda: timed(extra={2: ADD}),
         "detail-uneven": lambda: timed(extra={1: ADD}),
         "no-pad": lambda: Builder(bare=True, t=9e4, g=9e4)}[case]()
    if case == "no-pad":
        with t.iteration():
            t.op("aten::linear", [(GEMM, 40.0)])
    tr = transfer(d.trace(), t.trace())
    assert tr.trace is None
    assert tr.note.startswith("light window not used (") and why in tr.note, tr.note
    assert "detail window's" in tr.note  # says which window the times then come from


def test_device_work_without_a_launch_record_falls_back():
    d, t = detail(), timed()
    tt = t.trace()
    lost = tt.gpu[-1].__class__(ADD, "kernel", tt.gpu[-1].end_us + 1.0, 2.0, correlation=None)
    tt.gpu.append(lost)
    tr = transfer(d.trace(), tt)
    assert tr.trace is None and "no launch record" in tr.note


def test_launch_calls_overlapping_across_threads_fall_back():
    """A second thread's launch call that overlaps the main thread's: no one monotone clock maps the windows,
    and a wrong map could nest one operator's launch inside another's, so the light window is not used."""
    from dataclasses import replace

    d, t = detail(), timed()
    dt = d.trace()
    i, s = next((i, s) for i, s in enumerate(dt.host) if s.name == "cuLaunchKernelEx")
    dt.host[i] = replace(s, tid=1, ts_us=s.ts_us - 3.0, dur_us=s.dur_us + 10.0)  # over the graph launch after it
    tr = transfer(dt, t.trace())
    assert tr.trace is None and "overlap or tie" in tr.note


def test_the_pad_in_front_of_a_window_is_not_idle_time():
    """The GPU sleep queued before the first iteration holds the GPU: the window's device time starts when it
    ends (a 5 ms pad would otherwise read as 1.7 ms of idle per iteration)."""
    short, long_ = detail(pad_us=1.0), detail(pad_us=5000.0)
    a = analyze(short.trace(), short.counts(), ceilings=H200).split
    b = analyze(long_.trace(), long_.counts(), ceilings=H200).split
    assert b.busy_us == pytest.approx(a.busy_us)
    assert b.window_us <= a.window_us + 1e-6 and b.idle_us <= a.idle_us + 1e-6
    assert not any(PAD_KERNEL in k.op for k in analyze(long_.trace(), long_.counts()).kernels)


def test_warp_is_exact_at_anchors_linear_between_and_shifted_outside():
    w = Warp([(10.0, 100.0), (20.0, 105.0), (30.0, 125.0)])
    assert [w(10.0), w(20.0), w(30.0)] == [100.0, 105.0, 125.0]
    assert w(15.0) == pytest.approx(102.5) and w(25.0) == pytest.approx(115.0)
    assert w(5.0) == pytest.approx(95.0) and w(40.0) == pytest.approx(135.0)
    with pytest.raises(ValueError):
        Warp([])


# ---- the host's head start ------------------------------------------------------------------------------

def test_host_pad_covers_one_call_bounded_by_the_window():
    from warpforge.profile.trace import PAD_MAX_US, PAD_MIN_US, host_pad_us

    assert host_pad_us(0.0, 20) == PAD_MIN_US  # a floor, so every CUDA window has its marker kernel
    assert host_pad_us(30.0, 100) == pytest.approx(2 * 30 + 30)  # twice the call + margin, where the share allows
    assert host_pad_us(30.0, 20) == pytest.approx(30.0)  # 5% of 20 calls: one call's host time
    assert host_pad_us(50_000.0, 1000) == PAD_MAX_US  # capped
    for host_us, iters in ((40.0, 20), (6500.0, 20), (500.0, 3)):
        pad = host_pad_us(host_us, iters)
        assert pad <= max(0.05 * iters * host_us, PAD_MIN_US) + 1e-9


class _FakeEvent:
    def __init__(self, log, clock):
        self.log, self.clock, self.t = log, clock, None

    def record(self):
        self.log.append("record")
        self.t = self.clock[0]

    def synchronize(self):
        self.log.append("event-sync")

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.mark.parametrize("cycles", [12345, 0])
def test_window_ms_sleeps_before_the_start_event_on_cuda(monkeypatch, cycles):
    """The CUDA path's order of calls, with the CUDA calls stood in for: sync, the sleep, the start event, the
    calls, the end event; no sleep when the pad is 0."""
    import torch

    from warpforge.profile import trace as trace_mod

    log: list = []
    clock = [0.0]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: log.append(("sleep", c)))
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: _FakeEvent(log, clock))

    def call(i):
        log.append(("call", i))
        clock[0] += 2.0

    ms = trace_mod._window_ms(call, 3, True, cycles)
    head = ["sync"] + ([("sleep", cycles)] if cycles else []) + ["record"]
    assert log == head + [("call", 0), ("call", 1), ("call", 2), "record", "event-sync"]
    assert ms == pytest.approx(2.0)


def test_window_ms_on_cpu_ignores_the_pad():
    from warpforge.profile.trace import _window_ms

    calls = []
    assert _window_ms(calls.append, 4, False, 999) > 0 and calls == [0, 1, 2, 3]


def test_window_option_is_validated():
    from warpforge.profile.trace import CaptureConfig

    assert CaptureConfig().window == "light" and CaptureConfig(window="full").window == "full"
    with pytest.raises(ValueError, match="window"):
        CaptureConfig(window="fast")


# ---- the capture's plumbing, with the GPU parts stood in for ------------------------------------------------

_CATS = {"op": "cpu_op", "annotation": "user_annotation", "runtime": "cuda_runtime"}


def to_raw(trace) -> dict:
    """A synthetic trace as the Kineto export it stands for (what parse_kineto reads)."""
    ev = [{"ph": "X", "cat": _CATS[s.kind], "name": s.name, "ts": s.ts_us, "dur": s.dur_us, "tid": s.tid,
           "args": {"correlation": s.correlation} if s.correlation is not None else {}} for s in trace.host]
    ev += [{"ph": "X", "cat": "kernel", "name": g.name, "ts": g.ts_us, "dur": g.dur_us, "tid": 7,
            "args": {"correlation": g.correlation, "stream": g.stream, "device": 0}} for g in trace.gpu]
    return {"traceEvents": ev}


@pytest.fixture
def fake_gpu(monkeypatch):
    """capture() on CUDA with its windows replaced by synthetic ones: returns the log of windows run and the
    setter for what the detail and timed windows 'recorded'."""
    import contextlib

    import torch

    from warpforge.profile import trace as tm

    log: list = []
    rec: dict = {}
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: None)
    monkeypatch.setattr(tm, "_host_us", lambda call: 40.0)
    monkeypatch.setattr(tm, "pad_cycles", lambda us, dev: int(us * 1000))
    monkeypatch.setattr(tm, "_window_ms", lambda call, iters, cuda, cyc=0: log.append(("plain", cyc)) or 1.0)
    monkeypatch.setattr(tm, "_detail_window", lambda fn, inputs, traced, hooks, iters, cuda, cyc:
                        log.append(("detail", cyc)) or (to_raw(rec["detail"].trace()), 1.5))
    monkeypatch.setattr(tm, "_timed_window", lambda fn, inputs, bare, iters, cyc:
                        log.append(("timed", cyc)) or (to_raw(rec["timed"].trace()), 1.02))
    return tm, log, rec


def test_capture_times_the_light_window_behind_the_same_pad_as_the_plain_ones(fake_gpu):
    import torch

    tm, log, rec = fake_gpu
    rec["detail"], rec["timed"] = detail(), timed(scale=0.9)
    cap = tm.capture(lambda: None, (), module=None, device=torch.device("cuda"), cfg=tm.CaptureConfig(iters=3))
    pad = tm.host_pad_us(40.0, 3)
    cyc = int(pad * 1000)
    assert log == [("plain", cyc), ("timed", cyc), ("detail", cyc), ("plain", cyc)]
    assert cap.window == "light" and cap.pad_us == pad
    assert (cap.window_ms, cap.detail_ms, cap.plain_ms) == (1.02, 1.5, 1.0) and cap.overhead == pytest.approx(0.02)
    assert any(n.startswith("times from the light window") for n in cap.notes)
    assert [round(g.dur_us, 6) for g in cap.trace.gpu if g.name == GEMM] == [36.0] * 3  # the timed window's
    assert cap.load["host_ops"] == 0 and cap.load["launches"] == 3


def test_capture_falls_back_to_the_detail_window_and_says_so(fake_gpu):
    import torch

    tm, log, rec = fake_gpu
    rec["detail"], rec["timed"] = detail(), timed(norm="_norm_kernel_v2")
    cap = tm.capture(lambda: None, (), module=None, device=torch.device("cuda"), cfg=tm.CaptureConfig(iters=3))
    assert cap.window == "full" and cap.window_ms == 1.5 and cap.overhead == pytest.approx(0.5) and cap.load is None
    assert len(cap.notes) == 1 and cap.notes[0].startswith("light window not used (launch 2 of iteration 1")
    assert [g.dur_us for g in cap.trace.gpu if g.name == GEMM] == [40.0] * 3  # the detail window's own


def test_capture_window_full_runs_no_timed_window(fake_gpu):
    import torch

    tm, log, rec = fake_gpu
    rec["detail"] = detail()
    cap = tm.capture(lambda: None, (), module=None, device=torch.device("cuda"),
                     cfg=tm.CaptureConfig(iters=3, window="full"))
    assert [w for w, _ in log] == ["plain", "detail", "plain"] and cap.window == "full" and cap.notes == []


def test_profile_reports_the_light_window(fake_gpu, monkeypatch):
    """profile() on the stood-in GPU: the timing block says which window and pad, the notes say how the
    times were matched, and the overhead finding speaks of what the light window recorded."""
    import torch

    from warpforge.profile import api
    from warpforge.profile.analysis import LaunchCost

    tm, log, rec = fake_gpu
    rec["detail"], rec["timed"] = detail(), timed(scale=0.9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    p = api.profile(lambda: None, device="cuda", iters=3, warmup=0, ceilings=H200, launch=LaunchCost(5.0, "test"))
    d = p.as_dict()
    assert d["timing"]["window"] == "light" and d["timing"]["detail_ms"] == 1.5 and d["timing"]["pad_us"] > 0
    assert p.window_ms == 1.02 and p.overhead == pytest.approx(0.02)
    assert any(n.startswith("times from the light window") for n in d["notes"])
    assert {r["op"]: r["time_us"] for r in d["kernels"]}[GEMM] == pytest.approx(36.0)
    assert not any(f["kind"] == "profiler-overhead" for f in d["findings"])  # 2% is under the bar
    rec["timed"] = timed()  # the same run, now 50% over the plain one: the finding, without operator records
    monkeypatch.setattr(tm, "_timed_window", lambda *a: (to_raw(rec["timed"].trace()), 1.5))
    f = next(f for f in api.profile(lambda: None, device="cuda", iters=3, warmup=0, ceilings=H200,
                                    launch=LaunchCost(5.0, "test")).findings if f["kind"] == "profiler-overhead")
    assert "recorded 4 runtime calls" in f["text"] and "operators" not in f["text"], f["text"]
