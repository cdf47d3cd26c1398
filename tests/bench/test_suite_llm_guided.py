"""Suite ``llm``'s structured-outputs row: the full row's settings, and a --quick run on the CPU (every request
decodes its tokens constrained and free: the same work, so a ratio, and the step time in the record)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from warpforge.results.record import validate_record


def _suite():
    from warpforge.bench.runner import load_suite

    return load_suite("llm")


def test_full_row():
    (c,) = [c for c in _suite().build(quick=False) if c.params["row"] == "guided-json-b64"]
    assert c.params["batch"] == 64 and c.params["preset"] == "gemma3-270m" and "free" in c.peers
    assert c.target == {"ratio": {"free": 0.91}}  # a constrained step at most 1.10x a free one


def test_quick_row_on_cpu(monkeypatch):
    """Also the row's MBU and MFU: a constrained step reads and computes what a free one does (the mask picks
    the token), so the row counts the model's work as every decode row does and the GPU run reports both.
    A CPU run has no ceilings (the runner gives none), so a far-off one stands in: the figures must exist."""
    from warpforge.bench import runner
    from warpforge.bench.runner import run_suite
    from warpforge.bench.suites._llm_work import _shape, matmul_params, weight_bytes

    far = SimpleNamespace(hbm_GBps=1e9, tflops={"bf16": 1e9, "fp32": 1e9, "fp16": 1e9}, source="datasheet")
    monkeypatch.setattr(runner, "_ceilings", lambda dev: far)
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
    for side in (r["ours"], r["peers"]["free"]):
        assert side["mbu"] is not None and side["mfu"] is not None, side
    # 8 requests of 8 tokens in fp32: 8 steps each read the weights, and every request's 7 decode steps at least
    # multiply through them (its prompt's tokens add to both).
    s = _shape("llama-tiny")
    assert r["work"]["bytes"] >= 8 * weight_bytes(s, 4) and r["work"]["flops"] >= 8 * 7 * 2 * matmul_params(s)
