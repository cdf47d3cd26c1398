"""Run every `gpu`-marked test to completion on one GPU box: N concurrent pytest shards, then the
timing-sensitive tests alone on a quiet GPU; write the counts and every failure's node id.

    python benchmarks/gpu_tests.py [-n N] [--logdir DIR] [--json FILE] [--git SHA] [path ...]

Triton compiles dominate GPU test time and the box has many cores, so shards cut the wall time about
N-fold; they share one Triton cache, so a kernel one shard compiled is a cache hit for the others.
A test that hangs inside CUDA can only be ended with its process (pytest-timeout's thread method);
the shard then starts again after that test, which is counted as failed ("timeout or crash"), so one
bad test never hides the ones behind it. Exit status 0 only when nothing failed and every test ran.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Files or node ids that time the GPU or read its free memory: run alone, after the shards.
# Also those that choose kernels or passes by timing them (under twelve shards the choice moves, and with it
# the counts and outputs the test pins) and the profilers' overhead bars.
SERIAL = ("tests/hw/test_probe.py", "tests/profile/test_profile_gpu.py", "tests/profile/test_train_gpu.py",
          "tests/llm/test_runner.py::test_kv_cache_sized_from_free_memory",
          "tests/optimize/test_fuse_linear.py::test_gpu_vit_block_stack_through_the_kernels",
          "tests/optimize/test_regions.py::test_gpu_regions_replay_cuda_graphs")
# A kernel that deadlocks blocks inside CUDA, where pytest-timeout's default signal never lands:
# the thread method dumps the stacks and ends the process (the shard restarts after that test).
HERE = os.path.dirname(os.path.abspath(__file__))
# Whole benchmark suites run as tests (minutes each, mostly inductor compiles) carry `gpu_full` as well: the
# verify call's bench stage runs those suites anyway, so the test pass leaves them out unless --full.
MARK = "gpu and not gpu_full"
PYTEST = [sys.executable, "-m", "pytest", "-v", "-o", "timeout_method=thread",
          "-p", "no:cacheprovider", "--durations=0", "--durations-min=1", "-o", "console_output_style=classic"]
# Parametrized ids may hold spaces ("Config(block_m=64, block_n=32)"): the outcome word ends the id.
OUTCOME = re.compile(r"^(\S+::.+?)(?: <- \S+)? (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: |$)")


def _outcomes(text: str) -> dict:
    """node id -> outcome, from a `pytest -v` log (a test with an error in teardown reports twice: keep the worst)."""
    seen = {}
    for line in text.splitlines():
        m = OUTCOME.match(line)
        if m:
            nid, out = m.groups()
            if seen.get(nid) not in ("FAILED", "ERROR"):
                seen[nid] = out
    return seen


def _durations(text: str) -> list:
    """(seconds, phase, node id) from pytest's --durations table."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+::.+?)\s*$", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3)))
    return rows


def _run_shard(name, ids, logdir, deadline_at, per_test, mark=MARK):
    """Run ids in pytest processes until all have an outcome or the deadline passes. Returns
    (outcomes, durations, notes)."""
    results, durs, notes = {}, [], []
    left = list(ids)
    attempt = 0
    while left:
        remaining = deadline_at - time.time()
        if remaining < 5:
            break
        attempt += 1
        log_path = os.path.join(logdir, f"test-gpu-{name}.{attempt}.log")
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(left) + "\n")
            argfile = f.name
        files = sorted({i.split("::", 1)[0] for i in left})
        env = {**os.environ, "GPU_TESTS_SHARD_IDS": argfile,
               "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            p = subprocess.Popen([*PYTEST, "-m", mark, "-p", "_gpu_shard", "--timeout", str(per_test), *files],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                p.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                notes.append(f"{name}: killed at the deadline")
        os.unlink(argfile)
        text = open(log_path, errors="replace").read()
        got = _outcomes(text)
        results.update(got)
        durs += _durations(text)
        left = [i for i in left if i not in results]
        if left and p.returncode is not None and time.time() < deadline_at - 5:
            if not got and attempt > 1 and "Timeout" not in text and "Fatal Python error" not in text:
                notes.append(f"{name}: pytest made no progress; last lines:\n" + "\n".join(text.splitlines()[-15:]))
                break
            # The process died inside left[0] (a timeout, a crash): count it and go on after it.
            results[left[0]] = "FAILED"
            notes.append(f"{name}: {left[0]} ended the process (timeout or crash), see {os.path.basename(log_path)}")
            left = left[1:]
    return results, durs, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=8, help="concurrent shards (default 8)")
    ap.add_argument("--logdir", default="out")
    ap.add_argument("--deadline", type=float, default=420, help="seconds before unfinished shards are stopped")
    ap.add_argument("--per-test", type=int, default=150, help="seconds one test may take (pytest-timeout)")
    ap.add_argument("--json", help="write the counts, failures and slowest tests here")
    ap.add_argument("--git", default=os.environ.get("WARPFORGE_GIT", "unknown"), help="sha recorded in --json")
    ap.add_argument("--full", action="store_true", help="also the gpu_full tests (whole benchmark suites)")
    ap.add_argument("--history", default=None,
                    help="an earlier gpu_tests.json: its slowest tests are started first, spread over the shards")
    ap.add_argument("paths", nargs="*", default=["tests"])
    args = ap.parse_args()
    os.makedirs(args.logdir, exist_ok=True)
    t0 = time.time()
    mark = "gpu" if args.full else MARK
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", mark, "-p", "no:cacheprovider",
                                "--collect-only", *args.paths], capture_output=True, text=True)
    ids = [line.strip() for line in collected.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        print(collected.stdout[-3000:], collected.stderr[-3000:])
        return 2
    serial = [i for i in ids if any(i == s or i.startswith(s + ("::" if s.endswith(".py") else "[")) for s in SERIAL)]
    by_file = collections.defaultdict(list)
    for i in ids:
        if i not in serial:
            by_file[i.split("::", 1)[0]].append(i)
    # Tests known to be slow (an earlier run's list) go first, each to the shard with the least known work;
    # the rest round-robin within each file, which spreads a file's expensive parametrizations.
    known = {}
    if args.history and os.path.exists(args.history):
        for row in json.load(open(args.history)).get("slowest", []):
            known[row["test"]] = known.get(row["test"], 0.0) + row["s"]
    shards = [[] for _ in range(args.n)]
    load = [0.0] * args.n
    for i in sorted((i for i in ids if i in known and i not in serial), key=lambda i: -known[i]):
        s = load.index(min(load))
        shards[s].append(i)
        load[s] += known[i]
    k = 0
    for f in sorted(by_file):
        for i in by_file[f]:
            if i not in known:
                s = min(range(args.n), key=lambda j: (load[j], (j - k) % args.n))
                shards[s].append(i)
                load[s] += 2.0  # a typical test's seconds: keeps the round-robin even once known work is spread
                k += 1
    deadline_at = t0 + args.deadline
    # The serial part gets its share of the deadline: reserve time for it out of the shards' window.
    serial_reserve = min(90.0, 6.0 * len(serial))
    import concurrent.futures as cf

    results, durs, notes = {}, [], []
    with cf.ThreadPoolExecutor(len(shards)) as ex:
        futs = [ex.submit(_run_shard, f"shard{s}", shard, args.logdir, deadline_at - serial_reserve, args.per_test,
                          mark)
                for s, shard in enumerate(shards) if shard]
        for fut in futs:
            r, d, n = fut.result()
            results.update(r)
            durs += d
            notes += n
    t_shards = time.time() - t0
    if serial:
        r, d, n = _run_shard("serial", serial, args.logdir, deadline_at, args.per_test, mark)
        results.update(r)
        durs += d
        notes += n
    seconds = time.time() - t0
    counts = collections.Counter(results.values())
    not_run = [i for i in ids if i not in results]
    failures = sorted(i for i, o in results.items() if o in ("FAILED", "ERROR", "XPASS"))
    slow = sorted(durs, reverse=True)[:120]
    by_file_s = collections.Counter()
    for s, _, nid in durs:
        by_file_s[nid.split("::")[0]] += s
    summary = {
        "git": args.git, "collected": len(ids), "passed": counts["PASSED"] + counts["XFAIL"],
        "failed": len(failures), "skipped": counts["SKIPPED"], "not_run": len(not_run),
        "seconds": round(seconds, 1), "shards": args.n, "marker": mark, "shard_seconds": round(t_shards, 1),
        "failures": failures, "not_run_ids": not_run[:200], "notes": notes,
        "slowest": [{"s": round(s, 1), "phase": ph, "test": nid} for s, ph, nid in slow],
        "slowest_files": [{"s": round(s, 1), "file": f} for f, s in by_file_s.most_common(15)],
    }
    try:
        import torch

        summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - the summary is still worth writing
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print("== slowest tests (s)")
    for row in summary["slowest"][:12]:
        print(f"  {row['s']:7.1f} {row['phase']:8s} {row['test'][:140]}")
    print("== slowest files (s)")
    for row in summary["slowest_files"][:8]:
        print(f"  {row['s']:7.1f} {row['file']}")
    for n in notes:
        print("note:", n[:600])
    for nid in failures:
        print("FAILED", nid)
    print(f"== gpu tests: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped, "
          f"{len(not_run)} not run, of {len(ids)}; {seconds:.0f} s ({args.n} shards {t_shards:.0f} s, serial after)")
    return 0 if not failures and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
