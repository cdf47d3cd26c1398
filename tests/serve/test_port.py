"""The port is taken before the model loads: of two `warpforge serve --port P` started together exactly one
serves, the other says so in one line and exits 2 without loading anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from tests.serve.conftest import MAX_MODEL_LEN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_servers_on_one_port_one_serves_the_other_exits_2(tiny_model, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "warpforge", "serve", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--shutdown-grace", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []
    for log in logs:
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.05)
        loser = next(i for i, p in enumerate(procs) if p.poll() is not None)
        winner = 1 - loser
        out = logs[loser].read_text()
        assert procs[loser].returncode == 2, out
        lines = [line for line in out.splitlines() if line.strip()]
        assert lines == [f"warpforge serve: port {port} is in use on 127.0.0.1 (another server listens there; "
                         f"pick another --port)"]
        while "listening on" not in logs[winner].read_text():
            assert procs[winner].poll() is None and time.monotonic() < deadline, logs[winner].read_text()
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        assert procs[winner].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
