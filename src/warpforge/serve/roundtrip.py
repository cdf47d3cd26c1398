"""A server round trip for `warpforge demo`: `warpforge serve MODEL` in its own process, one streamed
completion over HTTP, the time to first token and the token rate as a client sees them, then SIGTERM.

The server is the real command (its own process, a free port on 127.0.0.1), so the figures include
HTTP, JSON, SSE and the engine, as a user's first request would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

_LISTENING = re.compile(r"listening on (http://\S+?:\d+)")


@dataclass
class RoundTrip:
    text: str
    ttft_ms: float  # request sent -> first content chunk
    e2e_ms: float  # request sent -> [DONE]
    completion_tokens: int  # from the server's usage
    load_s: float  # process start -> listening (model load included)

    @property
    def decode_tok_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / ((self.e2e_ms - self.ttft_ms) / 1e3) if steps > 0 and self.e2e_ms > self.ttft_ms else 0.0


def _wait_listening(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """Read the server's stderr until its 'listening on URL' line; -> URL."""
    assert proc.stderr is not None, "the server is started with stderr=PIPE"
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before listening: "
                                   + " | ".join(seen[-3:]))
            continue
        seen.append(line.strip())
        m = _LISTENING.search(line)
        if m:
            return m.group(1)
    raise RuntimeError(f"the server did not listen within {timeout_s:.0f} s")


def round_trip(model: str, prompt: str, *, max_tokens: int, dtype: str = "auto", max_model_len: int = 1024,
               timeout_s: float = 300.0) -> RoundTrip:
    """Start the server, stream one greedy completion, stop the server (SIGTERM, then kill if it hangs)."""
    import httpx

    cmd = [sys.executable, "-m", "warpforge", "serve", model, "--port", "0", "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--max-num-seqs", "8", "--shutdown-grace", "5"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_listening(proc, timeout_s)
        load_s = time.perf_counter() - t0
        # keep reading its stderr so a chatty server never blocks on a full pipe
        stderr = proc.stderr
        assert stderr is not None  # stderr=PIPE above
        threading.Thread(target=lambda: [None for _ in stderr], daemon=True).start()
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        text: list[str] = []
        usage: dict[str, Any] = {}
        ttft: float | None = None
        start = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                raise RuntimeError(f"POST /v1/completions answered {r.status_code}: {r.read().decode()[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        text.append(choice["text"])
                usage = chunk.get("usage") or usage
        e2e = time.perf_counter() - start
        return RoundTrip("".join(text), 1e3 * (ttft if ttft is not None else e2e), 1e3 * e2e,
                         int(usage.get("completion_tokens", 0)), load_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
