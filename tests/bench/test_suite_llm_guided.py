"""Suite ``llm``'s structured-outputs row: the full row's settings, and a --quick run on the CPU (every request
decodes its tokens constrained and free: the same work, so a ratio, and the step time in the record)."""

from __future__ import annotations

import torch

from warpforge.bench.record import validate_record


def _suite():
    from warpforge.bench.runner import load_suite

    return load_suite("llm")


def test_full_row():
    (c,) = [c for c in _suite().build(quick=False) if c.params["row"] == "guided-json-b64"]
    assert c.params["batch"] == 64 and c.params["preset"] == "gemma3-270m" and "free" in c.peers
    assert c.target == {"ratio": {"free": 0.91}}  # a constrained step at most 1.10x a free one


def test_quick_row_on_cpu():
    from warpforge.bench.runner import run_suite

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (r,) = run_suite(_suite(), quick=True, device="cpu", case_filter="structured outputs")
    finally:
        torch.set_num_threads(prev)
    validate_record(r)
    assert r["correct"]["ok"], r["correct"]
    assert r["ratio"]["free"] > 0 and "ratio_null" not in r
    assert r["ours"]["tokens"] == r["peers"]["free"]["tokens"] == 8 * 8
