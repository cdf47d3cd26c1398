"""Harness statistics on known samples, and the CPU host-timer path."""

from __future__ import annotations

import time

import numpy as np
import pytest

from warpforge.timing import Timing, percentile, summarize, time_fn, time_interleaved


def test_summarize_known_samples():
    # 1..11 ms: positions h = 10 q fall exactly on order statistics for q in {0.2, 0.5, 0.8}.
    t = summarize([float(x) for x in range(11, 0, -1)], "host")  # unsorted on purpose
    assert t.median_ms == 6.0
    assert t.p20_ms == 3.0
    assert t.p80_ms == 9.0
    assert t.iqr_ms == pytest.approx(8.5 - 3.5)  # p75 = 8.5, p25 = 3.5
    assert t.min_ms == 1.0
    assert t.n == 11
    assert t.method == "host"


def test_summarize_interpolates_between_order_statistics():
    # Four samples: p20 sits at h = 0.6 between 10 and 20; the median halfway between 20 and 30.
    t = summarize([10.0, 20.0, 30.0, 40.0], "cuda_event")
    assert t.p20_ms == pytest.approx(16.0)
    assert t.median_ms == pytest.approx(25.0)
    assert t.p80_ms == pytest.approx(34.0)
    assert t.iqr_ms == pytest.approx(32.5 - 17.5)


@pytest.mark.parametrize("q", [0.0, 0.2, 0.25, 0.5, 0.75, 0.8, 1.0])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(0)
    xs = sorted(rng.exponential(size=37).tolist())
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, 100 * q)))


def test_single_sample_and_outlier_robustness():
    t = summarize([2.5], "host")
    assert (t.median_ms, t.p20_ms, t.p80_ms, t.iqr_ms, t.min_ms) == (2.5, 2.5, 2.5, 0.0, 2.5)
    # One preempted repeat must not move the median.
    t = summarize([1.0] * 20 + [1000.0], "host")
    assert t.median_ms == 1.0 and t.p80_ms == 1.0


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -0.5], [float("inf")]])
def test_summarize_rejects_bad_samples(bad):
    with pytest.raises(ValueError):
        summarize(bad, "host")


def test_timing_as_dict_round_trip():
    t = summarize([1.0, 2.0, 3.0], "host")
    assert Timing(**t.as_dict()) == t


def test_time_fn_cpu_is_sane():
    t = time_fn(lambda: time.sleep(0.002), warmup=1, rep=5, device="cpu")
    assert t.method == "host" and t.n == 5
    assert 2.0 <= t.median_ms < 200.0
    assert 0 < t.min_ms <= t.p20_ms <= t.median_ms <= t.p80_ms


def test_time_interleaved_cpu_orders_and_counts():
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "c": lambda: calls.append("c")}
    out = time_interleaved(fns, warmup=2, rep=4, flush_l2=True, cuda_graph=False, device="cpu")
    assert set(out) == {"a", "b", "c"} and all(t.n == 4 for t in out.values())
    timed = calls[6:]  # after 2 warm-up calls each
    assert len(timed) == 12 and timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"]


def test_bad_counts_rejected():
    with pytest.raises(ValueError, match="rep"):
        time_fn(lambda: None, rep=0, device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        time_fn(lambda: None, warmup=-1, device="cpu")


@pytest.mark.gpu
def test_time_fn_gpu_events_graph_and_flush():
    import torch

    from warpforge.timing import flush_bytes

    dev = torch.device("cuda")
    assert flush_bytes(dev) >= 2 * torch.cuda.get_device_properties(dev).L2_cache_size
    x = torch.randn(1 << 24, device=dev)
    t = time_fn(lambda: x.mul_(1.0), device=dev)
    assert t.method == "cuda_event+l2flush-read+hostpad" and t.median_ms > 0
    tg = time_fn(lambda: x.add_(1.0), cuda_graph=True, flush_l2=False, device=dev)
    assert tg.method == "cuda_graph+hostpad" and 0 < tg.median_ms < 10 * t.median_ms
    # A 64 MiB read+write at ~4.8 TB/s is ~28 us: events that measured the launch only would be far lower.
    assert t.median_ms > 0.01


@pytest.mark.gpu
def test_slow_host_is_not_timed():
    """A call whose host side is slow (300 us of Python before a ~10 us kernel): the pad keeps
    the GPU busy while the host catches up, so the events time the kernel, not the host."""
    import torch

    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev)

    def slow_launcher():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 300e-6:
            pass
        x.mul_(1.0)

    padded = time_fn(slow_launcher, device=dev, rep=20)
    raw = time_fn(slow_launcher, device=dev, rep=20, hide_host=False)
    assert padded.method.endswith("+hostpad") and not raw.method.endswith("+hostpad")
    assert raw.median_ms > 0.2  # without the pad the start event waits out the host
    assert padded.median_ms < 0.05, padded

