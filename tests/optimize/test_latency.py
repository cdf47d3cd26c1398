"""The single-stream / offline protocol on callables whose time is known (host clock on CPU)."""

import time

import pytest
import torch

from warpforge.optimize.latency import PeakMemory, batch_size, offline, single_stream, single_stream_interleaved


def _sleeper(ms: float):
    calls = []

    def fn(*args):
        calls.append(1)
        time.sleep(ms / 1e3)

    return fn, calls


def test_single_stream_percentiles_and_counts():
    fn, calls = _sleeper(2.0)
    lat = single_stream(fn, (torch.zeros(4, 3),), queries=12, warmup=3, device="cpu")
    assert len(calls) == 15 and lat.n == 12 and lat.warmup == 3 and lat.method == "host"
    assert 2.0 <= lat.min_ms <= lat.p50_ms <= lat.p90_ms <= lat.p99_ms <= lat.max_ms
    assert lat.p50_ms < 50  # a 2 ms sleep, even on a busy machine


def test_interleaved_candidates_each_get_their_queries():
    fast, nf = _sleeper(0.5)
    slow, ns = _sleeper(4.0)
    lat = single_stream_interleaved({"fast": fast, "slow": slow}, (), queries=7, warmup=1, rounds=3, device="cpu")
    assert lat["fast"].n == lat["slow"].n == 7 and len(nf) == len(ns) == 8
    assert lat["fast"].p50_ms < lat["slow"].p50_ms


def test_offline_throughput():
    fn, calls = _sleeper(1.0)
    thr = offline(fn, (torch.zeros(8, 2),), calls=5, warmup=2, device="cpu")
    assert len(calls) == 7 and thr.batch == 8 and thr.calls == 5
    assert thr.items_per_s == pytest.approx(8 * 5 / (thr.total_ms / 1e3))
    assert thr.items_per_s <= 8 / 1e-3  # never faster than the sleep allows


def test_peak_memory_is_none_on_cpu_and_batch_size():
    with PeakMemory("cpu") as mem:
        torch.zeros(1000)
    assert mem.bytes is None  # not measured on CPU: no fake figure
    assert batch_size((3, torch.zeros(5, 2))) == 5 and batch_size(()) == 1


def test_bad_settings():
    with pytest.raises(ValueError, match="queries"):
        single_stream(lambda: None, (), queries=0, device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        offline(lambda: None, (), warmup=-1, device="cpu")


@pytest.mark.gpu
def test_cuda_single_stream_times_each_query_on_the_gpu():
    cycles = 300_000  # 0.15-0.3 ms of GPU sleep at 1-2 GHz
    lat = single_stream(lambda: torch.cuda._sleep(cycles), (), queries=20, warmup=2, device="cuda")
    assert lat.method == "cuda_event+sync"
    assert 0.05 < lat.p50_ms < 5.0
    x = torch.zeros(1 << 20, device="cuda")
    with PeakMemory("cuda") as mem:
        y = x * 2  # 4 MiB more
    assert mem.bytes >= 4 << 20
    del y
