"""Run tests/kernels/sm90_compile.py split into shards side by side, one per CPU core (at most ``max_shards``).

The offline sm_90 compiles are CPU-bound and independent, and pytest runs on one core: on CI's 2-core box two
shards take about half the time. Every shard gets the same job list and takes every N-th job
(``--shard=I/N``); the rows are concatenated. Kept out of sm90_compile.py, which must not be imported by a
test process (it turns the Triton interpreter off at import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_sharded(args: list[str], cache_dir: Path, *, timeout: float,
                max_shards: int = 4) -> tuple[list[dict], list[int], str]:
    """(JSON rows of every shard, each shard's return code, the shards' stderr tails). ``cache_dir``: the
    TRITON_CACHE_DIR they share (an identical kernel compiled twice in a session is a cache hit)."""
    n = max(1, min(max_shards, cores()))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    with tempfile.TemporaryDirectory(prefix="sm90-shards-") as tmp:
        procs = []
        for i in range(n):
            out, err = open(Path(tmp) / f"{i}.out", "w+"), open(Path(tmp) / f"{i}.err", "w+")
            procs.append((subprocess.Popen([sys.executable, str(SCRIPT), *args, f"--shard={i}/{n}"], stdout=out,
                                           stderr=err, text=True, env=env), out, err))
        deadline = time.monotonic() + timeout
        rows, rcs, errs = [], [], []
        try:
            for p, out, err in procs:
                rcs.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                out.seek(0)
                err.seek(0)
                rows += [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
                errs.append(err.read()[-2000:])
        finally:
            for p, out, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out.close()
                err.close()
    return rows, rcs, "\n".join(errs)
