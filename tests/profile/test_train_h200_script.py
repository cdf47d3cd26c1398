"""``benchmarks/profile_train_h200.py`` end to end at --quick sizes on the CPU (gloo for the 2-rank cases):
every case runs, the injected bottlenecks come out as the top findings, and only the training lines of
an existing profile.jsonl are replaced."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~25 s of CI's 2 cores (tests/conftest.py starts files with a slow test first)
def test_quick_run_writes_training_lines_and_keeps_the_others(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_train_h200", ROOT / "benchmarks" / "profile_train_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "profile.jsonl"
    out.write_text(json.dumps({"case": "memory/copy bf16 1GiB", "keep": True}) + "\n"
                   + json.dumps({"case": "train/old", "keep": False}) + "\n")
    assert mod.main(["--quick", "--out", str(out), "--reports", str(tmp_path / "reports")]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"case": "memory/copy bf16 1GiB", "keep": True}
    by = {x["case"]: x for x in lines[1:]}
    assert set(by) == {"train/tiny_gpt tiny 1gpu", "train/slow loader 2gpu", "train/exposed allreduce 2gpu",
                       "collectives/all_reduce 2 gloo", "train/resnet50 tiny 1gpu"}
    assert all("train" in x["tags"] and "error" not in x for x in by.values())
    assert by["train/slow loader 2gpu"]["summary"]["top_finding"]["kind"] == "starved_loader"
    assert by["train/exposed allreduce 2gpu"]["summary"]["top_finding"]["kind"] == "exposed_comm"
    assert by["train/tiny_gpt tiny 1gpu"]["summary"]["parts_error"] < 0.05
    assert by["collectives/all_reduce 2 gloo"]["nvlink_GBps"] is None and "CPU figures" in \
        by["collectives/all_reduce 2 gloo"]["note"]
    for name in ("train-tiny_gpt-tiny", "train-slow_loader-2ranks", "train-resnet50-tiny"):
        assert (tmp_path / "reports" / name / "report.html").is_file()
