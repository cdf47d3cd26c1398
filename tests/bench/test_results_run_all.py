"""`benchmarks/run_gpu.sh all`: the plan covers every case of every suite once, lanes fit the call, and the
lanes' records are gathered in the committed layout. (The GPU run itself happens on the H200 box.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from warpforge.bench.runner import list_suites, load_suite

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_all", REPO / "benchmarks" / "run_all.py")
run_all = importlib.util.module_from_spec(spec)
sys.modules["run_all"] = run_all  # dataclasses look their module up there
spec.loader.exec_module(run_all)


def _filters() -> dict[str, list[tuple[str, str | None]]]:
    """suite -> [(shard, case filter or None)] from every shard's bench stages."""
    out: dict[str, list[tuple[str, str | None]]] = {}
    for s in run_all.SHARDS:
        for st in s.stages:
            if st.startswith("bench:"):
                _, suite, *filt = st.split(":", 2)
                out.setdefault(suite, []).append((s.name, filt[0] if filt else None))
    return out


@pytest.mark.parametrize("suite", list_suites())
def test_every_case_is_measured_by_exactly_one_shard(suite):
    filters = _filters()
    assert suite in filters, f"no shard of run_all.SHARDS runs suite {suite!r}"
    for case in load_suite(suite).build(False):
        hits = [shard for shard, f in filters[suite] if f is None or f in case.name]
        assert len(hits) == 1, f"{suite}: case {case.name!r} is run by {hits or 'no shard'}"


def test_plan_fits_the_budget_and_defers_the_rest():
    shards = list(run_all.SHARDS)
    for gpus, budget in [(8, 545), (4, 545), (1, 545), (8, 10_000)]:
        lanes, deferred = run_all.plan(shards, gpus, budget)
        assert len(lanes) <= gpus and all(ln.load_s <= budget for ln in lanes)
        planned = [s.name for ln in lanes for s in ln.shards]
        assert sorted(planned + [s.name for s in deferred]) == sorted(s.name for s in shards)
        assert len(set(planned)) == len(planned)
    lanes, deferred = run_all.plan(shards, 8, 10_000)
    assert not deferred and len(lanes) == 8  # given time, one call does everything
    assert run_all.plan(shards, 1, 545)[1][0].name == "kernels"  # deferred shards keep the plan's order
    with pytest.raises(ValueError, match="unknown shard"):
        run_all.pick("kernels,nope")


def test_plan_and_deps_on_the_command_line():
    r = subprocess.run(["python3", "benchmarks/run_all.py", "--plan", "--gpus", "2", "kernels,splat,serve"],
                       cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.count("lane ") == 2, r.stdout + r.stderr
    r = subprocess.run(["python3", "benchmarks/run_all.py", "--deps", "splat,splat-train,serve,kernels"], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.split() == ["gsplat", "serve-deps"]


def test_all_demands_the_full_sha(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "WARPFORGE_GIT": "abc1234"}
    r = subprocess.run(["bash", "benchmarks/run_gpu.sh", "all"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "git describe --always --dirty --abbrev=40" in r.stdout


def test_lanes_run_concurrently_and_their_records_are_gathered(tmp_path, monkeypatch, capsys):
    # a stand-in for run_gpu.sh: each lane writes one record per bench stage into its OUT and a summary
    script = ('for st in "$@"; do s=${st#bench:}; s=${s%%:*}; '
              'echo "{\\"suite\\": \\"$s\\", \\"gpu\\": \\"$CUDA_VISIBLE_DEVICES\\"}" >> "$OUT/$s.1.jsonl"; done; '
              'echo "lane $RUN_GPU_LANE rc=0" > "$OUT/summary.txt"')
    monkeypatch.setattr(run_all, "lane_command",
                        lambda ln: ["bash", "-c", script, "lane", *(st for s in ln.shards for st in s.stages)])
    rc = run_all.main(["--out", str(tmp_path), "--gpus", "2", "--limit-s", "2000", "kernels,memory-attention"])
    assert rc == 0
    got = {f.name: [json.loads(x) for x in f.read_text().splitlines()] for f in (tmp_path / "records").iterdir()}
    assert set(got) == {"kernels.jsonl", "memory.jsonl", "attention.jsonl"}
    assert {r["gpu"] for recs in got.values() for r in recs} == {"0", "1"}  # one lane per GPU
    assert "lane 0 rc=0" in capsys.readouterr().out
