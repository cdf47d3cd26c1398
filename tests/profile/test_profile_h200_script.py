"""``benchmarks/profile_h200.py``: its plumbing end to end at --quick sizes on the CPU, and the cases it
would pick on the H200 (checked against the case names of the committed H200 records)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("profile_h200", ROOT / "benchmarks" / "profile_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_full_size_selection_picks_the_intended_h200_cases(script):
    names = {}
    for suite in ("memory", "kernels", "attention"):
        path = ROOT / "benchmarks" / "results" / "h200" / f"{suite}.jsonl"
        names[suite] = [json.loads(line)["case"] for line in path.read_text().splitlines() if line.strip()]
    picked = [script.match_case(names[suite], patterns) for suite, patterns in script.CASES]
    assert picked == ["copy bf16 1GiB", "bfloat16 linear M1 N14336 K4096", "rms_norm+residual bf16 16384x4096",
                      "silu_and_mul bf16 4096x28672", "softmax bfloat16 4096x32768",
                      "conv2d fp16 b32 7x7/2 3->64 @224 +bias+relu",
                      "decode headline bf16 pages B16 ctx8192 H32/8 D128"]


# The script's 270 s default budget guards an H200 call's time limit; on a CI CPU the dry run (~1 min on an idle
# 2-core box) gets what pytest's own 600 s timeout leaves, so a slow machine is not a failure but a hang still is
# (test_budget_skips_what_is_left_and_says_so checks the budget itself).
DRY_RUN_BUDGET_S = 540


@pytest.mark.slow  # ~25 s of CI's 2 cores (tests/conftest.py starts files with a slow test first)
def test_quick_dry_run_writes_the_lines_and_the_reports(script, tmp_path, capsys):
    out, reports = tmp_path / "profile.jsonl", tmp_path / "reports"
    rc = script.main(["--quick", "--device", "cpu", "--out", str(out), "--reports", str(reports),
                      "--budget-s", str(DRY_RUN_BUDGET_S)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    every = [json.loads(line) for line in out.read_text().splitlines()]
    lines = [line for line in every if not line["case"].startswith("report/")]
    assert [line["case"].split("/")[0] for line in lines] == [suite for suite, _ in script.CASES]
    assert every[:len(lines)] == lines  # the cases first, then the reports
    for line in lines:
        prof, bench, work = line["profiler"], line["bench"], line["work"]
        assert bench["figure"] > 0 and prof["figure"] > 0 and prof["overhead"] is not None
        assert line["ratio"] == pytest.approx(prof["figure"] / bench["figure"])
        assert line["agree"] == (abs(line["ratio"] - 1) <= script.AGREE)
        assert line["overhead_ok"] == (prof["overhead"] < script.OVERHEAD)
        # each figure is the case's declared work over its own time
        per_s = work["bytes"] / 1e9 if line["metric"] == "GBps" else work["flops"] / 1e12
        assert prof["figure"] == pytest.approx(per_s / (prof["device_us"] * 1e-6))
        assert bench["figure"] == pytest.approx(per_s / (bench["ms"] * 1e-3))
        assert bench["method"] == "host" and line["device"]["name"] == "cpu"
        # on a CPU there are no graphs to replay and no kernels to match: eager, one window, no GPU sleep
        assert (prof["mode"], prof["window"], prof["pad_us"]) == ("eager", "full", 0.0)
    targets = {"resnet50-eager-fp32-b1": "resnet50 (batch 1", "resnet50-optimized-b1": "resnet50 optimized: ",
               "llm-tiny-decode-b1": "llm decode: batch 1,",
               "llm-tiny-decode-b8": "llm decode: batch 8,", "llm-tiny-prefill-b1x16": "llm prefill: batch 1 x 16"}
    for folder, target in targets.items():
        d = json.loads((reports / folder / "report.json").read_text())
        assert d["tool"] == "warpforge.profile" and d["target"].startswith(target), (folder, d["target"])
        assert d["counts"]["flops"] > 0 and not d["counts"]["error"]
        assert (reports / folder / "report.html").read_text().startswith("<!DOCTYPE html>")
    # Each report's summary is a line of the JSONL too, with what its report.json says.
    reported = {line["case"]: line for line in every if line["case"].startswith("report/")}
    assert list(reported) == [f"report/{folder}" for folder in targets]
    for folder in targets:
        line, d = reported[f"report/{folder}"], json.loads((reports / folder / "report.json").read_text())
        r, t = line["report"], d["timing"]
        assert line["suite"] == "profile" and line["device"]["name"] == "cpu" and line["target"] == d["target"]
        assert r["verdict"] == d["verdict"] and r["window_ms"] == t["window_ms"] and r["plain_ms"] == t["plain_ms"]
        assert r["overhead"] == pytest.approx(r["window_ms"] / r["plain_ms"] - 1)
        assert r["overhead_parts"] is None and r["window"] == "full"  # the halves are timed on CUDA only
        assert line["overhead_ok"] == (r["overhead"] < script.OVERHEAD)
    resnet = json.loads((reports / "resnet50-eager-fp32-b1" / "report.json").read_text())
    assert resnet["meta"]["tf32"] == {"matmul": False, "cudnn": False}  # fp32 means no TF32


def test_budget_skips_what_is_left_and_says_so(script, tmp_path):
    import torch

    res = script.run(out=tmp_path / "p.jsonl", reports=tmp_path / "r", quick=True, device=torch.device("cpu"),
                     only=("resnet50",), budget_s=0.0, log=lambda *_: None)
    assert res["cases"] == [] and res["reports"] == []
    assert len(res["errors"]) == len(script.CASES) + 1 and all("budget" in e for e in res["errors"])
    assert (tmp_path / "p.jsonl").read_text() == "" and not (tmp_path / "r").exists()


def test_full_sizes_refuse_a_cpu(script):
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu"])


@pytest.mark.gpu
def test_graph_timed_case_is_profiled_by_graph_replay(script):
    """The linear M=1 case (timed by graph replay in its suite) is profiled the same way: a graph of one call
    replayed, its kernel mapped to the eager call's operator through count_fn."""
    import torch

    dev = torch.device("cuda")
    suite, case = next((s, c) for s, c in script.pick_cases(quick=True) if s == "kernels" and " linear M1 " in c.name)
    assert case.cuda_graph
    line = script.agreement(suite, case, dev, quick=True)
    prof = line["profiler"]
    assert prof["mode"] == "graph" and prof["window"] == "light" and prof["pad_us"] > 0
    assert any("_linear_kernel" in k for k in prof["kernels"]), prof["kernels"]
    assert prof["figure"] and line["ratio"] is not None and prof["overhead"] is not None
