"""The load generator spread over several client processes.

One asyncio client spends about 3 ms of CPU per 16-token streamed request (httpx, SSE reads) on this
project's CPU, so one process tops out near 300 requests/s, and near 10k streamed tokens/s: at 64
closed-loop streams, or a fast engine at the unlimited rate, it and not the server would set the pace, and
its limit would be charged to the server. ``run_split(target, specs, times, streams, procs)`` deals the
requests (with their arrival times) and the streams round-robin over ``procs`` fresh interpreters (not
multiprocessing's spawn, which would re-run ``python -m warpforge``), starts them at one instant and
merges their results. Timestamps are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every
process), so the merged run is timed as one.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from warpforge.bench.loadgen.client import LoadRun, RequestResult, Target, run_load

_BOOT = ("import pickle, sys; args = pickle.load(sys.stdin.buffer); sys.path[:0] = args.pop('sys_path'); "
         "from warpforge.bench.suites._serve_clients import worker; worker(**args)")


def client_procs() -> int:
    """Client processes for this machine: up to 4, leaving at least three quarters of the cores to the rest."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def drive(target: Target, specs: list, times: list[float], streams: int | None = None) -> LoadRun:
    """``run_split`` over ``client_procs()`` processes; in this process when that is one."""
    procs = client_procs()
    if procs == 1:
        import asyncio

        return asyncio.run(run_load(target, specs, times, max_concurrency=streams))
    return run_split(target, specs, times, streams, procs)


def worker(target: Target, specs: list, times: list[float], streams: int | None, out: str) -> None:
    """One client process: say ready, wait for the start instant (a perf_counter value on stdin), run."""
    import asyncio

    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    delay = start_at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    run = asyncio.run(run_load(target, specs, times, max_concurrency=streams))
    Path(out).write_bytes(pickle.dumps(run))


def run_split(target: Target, specs: list, times: list[float], streams: int | None, procs: int, *,
              timeout_s: float = 3600.0) -> LoadRun:
    """``specs[i]`` sent at ``times[i]`` s after the start, at most ``streams`` in flight (None: no limit), from
    ``procs`` processes, as one LoadRun (results in the order of ``specs``; duration from the first request
    sent to the last process's end of its run; client CPU summed)."""
    procs = max(1, min(procs, streams or procs, len(specs)))
    tmp = Path(tempfile.mkdtemp(prefix="wf-clients-"))
    children: list[subprocess.Popen] = []
    try:
        for k in range(procs):
            part = specs[k::procs]
            p = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=False)
            children.append(p)
            p.stdin.write(pickle.dumps({"target": target, "specs": part, "times": list(times[k::procs]),
                                        "streams": None if streams is None else len(range(k, streams, procs)),
                                        "out": str(tmp / f"{k}.pkl"), "sys_path": list(sys.path)}))
            p.stdin.flush()
        for p in children:
            if p.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"a load-generator process did not start (exit {p.wait()})")
        start_at = time.perf_counter() + 0.2
        for p in children:
            p.stdin.write(f"{start_at!r}\n".encode())
            p.stdin.close()
        for p in children:
            if p.wait(timeout_s) != 0:
                raise RuntimeError(f"a load-generator process failed (exit {p.returncode})")
        parts = [pickle.loads((tmp / f"{k}.pkl").read_bytes()) for k in range(procs)]
    finally:
        for p in children:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    results: list[RequestResult] = [None] * len(specs)  # type: ignore[list-item]
    for k, run in enumerate(parts):
        for j, r in enumerate(run.results):
            results[k + j * procs] = r
    # run_load starts its clock just before its first send: each part's span is [first sent, + its duration]
    starts = [min(r.sent for r in run.results) for run in parts]
    begin, end = min(starts), max(t + run.duration_s for t, run in zip(starts, parts))
    return LoadRun(results, end - begin, sum(run.client_cpu_s for run in parts))
