"""The attention benchmark suite: every row of the issue is a case; the CPU quick run checks out."""

from __future__ import annotations

import pytest

from warpforge.bench.runner import load_suite, run_suite
from warpforge.bench.suites import attention


def test_full_suite_has_every_row():
    cases = attention._gpu_cases(quick=False)
    names = [c.name for c in cases]
    assert len(set(names)) == len(names)
    for row in ("prefill bf16 B2 H32 S4096 D128 non-causal", "prefill bf16 B2 H32 S4096 D128 causal",
                "prefill bf16 B8 H16 S2048 D64 non-causal", "prefill bf16 B8 H16 S2048 D64 causal",
                "prefill varlen bf16 64 seqs 100-2000", "decode headline bf16 pages B16 ctx8192",
                "decode headline fp8 pages B16 ctx8192"):
        assert any(n.startswith(row) for n in names), row
    by_name = {c.name: c for c in cases}
    assert set(by_name["prefill bf16 B2 H32 S4096 D128 causal"].peers) == {"sdpa flash", "sdpa cudnn"}
    sweep = [c for c in cases if c.name.startswith("decode sweep")]
    assert len(sweep) == 2 * (16 - len(attention.SWEEP_SKIP))
    for c in sweep:
        assert c.params["kv_bytes"] == c.bytes and c.cuda_graph
        assert c.params["kv_bytes_over_64MiB"] == (c.bytes > 64 << 20)
    fp8 = [c for c in cases if "fp8" in c.name]
    assert fp8 and all(set(c.peers) == {"warpforge bf16 decode"} for c in fp8)
    causal = by_name["prefill bf16 B2 H32 S4096 D128 causal"]
    assert causal.flops == 4 * 2 * 32 * 4096 * 4096 * 128 / 2


@pytest.mark.slow
def test_cpu_quick_run_is_correct():
    records = run_suite(load_suite("attention"), quick=True)
    assert records
    for r in records:
        assert r["correct"]["ok"], r["case"]
        for name, peer in r["peers"].items():
            assert peer.get("correct", {}).get("ok"), (r["case"], name, peer)
