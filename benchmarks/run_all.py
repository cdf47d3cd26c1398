#!/usr/bin/env python3
"""Every suite at one commit, spread over the GPUs of one machine: the `all` stage of benchmarks/run_gpu.sh.

The suites are cut into shards (a suite, or a part of one by its case filter) with an expected time each.
The shards are packed longest first onto one lane per GPU within the call's time limit (CALL_LIMIT, less
the time already spent and a margin to pack the results); each lane is run_gpu.sh itself, its stages in
order on its own GPU (CUDA_VISIBLE_DEVICES), all lanes at once and writing one results store. Shards that
do not fit are not started: the summary names them with the command for the next call. The records of
every lane are then gathered into OUT/records/<suite>.jsonl, the layout of benchmarks/results/h200/.

    python3 benchmarks/run_all.py --out OUT [SHARD,SHARD,...] [--gpus N] [--plan | --deps]

Standard library only: it runs before anything is installed in the lanes' environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK_MARGIN_S = 25  # what run_gpu.sh keeps to tar the results


@dataclass(frozen=True)
class Shard:
    name: str
    stages: tuple[str, ...]  # run_gpu.sh stages, in order, on the lane's GPU
    expect_s: int  # expected seconds on an H200; "measured" or "estimate" in the comment beside it
    deps: tuple[str, ...] = ()  # run_gpu.sh install stages it needs, run once before the lanes start


# Expected times: "measured" where benchmarks/notes/ has the figure, "estimate" otherwise (then generous:
# a shard that overruns is stopped by its lane's limit, its finished cases kept).
SHARDS: tuple[Shard, ...] = (
    Shard("kernels", ("bench:kernels",), 150),  # measured: ~2 min (notes/gpu-runs.md, session plans)
    Shard("memory-attention", ("bench:memory", "bench:attention"), 240),  # estimate
    Shard("vision-mobilenet", ("bench:vision:mobilenet_v2 batch",), 420),  # estimate: max-autotune peers compile
    Shard("vision-resnet50", ("bench:vision:resnet50 batch",), 420),  # estimate
    Shard("vision-vit", ("bench:vision:vit_b16 batch",), 360),  # estimate
    Shard("vision-bev-planner", ("bench:vision:bev_lss", "bench:vision:planner"), 300),  # estimate
    Shard("vision-wall", ("bench:vision:optimize wall",), 360),  # measured: ours 48.6 s, max-autotune peer 277 s
    Shard("llm-decode", ("bench:llm:decode batch 1", "bench:llm:gemma3"), 240, ("gemma",)),  # estimate
    Shard("llm-offline", ("bench:llm:offline", "bench:llm:prefix cache", "bench:llm:long prompt"), 420),  # estimate
    Shard("llm-throughput", ("bench:llm:throughput",), 300),  # measured: ~4 min for both rows (notes/llm.md)
    Shard("splat", ("bench:splat",), 300, ("gsplat",)),  # estimate
    Shard("splat-train", ("bench:splat_train",), 360, ("gsplat",)),  # estimate
    Shard("serve", ("bench:serve",), 420, ("serve-deps",)),  # estimate
    Shard("profile", ("profile",), 200),  # measured: 2-3 min (notes/llm.md)
)
BY_NAME = {s.name: s for s in SHARDS}


@dataclass
class Lane:
    gpu: int
    shards: list[Shard] = field(default_factory=list)

    @property
    def load_s(self) -> int:
        return sum(s.expect_s for s in self.shards)


def plan(shards: list[Shard], gpus: int, budget_s: float) -> tuple[list[Lane], list[Shard]]:
    """Longest first onto the least-loaded lane while it fits in ``budget_s``; the rest deferred (in order)."""
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {gpus}")
    lanes = [Lane(g) for g in range(gpus)]
    deferred = []
    for s in sorted(shards, key=lambda s: -s.expect_s):
        lane = min(lanes, key=lambda ln: ln.load_s)
        if lane.load_s + s.expect_s <= budget_s:
            lane.shards.append(s)
        else:
            deferred.append(s)
    deferred.sort(key=shards.index)
    return [ln for ln in lanes if ln.shards], deferred


def pick(spec: str) -> list[Shard]:
    """``""`` -> every shard; ``"a,b"`` -> those, in the plan's order. Unknown names raise ValueError."""
    names = [x for x in spec.split(",") if x]
    bad = [n for n in names if n not in BY_NAME]
    if bad:
        raise ValueError(f"unknown shard(s) {', '.join(bad)}; shards: {', '.join(BY_NAME)}")
    return [s for s in SHARDS if not names or s.name in names]


def gpu_count() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return len([x for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def lane_command(lane: Lane) -> list[str]:
    return ["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), *(st for s in lane.shards for st in s.stages)]


def gather(out: Path) -> dict[str, int]:
    """Every lane's bench records into out/records/<suite>.jsonl (lane order, then stage order)."""
    dest = out / "records"
    dest.mkdir(exist_ok=True)
    counts: dict[str, int] = {}
    for f in sorted(out.glob("lane*/*.jsonl"), key=lambda p: (p.parent.name, p.name)):
        suite = f.name.split(".")[0]
        lines = [x for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
        if suite == "profile" or not lines:
            continue
        with (dest / f"{suite}.jsonl").open("a", encoding="utf-8") as g:
            g.write("\n".join(lines) + "\n")
        counts[suite] = counts.get(suite, 0) + len(lines)
    for f in out.glob("lane*/profile.jsonl"):
        shutil.copy(f, dest / "profile.jsonl")
        counts["profile"] = len(f.read_text(encoding="utf-8").splitlines())
    return counts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shards", nargs="?", default="", help="comma-separated shard names (default: all)")
    ap.add_argument("--out", type=Path, default=Path("out"), help="run_gpu.sh's OUT: lanes write OUT/lane<N>/")
    ap.add_argument("--gpus", type=int, default=None, help="lanes (default: the GPUs nvidia-smi lists)")
    ap.add_argument("--limit-s", type=float, default=float(os.environ.get("CALL_LIMIT") or 570),
                    help="seconds the lanes may take in all (default $CALL_LIMIT or 570)")
    ap.add_argument("--plan", action="store_true", help="print the lanes and exit")
    ap.add_argument("--deps", action="store_true",
                    help="print the run_gpu.sh install stages the shards need (one line) and exit")
    a = ap.parse_args(argv)
    try:
        shards = pick(a.shards)
    except ValueError as e:
        print(f"run_all: {e}", file=sys.stderr)
        return 2
    if a.deps:
        print(" ".join(dict.fromkeys(d for s in shards for d in s.deps)))
        return 0
    gpus = a.gpus if a.gpus is not None else gpu_count()
    if gpus < 1:
        print("run_all: no GPU found (nvidia-smi -L lists none); --gpus N to plan anyway", file=sys.stderr)
        return 2
    budget = a.limit_s - PACK_MARGIN_S
    lanes, deferred = plan(shards, gpus, budget)
    for ln in lanes:
        print(f"lane {ln.gpu} (GPU {ln.gpu}, ~{ln.load_s} s expected): " + " ".join(s.name for s in ln.shards))
    if deferred:
        print(f"next call: WARPFORGE_GIT=<same sha> benchmarks/run_gpu.sh all:{','.join(s.name for s in deferred)}")
    if a.plan:
        return 0
    procs = []
    t0 = time.time()
    for ln in lanes:
        lane_out = a.out / f"lane{ln.gpu}"
        lane_out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(ln.gpu), "RUN_GPU_LANE": str(ln.gpu), "OUT": str(lane_out),
               "CALL_LIMIT": str(int(a.limit_s))}
        log = (lane_out / "lane.log").open("w")
        procs.append((ln, subprocess.Popen(lane_command(ln), env=env, stdout=log, stderr=subprocess.STDOUT), log))
    rc = 0
    for ln, p, log in procs:
        try:
            code = p.wait(timeout=max(1.0, a.limit_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.terminate()
            code = p.wait()
        log.close()
        rc = rc or code
        tail = (a.out / f"lane{ln.gpu}" / "summary.txt")
        print(f"== lane {ln.gpu} rc={code} {time.time() - t0:.0f}s")
        if tail.exists():
            print(tail.read_text().rstrip())
    counts = gather(a.out)
    print("records: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
          + f" -> {a.out / 'records'}/<suite>.jsonl")
    if deferred:
        print(f"not run (did not fit): {', '.join(s.name for s in deferred)}; next call: "
              f"WARPFORGE_GIT=<same sha> benchmarks/run_gpu.sh all:{','.join(s.name for s in deferred)}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
