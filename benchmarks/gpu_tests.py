"""Run the `gpu`-marked tests as N concurrent pytest processes on one GPU box, then the
timing-sensitive files alone on a quiet GPU. Triton compiles dominate GPU test time and the box
has many cores, so shards cut the wall time about N-fold.

    python benchmarks/gpu_tests.py [-n N] [--logdir DIR] [path ...]

Exit status 0 only when every shard and the serial part pass.
"""
import argparse
import collections
import os
import subprocess
import sys
import time

# Files or node ids that time the GPU or read its free memory: run alone, after the shards.
SERIAL = ("tests/hw/test_probe.py", "tests/profile/test_profile_gpu.py",
          "tests/llm/test_runner.py::test_kv_cache_sized_from_free_memory")
# A kernel that deadlocks blocks inside CUDA, where pytest-timeout's default signal never lands:
# the thread method dumps the stacks and ends the process.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--timeout", "240", "-o", "timeout_method=thread",
          "-p", "no:cacheprovider"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--logdir", default="out")
    ap.add_argument("--deadline", type=float, default=420, help="seconds before unfinished shards are killed")
    ap.add_argument("paths", nargs="*", default=["tests"])
    args = ap.parse_args()
    os.makedirs(args.logdir, exist_ok=True)
    collected = subprocess.run([*PYTEST, "--collect-only", *args.paths], capture_output=True, text=True)
    ids = [line.strip() for line in collected.stdout.splitlines() if "::" in line]
    if not ids:
        print(collected.stdout[-3000:], collected.stderr[-3000:])
        return 2
    serial = [i for i in ids if any(i == s or i.startswith(s + ("::" if s.endswith(".py") else "[")) for s in SERIAL)]
    # Round-robin within each file spreads a file's expensive parametrizations over the shards.
    by_file = collections.defaultdict(list)
    for i in ids:
        if i not in serial:
            by_file[i.split("::", 1)[0]].append(i)
    shards = [[] for _ in range(args.n)]
    k = 0
    for f in sorted(by_file):
        for i in by_file[f]:
            shards[k % args.n].append(i)
            k += 1
    t0 = time.time()
    procs = []
    for s, shard in enumerate(shards):
        if shard:
            log = open(os.path.join(args.logdir, f"test-gpu-shard{s}.log"), "w")
            procs.append((s, subprocess.Popen([*PYTEST, *shard], stdout=log, stderr=subprocess.STDOUT), log))
    rcs = {}
    for s, p, log in procs:
        try:
            rcs[f"shard{s}"] = p.wait(timeout=max(1.0, t0 + args.deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs[f"shard{s}"] = p.wait()
            print(f"shard{s}: killed at the {args.deadline:.0f} s deadline", flush=True)
        log.close()
    print(f"{len(ids) - len(serial)} tests in {len(procs)} shards: {time.time() - t0:.0f} s", flush=True)
    if serial:
        t1 = time.time()
        with open(os.path.join(args.logdir, "test-gpu-serial.log"), "w") as log:
            rcs["serial"] = subprocess.run([*PYTEST, *serial], stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{len(serial)} timing-sensitive tests alone: {time.time() - t1:.0f} s")
    for name in sorted(rcs):
        path = os.path.join(args.logdir, f"test-gpu-{name}.log")
        tail = open(path).read().splitlines()
        fails = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
        print(f"== {name}: rc={rcs[name]} {tail[-1] if tail else ''}")
        for line in fails:
            print("  ", line[:300])
    return max(rcs.values()) if rcs else 0


if __name__ == "__main__":
    sys.exit(main())
