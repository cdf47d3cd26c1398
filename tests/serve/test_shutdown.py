"""SIGTERM / Ctrl-C: the server drains (the listener stays open; /health and new requests get 503), in-flight
requests finish within the grace period (or are aborted after it, their streams still ending in
finish_reason "abort" and ``[DONE]``), then the listener closes and the exit status is 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest


def start_requests(server, *, max_tokens: int, streams: int = 3):
    """``streams`` streamed requests and one non-streamed (n = 4), each running when this returns;
    -> (threads, results: {name: (status, finish reasons or body, last line)})."""
    results: dict[str, tuple] = {}
    started = threading.Barrier(streams + 1)

    def stream(name: str) -> None:
        body = {"model": server.model, "prompt": "To be, or not to be", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
            lines, first = [], True
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if first:
                        first = False
                        started.wait(30)
        finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1]]
        results[name] = (r.status_code, finishes, lines[-1])

    def whole() -> None:
        body = {"model": server.model, "prompt": "Who's there?", "n": 4, "max_tokens": max_tokens, "ignore_eos": True}
        r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        results["whole"] = (r.status_code, r.json(), None)

    threads = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(streams)]
    threads.append(threading.Thread(target=whole))
    for t in threads:
        t.start()
    started.wait(30)  # every stream has its first token
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # and the non-streamed request is in the engine too
        m = server.metrics()
        if m["warpforge_num_requests_running"] + m["warpforge_num_requests_waiting"] >= streams + 4:
            break
        time.sleep(0.02)
    return threads, results


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(start_server):
    server = start_server("--shutdown-grace", "30")
    threads, results = start_requests(server, max_tokens=120)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (health := httpx.get(server.root + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline  # the signal is handled within a poll or two
        time.sleep(0.02)
    # draining: still listening (a load balancer reads 503 and moves away instead of a refused connection)
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    late = httpx.post(server.base_url + "/completions", json={"model": server.model, "prompt": "x", "max_tokens": 1},
                      timeout=5)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert any(t.is_alive() for t in threads)  # those answers came while requests were still running
    for t in threads:
        t.join(60)
    assert server.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):  # the listener closes once the drain is over
        httpx.get(server.root + "/health", timeout=5)
    assert time.monotonic() - t0 < 25  # done when the requests are, not at the end of the grace period
    for name in ("s0", "s1", "s2"):
        status, finishes, last = results[name]
        assert status == 200 and last == "data: [DONE]" and finishes[-1] == "length", results[name]
    status, body, _ = results["whole"]
    assert status == 200 and [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
    log = server.output()
    assert "stopping" in log and "stopped" in log and "Traceback" not in log


def test_ctrl_c_aborts_what_outlives_the_grace_period_and_exits_0(start_server):
    server = start_server("--shutdown-grace", "0")
    threads, results = start_requests(server, max_tokens=230)
    server.proc.send_signal(signal.SIGINT)
    for t in threads:
        t.join(60)
    assert server.proc.wait(30) == 0
    for name in ("s0", "s1", "s2"):
        status, finishes, last = results[name]
        # ended properly: a last choice chunk with a finish reason, then [DONE]
        assert status == 200 and last == "data: [DONE]" and finishes[-1] == "abort", results[name]
    status, body, _ = results["whole"]
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert "Traceback" not in server.output()
