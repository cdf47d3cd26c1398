"""The HTTP side of the load generator: streaming OpenAI requests over httpx, timed per SSE chunk.

One asyncio loop sends every request at its scheduled time (``run_load``), each as a streaming POST to
``/v1/completions`` or ``/v1/chat/completions`` with ``stream_options.include_usage``. The hot loop only
reads bytes, splits server-sent events and stamps each with ``time.perf_counter()``; the JSON is parsed
after the whole run, so the client's own parsing never delays another stream's timestamps. Requests are
spread over several httpx clients (``POOL`` in flight each): one pool of a thousand connections costs
httpcore quadratic time. (The ``openai`` client is not used: its per-chunk overhead would be measured as
the server's.)

Timing follows vLLM's ``bench serve``, so figures compare: TTFT is the first chunk that carries a choice,
ITL the gaps between successive such chunks, E2E the time until the stream closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from warpforge.bench.loadgen.workload import RequestSpec

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


class ServerError(RuntimeError):
    """The server cannot be used for the benchmark (unreachable, no such model); one line for the user."""


@dataclass(frozen=True)
class Target:
    """Where and how requests go. ``url``: the server's base URL, with or without ``/v1``."""

    url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True  # a vLLM extension (our server takes it too): output lengths as drawn
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request, from send to the last byte

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--url: expected http(s)://HOST:PORT[/v1], got {self.url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: expected one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"--timeout: expected seconds > 0, got {self.timeout_s}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"--temperature: expected a number >= 0, got {self.temperature}")

    @property
    def base(self) -> str:
        """``http://host:port/v1`` (the OpenAI API's root)."""
        u = self.url.rstrip("/")
        return u if u.endswith("/v1") else u + "/v1"

    @property
    def where(self) -> str:
        return urlsplit(self.url).netloc

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": self.temperature,
                             "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            b["prompt"] = spec.prompt
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds, on the ``perf_counter`` clock."""

    index: int
    max_tokens: int
    sent: float = 0.0
    ok: bool = False
    error: str | None = None  # "HTTP 429", "timeout", "ConnectError", ... (None when ok)
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried a choice
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # from the server's usage, when it sent one
    output_tokens: int | None = None
    # The stream as received, (arrival time, event bytes), until ``finish`` parses it (after the run: the
    # client's JSON parsing never competes with other streams' reads while anything is timed).
    events: list[tuple[float, bytes]] | None = field(default=None, repr=False)

    def finish(self, chat: bool) -> RequestResult:
        if self.events is not None:
            parse_events(self.events, self, chat)
            self.events = None
        return self


def _error_body(raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err)
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = raw.decode("utf-8", "replace")
    return " ".join(str(msg).split())[:200]


def parse_events(events: Sequence[tuple[float, bytes]], res: RequestResult, chat: bool) -> None:
    """Fill ``res`` from the stream's (arrival time, event bytes) pairs. A chunk with a non-empty
    ``choices`` list is a content chunk (timed); ``usage`` is read wherever it comes; ``[DONE]`` or a
    finish_reason ends the stream properly."""
    done, prev, parts = False, None, []
    for t, raw in events:
        data = "\n".join(line[5:].lstrip() for line in raw.decode("utf-8", "replace").splitlines()
                         if line.startswith("data:"))
        if not data:
            continue  # a comment or keep-alive
        if data == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            res.error = f"bad SSE data: {data[:80]!r}"
            return
        if not isinstance(obj, dict):
            continue
        if obj.get("error"):
            res.error = f"stream error: {_error_body(data.encode())}"
            return
        if obj.get("choices"):
            c = obj["choices"][0]
            res.chunks += 1
            if prev is None:
                res.ttft = t - res.sent
            else:
                res.itl.append(t - prev)
            prev = t
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            parts.append(piece or "")
            res.finish_reason = c.get("finish_reason") or res.finish_reason
        usage = obj.get("usage")
        if isinstance(usage, dict):
            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
            res.output_tokens = usage.get("completion_tokens", res.output_tokens)
    res.text = "".join(parts)
    if not res.chunks:
        res.error = "the stream carried no content chunk"
    elif not (done or res.finish_reason):
        res.error = "the stream ended before [DONE] or a finish_reason"
    else:
        res.ok = True


async def send(client: Any, target: Target, spec: RequestSpec) -> RequestResult:
    """One streaming request, its events kept unparsed (``RequestResult.finish`` parses them); never
    raises for a failed request (the result says what went wrong)."""
    import httpx

    res = RequestResult(index=spec.index, max_tokens=spec.max_tokens)
    events: list[tuple[float, bytes]] = []
    url = target.base + ENDPOINTS[target.endpoint]
    res.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=target.body(spec), headers=target.headers()) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}"
                res.e2e = time.perf_counter() - res.sent
                res.text = _error_body(await r.aread())
                return res
            buf = b""
            async for data in r.aiter_raw():
                t = time.perf_counter()
                buf = (buf + data).replace(b"\r\n", b"\n")  # SSE allows CRLF; sse-starlette sends it
                while (k := buf.find(b"\n\n")) >= 0:
                    events.append((t, buf[:k]))
                    buf = buf[k + 2:]
            if buf.strip():
                events.append((time.perf_counter(), buf))
        res.e2e = time.perf_counter() - res.sent
    except httpx.TimeoutException:
        res.error = "timeout"
        return res
    except (httpx.HTTPError, OSError) as e:
        res.error = type(e).__name__
        res.text = str(e)[:200]
        return res
    res.events = events
    return res


@dataclass
class LoadRun:
    """Every request of one rate, and the run's wall-clock span and client CPU time."""

    results: list[RequestResult]
    duration_s: float
    client_cpu_s: float


POOL = 16  # requests in flight per httpx client, on average


def _client(target: Target, ssl: Any = None) -> Any:
    import httpx

    timeout = httpx.Timeout(target.timeout_s, connect=min(30.0, target.timeout_s))
    # No connection limit: a pool smaller than the concurrency would queue requests in the client, and
    # the wait would be measured as the server's.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits, verify=True if ssl is None else ssl)


async def run_load(target: Target, specs: Sequence[RequestSpec], times: Sequence[float], *,
                   max_concurrency: int | None = None,
                   on_result: Callable[[RequestResult], None] | None = None,
                   on_send: Callable[[], None] | None = None) -> LoadRun:
    """Send ``specs[i]`` at ``times[i]`` seconds after the start (at most ``max_concurrency`` in flight:
    a request due while the limit is reached waits for a slot, as in vLLM's bench serve)."""
    if len(specs) != len(times):
        raise ValueError(f"times: expected one per request ({len(specs)}), got {len(times)}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # Several clients, requests dealt round-robin: httpcore scans its whole pool whenever a request starts
    # or ends, so one pool of a thousand connections costs the client quadratic time (measured: most of
    # its CPU at 200 concurrent streams).
    n_clients = max(1, -(-min(max_concurrency or len(specs), len(specs)) // POOL))
    import httpx

    ssl = httpx.create_ssl_context()  # one for all clients: each would load the CA bundle again (~20 ms)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_client(target, ssl)) for _ in range(n_clients)]
        cpu0, start = time.process_time(), time.perf_counter()

        async def one(spec: RequestSpec, at: float) -> RequestResult:
            client = clients[spec.index % n_clients]
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is None:
                if on_send:
                    on_send()
                res = await send(client, target, spec)
            else:
                async with slots:
                    if on_send:
                        on_send()
                    res = await send(client, target, spec)
            if on_result:
                on_result(res)
            return res

        results = await asyncio.gather(*(one(s, t) for s, t in zip(specs, times)))
        duration, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return LoadRun([r.finish(target.endpoint == "chat") for r in results], duration, cpu)


async def served_models(target: Target) -> list[str]:
    """Model ids from ``GET /v1/models``; ServerError with one line when the server cannot be used."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
            r = await client.get(target.base + "/models", headers=target.headers())
    except (httpx.HTTPError, OSError) as e:
        raise ServerError(f"cannot reach {target.base}/models: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ServerError(f"{target.base}/models answered HTTP {r.status_code}: {_error_body(r.content)}")
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{target.base}/models: not an OpenAI model list: {r.text[:120]!r}") from None


async def check_request(target: Target, spec: RequestSpec) -> RequestResult:
    """One request before the timed runs (it also warms the server): ServerError when it fails."""
    async with _client(target) as client:
        res = (await send(client, target, spec)).finish(target.endpoint == "chat")
    if not res.ok:
        detail = f": {res.text}" if res.text and not res.ok else ""
        raise ServerError(f"a test request to {target.base}{ENDPOINTS[target.endpoint]} failed "
                          f"({res.error}){detail}")
    return res
