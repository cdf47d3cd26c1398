"""The engine in its own process (serve/engine_core.py, engine_client.py): it starts with the server and ends
with it, however the server ends; an engine that dies fails its streams in one line while the server keeps
answering; a schema that takes seconds to compile does not hold up the other streams."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest


def engine_pid(server) -> int:
    """The server's one child process: its engine."""
    kids = [int(c) for t in os.listdir(f"/proc/{server.proc.pid}/task")
            for c in Path(f"/proc/{server.proc.pid}/task/{t}/children").read_text().split()]
    assert len(kids) == 1, kids
    return kids[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")  # a zombie has exited; its parent has not reaped it yet


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from /proc")


def test_sigterm_stops_the_engine_process_too(start_server):
    s = start_server()
    pid = engine_pid(s)
    # its OpenMP threads sleep at barriers instead of spinning on cores the HTTP process needs
    assert b"OMP_WAIT_POLICY=PASSIVE" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    r = httpx.post(s.base_url + "/completions", json={"model": s.model, "prompt": "To be", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert s.stop() == 0
    assert wait_gone(pid, 10), "the engine process outlived its server"


def test_a_killed_server_takes_its_engine_along(start_server):
    s = start_server()
    pid = engine_pid(s)
    s.proc.kill()  # no exit handlers run: the engine notices its socket close (or its parent go)
    s.proc.wait(10)
    assert wait_gone(pid, 10), "the engine process outlived a SIGKILLed server"


def test_a_dead_engine_fails_streams_and_the_server_says_so(start_server):
    s = start_server()
    pid = engine_pid(s)
    body = {"model": s.model, "prompt": "To be", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "engine_failed" and "engine" in err["message"] and "\n" not in err["message"]
    health = httpx.get(s.root + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
    r = httpx.post(s.base_url + "/completions", json={"model": s.model, "prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
    assert s.stop() == 0  # the server itself still stops cleanly


def _wide_schema(tag: str, n: int = 300) -> dict:
    """A schema xgrammar takes seconds to compile (hundreds of bounded patterns); ``tag`` makes it new to
    every cache."""
    props = {f"{tag}_{i}": {"type": "string", "pattern": "^[a-z]{%d,%d}$" % (i % 7, 30 + i)} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_slow_schema_does_not_stall_other_streams(server):
    """While one request's schema compiles (on a worker thread in the HTTP process, then on one in the engine
    process), plain streams keep getting tokens: no gap in them comes near the compile's length."""
    async def main() -> tuple[float, float, list[float]]:
        stamps: list[float] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            async def ticker() -> None:  # back-to-back plain streams, every chunk's arrival stamped
                body = {"model": server.model, "prompt": "To be", "max_tokens": 60, "ignore_eos": True,
                        "stream": True}
                while not stop.is_set():
                    async with client.stream("POST", "/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                stamps.append(time.perf_counter())

            tick = asyncio.ensure_future(ticker())
            while len(stamps) < 5:  # streaming before the schema arrives
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            r = await client.post("/completions", json={
                "model": server.model, "prompt": "The king", "max_tokens": 1,
                "guided_json": _wide_schema("k" + uuid.uuid4().hex[:6])})
            t1 = time.perf_counter()
            stop.set()
            await tick
            assert r.status_code == 200, r.text
        return t0, t1, stamps

    t0, t1, stamps = asyncio.run(main())
    during = [t for t in stamps if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0, *during], [*during, t1])]
    # The request took seconds: two compiles of about equal length (the check before admission, the engine's
    # matcher). Were the event loop or the engine's loop blocked by one, a gap would be about half of it.
    assert t1 - t0 > 1.5, f"the schema compiled in {t1 - t0:.2f} s: too fast to show anything"
    assert len(during) >= 20 and max(gaps) < 0.3 * (t1 - t0), (t1 - t0, len(during), max(gaps))


def test_a_lagging_stream_gets_the_steps_it_missed_as_one_output():
    """What arrived since the last read comes out as one output (deltas joined, cumulative text and ids); an
    engine failure after a finish still hands the finish out first."""
    from warpforge.serve.engine_client import _Stream

    async def main():
        st = _Stream("r", [1, 2], logprobs=[])
        st.put(" to", [7], [{7: -0.1}], None)
        st.put(" be", [8], [{8: -0.2}], None)
        a = await st.get()
        assert (a.delta_text, a.delta_token_ids, a.text, a.token_ids) == (" to be", [7, 8], " to be", [7, 8])
        assert a.logprobs == [{7: -0.1}, {8: -0.2}] and a.finish_reason is None
        st.put(",", [9], [{9: -0.3}], "abort")
        st.fail(RuntimeError("engine failed: gone"))
        b = await st.get()
        assert (b.delta_text, b.delta_token_ids, b.text, b.finish_reason) == (",", [9], " to be,", "abort")
        with pytest.raises(RuntimeError, match="gone"):
            await st.get()
        lone = _Stream("q", [1])
        lone.fail(ValueError("refused"))
        with pytest.raises(ValueError, match="refused"):
            await lone.get()

    asyncio.run(main())
