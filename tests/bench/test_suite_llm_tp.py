"""Suite ``llm``'s tensor-parallel rows: built only where two GPUs are, and their logic run on the CPU with
two gloo ranks at toy shapes (ours on 2 ranks, the peer on one process, the same requests)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from warpforge.bench.e2e import run_end_to_end
from warpforge.results.record import validate_record

pytestmark = pytest.mark.timeout(120)


def test_rows_exist_only_with_two_gpus(monkeypatch):
    from warpforge.bench.suites.llm import _cases

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not [c for c in _cases(False) if "gpus" in c.params]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rows = {c.params["row"]: c for c in _cases(False) if "gpus" in c.params}
    assert set(rows) == {"decode-b1-8b-tp2", "offline-8b-tp2"}
    for row, target in (("decode-b1-8b-tp2", 1.5), ("offline-8b-tp2", 1.8)):
        c = rows[row]
        assert c.params["preset"] == "llama-8b" and c.params["gpus"] == 2
        assert c.target == {"ratio": {"1-gpu": target}} and c.check_against == "1-gpu"
    assert rows["offline-8b-tp2"].params["requests"] == 256
    assert (rows["decode-b1-8b-tp2"].params["prompt"], rows["decode-b1-8b-tp2"].params["new"]) == (128, 256)


def test_quick_rows_run_on_two_cpu_ranks():
    from warpforge.bench.suites.llm import tensor_parallel_cases

    torch.set_num_threads(1)
    ceil = SimpleNamespace(hbm_GBps=100.0, tflops={"bf16": 1.0, "fp32": 1.0, "fp16": 1.0}, source="test")
    cpu = {"name": "cpu", "torch": torch.__version__}
    decode, offline = tensor_parallel_cases(quick=True)
    assert offline.params["tensor_parallel_size"] == 2 and offline.check_against == "1-gpu"
    for case in (decode,):  # the offline row runs the same callables on more requests
        case.rep = 1
        rec = run_end_to_end(case, suite="llm", device=torch.device("cpu"), env_device=cpu, git=None, ceil=ceil)
        validate_record(rec)
        ours, peer = rec["ours"], rec["peers"]["1-gpu"]
        assert "error" not in ours and "error" not in peer, (ours, peer)
        assert ours["engine"]["tensor_parallel_size"] == 2 and peer["engine"]["tensor_parallel_size"] == 1
        assert rec["correct"]["ok"], rec["correct"]  # fp32: every request's tokens identical
        assert ours["tokens"] == peer["tokens"] > 0
        assert math.isclose(rec["ratio"]["1-gpu"], ours["tok/s"] / peer["tok/s"])
        assert math.isclose(ours["mbu"] * 2, peer["mbu"] * peer["ms"] / ours["ms"])  # per-GPU: half the bytes
