"""The training breakdown's arithmetic and the findings' logic, on recorded and synthetic spans (no run)."""

from __future__ import annotations

import copy

import pytest

from warpforge.profile.train_breakdown import (PARTS, StepRecord, aggregate, breakdown, memory_phases,
                                                split_device_comm)
from warpforge.profile.train_findings import (THRESHOLD, low_mfu_layers, pageable_copies, stragglers,
                                               train_findings)

MS = 1e6  # host nanoseconds per ms


def _rec(**kw) -> StepRecord:
    """A 10 ms step: data 0-1, h2d 1-1.5, forward 1.5-4, backward 4-8, optimizer 8.5-9.5 (ms)."""
    r = StepRecord(start=0, end=10 * MS, phases=[("data", 0, 1 * MS), ("h2d", 1 * MS, 1.5 * MS),
                                                ("forward", 1.5 * MS, 4 * MS), ("backward", 4 * MS, 8 * MS),
                                                ("optimizer", 8.5 * MS, 9.5 * MS)])
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_parts_are_exclusive_and_sum_to_the_step():
    b = breakdown(_rec())
    assert b["step_ms"] == pytest.approx(10)
    assert [round(b[k], 6) for k in PARTS] == [1, 0.5, 2.5, 4, 1, 0, 1]  # other: 8-8.5 and 9.5-10
    assert sum(b[k] for k in PARTS) == pytest.approx(b["step_ms"])


def test_async_bucket_all_reduce_splits_at_the_last_hand_over():
    # Buckets handed over at 5 and 7 ms; they land at 6.5 and 7.8 ms; backward waits until 8 ms.
    # Before 7 ms: overlapped (6.5-5 = 1.5 ms); after 7: exposed 0.8 ms, taken out of backward.
    b = breakdown(_rec(async_comm=[("ar", 5 * MS, 6.5 * MS, 100), ("ar", 7 * MS, 7.8 * MS, 200)]))
    assert b["comm_overlapped"] == pytest.approx(1.5)
    assert b["comm_exposed"] == pytest.approx(0.8)
    assert b["backward"] == pytest.approx(4 - 0.8)
    assert b["comm_bytes"] == 300 and b["collectives"] == 2
    assert sum(b[k] for k in PARTS) == pytest.approx(10)


def test_synchronous_collective_after_backward_is_all_exposed():
    # A manual all-reduce between backward and optimizer (8-8.5) and one inside the optimizer (9-9.2).
    b = breakdown(_rec(sync_comm=[("all_reduce", 8 * MS, 8.5 * MS, 64), ("all_reduce", 9 * MS, 9.2 * MS, 64)]))
    assert b["comm_exposed"] == pytest.approx(0.7)
    assert b["optimizer"] == pytest.approx(0.8) and b["other"] == pytest.approx(0.5)
    assert sum(b[k] for k in PARTS) == pytest.approx(10)


def test_device_comm_split_from_kernels():
    # µs: compute 0-100 and 150-200; NCCL 80-170 -> 20 + 20 overlapped, 50 exposed.
    k = [("ampere_sgemm", 0, 100), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 80, 170), ("elementwise", 150, 200)]
    s = split_device_comm(k)
    assert s == {"comm": 90, "overlapped": 40, "exposed": 50, "compute": 150}


def test_memory_peak_phase_and_split():
    m = memory_phases(params=100, grads={"start": 0, "backward": 100}, opt_state={"start": 200, "optimizer": 200},
                      activations=1000)
    assert m["peak_phase"] == "forward" and m["peak_bytes"] == 1300
    assert m["phases"]["backward"]["activations"] == 900  # backward's high point: max(activations, gradients)
    assert m["phases"]["optimizer"] == {"parameters": 100, "gradients": 100, "optimizer_state": 200,
                                        "activations": 0}
    small = memory_phases(params=100, grads={"backward": 100}, opt_state={"optimizer": 200}, activations=10)
    assert small["peak_phase"] == "optimizer"


def _profile(parts: dict[str, float], **extra) -> dict:
    steps = [dict({k: 0.0 for k in PARTS}, comm_overlapped=0.0, collectives=0, comm_bytes=0, **parts,
                  step_ms=sum(parts.values()))] * 3
    d = {"meta": {"device_type": "cuda", "rank": 0}, "aggregate": aggregate(steps), "steps": steps,
         "loader": {"num_workers": 0, "pin_memory": False}, "h2d": {"bytes": 0, "pinned": None},
         "optimizer": {"type": "AdamW", "param_tensors": 10, "foreach": None, "fused": True},
         "memory": {}, "layers": [], "ddp": None}
    d.update(extra)
    return d


def test_pageable_copies_found_on_a_recorded_trace():
    # 256 MiB per step copied in 40 ms (6.7 GB/s) where the probe measured 50 GB/s pinned.
    probe = {"pcie": {"h2d_pinned_GBps": 50.0, "h2d_pageable_GBps": 8.0}}
    d = _profile({"h2d": 40, "forward": 30, "backward": 60, "optimizer": 10},
                 h2d={"bytes": 256 * 2**20, "pinned": False})
    f = train_findings(d, probe)
    assert f[0]["kind"] == "pageable_copies" and "pin_memory=True" in f[0]["advice"]
    assert f[0]["evidence"]["achieved_GBps"] == pytest.approx(256 * 2**20 / 0.04 / 1e9)
    assert "50 GB/s" in f[0]["text"]
    pinned = copy.deepcopy(d)
    pinned["h2d"]["pinned"] = True
    assert pageable_copies(pinned, probe) is None  # pinned copies: the same share is not this finding


def test_low_mfu_layers_named_with_a_peak():
    layers = [{"layer": "blocks.0.fc", "type": "Linear", "calls": 1, "forward_ms": 5.0, "flops": 1e9},
              {"layer": "head", "type": "Linear", "calls": 1, "forward_ms": 0.1, "flops": 5e10}]
    d = _profile({"forward": 10, "backward": 20, "optimizer": 1}, layers=layers)
    f = low_mfu_layers(d, peak_tflops=1000.0)
    assert f is not None and f["evidence"]["layers"][0]["layer"] == "blocks.0.fc"
    assert "blocks.0.fc" in f["text"] and "head" not in f["text"]  # head runs at 50% of the peak
    assert low_mfu_layers(d, peak_tflops=None) is None  # no peak (CPU): no MFU claim


def test_straggler_named_from_merged_ranks():
    fast = _profile({"forward": 10, "backward": 20, "comm_exposed": 15})
    slow = _profile({"forward": 10, "backward": 20, "data": 15, "comm_exposed": 0.5})
    fast["meta"], slow["meta"] = {"rank": 0}, {"rank": 1}
    f = stragglers([fast, slow])
    assert f is not None and "Rank 1" in f["text"] and f["evidence"]["part"] == "data"
    assert stragglers([fast, copy.deepcopy(fast)]) is None


def test_exposed_comm_is_net_of_the_wait_for_a_straggler():
    # Rank 0 spends 15 ms per step in the all-reduce, all of it waiting for rank 1's 15 ms of extra loading: the
    # merged profile blames the straggler, and the network only for what is left over.
    fast = _profile({"forward": 10, "backward": 20, "comm_exposed": 15})
    slow = _profile({"forward": 10, "backward": 20, "data": 15, "comm_exposed": 0.5})
    fast["meta"], slow["meta"] = {"rank": 0}, {"rank": 1}
    merged = dict(copy.deepcopy(fast), ranks=[fast, slow])
    kinds = [f["kind"] for f in train_findings(merged)]
    assert kinds[0] == "straggler" and "exposed_comm" not in kinds
    # With 6 ms of its own on top of the wait, the finding stays, sized and worded by those 6 ms.
    noisy = _profile({"forward": 10, "backward": 20, "comm_exposed": 21})
    noisy["meta"] = {"rank": 0}
    merged = dict(copy.deepcopy(noisy), ranks=[noisy, slow])
    comm = next(f for f in train_findings(merged) if f["kind"] == "exposed_comm")
    assert comm["evidence"]["exposed_ms"] == pytest.approx(6.0)
    assert comm["evidence"]["straggler_wait_ms"] == pytest.approx(15.0)
    assert comm["severity"] == pytest.approx(6 / 51, abs=1e-4)
    assert "6 ms per step" in comm["text"] and "15 ms waiting for the straggler, rank 1" in comm["text"]
    assert train_findings(noisy)[0]["evidence"]["straggler_wait_ms"] == 0  # one rank alone: no wait taken off


def test_clean_profile_has_no_finding_at_the_threshold():
    d = _profile({"data": 0.5, "h2d": 0.2, "forward": 30, "backward": 60, "optimizer": 5, "other": 2})
    assert [f for f in train_findings(d) if f["severity"] >= THRESHOLD] == []


def test_exposed_all_reduce_set_against_the_nvlink_datasheet():
    # 2 H200s, 1 GiB of gradients all-reduced in 10 ms, none of it overlapped: algbw 107 GB/s, busbw the same
    # (2 (n-1) / n = 1 at n = 2), 24% of the 450 GB/s one-direction NVLink figure.
    steps_parts = {"forward": 10, "backward": 20, "comm_exposed": 10}
    d = _profile(steps_parts)
    for s in d["steps"]:
        s.update(collectives=4, comm_bytes=2**30)
    d["aggregate"] = aggregate(d["steps"])
    d["meta"].update(world=2, device="NVIDIA H200")
    from warpforge.profile.train_findings import exposed_comm

    f = exposed_comm(d)
    ev = f["evidence"]
    assert ev["algbw_GBps"] == pytest.approx(2**30 / 0.01 / 1e9)
    assert ev["busbw_GBps"] == pytest.approx(ev["algbw_GBps"]) and ev["nvlink_GBps"] == 450
    assert ev["of_link"] == pytest.approx(ev["busbw_GBps"] / 450) and "% of the 450 GB/s NVLink" in f["text"]
    d["meta"].update(world=4)
    assert exposed_comm(d)["evidence"]["busbw_GBps"] == pytest.approx(1.5 * ev["algbw_GBps"])
    d["meta"].update(device_type="cpu", device="CPU")
    assert exposed_comm(d)["evidence"]["of_link"] is None  # no link to set it against


def test_step_roofline_names_the_binding_roof():
    from warpforge.profile.train_cli import step_roofline

    d = _profile({"forward": 10, "backward": 20, "optimizer": 10})  # a 40 ms step
    # 0.4 TFLOP at 1000 TFLOP/s: 0.4 ms; 48 GB at 4800 GB/s: 10 ms -> memory-bound, 25% of the floor
    d.update(flops_per_step=4e11, bytes_per_step=48e9)
    r = step_roofline(d, peak_tflops=1000.0, hbm_GBps=4800.0)
    assert r["bound"] == "memory" and r["compute_floor_ms"] == pytest.approx(0.4)
    assert r["memory_floor_ms"] == pytest.approx(10.0) and r["fraction"] == pytest.approx(0.25)
    assert r["mbu"] == pytest.approx(0.25)
    d.update(flops_per_step=2e13)  # 20 ms of compute: compute-bound at 50%
    r = step_roofline(d, peak_tflops=1000.0, hbm_GBps=4800.0)
    assert r["bound"] == "compute" and r["fraction"] == pytest.approx(0.5)
    assert step_roofline(d, peak_tflops=None, hbm_GBps=None) is None  # CPU: no roofs
